"""Tests for grpo_colocate.py, all on the CPU: `bash run.sh test`.

1. Pure functions against values computed by hand: advantages, every loss normalisation, clipping on both sides,
   masks, the KL term, the importance weights, chunked logprobs, the Policy forward, data order, reward functions.
2. The TP prompt gather/slice with 4 real gloo processes (tp=2).
3. End to end with the REAL vLLM engine and the REAL embedded SmolLM2-135M-Instruct (torchrun, 2 ranks), the
   resume of that run, and tp=2 on a tiny random Llama (SmolLM2's 9 heads only split for tp in {1, 3}).
4. Marked slow (`bash run.sh test --slow`): world size 8 with tp 1, 2 and 4 on a tiny random Llama, checked against
   what every rank sampled and scored, and its 8-rank checkpoint resumed on 2 ranks.
No mocks of vLLM or the model in the end-to-end tests.
"""

import contextlib
import dataclasses
import datetime
import importlib.util
import io
import json
import math
import os
import pickle
import re
import shutil
import signal
import socket
import subprocess
import time
import sys
import typing
from types import SimpleNamespace
from unittest import mock

import msgspec
import pytest
from pytest import approx
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import grpo_colocate as gc
import reward_fns as rf

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may download
HERE = os.path.dirname(os.path.abspath(__file__))
MODEL = os.environ.get("MODEL_DIR") or gc.DEFAULT_MODEL  # run.sh's MODEL_DIR (GPU machines set it)


def close(a, b, rtol=1e-6, atol=0.0):
    """|a - b| <= atol + rtol |b|: each comparison picks the tolerances of its quantity (a relative
    one for values of any size, an absolute one for values that are noise around 0)."""
    return abs(float(a) - float(b)) <= atol + rtol * abs(float(b))


# The CUDA half of the trainer (marked gpu): skipped without a GPU; `bash run.sh test --gpu` runs
# these alone.
NEEDS_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


# ------------------------------------------------------------------------------------------------------------
# helpers: a CPU process's env, model masks, a generation batch for train_step, an optimizer stand-in
# ------------------------------------------------------------------------------------------------------------

def cpu_env(**overrides):
    """setup_env's namespace for a world of one CPU process (what train_step, build_trainer,
    memory_plan and run read)."""
    return SimpleNamespace(**{"rank": 0, "world": 1, "local_world": 1, "is_main": True, "device": torch.device("cpu"),
                              "dtype": torch.float32, "tp": 1, "engine_bytes": 0, "push_via": "reload_weights",
                              "attention": "sdpa", **overrides})


def completion_mask_of(completions):
    """[N, T] model mask: 1 on each completion token, left-aligned (from column 0); T: the longest, >= 1."""
    lengths = torch.tensor([len(c) for c in completions])
    return (torch.arange(max(1, int(lengths.max())))[None] < lengths[:, None]).long()


def train_batch(prompts, completions, advantages, model_mask=None, vllm_logps=None):
    """A generation batch as make_batch returns it, for train_step: every model token is a loss token."""
    model_mask = completion_mask_of(completions) if model_mask is None else model_mask
    return SimpleNamespace(sample_prompt_ids=prompts, completion_ids=completions, model_mask=model_mask,
                           loss_mask=model_mask.float(), filler=torch.zeros(len(completions), dtype=torch.bool),
                           advantages=torch.tensor(advantages), vllm_logps=vllm_logps, old_logps=None,
                           ref_logps=None)


class StepGradients:
    """An optimizer stand-in for train_step: step() keeps the gradients it is given (clipped, if
    --max_grad_norm clips) and moves no weight."""

    def __init__(self, module):
        self.params = list(module.parameters())
        self.grads = None

    def step(self):
        self.grads = [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in self.params]

    def zero_grad(self, set_to_none=True):
        for p in self.params:
            p.grad = None


NO_SCHEDULE = SimpleNamespace(step=lambda: None)  # train_step's scheduler where the rate does not matter
BUDGET = 10_000  # train_step's tokens per micro-batch: one micro-batch for the small batches here


# ------------------------------------------------------------------------------------------------------------
# compute_advantages
# ------------------------------------------------------------------------------------------------------------

REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])  # two groups of G = 4


def test_advantages_group():
    # group 0: mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = sqrt(1/3); group 1: constant -> 0
    a = 0.5 / (math.sqrt(1 / 3) + 1e-4)
    expected = [a, -a, -a, a, 0, 0, 0, 0]
    got = gc.compute_advantages(REWARDS, 4, "group")
    assert all(close(g, e) for g, e in zip(got.tolist(), expected))


def test_advantages_batch():
    # batch: mean 1.25, squared deviations 0.0625 + 1.5625 + 1.5625 + 0.0625 + 4 * 0.5625 = 5.5, var 5.5 / 7
    a = 0.5 / (math.sqrt(5.5 / 7) + 1e-4)
    expected = [a, -a, -a, a, 0, 0, 0, 0]
    got = gc.compute_advantages(REWARDS, 4, "batch")
    assert all(close(g, e) for g, e in zip(got.tolist(), expected))


def test_advantages_none():
    assert gc.compute_advantages(REWARDS, 4, "none").tolist() == [0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0]


# unscorable completions (NaN: every reward function returned None), as TRL 1.16 treats them
UNSCORABLE = torch.tensor([1.0, math.nan, 0.0, 1.0, math.nan, 2.0, math.nan, math.nan])


def test_advantages_leave_unscorable_completions_out():
    # group 0 scores 1, 0, 1: mean 2/3, std sqrt((1/9 + 4/9 + 1/9) / 2) = sqrt(1/3); its NaN gets 0.
    # group 1 has one scored completion: std NaN, so every advantage of the group is 0.
    a = (1 / 3) / (math.sqrt(1 / 3) + 1e-4)
    expected = [a, 0, -2 * a, a, 0, 0, 0, 0]
    got = gc.compute_advantages(UNSCORABLE, 4, "group")
    assert all(close(g, e) for g, e in zip(got.tolist(), expected))
    # batch: the scored 1, 0, 1, 2 have mean 1 and variance (0 + 1 + 0 + 1) / 3
    b = (1 / 3) / (math.sqrt(2 / 3) + 1e-4)
    got = gc.compute_advantages(UNSCORABLE, 4, "batch")
    assert all(close(g, e) for g, e in zip(got.tolist(), [b, 0, -2 * b, b, 0, 0, 0, 0]))
    got = gc.compute_advantages(UNSCORABLE, 4, "none")
    assert all(close(g, e) for g, e in zip(got.tolist(), [1 / 3, 0, -2 / 3, 1 / 3, 0, 0, 0, 0]))


# ------------------------------------------------------------------------------------------------------------
# grpo_loss: B = 2 sequences, T = 3 tokens, the last token of row 1 masked.
# ratios r = exp(logp - old): row 0 [e^0.2, e^-0.5, 1] with A = +1, row 1 [e^-0.5, e^0.2, 1] with A = -2.
# clip to [0.8, 1.2]; l = -min(r A, clip(r) A):
#   row 0: -min(1.2214, 1.2) = -1.2 (high clip) | -min(0.6065, 0.8) = -0.6065 | -1
#   row 1: -min(-1.2131, -1.6) = 1.6 (low clip)  | -min(-2.4428, -2.4) = 2.4428 | (masked) 2
# ------------------------------------------------------------------------------------------------------------

LOGPS = torch.tensor([[-1.0, -2.0, -0.5], [-1.5, -0.2, -3.0]])
OLD = torch.tensor([[-1.2, -1.5, -0.5], [-1.0, -0.4, -3.0]])
ADV = torch.tensor([1.0, -2.0])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
ROW0 = [-1.2, -math.exp(-0.5), -1.0]
ROW1 = [1.6, 2 * math.exp(0.2), 2.0]
MASKED_SUM = sum(ROW0) + ROW1[0] + ROW1[1]  # 5 active tokens


def loss_cfg(loss_type="dapo", epsilon=0.2, epsilon_high=0.0, **flags):
    """grpo_loss's knobs, a Config: epsilon_high 0 is epsilon (cispo: its cap, 0 is CISPO_CAP)."""
    return gc.Config(loss_type=loss_type, epsilon=epsilon, epsilon_high=epsilon_high, **flags)


@pytest.mark.parametrize("loss_type,expected", [
    ("grpo", (sum(ROW0) / 3 + (ROW1[0] + ROW1[1]) / 2) / 2),  # per-sequence means, then the batch mean
    ("bnpo", MASKED_SUM / 5),  # token mean over the batch
    ("dr_grpo", MASKED_SUM / (2 * 4)),  # B * max_completion_length (= 4)
    ("dapo", MASKED_SUM / 5),  # global_count=None: this batch's tokens
])
def test_grpo_loss_normalisations(loss_type, expected):
    loss, stats = gc.grpo_loss(LOGPS, OLD, ADV, MASK, loss_cfg(loss_type, max_completion_length=4))
    assert close(loss, expected)
    # one of 5 tokens clipped high (row 0, t0), one clipped low (row 1, t0)
    assert close(stats["clip_ratio/high"], 0.2) and close(stats["clip_ratio/low"], 0.2)
    assert close(stats["clip_ratio/region"], 0.4)
    assert "kl" not in stats


def test_grpo_loss_global_counts():
    # global_count: the global batch's tokens (dapo) or sequences (grpo, dr_grpo), over all ranks and micro-batches
    assert close(gc.grpo_loss(LOGPS, OLD, ADV, MASK, loss_cfg("dapo"), global_count=10)[0], MASKED_SUM / 10)
    loss, _ = gc.grpo_loss(LOGPS, OLD, ADV, MASK, loss_cfg("grpo"), global_count=8)
    assert close(loss, (sum(ROW0) / 3 + (ROW1[0] + ROW1[1]) / 2) / 8)
    loss, _ = gc.grpo_loss(LOGPS, OLD, ADV, MASK, loss_cfg("dr_grpo", max_completion_length=4), global_count=8)
    assert close(loss, MASKED_SUM / (8 * 4))


def test_grpo_loss_clip_higher():
    # epsilon_high 0.25: row 0 t0 (r = 1.2214) is no longer clipped, l = -1.2214
    loss, stats = gc.grpo_loss(LOGPS, OLD, ADV, MASK, loss_cfg("bnpo", 0.2, 0.25))
    assert close(loss, (MASKED_SUM + 1.2 - math.exp(0.2)) / 5)
    assert close(stats["clip_ratio/high"], 0.0)


def test_grpo_loss_kl():
    ref = torch.full_like(LOGPS, -1.0)
    d = (ref - LOGPS).tolist()  # [[0, 1, -0.5], [0.5, -0.8, 2 (masked)]]
    kl = [[math.exp(x) - x - 1 for x in row] for row in d]
    kl_sum = sum(kl[0]) + kl[1][0] + kl[1][1]
    loss, stats = gc.grpo_loss(LOGPS, OLD, ADV, MASK, loss_cfg("bnpo", beta=0.1, use_bias_correction_kl=False),
                               ref_logps=ref)  # the plain k3
    assert close(loss, (MASKED_SUM + 0.1 * kl_sum) / 5)
    assert close(stats["kl"], kl_sum / 5)
    assert kl[0][0] == 0 and all(x >= 0 for row in kl for x in row)


RATIOS = [[math.exp(0.2), math.exp(-0.5), 1.0], [math.exp(-0.5), math.exp(0.2), 1.0]]


def test_grpo_loss_kl_bias_correction():
    # TRL's default: r_t KL_t. Off-policy, the value is the ratio-weighted k3. On-policy (r = 1,
    # with its gradient) the gradient of r_t KL_t is (1 - e^d) + KL_t = -d = logp_t - ref_t, where
    # d = ref_t - logp_t
    ref = torch.full_like(LOGPS, -1.0)
    d = (ref - LOGPS).tolist()
    kl = [[(math.exp(x) - x - 1) * r for x, r in zip(d_row, r_row)]
          for d_row, r_row in zip(d, RATIOS)]  # RATIOS = exp(LOGPS - OLD)
    kl_sum = sum(kl[0]) + kl[1][0] + kl[1][1]
    loss, stats = gc.grpo_loss(LOGPS, OLD, ADV, MASK, loss_cfg("bnpo", beta=0.1), ref_logps=ref)
    assert close(loss, (MASKED_SUM + 0.1 * kl_sum) / 5) and close(stats["kl"], kl_sum / 5)
    logps = LOGPS.clone().requires_grad_(True)
    loss, _ = gc.grpo_loss(logps, logps.detach(), torch.zeros(2), MASK, loss_cfg("bnpo", beta=0.1),
                           ref_logps=ref)
    loss.backward()
    assert torch.allclose(logps.grad, 0.1 * (LOGPS - ref) * MASK / 5)


def test_grpo_loss_cispo():
    # l_t = -sg(min(r_t, eps_high)) A logp_t, a token mean (as dapo). eps_high 1.1 caps r = e^0.2:
    # the weights are [[1.1, e^-0.5, 1], [e^-0.5, 1.1, (masked)]]
    weights = [[1.1, math.exp(-0.5), 1.0], [math.exp(-0.5), 1.1, 1.0]]
    per_token = [[-w * a * lp for w, lp in zip(w_row, lp_row)]
                 for w_row, lp_row, a in zip(weights, LOGPS.tolist(), (1, -2))]
    logps = LOGPS.clone().requires_grad_(True)
    loss, stats = gc.grpo_loss(logps, OLD, ADV, MASK, loss_cfg("cispo", 0.2, 1.1))
    assert close(loss.detach(), (sum(per_token[0]) + per_token[1][0] + per_token[1][1]) / 5)
    # capped where r > 1.1 and A > 0 (row 0, t0): TRL's cispo clip ratio; nothing is clipped low
    assert close(stats["clip_ratio/high"], 1 / 5) and close(stats["clip_ratio/low"], 0.0)
    loss.backward()  # no gradient through the weight: d/dlogp_t = -w_t A / 5, on every token
    assert torch.allclose(logps.grad, -torch.tensor(weights) * ADV[:, None] * MASK / 5)
    global_loss, _ = gc.grpo_loss(LOGPS, OLD, ADV, MASK, loss_cfg("cispo", 0.2, 1.1), global_count=10)
    assert close(global_loss * 10, loss.detach() * 5)  # normalised by the global batch's tokens
    # a bare --loss_type cispo (epsilon_high 0): the cap is CISPO_CAP = 5, over every ratio here
    # (e^0.2 = 1.22 at most), so the weights are the ratios themselves and nothing is capped
    assert gc.CISPO_CAP == 5.0
    uncapped = [[-r * a * lp for r, lp in zip(r_row, lp_row)]
                for r_row, lp_row, a in zip(RATIOS, LOGPS.tolist(), (1, -2))]
    loss, stats = gc.grpo_loss(LOGPS, OLD, ADV, MASK, loss_cfg("cispo"))
    assert close(loss, (sum(uncapped[0]) + uncapped[1][0] + uncapped[1][1]) / 5)
    assert close(stats["clip_ratio/high"], 0.0)


def test_grpo_loss_sapo():
    # l_t = -(4 / tau) sigmoid(tau (r_t - 1)) A, tau 1.0 (A > 0: row 0), 1.05 (row 1); as grpo
    def gate(r, tau):
        return 4 / tau / (1 + math.exp(-tau * (r - 1)))
    row0 = [-gate(r, 1.0) * 1 for r in RATIOS[0]]
    row1 = [gate(r, 1.05) * 2 for r in RATIOS[1][:2]]
    loss, _ = gc.grpo_loss(LOGPS, OLD, ADV, MASK, loss_cfg("sapo"))
    assert close(loss, (sum(row0) / 3 + sum(row1) / 2) / 2)
    # at r = 1 the gate's slope is 1: on-policy, its gradient is the policy gradient of grpo
    logps = LOGPS.clone().requires_grad_(True)
    loss, _ = gc.grpo_loss(logps, logps.detach(), ADV, MASK, loss_cfg("sapo", sapo_temperature_neg=2.0))
    loss.backward()
    assert torch.allclose(logps.grad, -ADV[:, None] * MASK / MASK.sum(1, keepdim=True) / 2)


def test_grpo_loss_gradient_is_policy_gradient_on_policy():
    # with old = logp (num_iterations = 1) the bnpo gradient w.r.t. logp_t is -A_t m_t / sum(m)
    logps = LOGPS.clone().requires_grad_(True)
    loss, _ = gc.grpo_loss(logps, logps.detach(), ADV, MASK, loss_cfg("bnpo"))
    loss.backward()
    assert torch.allclose(logps.grad, -ADV[:, None] * MASK / 5)


def test_grpo_loss_is_weights():
    w = torch.tensor([[2.0], [0.0]])  # sequence-level: row 1 masked out by its weight
    loss, _ = gc.grpo_loss(LOGPS, OLD, ADV, MASK, loss_cfg("bnpo"), is_weights=w)
    assert close(loss, 2 * sum(ROW0) / 5)


# GSPO: one ratio per sequence, exp of the mean masked log ratio. Row 0: mean(0.2, -0.5, 0) = -0.1, r = e^-0.1,
# A = +1; row 1: mean(-0.5, 0.2) = -0.15 (the masked token ignored), r = e^-0.15 = 0.8607, A = -2.
# With eps 0.05: row 0 -> -min(0.9048, 0.95) = -0.9048 (unclipped: A > 0); row 1 -> -min(-1.7214, -1.9) = 1.9,
# clipped low: both of its tokens, so no gradient reaches row 1.
SEQ_R0, SEQ_R1 = math.exp(-0.1), math.exp(-0.15)


def test_grpo_loss_sequence_level_gspo():
    logps = LOGPS.clone().requires_grad_(True)
    gspo = loss_cfg("grpo", 0.05, 0.05, importance_sampling_level="sequence")
    loss, stats = gc.grpo_loss(logps, OLD, ADV, MASK, gspo)
    assert close(loss.detach(), (-SEQ_R0 + 1.9) / 2)  # per-sequence means: every token of a row has the same loss
    assert close(stats["clip_ratio/low"], 2 / 5) and close(stats["clip_ratio/high"], 0.0)
    loss.backward()  # d/dlogp_t of -r A / 2 (grpo: mean of 2 sequences) = -A r / n_tokens / 2, shared by the row
    assert torch.allclose(logps.grad, torch.tensor([[-SEQ_R0 / 6] * 3, [0.0, 0.0, 0.0]]))
    token, _ = gc.grpo_loss(LOGPS, OLD, ADV, MASK, loss_cfg("bnpo", 0.05, 0.05))  # the token level differs
    seq, _ = gc.grpo_loss(LOGPS, OLD, ADV, MASK, loss_cfg("bnpo", 0.05, 0.05, importance_sampling_level="sequence"))
    assert close(seq, (-3 * SEQ_R0 + 2 * 1.9) / 5) and not close(token, seq)


# entropies H of the 6 tokens (the masked one is 9.0) and a threshold of 1.0: e = [[0, 1, 1], [1, 0, .]]
ENTROPY = torch.tensor([[0.5, 2.0, 1.0], [3.0, 0.1, 9.0]])


def test_grpo_loss_top_entropy_tokens_only():
    keep = (ENTROPY >= 1.0).float()  # what train_step passes for a threshold of 1.0
    loss, stats = gc.grpo_loss(LOGPS, OLD, ADV, MASK, loss_cfg("bnpo"), entropy_mask=keep)
    # the policy term of the 3 kept tokens, still / 5 tokens: -0.0013, from O(1) terms that cancel
    # (fp32 rounding: an absolute tolerance)
    assert close(loss, (ROW0[1] + ROW0[2] + ROW1[0]) / 5, atol=1e-6)
    assert close(stats["clip_ratio/low"], 0.2)  # the stats still count every token, as TRL's


def train_step_gradients(cfg, batch, budget=BUDGET):
    """The gradients that train_step steps with, on a fresh tiny Llama wrapped as the trainer wraps
    it (its entropy carries a gradient with --entropy_coef); the optimizer stand-in keeps them."""
    env = cpu_env()
    policy = gc.wrap_policy(tiny_llama(), env, cfg, False)
    optimizer = StepGradients(policy)
    stats = gc.train_step(policy, optimizer, NO_SCHEDULE, batch, cfg, env, budget, {}, 1)
    return optimizer.grads, stats


def entropy_bonus_by_hand(batch, budget, coef, rho=1.0, per_micro_batch=True):
    """The gradient of -bonus on a fresh tiny Llama, TRL's bonus: coef x the mean entropy of each
    micro-batch's learning tokens (its loss tokens, of the top rho by entropy) / the M micro-batches.
    per_micro_batch=False: one mean over all the batch's learning tokens instead."""
    policy = gc.Policy(tiny_llama(), entropy_grad=True)
    cuts = gc.split_micro_batches([len(p) + len(c) for p, c in zip(batch.sample_prompt_ids, batch.completion_ids)], budget)
    sums, counts = [], []
    for seqs in cuts:
        mb = gc.micro_batch(batch, seqs, "cpu")
        _, entropy = policy(*mb.packed, mb.model_mask, 1.0)  # [b, T]
        keep = torch.ones_like(entropy)
        if rho < 1:  # the (1 - rho)-quantile of the loss tokens' entropies, by torch.quantile
            keep = (entropy >= torch.quantile(entropy[mb.loss_mask.bool()], 1 - rho)).float()
        sums.append((entropy * keep * mb.loss_mask).sum())
        counts.append((keep * mb.loss_mask).sum())
    if per_micro_batch:
        bonus = coef * sum(s / n for s, n in zip(sums, counts)) / len(cuts)
    else:
        bonus = coef * sum(sums) / sum(counts)
    return torch.autograd.grad(-bonus, list(policy.parameters()))


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "bnpo"])  # normalised by tokens, sequences, micro-batch
def test_train_step_entropy_bonus_is_trls(loss_type):
    """--entropy_coef c, as TRL (issue 36 item 1): train_step backpropagates loss x loss_scale - bonus,
    bonus = c x the mean entropy of the micro-batch's loss tokens / M micro-batches, outside the
    loss's normaliser whatever the loss type. Budget 5: the sequences of 2 + 3 and 1 + 2 tokens are
    2 micro-batches, of 3 and 2 loss tokens, so TRL's mean of means (H1 / 3 + H2 / 2) / 2 differs from
    one mean (H1 + H2) / 5. The policy term is the same with or without the bonus (the entropy only
    changes it through --top_entropy_quantile): the gradients differ by the bonus's alone."""
    batch = train_batch([[1, 2], [3]], [[4, 5, 6], [7, 8]], [1.0, -1.0])
    flags = dict(loss_type=loss_type, max_grad_norm=0.0, vllm_importance_sampling_correction=False)  # no clipping
    without, _ = train_step_gradients(gc.Config(**flags), batch, budget=5)
    with_bonus, stats = train_step_gradients(gc.Config(entropy_coef=0.1, **flags), batch, budget=5)
    assert stats["skipped"] == 0.0 and any(g.abs().max() > 0 for g in without)  # a policy gradient too
    want = entropy_bonus_by_hand(batch, 5, 0.1)
    scale = max(w.abs().max().item() for w in want)  # 1.4e-3
    # within 1e-3 of the largest entry (4e-7 measured: fp32 noise of the policy term, which cancels)
    assert max((a - b - w).abs().max().item() for a, b, w in zip(with_bonus, without, want)) <= 1e-3 * scale
    one_mean = entropy_bonus_by_hand(batch, 5, 0.1, per_micro_batch=False)
    assert max((w - o).abs().max().item() for w, o in zip(want, one_mean)) > 0.1 * scale  # 2.7e-4: told apart


def test_entropy_bonus_with_top_entropy_quantile_is_the_kept_tokens_mean():
    # H = 1..5, rho 0.2: the 0.8-quantile is 4.2, so only H = 5 is kept. TRL's bonus is the mean
    # over the kept tokens, -5 c; divided by all 5 tokens it would be -1 c.
    entropy = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0]])
    mask = torch.ones(1, 5)
    assert gc.top_entropy_mask(entropy, mask, 0.2, world=1).tolist() == [[0.0, 0.0, 0.0, 0.0, 1.0]]
    assert gc.top_entropy_mask(entropy, mask, 0.4, world=1).tolist() == [[0.0, 0.0, 0.0, 1.0, 1.0]]  # 3.4
    # through train_step, on 5 loss tokens of the tiny Llama with advantages 0 (no policy term: the
    # gradient is the bonus's alone): rho 0.2 keeps the token of the highest entropy, and the bonus
    # is c x its entropy (its mean over the 1 kept token), not c x its entropy / 5
    batch = train_batch([[1, 2]], [[3, 4, 5, 6, 7]], [0.0])
    for loss_type in ("dapo", "bnpo"):
        cfg = gc.Config(loss_type=loss_type, entropy_coef=0.1, top_entropy_quantile=0.2, max_grad_norm=0.0,
                        vllm_importance_sampling_correction=False)
        got, _ = train_step_gradients(cfg, batch)
        want = entropy_bonus_by_hand(batch, BUDGET, 0.1, rho=0.2)
        assert all(torch.allclose(g, w, rtol=1e-4, atol=1e-8) for g, w in zip(got, want)), loss_type
        assert not all(torch.allclose(g, w / 5, rtol=1e-4, atol=1e-8) for g, w in zip(got, want))


def test_top_entropy_mask_one_rank():
    # the 5 loss tokens sorted: 0.1 0.5 1 2 3; the 0.6-quantile (top_entropy_quantile 0.4) at 0.6 * 4 = 2.4: 1.4,
    # so 2 and 3 are kept, and the masked 9.0 (its loss_mask drops it later)
    assert gc.top_entropy_mask(ENTROPY, MASK, 0.4, world=1).tolist() == [[0, 1, 0], [1, 0, 1]]
    # the threshold is 1.4: two tokens outside the loss mask, at 1.39 and 1.41, fall either side
    probe = torch.tensor([[0.1, 0.5, 1.0, 2.0, 3.0, 1.39, 1.41]])
    probe_mask = torch.tensor([[1.0] * 5 + [0.0, 0.0]])
    assert gc.top_entropy_mask(probe, probe_mask, 0.4, world=1).tolist() == [[0, 0, 0, 1, 1, 0, 1]]
    assert gc.top_entropy_mask(ENTROPY, MASK, 0.0, world=1).tolist() == [[0, 0, 0], [1, 0, 1]]  # rho 0: the top token
    assert gc.top_entropy_mask(ENTROPY, MASK, 1.0, world=1).tolist() == [[1, 1, 1], [1, 1, 1]]  # the default: all
    assert gc.top_entropy_mask(ENTROPY, torch.zeros_like(MASK), 0.5, world=1).sum() == 0  # no tokens: none kept


# ------------------------------------------------------------------------------------------------------------
# vllm_importance_weights: trainer vs vLLM logprobs; masked positions do not count
# ------------------------------------------------------------------------------------------------------------

TRAINER = torch.tensor([[-1.0, -2.0], [-0.5, -1.0]])
VLLM = torch.tensor([[-1.5, -2.0], [-0.5, -3.0]])
IS_MASK = torch.tensor([[1.0, 1.0], [1.0, 0.0]])


@pytest.mark.parametrize("mode,expected", [
    ("token_truncate", [[1.5, 1.0], [1.0, 1.0]]),  # e^0.5 = 1.65 capped at 1.5
    ("token_mask", [[0.0, 1.0], [1.0, 1.0]]),  # e^0.5 > 1.5 -> 0
    ("sequence_truncate", [[1.5], [1.0]]),  # row sums 0.5 and 0 (the masked diff of 2 is ignored)
    ("sequence_mask", [[0.0], [1.0]]),
])
def test_importance_weights(mode, expected):
    got = gc.vllm_importance_weights(TRAINER, VLLM, IS_MASK, mode, clip_max=1.5)
    assert torch.allclose(got, torch.tensor(expected))


def test_importance_weights_ignore_a_nan_vllm_logprob():
    # TRL: the token's difference is 0, so its weight is 1 (no correction) and the loss stays finite
    vllm = torch.tensor([[-1.5, math.nan], [-0.5, -3.0]])
    got = gc.vllm_importance_weights(TRAINER, vllm, IS_MASK, "token_truncate", clip_max=3.0)
    assert torch.allclose(got, torch.tensor([[math.exp(0.5), 1.0], [1.0, 1.0]]))
    got = gc.vllm_importance_weights(TRAINER, vllm, IS_MASK, "sequence_truncate", clip_max=3.0)
    assert torch.allclose(got, torch.tensor([[math.exp(0.5)], [1.0]]))
    loss, _ = gc.grpo_loss(LOGPS[:, :2], LOGPS[:, :2], ADV, IS_MASK, loss_cfg(), is_weights=got)
    assert torch.isfinite(loss)


def test_importance_weights_uncapped_value():
    got = gc.vllm_importance_weights(TRAINER, VLLM, IS_MASK, "token_truncate", clip_max=3.0)
    assert close(got[0, 0], math.exp(0.5))


# ------------------------------------------------------------------------------------------------------------
# logprobs: chunked == full log_softmax (values and gradients); the Policy forward on a padded batch
# ------------------------------------------------------------------------------------------------------------

def chunked_logprobs(hidden, weight, targets, temperature=1.0, chunk_size=1024, top_k=0, top_p=1.0):
    """(logps, entropies) [N] of the tokens of hidden [N, H] for targets [N]: gc.TokenLogprobs, what
    Policy runs (its entropy carries a gradient; Policy detaches it without --entropy_coef)."""
    return gc.TokenLogprobs.apply(hidden, weight, targets, temperature, top_k, top_p, chunk_size)


def test_chunked_logprobs_match_full_softmax():
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(7, 5, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(11, 5, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 11, (7,), generator=g)
    lp, ent = chunked_logprobs(hidden, weight, targets, temperature=0.7, chunk_size=3)
    logits = hidden @ weight.T / 0.7
    ref = logits.log_softmax(-1)
    ref_lp = ref.gather(-1, targets[:, None])[:, 0]
    assert torch.allclose(lp, ref_lp.float(), atol=1e-6)
    assert torch.allclose(ent, -(ref.exp() * ref).sum(-1).float(), atol=1e-5)
    (g1h, g1w) = torch.autograd.grad(lp.sum(), (hidden, weight))
    (g2h, g2w) = torch.autograd.grad(ref_lp.sum(), (hidden, weight))
    assert torch.allclose(g1h, g2h, atol=1e-6) and torch.allclose(g1w, g2w, atol=1e-6)
    lp, ent = chunked_logprobs(hidden, weight, targets, temperature=0.7, chunk_size=3)
    (g1h,) = torch.autograd.grad(ent.sum(), (hidden,))
    ref = (hidden @ weight.T / 0.7).log_softmax(-1)  # a fresh graph: the first one was freed
    (g2h,) = torch.autograd.grad(-(ref.exp() * ref).sum(), (hidden,))
    assert torch.allclose(g1h, g2h, atol=1e-5)  # the chunk computes in fp32
    # the entropy is only logged (or ranks tokens) unless --entropy_coef needs its gradient:
    # wrap_policy gives Policy's entropy a gradient then only
    packed = gc.pack(PROMPTS, COMPLETIONS, completion_mask_of(COMPLETIONS))
    for coef in (0.0, 0.1):
        policy = gc.wrap_policy(tiny_llama(), cpu_env(), gc.Config(entropy_coef=coef), False)
        logps, entropy = policy(*packed, completion_mask_of(COMPLETIONS), 1.0)
        assert logps.requires_grad and entropy.requires_grad == (coef != 0), coef


@pytest.mark.parametrize("device", [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.gpu, NEEDS_CUDA]),
])
def test_compiled_logprobs_match_the_definition(device, monkeypatch):
    """chunked_logprobs as CUDA runs it, its chunk functions compiled by torch.compile (inductor),
    on the CPU too (which otherwise runs them eager) when inductor finds a C++ compiler: logprobs,
    entropies and their gradients against log_softmax in float64, with and without top-k / top-p,
    at two row counts (dynamic shapes), in chunks of 16 rows."""
    if device == "cpu":
        if shutil.which("g++") is None and shutil.which("c++") is None:
            pytest.skip("inductor needs a C++ compiler on the CPU")
        # the kernels CUDA runs compiled, in their compiled form
        for eager, fast in gc.COMPILED.items():
            monkeypatch.setattr(gc, eager.__name__, fast)
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(300, 16, generator=g)  # [V, H], fp32 (bf16 would add its rounding)
    for rows, top_k, top_p in ((37, 0, 1.0), (5, 20, 0.9)):
        hidden = torch.randn(rows, 16, generator=g)  # [N, H]
        targets = torch.randint(0, 300, (rows,), generator=g)  # [N]
        h = hidden.to(device).requires_grad_(True)
        w = weight.to(device).requires_grad_(True)
        logps, entropy = chunked_logprobs(h, w, targets.to(device), 0.7, 16, top_k, top_p)
        got = [logps, entropy, *torch.autograd.grad(logps.sum() + entropy.sum(), (h, w))]
        # the definition, in float64: log softmax over the kept set (and the target); the entropy
        # of the full distribution
        h64 = hidden.double().requires_grad_(True)
        w64 = weight.double().requires_grad_(True)
        logits = h64 @ w64.T / 0.7  # [N, V]
        kept = gc.top_k_top_p_mask(logits.detach(), top_k, top_p)
        kept[torch.arange(rows), targets] = True
        logps = logits.masked_fill(~kept, -math.inf).log_softmax(-1)[torch.arange(rows), targets]
        log_p = logits.log_softmax(-1)  # [N, V]
        entropy = -(log_p.exp() * log_p).sum(-1)  # [N]
        want = [logps, entropy, *torch.autograd.grad(logps.sum() + entropy.sum(), (h64, w64))]
        # fp32 against float64: within 1e-4 of each tensor's largest value (a 1% error in the
        # temperature gives 1e-2)
        for name, a, b in zip(("logps", "entropy", "d/dhidden", "d/dweight"), got, want):
            error = (a.detach().cpu().double() - b).abs().max().item()
            assert error <= 1e-4 * b.abs().max().item(), (name, error)


# top-k / top-p by hand. Row 0: p = [.15, .5, .05, .3], top_p 0.7: ascending cumulative mass .05, .2, .5, 1 -> drop
# while <= 0.3 -> keep {.5, .3}: logp(.3) = log(.3 / .8). Row 1: p = [.4, .3, .2, .1], top_k 2 THEN top_p 0.5: the
# top 2 renormalised are [.571, .429]; .429 <= 0.5 drops .3 -> only .4 is left, logp = 0 (top-p first would keep
# {.4, .3}). Row 2: logits [1, 2, 2, 0], top_k 1: ties at the k-th value are kept -> logp(index 1) = log(1/2).
TOPKP = [([.15, .5, .05, .3], 0, 0.7, [0, 1, 0, 1], 3, math.log(.3 / .8)),
         ([.4, .3, .2, .1], 2, 0.5, [1, 0, 0, 0], 0, 0.0),
         ([math.e, math.e ** 2, math.e ** 2, 1.0], 1, 1.0, [0, 1, 1, 0], 1, math.log(0.5))]


@pytest.mark.parametrize("probs,top_k,top_p,kept,target,logp", TOPKP)
def test_top_k_top_p_logprobs_by_hand(probs, top_k, top_p, kept, target, logp):
    logits = torch.tensor([probs]).log() * 0.5  # temperature 0.5 undoes the 0.5: filtering sees the scaled logits
    assert gc.top_k_top_p_mask(logits / 0.5, top_k, top_p).int().tolist() == [kept]
    hidden = logits.clone().requires_grad_(True)  # weight = identity: logits = hidden
    lp, ent = chunked_logprobs(hidden, torch.eye(4), torch.tensor([target]), 0.5, 1, top_k, top_p)
    assert close(lp.detach(), logp)
    full = torch.tensor([probs]) / sum(probs)
    assert close(ent.detach(), -(full * full.log()).sum())  # the logged entropy is the full distribution's
    lp.sum().backward()
    assert torch.isfinite(hidden.grad).all() and (hidden.grad[0][torch.tensor(kept) == 0] == 0).all()


def test_top_k_top_p_mask_matches_vllm():
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    logits = (torch.randn(16, 200, generator=torch.Generator().manual_seed(0)) * 2).round(decimals=1)  # many ties
    for k, p in [(0, 0.9), (50, 1.0), (50, 0.95), (1, 1.0), (200, 0.5)]:
        ref = apply_top_k_top_p_pytorch(logits.clone(), torch.full((16,), k) if k else None,
                                        torch.full((16,), p) if p < 1 else None)
        assert torch.equal(gc.top_k_top_p_mask(logits, k, p), ref > -math.inf), (k, p)
    # a sampled token the trainer's own filter leaves out (bf16 noise at the boundary) still gets a finite logp
    lp, _ = chunked_logprobs(torch.tensor([[2.0, 1.0, 0.0]]), torch.eye(3), torch.tensor([2]), 1.0, 4, 1, 1.0)
    assert close(lp, -math.log(math.e ** 2 + 1))


def tiny_llama(vocab=64, hidden=32, heads=4, kv_heads=2, tie=True):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=256,
                         tie_word_embeddings=tie, attn_implementation="sdpa")
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="session")
def smol_tokenizer():
    assert os.path.isfile(os.path.join(MODEL, "model.safetensors")), \
        f"the embedded model is missing at {MODEL}: `bash run.sh test` prepares it"
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(MODEL)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory, smol_tokenizer):
    """tiny_model(engine=False, **shape): the directory of tiny_llama(**shape) with SmolLM2's
    tokenizer, saved once per session and shape. engine=True: SmolLM2's vocabulary and hidden 256
    (head_dim 64, what vLLM-CPU's attention needs), for runs with the engine."""
    saved = {}

    def directory(engine=False, **shape):
        if engine:
            shape = {"vocab": len(smol_tokenizer), "hidden": 256, **shape}
        key = repr(sorted(shape.items()))
        if key not in saved:
            saved[key] = str(tmp_path_factory.mktemp("tiny-llama"))
            tiny_llama(**shape).save_pretrained(saved[key])
            smol_tokenizer.save_pretrained(saved[key])
        return saved[key]
    return directory


PROMPTS, COMPLETIONS = [[5, 6, 7], [8, 9], [4]], [[10, 11], [12, 13, 14], []]  # the last: an empty completion


def test_pack():
    mask = completion_mask_of(COMPLETIONS)
    assert mask.tolist() == [[1, 1, 0], [1, 1, 1], [0, 0, 0]]  # every completion token scored
    input_ids, position_ids, cu_seqlens, longest, completion_index = gc.pack(PROMPTS, COMPLETIONS, mask)
    assert input_ids.tolist() == [[5, 6, 7, 10, 11, 8, 9, 12, 13, 14, 4]]  # one row, no padding
    assert position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 0]]  # restarting at every sequence
    assert cu_seqlens.tolist() == [0, 5, 10, 11] and cu_seqlens.dtype == torch.int32 and longest == 5
    assert completion_index.tolist() == [3, 4, 7, 8, 9]


def test_tool_tokens_are_packed_but_not_scored():
    # completion 1: a model token, a tool result's token (13), a model token (model_mask)
    mask = torch.tensor([[1, 1, 0], [1, 0, 1], [0, 0, 0]])
    input_ids, _, _, _, completion_index = gc.pack(PROMPTS, COMPLETIONS, mask)
    assert input_ids.tolist() == [[5, 6, 7, 10, 11, 8, 9, 12, 13, 14, 4]]  # 13 is read...
    assert completion_index.tolist() == [3, 4, 7, 9]  # ...but not scored
    lm = tiny_llama()
    logps, entropy = gc.Policy(lm)(*gc.pack(PROMPTS, COMPLETIONS, mask), mask, 1.0)
    full = lm(torch.tensor([[8, 9, 12, 13, 14]])).logits[0].log_softmax(-1)
    want = torch.stack([full[1, 12], torch.tensor(0.0), full[3, 14]])
    assert torch.allclose(logps[1], want, atol=1e-5)
    assert entropy[1, 1] == 0 and entropy[1, 0] > 0 and entropy[1, 2] > 0


def check_packed_logps(lm, attention_lm=None, atol=2e-3, device="cpu"):
    """The packed forward of (attention_lm or lm) == every sequence run alone through lm, unpacked to [B, T]."""
    mask = completion_mask_of(COMPLETIONS).to(device)
    logps, _ = gc.Policy(attention_lm or lm)(*gc.pack(PROMPTS, COMPLETIONS, mask, device), mask, 1.0)
    for i, (p, c) in enumerate(zip(PROMPTS, COMPLETIONS)):
        full = lm(torch.tensor([p + c], device=device)).logits[0].log_softmax(-1)
        want = [full[len(p) - 1 + t, tok].item() for t, tok in enumerate(c)]
        assert torch.allclose(logps[i, :len(c)].cpu(), torch.tensor(want), atol=atol)
        assert (logps[i, len(c):] == 0).all()


def test_policy_packed_forward_matches_each_sequence_alone():
    # sdpa: transformers builds the block-diagonal mask from the position ids, and keeps each
    # sequence's sliding window
    check_packed_logps(tiny_llama(), atol=1e-5)
    check_packed_logps(tiny_mistral(), atol=1e-5)


def tiny_mistral(window=2, hidden=32):  # a sliding window of `window` keys in every layer
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    config = MistralConfig(vocab_size=64, hidden_size=hidden, intermediate_size=2 * hidden,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           max_position_embeddings=256, sliding_window=window,
                           tie_word_embeddings=True, attn_implementation="sdpa")
    return MistralForCausalLM(config).eval()


@pytest.mark.parametrize("make_lm", [tiny_llama, tiny_mistral])
def test_varlen_attention_wiring(tmp_path, monkeypatch, make_lm):
    """The CUDA path's attention function, with a per-sequence sdpa standing in for torch's varlen
    kernel (CUDA only): GQA, layouts, the causal window (FlashAttention's (left, 0): keys
    i - left .. i, -1: all; a sliding window of 2 keys is (1, 0)), cu_seqlens, bf16 inputs. The
    stand-in has the signature of torch >= 2.12 (enable_gqa), the installed torch's; the GPU test
    below runs the kernel itself."""
    import types

    def varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1),
                    enable_gqa=False):
        assert window_size == ((1, 0) if make_lm is tiny_mistral else (-1, 0))
        assert q.dtype == k.dtype == torch.bfloat16 and cu_q.dtype == torch.int32
        assert enable_gqa  # found in the signature by load_lm, as in the installed torch's
        assert k.shape == v.shape and q.shape[1] == 2 * k.shape[1]  # grouped K/V heads, as they are (tiny_llama's)
        assert q.is_contiguous() and k.is_contiguous() and v.is_contiguous()
        assert max_q == int((cu_q[1:] - cu_q[:-1]).max()) and torch.equal(cu_q, cu_k)
        k, v = (x.repeat_interleave(2, 1) for x in (k, v))  # what the kernel does: KV head j serves heads 2j, 2j + 1
        out = torch.empty_like(q)  # [L, heads, D]
        for a, b in zip(cu_q[:-1].tolist(), cu_q[1:].tolist()):
            i = torch.arange(b - a)
            behind = i[:, None] - i[None]  # [l, l]: query position - key position
            allowed = (behind >= 0) & ((behind <= window_size[0]) | (window_size[0] < 0))
            qkv = (x[a:b].transpose(0, 1).float() for x in (q, k, v))  # [heads, l, D]
            sdpa = torch.nn.functional.scaled_dot_product_attention
            attention = sdpa(*qkv, attn_mask=allowed, scale=scale)  # [heads, l, D]
            out[a:b] = attention.transpose(0, 1).to(q.dtype)
        return out
    monkeypatch.setitem(sys.modules, "torch.nn.attention.varlen", types.SimpleNamespace(varlen_attn=varlen_attn))
    make_lm().save_pretrained(tmp_path)
    lm = gc.load_lm(str(tmp_path), "cpu", "varlen")
    assert lm.config._attn_implementation == "varlen"
    check_packed_logps(gc.load_lm(str(tmp_path), "cpu"), lm)  # bf16 q/k/v: 2e-3


@pytest.mark.gpu
@NEEDS_CUDA
def test_varlen_kernel_matches_sdpa_on_a_packed_batch(tiny_model):
    """torch's varlen kernel on CUDA, registered by load_lm for the installed torch: the packed
    forward against every sequence alone through sdpa (bf16 q/k/v: 3e-3 measured on a larger
    model), and its gradients."""
    path = tiny_model(hidden=256)  # head_dim 64, 4 heads sharing 2 KV heads
    varlen = gc.load_lm(path, "cuda", "varlen")
    sdpa = gc.load_lm(path, "cuda")
    check_packed_logps(sdpa, varlen, atol=1e-2, device="cuda")
    mask = completion_mask_of(COMPLETIONS).cuda()
    grads = []
    for lm in (varlen, sdpa):
        logps, _ = gc.Policy(lm)(*gc.pack(PROMPTS, COMPLETIONS, mask, "cuda"), mask, 1.0)
        grads.append(torch.autograd.grad((logps * mask).sum(), list(lm.parameters())))
    # packed sdpa is exact (the CPU test above): the kernel's gradients agree within bf16 noise
    for a, b in zip(*grads):
        assert (a - b).abs().max() <= 0.05 * b.abs().max() + 1e-6


@pytest.mark.gpu
@NEEDS_CUDA
def test_varlen_kernel_keeps_a_sliding_window(tmp_path):
    """torch's varlen kernel on CUDA with a sliding window of 2 keys (window_size (1, 0)): the packed
    forward against every sequence alone through sdpa, which keeps the window (the CPU test above).
    Full attention instead of the window moves these logprobs by 0.38 (fp32, on the CPU)."""
    tiny_mistral(hidden=256).save_pretrained(tmp_path)  # head_dim 64, 4 heads sharing 2 KV heads
    sdpa = gc.load_lm(str(tmp_path), "cuda")
    check_packed_logps(sdpa, gc.load_lm(str(tmp_path), "cuda", "varlen"), atol=1e-2, device="cuda")


def test_split_micro_batches():
    lengths = [5, 5, 5, 5, 12, 3]
    assert gc.split_micro_batches(lengths, 10) == [range(0, 2), range(2, 4), range(4, 5), range(5, 6)]  # 12 alone
    assert gc.split_micro_batches(lengths, 100) == [range(0, 6)]
    # exactly 3 (another rank needs 3): the one micro-batch is halved, then the half of more tokens (rows 3-5)
    assert gc.split_micro_batches(lengths, 100, 3) == [range(0, 3), range(3, 4), range(4, 6)]
    assert len(gc.split_micro_batches(lengths, 10, 6)) == 6


QWEN15 = SimpleNamespace(hidden_size=1536, num_hidden_layers=28)  # the Qwen2.5-1.5B shape
N15 = 1_543_714_304  # its parameters
GiB = 1 << 30


def test_memory_plan(monkeypatch):
    """memory_plan's rules: per parameter 16 bytes (+4 for beta's reference; LoRA 4; / world
    under FSDP2; + 2 on CUDA without FSDP2: autocast's bf16 copies), room = 0.85 x the GPU - those,
    64 x hidden x layers bytes per token (checkpointed: 4 x hidden x layers + 64 x hidden),
    checkpointing where your budget, or 4,096 tokens, would not fit; a CPU plans in its share of
    the RAM beside an engine that stays awake."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (0, 80 * GiB))  # an 80 GiB GPU
    gpu = cpu_env(device=SimpleNamespace(type="cuda"), dtype=torch.bfloat16)  # engine_bytes 0 for now

    def plan(env=gpu, shape=QWEN15, params=N15, **flags):  # (tokens, checkpointing, sleep)
        p = gc.memory_plan(gc.Config(**flags), env, shape, params)
        return p.token_budget, p.checkpointing, p.sleep
    # room = 0.85 x 80 GiB - 18 x 1,543,714,304 = 73,014,444,032 - 27,786,857,472 = 45,227,586,560 bytes;
    # 64 x 1536 x 28 = 2,752,512 bytes per token: 16,431 tokens. An engine of 0 bytes leaves as much
    # room awake: as many micro-batches, so the engine stays awake
    room = 0.85 * 80 * GiB - 18 * N15
    assert plan() == (int(room // (64 * 1536 * 28)), False, False) == (16431, False, False)
    assert plan(max_tokens_per_microbatch=8192) == (8192, False, False)  # 22.5 GB fit
    assert plan(max_tokens_per_microbatch=20480) == (20480, True, False)  # 56.4 GB do not
    # + an fp32 reference, 22 bytes per parameter: 73,014,444,032 - 33,961,714,688 = 39,052,729,344 bytes
    assert plan(beta=0.04) == (14188, False, False)
    # LoRA, 6 bytes per parameter (the frozen fp32 base, its bf16 copies): 63,752,158,208 bytes // 2,752,512
    assert plan(use_peft=True) == (23161, False, False)
    # an engine of 8 GiB: 36,637,651,968 bytes beside it, 13,310 tokens. A batch of 128 x (256 + 256)
    # = 65,536 tokens takes ceil(65,536 / 13,310) = 5 micro-batches awake, ceil(65,536 / 16,431) = 4
    # asleep: one more (0.05 s) costs less than a sleep and a wake (0.15 s), so auto stays awake
    gpu.engine_bytes = 8 * GiB
    assert plan() == (13310, False, False)
    assert plan(vllm_enable_sleep_mode="true") == (16431, False, True)
    assert plan(vllm_enable_sleep_mode="false") == (13310, False, False)  # awake: the room beside it
    assert plan(vllm_enable_sleep_mode="false", gradient_checkpointing="false",
                max_tokens_per_microbatch=20480) == (20480, False, False)
    # the Qwen2.5-7B shape, FSDP2 over 2 ranks: 16 x 7,615,616,512 / 2 = 60.9 GB leave 12,089,511,936
    # bytes, < 4,096 x 64 x 3584 x 28 = 26.3 GB: checkpointed, 4 x 3584 x 28 + 64 x 3584 = 630,784
    # bytes per token: 19,165 tokens
    qwen7, n7 = SimpleNamespace(hidden_size=3584, num_hidden_layers=28), 7_615_616_512
    fsdp2 = cpu_env(device=SimpleNamespace(type="cuda"), world=2, local_world=2, dtype=torch.bfloat16)
    room7 = 0.85 * 80 * GiB - 8 * n7
    assert plan(fsdp2, qwen7, n7, fsdp=True) == (int(room7 // (4 * 3584 * 28 + 64 * 3584)), True, False)
    assert plan(fsdp2, qwen7, n7, fsdp=True)[0] == 19165
    # on one GPU the 7B's 122 GB of weights, gradients and AdamW leave no room: refused by flag
    with pytest.raises(gc.ConfigError, match="^--max_completion_length: a sequence of 512 tokens needs"):
        plan(gpu, qwen7, n7)

    # a CPU: this process's share of 32 GiB of RAM (2 processes) less 2 GiB, 15,032,385,536 bytes; 85%
    # of it, less 16 x 134,515,008 (SmolLM2-135M's shape) and the engine, awake: its KV cache
    # max_num_seqs 128 x 512 tokens x (2 x 30 layers x 3 KV heads x 64 x 4 bytes = 46,080) =
    # 3,019,898,880 bytes + its fp32 weights 4 x 134,515,008: room 7,067,328,665.6 bytes
    monkeypatch.setattr(os, "sysconf", lambda name: {"SC_PAGE_SIZE": 4096, "SC_PHYS_PAGES": 32 * GiB // 4096}[name])
    smol = SimpleNamespace(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                           head_dim=64)
    n135, cpu = 134_515_008, cpu_env(local_world=2)
    room_cpu = 0.85 * (16 * GiB - 2 * GiB) - 16 * n135 - (128 * 512 * 46_080 + 4 * n135)
    # 180 x 576 x 30 = 3,110,400 bytes per token: 4,096 tokens (12.7 GB) do not fit, so auto
    # checkpoints, 4 x 576 x 30 + 180 x 576 = 172,800 bytes per token
    assert plan(cpu, smol, n135) == (int(room_cpu // 172_800), True, False) == (40898, True, False)
    assert plan(cpu, smol, n135, gradient_checkpointing="false") == (int(room_cpu // 3_110_400), False, False)
    assert plan(cpu, smol, n135, gradient_checkpointing="false")[0] == 2272
    assert plan(cpu, smol, n135, max_tokens_per_microbatch=600) == (600, False, False)  # 1.9 GB fit: off


def test_auto_sleep_from_the_planned_peak(monkeypatch):
    """Sleep mode auto decides from memory_plan's planned peak (parameters + a full token budget),
    never from a short first step: the engine stays awake only where 4,096 tokens (or your budget)
    fit beside it AND the micro-batches the smaller budget adds cost less than a sleep and a wake
    (MICRO_BATCH_SECONDS each against SLEEP_WAKE_SECONDS per rank on the host); the budget is
    then sized for the room beside it. 0.5B on 80 GiB."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (0, 80 * GiB))
    qwen05, n05 = SimpleNamespace(hidden_size=896, num_hidden_layers=24), 494_032_768  # 0.5B
    engine = int(0.3 * 80 * GiB) + 2 * GiB  # setup_env's engine_bytes: 26 GiB
    env = cpu_env(device=SimpleNamespace(type="cuda"), dtype=torch.bfloat16, engine_bytes=engine)
    per_token = 64 * 896 * 24  # 1,376,256 bytes
    asleep = 0.85 * 80 * GiB - 18 * n05  # 64,121,854,208 bytes: 46,591 tokens
    awake = asleep - engine  # 36,204,566,784 bytes: 26,306 tokens

    def plan(shape=qwen05, params=n05, **flags):  # (tokens, checkpointing, sleep, why)
        cfg = gc.Config(**{"num_generations": 8, "gradient_accumulation_steps": 1,
                           "max_completion_length": 1024, **flags})  # sequences of <= 256 + 1,024 tokens
        p = gc.memory_plan(cfg, env, shape, params)
        return p.token_budget, p.checkpointing, p.sleep, p.why
    # 8 completions, <= 8 x 1,280 = 10,240 tokens: 1 micro-batch awake as asleep, so it stays awake
    assert plan(per_device_train_batch_size=8)[:3] == (int(awake // per_token), False, False) == (26306, False, False)
    assert 18 * n05 + 26306 * per_token + engine <= 0.85 * 80 * GiB  # fits, engine awake
    # 48 completions: 61,440 tokens, ceil(61,440 / 26,306) = 3 micro-batches awake, ceil(61,440 /
    # 46,591) = 2 asleep: a micro-batch more (0.05 s) costs less than a sleep and a wake (0.15 s)
    tokens, checkpointing, sleep, why = plan(per_device_train_batch_size=48)
    assert (tokens, checkpointing, sleep) == (26306, False, False)
    assert "off (auto: 3 micro-batches awake, 2 asleep: ~0.05s < a sleep and a wake" in why
    # 192 completions: 245,760 tokens, 10 micro-batches awake, 6 asleep: 4 more (0.20 s) cost more
    tokens, checkpointing, sleep, why = plan(per_device_train_batch_size=192)
    assert (tokens, checkpointing, sleep) == (int(asleep // per_token), False, True) == (46591, False, True)
    assert "awake would cut 10 micro-batches, not 6" in why
    # a budget of yours that fits only while the engine sleeps (30,000 x 1.38 MB = 41.3 GB > 36.2 GB)
    # keeps it asleep; so does "true"
    assert plan(per_device_train_batch_size=8, max_tokens_per_microbatch=30_000)[:3] == (30_000, False, True)
    assert plan(per_device_train_batch_size=8, vllm_enable_sleep_mode="true")[:3] == (46591, False, True)
    # the Qwen2.5-1.5B shape at the defaults, 128 x (256 + 256) = 65,536 tokens: 45,227,586,560 -
    # 27,917,287,424 = 17,310,299,136 bytes beside the engine, 6,288 tokens, 11 micro-batches; 4 asleep
    # (16,431 tokens): 7 more (0.35 s) cost more than a sleep and a wake, so it sleeps (as on an H100)
    p = gc.memory_plan(gc.Config(), env, QWEN15, N15)
    assert (p.token_budget, p.checkpointing, p.sleep) == (16431, False, True)
    assert "awake would cut 11 micro-batches, not 4" in p.why
    # --vllm_enable_sleep_mode false: the room beside the engine, however small: 6,288 tokens (4,096
    # fit). An engine of 0.4 x 80 GiB + 2 GiB leaves 8,720,364,544 bytes, under 4,096 x 2,752,512 =
    # 11,274,289,152: checkpointed, 4 x 1536 x 28 + 64 x 1536 = 270,336 bytes per token, 32,257 tokens
    p = gc.memory_plan(gc.Config(vllm_enable_sleep_mode="false"), env, QWEN15, N15)
    assert (p.token_budget, p.checkpointing, p.sleep) == (6288, False, False)
    env.engine_bytes = int(0.4 * 80 * GiB) + 2 * GiB
    p = gc.memory_plan(gc.Config(vllm_enable_sleep_mode="false"), env, QWEN15, N15)
    assert (p.token_budget, p.checkpointing, p.sleep) == (32257, True, False)
    env.engine_bytes = engine
    # four DDP ranks on the host: their sleeps and wakes take turns in the driver (4 x 0.15 s), so the
    # 4 micro-batches more of 192 completions (0.20 s) are the cheaper choice: awake
    env.local_world = 4
    tokens, checkpointing, sleep, why = plan(per_device_train_batch_size=192)
    assert (tokens, checkpointing, sleep) == (26306, False, False)
    assert "off (auto: 10 micro-batches awake, 6 asleep: ~0.20s < a sleep and a wake, ~0.60s)" in why
    # FSDP2 too (on 4 H100s awake was 0.5 s a step faster: 2 micro-batches more cost less than the sleep)
    assert "off (auto: 10 micro-batches awake, 6 asleep" in plan(per_device_train_batch_size=192, fsdp=True)[3]


def test_micro_batch_packs_rows_and_cuts_columns():
    model_mask = completion_mask_of(COMPLETIONS)
    batch = SimpleNamespace(sample_prompt_ids=PROMPTS, completion_ids=COMPLETIONS, model_mask=model_mask,
                            loss_mask=model_mask.float(), advantages=torch.arange(3.0), vllm_logps=None,
                            old_logps=torch.ones(3, 3), ref_logps=None)
    mb = gc.micro_batch(batch, range(0, 1), "cpu")
    assert [getattr(x, "tolist", lambda: x)() for x in mb.packed] == [[[5, 6, 7, 10, 11]], [[0, 1, 2, 3, 4]], [0, 5],
                                                                      5, [3, 4]]
    assert mb.model_mask.tolist() == [[1, 1]] and mb.old_logps.shape == (1, 2)  # T: its longest completion
    mb = gc.micro_batch(batch, range(1, 3), "cpu")
    assert mb.packed[1].tolist() == [[0, 1, 2, 3, 4, 0]] and mb.advantages.tolist() == [1.0, 2.0]


# ------------------------------------------------------------------------------------------------------------
# data, seeds, schedule, flags
# ------------------------------------------------------------------------------------------------------------

def test_arithmetic_task_is_deterministic_and_split():
    train, held = rf.arithmetic_task(seed=1, num_eval=50)
    train2, held2 = rf.arithmetic_task(seed=1, num_eval=50)
    assert train == train2 and held == held2 and len(held) == 50
    assert {r["prompt"] for r in train}.isdisjoint(r["prompt"] for r in held)
    assert rf.arithmetic_task(seed=2, num_eval=50)[0][:20] != train[:20]  # the seed changes the order
    for row in held[:10]:
        a, op, b = row["prompt"].split("?")[0].split()[2:5]
        assert int(row["answer"]) == (int(a) + int(b) if op == "+" else int(a) - int(b))


def test_rows_for_rollout_takes_a_global_slice_whatever_the_world_size():
    rows = list(range(10))
    epoch0, epoch1 = gc.epoch_permutation(10, 0, 0), gc.epoch_permutation(10, 0, 1)
    assert sorted(epoch0) == rows and epoch0 != epoch1
    two = [gc.rows_for_rollout(rows, 6, r, 3, seed=0) for r in range(2)]  # 2 ranks x 3 prompts from position 6
    assert [list(p) for p, _ in two] == [[6, 7, 8], [9, 10, 11]]  # rank 1 runs into epoch 1 (another order)
    assert two[1][1] == [epoch0[9], epoch1[0], epoch1[1]]
    one = gc.rows_for_rollout(rows, 6, 0, 6, seed=0)  # resumed on 1 rank with 6 prompts: the same slice
    assert list(one[0]) == [6, 7, 8, 9, 10, 11] and one[1] == two[0][1] + two[1][1]
    assert gc.rows_for_rollout(rows, 6, 1, 3, seed=0) == two[1]  # a pure function of (position, rank, size, seed)


def test_truncated_means_no_eos_as_in_trl():
    assert gc.is_truncated([5, 6, 7], "length", {2})  # cut off at max_completion_length
    assert not gc.is_truncated([5, 6, 2], "length", {2, 9})  # EOS was the last token allowed: it ended
    assert not gc.is_truncated([5, 9], "stop", {2, 9})


class FirstPush(Exception):
    """Ends run() at the engine's first push (test_parity_probe_fits_the_engine)."""


def test_parity_probe_fits_the_engine(tiny_model, smol_tokenizer, tmp_path, monkeypatch):
    """run's parity probe: the first eval prompt + "#### <answer>", cut to fit the engine's
    max_model_len (max_prompt_length + max_completion_length) with a token to spare. Read from the
    engine at its first push, which ends the run here (a stand-in engine: nothing generates)."""
    tok = smol_tokenizer
    probes = []

    def first_push(self, policy, step, ledger):
        probes.append(self.probe_ids)
        raise FirstPush
    monkeypatch.setattr(gc, "make_engine", lambda *args: RecordingEngine())
    monkeypatch.setattr(gc.ColocatedEngine, "wake_and_push", first_push)

    def probe(row, max_prompt_length, max_completion_length):
        cfg = gc.Config(model=tiny_model(), max_prompt_length=max_prompt_length, output_dir=str(tmp_path),
                        max_completion_length=max_completion_length, reward_funcs=["reward_len"])
        plan = SimpleNamespace(token_budget=BUDGET, checkpointing=False, sleep=False, why="off")
        with pytest.raises(FirstPush):
            gc.run(cfg, cpu_env(), SimpleNamespace(model_config=None, data=(tok, [row], [row]), state=None,
                                                   plan=plan))
        return probes.pop()
    row = {"prompt_ids": list(range(100, 120)), "answer": "She sold 48 / 2 = 24 clips in May. " * 20 + "#### 72"}
    long = probe(row, 20, 16)  # a GSM8K-style worked solution; max_model_len 20 + 16
    assert len(long) == 35 and long[:20] == row["prompt_ids"]
    assert long[20:] == tok(f"#### {row['answer']}", add_special_tokens=False)["input_ids"][:15]
    short = probe({"prompt_ids": [1, 2], "answer": "7"}, 20, 16)
    assert short == [1, 2] + tok("#### 7", add_special_tokens=False)["input_ids"]


def test_metrics_line_is_strict_json(tmp_path):
    cfg = gc.Config(output_dir=str(tmp_path))
    gc.log_metrics(cfg, cpu_env(), {"step": 3, "grad_norm": float("nan"), "kl": float("inf"), "loss": 0.5}, [])
    line = (tmp_path / "metrics.jsonl").read_text()
    assert line.count("\n") == 1 and "NaN" not in line and "Infinity" not in line
    assert json.loads(line) == {"step": 3, "grad_norm": None, "kl": None, "loss": 0.5}
    gc.log_metrics(cfg, cpu_env(rank=1, is_main=False), {"step": 3, "loss": 0.25}, [])  # rank 0 writes alone
    assert (tmp_path / "metrics.jsonl").read_text() == line


def test_mfu_params_skip_the_input_embedding_but_count_the_lm_head():
    vocab, hidden = 64, 32
    tied, untied = tiny_llama(tie=True), tiny_llama(tie=False)
    total = sum(p.numel() for p in untied.parameters())
    assert gc.matmul_params(untied) == total - vocab * hidden  # the embedding lookup costs no FLOPs
    assert gc.matmul_params(tied) == total - vocab * hidden  # a tied lm_head is still a matmul
    assert sum(p.numel() for p in tied.parameters()) == total - vocab * hidden


@pytest.mark.parametrize("name,peak", [("NVIDIA H100 PCIe", 756e12), ("NVIDIA H100 80GB HBM3", 989e12),
                                       ("NVIDIA H100 NVL", 835e12), ("NVIDIA H200", 989e12), ("NVIDIA H800", 989e12), ("Tesla T4", None)])
def test_peak_flops_tells_h100_pcie_from_sxm(monkeypatch, name, peak):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert gc.peak_flops(SimpleNamespace(device=torch.device("cuda", 0))) == peak


def test_derive_seed_stable_and_distinct():
    # pinned: the same in every process and on every machine (Python's hash() of a str is salted
    # per process)
    assert gc.derive_seed(1, "rollout", 3, 0) == 1889194598
    assert gc.derive_seed(42, "rollout") == 1334624133  # the default run's rollout seed base
    assert len({gc.derive_seed(s, "rollout", 3, e) for s in range(3) for e in range(3)}) == 9


def lr_factors(tiny_model, steps, **flags):
    """The schedule of build_trainer's AdamW (transformers' get_scheduler) with --max_steps 10: the
    rate of every parameter group after s scheduler steps, as a factor of --learning_rate, s <= 12."""
    import warnings

    cfg = gc.Config(model=tiny_model(), max_steps=10, learning_rate=1e-3, weight_decay=0.1, **flags)
    trainer = gc.build_trainer(cfg, cpu_env(), SimpleNamespace(checkpointing=False), None)
    factors = []
    with warnings.catch_warnings():  # scheduler steps without optimizer steps: torch warns
        warnings.simplefilter("ignore")
        for _ in range(13):
            rates = {group["lr"] / 1e-3 for group in trainer.optimizer.param_groups}
            assert len(rates) == 1 and len(trainer.optimizer.param_groups) == 2  # decayed or not: one rate
            factors.append(rates.pop())
            trainer.scheduler.step()
    return [round(factors[s], 4) for s in steps]


def test_lr_schedules(tiny_model):
    # warmup W = 2 (HF's s / W: 0 at step 0), then progress p = (s - 2) / 8
    assert lr_factors(tiny_model, (0, 1, 2, 6, 12), warmup_steps=2) == [0.0, 0.5, 1.0, 0.5, 0.0]  # linear
    assert lr_factors(tiny_model, (6,), warmup_steps=2, lr_scheduler_type="cosine") == [0.5]
    # constant: HF's constant_with_warmup
    assert lr_factors(tiny_model, (0, 1, 9), warmup_steps=2, lr_scheduler_type="constant") == [0.0, 0.5, 1.0]


def test_lr_schedules_without_warmup(tiny_model):
    # progress p = s / 10: linear 1 - p, cosine (1 + cos(pi p)) / 2 (0.9045 at p = 0.2, where linear
    # gives 0.8); linear stays at 0 past max_steps. (HF's cosine climbs back there, 0.0955 at p = 1.2:
    # never used, as the last step, max_steps, runs at the factor of max_steps - 1.)
    want = {
        "linear": [1.0, 0.8, 0.5, 0.0, 0.0],
        "cosine": [1.0, 0.9045, 0.5, 0.0],
        "constant": [1.0] * 5,
    }
    for schedule, factors in want.items():
        steps = (0, 2, 5, 10, 12)[:len(factors)]
        assert lr_factors(tiny_model, steps, warmup_steps=0, lr_scheduler_type=schedule) == factors, schedule


def test_parse_args_types_and_bools():
    cfg = gc.parse_args(["--beta", "0.04", "--reward_funcs", "reward_len", "format_reward", "--reward_weights",
                         "1", "0.5", "--mask_truncated_completions", "--vllm_importance_sampling_correction",
                         "false", "--top_k", "20"])
    assert cfg.beta == 0.04 and cfg.reward_weights == [1.0, 0.5] and cfg.top_k == 20
    assert cfg.mask_truncated_completions is True and cfg.vllm_importance_sampling_correction is False
    cfg = gc.parse_args(["--importance_sampling_level", "sequence", "--top_entropy_quantile", "0.2",
                         "--entropy_coef", "0.01", "--dynamic_sampling_factor", "1.5"])
    assert (cfg.importance_sampling_level, cfg.top_entropy_quantile, cfg.entropy_coef,
            cfg.dynamic_sampling_factor) == ("sequence", 0.2, 0.01, 1.5)


@pytest.mark.parametrize("argv,flag", [
    (["--num_generations", "1"], "--num_generations"),
    (["--per_device_train_batch_size", "6", "--gradient_accumulation_steps", "1"], "--per_device_train_batch_size"),
    (["--loss_type", "ppo"], "--loss_type"),
    (["--scale_rewards", "global"], "--scale_rewards"),
    (["--reward_funcs", "nope"], "--reward_funcs"),
    (["--reward_weights", "1", "2", "3"], "--reward_weights"),
    (["--epsilon_high", "0.1"], "--epsilon_high"),
    (["--beta", "-1"], "--beta"),
    (["--learning_rate", "nan"], "--learning_rate"),
    (["--max_steps", "0"], "--max_steps"),
    (["--vllm_gpu_memory_utilization", "1.5"], "--vllm_gpu_memory_utilization"),
    (["--vllm_sleep_level", "3"], "--vllm_sleep_level"),
    (["--vllm_enable_sleep_mode", "maybe"], "--vllm_enable_sleep_mode"),
    (["--vllm_importance_sampling_mode", "seq"], "--vllm_importance_sampling_mode"),
    (["--dtype", "float16"], "--dtype"),
    (["--lr_scheduler_type", "step"], "--lr_scheduler_type"),
    (["--resume_from_checkpoint", "/nonexistent"], "--resume_from_checkpoint"),
    (["--weight_push_bucket_mb", "0"], "--weight_push_bucket_mb"),
    (["--ignore_eos", "--mask_truncated_completions"], "--mask_truncated_completions"),  # would mask everything
    (["--max_tokens_per_microbatch", "500"], "--max_tokens_per_microbatch"),  # < 256 + 256: a sequence must fit
    (["--gradient_checkpointing", "sometimes"], "--gradient_checkpointing"),
    (["--use_peft", "--lora_r", "0"], "--lora_r"),
    (["--use_peft", "--lora_dropout", "1"], "--lora_dropout"),
    (["--report_to", "mlflow"], "--report_to"),
    (["--importance_sampling_level", "seq"], "--importance_sampling_level"),
    (["--top_entropy_quantile", "1.5"], "--top_entropy_quantile"),
    (["--entropy_coef", "nan"], "--entropy_coef"),
    (["--dynamic_sampling_factor", "0.5"], "--dynamic_sampling_factor"),
    (["--dynamic_sampling_factor", "inf"], "--dynamic_sampling_factor"),
    (["--ddp_timeout", "0"], "--ddp_timeout"),
    (["--warmup_steps", "-1"], "--warmup_steps"),
    (["--weight_decay", "-0.1"], "--weight_decay"),
    (["--max_grad_norm", "-1"], "--max_grad_norm"),
    (["--epsilon", "0"], "--epsilon"),
    (["--epsilon", "1.5"], "--epsilon"),
    (["--vllm_importance_sampling_clip_max", "0.5"], "--vllm_importance_sampling_clip_max"),
    (["--temperature", "0"], "--temperature"),
    (["--top_p", "0"], "--top_p"),
    (["--top_p", "1.5"], "--top_p"),
    (["--top_k", "-1"], "--top_k"),
    (["--eval_steps", "-1"], "--eval_steps"),
    (["--save_steps", "-2"], "--save_steps"),
    (["--lora_alpha", "0"], "--lora_alpha"),
    (["--reward_funcs"], "--reward_funcs"),  # none at all
    (["--dynamic_sampling_reward", "format_reward"], "--dynamic_sampling_reward"),  # not listed
    (["--loss_type", "cispo", "--epsilon_high", "0.5"], "--epsilon_high"),  # a cap < 1 scales every gradient down
    (["--sapo_temperature_neg", "0"], "--sapo_temperature_neg"),
    (["--max_tool_calling_iterations", "-1"], "--max_tool_calling_iterations"),
    (["--tools", "nope"], "--tools"),
    (["--no_such_flag", "1"], "--no_such_flag 1"),  # argparse's leftovers, named as they were typed
])
def test_bad_flags_rejected_with_the_flag_named(argv, flag):
    with pytest.raises(gc.ConfigError, match=f"^{flag}: "):  # "--flag: is <value>; <fix>", or argparse's text
        gc.parse_args(argv)


def test_a_bad_choice_is_argparses_message():
    choices = "'grpo', 'bnpo', 'dr_grpo', 'dapo', 'cispo', 'sapo'"
    with pytest.raises(gc.ConfigError, match=f"^--loss_type: invalid choice: 'ppo' \\(choose from {choices}\\)$"):
        gc.parse_args(["--loss_type", "ppo"])
    with pytest.raises(gc.ConfigError, match="^--beta: invalid float value: 'x'$"):
        gc.parse_args(["--beta", "x"])


def test_cispo_takes_its_default_cap():
    """A bare --loss_type cispo is accepted (issue 36 item 7): its cap is CISPO_CAP = 5.0."""
    cfg = gc.parse_args(["--loss_type", "cispo"])
    assert (cfg.loss_type, cfg.epsilon_high) == ("cispo", 0.0)
    assert gc.parse_args(["--loss_type", "cispo", "--epsilon_high", "4"]).epsilon_high == 4.0


def test_normalisers_cover_every_loss_type():
    loss_type = {f.name: f for f in dataclasses.fields(gc.Config)}["loss_type"]
    assert set(gc.NORMALISERS) == set(typing.get_args(loss_type.type))


def test_a_tool_needs_a_schema_and_a_chat_template(tmp_path):
    cfg = gc.parse_args(["--tools", "reward_fns:reward_len", "--num_eval", "2"])  # no type hints
    with pytest.raises(gc.ConfigError, match="--tools: .*reward_len"):
        gc.prepare_data(cfg)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(MODEL)
    tok.chat_template = None  # a base model
    tok.save_pretrained(tmp_path)
    (tmp_path / "chat_template.jinja").unlink(missing_ok=True)
    cfg = gc.parse_args(["--tools", "calculator", "--model", str(tmp_path), "--num_eval", "2"])
    with pytest.raises(gc.ConfigError, match="--tools: the model's chat template cannot render .*chat_template is not set"):
        gc.prepare_data(cfg)


def test_use_peft_needs_peft_and_an_adapter_to_resume(tmp_path, monkeypatch):
    genuine_checkpoint(tmp_path)  # a full fine-tuning checkpoint: no adapter/
    with pytest.raises(gc.ConfigError, match="^--use_peft: is True, but the checkpoint.s run had False: pass that"):
        gc.parse_args(["--use_peft", "--resume_from_checkpoint", str(tmp_path), "--output_dir", str(tmp_path / "out")])
    monkeypatch.setitem(sys.modules, "peft", None)  # not installed
    with pytest.raises(gc.ConfigError, match="^--use_peft: is True; pip install peft"):
        gc.parse_args(["--use_peft"])


def test_lora_on_an_embedding_is_refused(tmp_path):
    """peft adapts an embedding with lora_embedding_A/B, which the weight push does not merge (a
    KeyError at the first push; a tied lm_head would not follow it): refused at start, by flag."""
    tiny_llama().save_pretrained(tmp_path)
    for targets in (["embed_tokens"], ["q_proj", "model.embed_tokens"]):
        cfg = gc.Config(model=str(tmp_path), use_peft=True, lora_target_modules=targets,
                        max_prompt_length=128, max_completion_length=128)  # the tiny context: 256
        with pytest.raises(gc.ConfigError, match="--lora_target_modules: model.embed_tokens: the push merges"):
            gc.check_model(cfg, gc.load_model_config(cfg))
    cfg = dataclasses.replace(cfg, lora_target_modules=["q_proj", "v_proj"])
    gc.check_model(cfg, gc.load_model_config(cfg))  # Linear layers: fine


def test_bad_tp_for_world(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(gc.ConfigError, match="--vllm_tensor_parallel_size"):
        gc.parse_args(["--vllm_tensor_parallel_size", "3"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusals")
@pytest.mark.parametrize("argv,flag", [
    (["--vllm_enable_sleep_mode", "true"], "--vllm_enable_sleep_mode"),
])
def test_gpu_only_flags_refused_on_cpu(argv, flag):
    with pytest.raises(gc.ConfigError, match=flag):
        gc.parse_args(argv)


def test_sleep_mode_values():
    for value in ("auto", "false"):  # both mean no sleep on a CPU: accepted
        assert gc.parse_args(["--vllm_enable_sleep_mode", value]).vllm_enable_sleep_mode == value


@pytest.fixture
def world_of_one(tmp_path):
    """A gloo process group of one process, for code that all-reduces."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_process_group_waits_ddp_timeout(monkeypatch):
    """Every collective (the barriers while rank 0 saves) waits --ddp_timeout seconds, not the
    backend's default (NCCL: 10 minutes); our TP groups too."""
    # MASTER_PORT 0: the store of a world of one binds a free port itself
    world_of_one_env = dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                            MASTER_ADDR="127.0.0.1", MASTER_PORT="0")
    for key, value in world_of_one_env.items():
        monkeypatch.setenv(key, value)
    cfg = gc.Config(ddp_timeout=4321)
    env = gc.setup_env(cfg)
    gc.setup_distributed(cfg, env)
    try:
        for group in (dist.group.WORLD, env.tp_group):
            backend = group._get_backend(torch.device("cpu"))
            assert backend.options._timeout == datetime.timedelta(seconds=4321)
    finally:
        dist.destroy_process_group()


def test_gap_check_names_the_step(world_of_one):
    fp32, bf16 = (SimpleNamespace(device=torch.device("cpu"), dtype=d) for d in (torch.float32, torch.bfloat16))
    assert gc.check_gap(5e-5, fp32, 3, "the probe") == 5e-5 and gc.check_gap(0.013, bf16, 3, "the probe") == 0.013
    for gap, env in ((2e-4, fp32), (math.nan, fp32), (7.0, bf16)):  # above 1e-4 (fp32), NaN, above 0.5 (bf16)
        with pytest.raises(RuntimeError, match="step 3: vLLM and the trainer disagree on the probe: mean"):
            gc.check_gap(gap, env, 3, "the probe")


def test_dataset_file_missing(tmp_path):
    with pytest.raises(gc.ConfigError, match="--dataset"):
        gc.parse_args(["--dataset", str(tmp_path / "nope.jsonl")])


def test_output_dir_not_writable(tmp_path):
    (tmp_path / "a_file").write_text("x")  # a directory cannot be made under a file, not even by root
    with pytest.raises(gc.ConfigError, match="--output_dir"):
        gc.parse_args(["--output_dir", str(tmp_path / "a_file" / "run")])


def test_reward_module_missing():
    with pytest.raises(gc.ConfigError, match="--reward_funcs"):
        gc.parse_args(["--reward_funcs", "no_such_module_xyz:reward"])
    with pytest.raises(gc.ConfigError, match="--reward_funcs.*no_such_fn"):  # a module without it
        gc.parse_args(["--reward_funcs", "reward_fns:no_such_fn"])
    with pytest.raises(gc.ConfigError, match="REWARD_FUNCS is not a function"):  # there, but no function
        gc.parse_args(["--reward_funcs", "reward_fns:REWARD_FUNCS"])


def test_resume_latest_needs_a_saved_checkpoint(tmp_path):
    (tmp_path / "checkpoint-3.tmp").mkdir()  # a save that was cut short does not count
    with pytest.raises(gc.ConfigError, match="--resume_from_checkpoint"):
        gc.parse_args(["--output_dir", str(tmp_path), "--resume_from_checkpoint", "latest"])


def test_resume_latest_follows_the_pointer_not_the_newest_file(tmp_path):
    """Issue 35 b: a run resumed from checkpoint-200 points `latest` at it before its first save;
    the abandoned checkpoint-300 of the run before, though newer on disk, is not latest."""
    for step, saved_at in ((300, 2_000), (200, 500)):
        ckpt = tmp_path / f"checkpoint-{step}"
        ckpt.mkdir()
        (ckpt / "trainer_state.pt").write_bytes(b"")
        os.utime(ckpt / "trainer_state.pt", (saved_at, saved_at))
    (tmp_path / "latest").write_text("checkpoint-200")
    assert gc.latest_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-200")


def test_model_missing():
    with pytest.raises(gc.ConfigError, match="--model"):
        gc.load_model_config(gc.Config(model="/nonexistent/model-dir"))


def smol_shape(**extra):
    """A config of SmolLM2's shape (9 attention / 3 KV heads, 8,192 positions), one small layer."""
    from transformers import LlamaConfig

    return LlamaConfig(num_attention_heads=9, num_key_value_heads=3, hidden_size=72, intermediate_size=64,
                       num_hidden_layers=1, vocab_size=64, max_position_embeddings=8192, **extra)


@pytest.mark.parametrize("flags,flag", [
    ({"vllm_tensor_parallel_size": 2}, "--vllm_tensor_parallel_size"),  # 9 heads / 3 KV heads: tp in {1, 3}
    ({"vllm_tensor_parallel_size": 4}, "--vllm_tensor_parallel_size"),
    ({"max_prompt_length": 4096, "max_completion_length": 8192}, "--max_prompt_length"),  # > 8192 context
])
def test_model_shape_checks(flags, flag):
    with pytest.raises(gc.ConfigError, match=flag):
        gc.check_model(gc.Config(**flags), smol_shape())
    gc.check_model(gc.Config(vllm_tensor_parallel_size=3), smol_shape())  # fine


@pytest.mark.parametrize("capping", ["attn_logit_softcapping", "final_logit_softcapping"])
def test_soft_capped_models_are_refused(capping):
    """Gemma-2's soft-capped logits: neither the packed attention nor the logprobs cap them."""
    with pytest.raises(gc.ConfigError, match=capping):
        gc.check_model(gc.Config(), smol_shape(**{capping: 30.0}))
    gc.check_model(gc.Config(), smol_shape(**{capping: None}))  # Gemma-3


ORDER_FLAGS = [("model", "someone/else"), ("seed", 7), ("dataset", "openai/gsm8k"),
               ("eval_split", "test"), ("num_eval", 64),
               ("prompt_column", "question"), ("answer_column", "solution"),
               ("max_prompt_length", 128), ("lora_r", 8), ("lora_alpha", 16), ("lora_dropout", 0.05),
               ("lora_target_modules", ["q_proj"])]  # the last four: the adapter's shape, from the checkpoint


@pytest.mark.parametrize("flag,value", ORDER_FLAGS)
def test_resume_with_another_data_order_is_refused(tmp_path, flag, value):
    """The saved data position counts prompts of one filtered, shuffled train order: a resume
    whose flags would make another order is refused, naming the flag."""
    genuine_checkpoint(tmp_path)
    argv = ["--resume_from_checkpoint", str(tmp_path), "--output_dir", str(tmp_path / "out")]
    assert gc.parse_args(argv).resume_from_checkpoint == str(tmp_path)  # the same flags: fine
    config = json.loads((tmp_path / "grpo_config.json").read_text())
    config[flag] = value  # the checkpoint's run had another value
    (tmp_path / "grpo_config.json").write_text(json.dumps(config))
    with pytest.raises(gc.ConfigError, match=f"^--{flag}: is .*, but the checkpoint's run had {re.escape(repr(value))}"):
        gc.parse_args(argv)


# ------------------------------------------------------------------------------------------------------------
# loading never runs code from a checkpoint or a model (issue 18)
# ------------------------------------------------------------------------------------------------------------

def genuine_checkpoint(path):
    """What save_checkpoint writes for the optimizer and the trainer state: DCP files, trainer_state.pt
    (the step and the data position) and grpo_config.json."""
    import torch.distributed.checkpoint as dcp
    from transformers import get_scheduler

    lm = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(lm.parameters(), lr=1e-3)
    scheduler = get_scheduler("linear", optimizer, 0, 10)  # as build_trainer's: initial_lr in the param groups
    lm(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    scheduler.step()
    dcp.save({"optimizer": optimizer.state_dict()}, checkpoint_id=str(path / "optimizer"), no_dist=True)
    torch.save({"step": 1, "data_position": 4}, path / "trainer_state.pt")
    (path / "grpo_config.json").write_text(json.dumps(dataclasses.asdict(gc.Config())))


class WritesAMarker:
    """Unpickling this runs code: it writes a file (what a crafted checkpoint could do instead)."""
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').close()",)


@pytest.mark.parametrize("crafted", ["trainer_state.pt", "optimizer/.metadata"])
def test_a_crafted_checkpoint_is_refused_before_any_engine(tmp_path, crafted):
    ckpt, marker = tmp_path / "checkpoint-1", tmp_path / "marker"
    ckpt.mkdir()
    genuine_checkpoint(ckpt)
    assert gc.read_checkpoint_state(str(ckpt))["data_position"] == 4  # the genuine one reads (numbers)
    if crafted == "trainer_state.pt":
        torch.save({"step": 1, "data_position": WritesAMarker(marker)}, ckpt / crafted)
    else:  # torch.distributed.checkpoint itself reads this one with a plain pickle.load
        (ckpt / crafted).write_bytes(pickle.dumps(WritesAMarker(marker)))
    with pytest.raises(gc.ConfigError, match=r"--resume_from_checkpoint: .* \(UnpicklingError: "):
        gc.parse_args(["--resume_from_checkpoint", str(ckpt), "--output_dir", str(tmp_path / "out")])
    assert not marker.exists()


class WrongArguments:
    """An allowed class with arguments it refuses: TypeError while unpickling."""
    def __reduce__(self):
        return torch.Size, ("abc",)


@pytest.mark.parametrize("name,content", [
    ("optimizer/.metadata", b""),  # EOFError
    ("optimizer/.metadata", pickle.dumps(WrongArguments())),  # TypeError
    ("trainer_state.pt", b""),  # EOFError without a message
    ("trainer_state.pt", b"abc"),  # IndexError inside torch's weights-only unpickler
    ("grpo_config.json", b"{not json"),  # ValueError
    ("grpo_config.json", b"[1, 2]"),  # not a dict: TypeError
])
def test_a_broken_checkpoint_is_a_config_error(tmp_path, name, content):
    genuine_checkpoint(tmp_path)
    (tmp_path / name).write_bytes(content)
    with pytest.raises(gc.ConfigError, match=r"^--resume_from_checkpoint: .* is no checkpoint-"):
        gc.read_checkpoint_state(str(tmp_path))


def test_a_model_with_its_own_code_is_refused_unless_trusted(tmp_path):
    marker = tmp_path / "marker"
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "custom_arch", "auto_map": {"AutoConfig": "configuration_custom.CustomConfig"}}))
    (tmp_path / "configuration_custom.py").write_text(
        f"open({str(marker)!r}, 'w').close()\nfrom transformers import PretrainedConfig\n\n\n"
        "class CustomConfig(PretrainedConfig):\n    model_type = 'custom_arch'\n")
    with pytest.raises(gc.ConfigError, match="--model: .*--trust_remote_code"):
        gc.load_model_config(gc.parse_args(["--model", str(tmp_path)]))
    assert not marker.exists()
    cfg = gc.parse_args(["--model", str(tmp_path), "--trust_remote_code"])  # the deliberate opt-in
    assert type(gc.load_model_config(cfg)).__name__ == "CustomConfig" and marker.exists()


def test_pickled_weights_are_refused(tmp_path):
    (tmp_path / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(gc.ConfigError, match="--model: .*safetensors"):
        gc.check_model(gc.Config(model=str(tmp_path)), smol_shape())


def data_config(tmp_path, rows, **flags):
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return gc.Config(**{"model": MODEL, "dataset": str(path), "num_eval": 2, **flags})


ROWS = [{"prompt": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(10)]


@pytest.mark.parametrize("rows,flags,flag", [
    ([], {}, "--dataset"),  # empty
    ([{"question": "q", "answer": "1"}] * 10, {}, "--prompt_column"),
    ([{"prompt": "q", "solution": "1"}] * 10, {}, "--answer_column"),
    (ROWS, {"max_prompt_length": 5}, "--max_prompt_length"),  # every prompt is longer: nothing left
    (ROWS[:1], {"num_eval": 1}, "--dataset"),  # one row: nothing left to train on after the eval row
])
def test_bad_datasets(tmp_path, rows, flags, flag):
    with pytest.raises(gc.ConfigError, match=flag):
        gc.prepare_data(data_config(tmp_path, rows, **flags))


def test_prompt_and_answer_columns_become_prompt_and_answer(tmp_path):
    rows = [{"question": f"What is {i} + 1?", "solution": f"#### {i + 1}", "level": i % 3}
            for i in range(20)]
    cfg = data_config(tmp_path, rows, prompt_column="question", answer_column="solution")
    _, train, held = gc.prepare_data(cfg)
    assert len(train) + len(held) == 20
    # `answer` is what the reward functions get; the other columns go along
    for row in train + held:
        i = int(row["prompt"].split()[2])
        assert row["answer"] == f"#### {i + 1}" and row["level"] == i % 3, row
        assert "question" not in row and "solution" not in row


def test_small_dataset_holds_out_a_tenth(tmp_path, capsys):
    rows = [{"prompt": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(24)]
    _, train, held = gc.prepare_data(data_config(tmp_path, rows, num_eval=64))  # run.sh's CPU default: 64
    assert (len(train), len(held)) == (22, 2)  # 24 // 10 held out, instead of refusing
    assert {r["prompt"] for r in train}.isdisjoint(r["prompt"] for r in held)
    assert "holding out 2 of 24 rows" in capsys.readouterr().out
    _, train, held = gc.prepare_data(data_config(tmp_path, rows, num_eval=1))  # a smaller --num_eval is kept
    assert (len(train), len(held)) == (23, 1)


def test_long_prompts_are_dropped_and_counted(tmp_path, capsys):
    rows = ROWS + [{"prompt": "word " * 300, "answer": "0"}]
    _, train, held = gc.prepare_data(data_config(tmp_path, rows, max_prompt_length=64, num_eval=1))
    assert len(train) + len(held) == 10
    assert "dropped 1 of" in capsys.readouterr().out


# ------------------------------------------------------------------------------------------------------------
# non-finite steps, atomic checkpoints
# ------------------------------------------------------------------------------------------------------------

def test_gradient_clipping_scales_down_only():
    """train_step's clipping (torch's): g *= min(1, max_grad_norm / ||g||), ||g|| over every
    parameter; the logged grad_norm is the norm before clipping."""
    batch = train_batch([[1, 2], [3]], [[4, 5], [6, 7]], [-1.0, 1.0])
    policy = gc.Policy(tiny_llama())
    optimizer = StepGradients(policy)

    def step(max_norm):  # (the gradients the optimizer got, the logged norm)
        cfg = gc.Config(loss_type="grpo", max_grad_norm=max_norm, vllm_importance_sampling_correction=False)
        stats = gc.train_step(policy, optimizer, NO_SCHEDULE, batch, cfg, cpu_env(), BUDGET, {}, 1)
        return torch.cat([g.flatten() for g in optimizer.grads]), stats["grad_norm"]
    grads, norm = step(0.0)  # 0: no clipping
    assert close(grads.norm(), norm, rtol=1e-5) and norm > 0
    # a max_grad_norm over the norm: kept; under it: scaled down
    for max_norm, scale in ((2 * norm, 1.0), (norm / 2, 0.5), (norm / 4, 0.25)):
        clipped, logged = step(max_norm)
        assert close(logged, norm, rtol=1e-6)  # the norm before clipping
        assert torch.allclose(clipped, scale * grads, rtol=1e-5, atol=1e-9), max_norm


def test_non_finite_step_is_skipped():
    lm = tiny_llama()
    policy = gc.Policy(lm)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    prompts, completions = [[1, 2], [3]], [[4, 5], [6, 7]]
    cfg = gc.Config(num_generations=2, per_device_train_batch_size=2, gradient_accumulation_steps=1,
                    loss_type="grpo", vllm_importance_sampling_correction=False)
    env = cpu_env()

    def batch(advantages):
        return train_batch(prompts, completions, advantages)
    before = [p.detach().clone() for p in policy.parameters()]
    sums = gc.train_step(policy, optimizer, scheduler, batch([float("nan"), 1.0]), cfg, env, BUDGET, {}, 1)
    assert sums["skipped"] == 1.0 and not math.isfinite(sums["grad_norm"])
    assert all(torch.equal(a, b) for a, b in zip(before, policy.parameters()))  # no update
    # no update, but the rate follows the step count (as a resume sets it from the step)
    assert all(p.grad is None for p in policy.parameters()) and scheduler.last_epoch == 1
    sums = gc.train_step(policy, optimizer, scheduler, batch([-1.0, 1.0]), cfg, env, BUDGET, {}, 2)
    assert sums["skipped"] == 0.0 and not all(torch.equal(a, b) for a, b in zip(before, policy.parameters()))


def _ddp_grads_worker(rank, world, store, results):
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    torch.manual_seed(0)
    env = cpu_env(rank=rank, world=world, is_main=rank == 0)
    cfg = gc.Config(num_generations=2, per_device_train_batch_size=2, gradient_accumulation_steps=1,
                    loss_type="grpo", vllm_importance_sampling_correction=False)
    policy = gc.wrap_policy(tiny_llama(hidden=256), env, cfg, checkpointing=False)  # 2.5 MB a layer
    # the layers compiled as on a GPU, through a backend that keeps dynamo's graphs; 1 MB buckets
    # (DDP's default 25 MB would hold the whole model), where dynamo's DDPOptimizer would cut them
    graphs = []
    policy.bucket_bytes_cap = 1 << 20
    for layer in gc.unwrap(policy).lm.get_decoder().layers:
        layer.compile(backend=lambda graph, inputs: graphs.append(graph) or graph.forward, dynamic=True)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    in_no_sync = []  # per step: each gradient's storage after the micro-batch under no_sync
    no_sync = policy.no_sync

    @contextlib.contextmanager
    def recording_no_sync():
        with no_sync():
            yield
        in_no_sync.append([p.grad.data_ptr() for p in policy.parameters()])
    policy.no_sync = recording_no_sync
    storage = []  # per step: each gradient's storage after it, and whether all are zero again
    for step in (1, 2, 3):
        batch = train_batch([[1, 2], [3]], [[4 + rank, 5], [6, 7 + step]], [-1.0, 1.0])
        gc.train_step(policy, optimizer, scheduler, batch, cfg, env, 4, {}, step)  # 2 micro-batches
        grads = [p.grad for p in policy.parameters()]
        storage.append(([g.data_ptr() for g in grads], all(bool((g == 0).all()) for g in grads)))
    # the parameters each graph takes: a whole layer's, or DDPOptimizer's cut
    layer_params = [sum("_parameters_" in n.name for n in g.graph.find_nodes(op="placeholder"))
                    for g in graphs]
    results[rank] = (in_no_sync, storage, [p.detach().clone() for p in policy.parameters()], layer_params)
    dist.destroy_process_group()


def test_ddp_gradients_stay_in_its_buckets(tmp_path):
    """Under DDP the gradients are views of its all-reduce buckets from the start, and are zeroed in
    place after each step: the micro-batches under no_sync add into the buckets, not into a second
    copy (set to None, the next step's first backward would allocate one: 4 bytes a parameter).
    And each compiled decoder layer stays one graph under DDP."""
    results = mp.Manager().dict()
    mp.spawn(_ddp_grads_worker, args=(2, tmp_path / "store", results), nprocs=2, join=True)
    for rank in range(2):
        in_no_sync, storage, _, layer_params = results[rank]
        # every graph a whole layer's 9 (4 attention projections, 3 MLP's, 2 norms): not cut at
        # DDP's buckets (with dynamo's DDPOptimizer: [2, 5, 2] a layer)
        assert layer_params and all(count == 9 for count in layer_params)
        assert all(zeroed for _, zeroed in storage)  # not None: zeroed in place
        # the first micro-batch's gradients are already the buckets' (step 1 included); DDP rebuilds
        # its buckets once, after the first step, and from then on the storage stays
        assert in_no_sync == [ptrs for ptrs, _ in storage]
        assert storage[1][0] == storage[2][0]
    assert all(torch.equal(a, b) for a, b in zip(results[0][2], results[1][2]))  # the ranks agree


class RecordingEngine:
    """Stands in for vllm.LLM in the engine tests below: notes sleeps and wakes, returns fixed completions."""
    awake = True

    def sleep(self, level):
        self.awake = False

    def wake_up(self, tags):  # the weights, then the KV cache: awake once both are back
        self.awake = self.awake or tags == ["kv_cache"]

    def reset_prefix_cache(self):
        pass

    def generate(self, requests, params, use_tqdm=False):
        def sample():
            return SimpleNamespace(token_ids=[5, 6, 7], finish_reason="length", logprobs=None)
        per_request = params if isinstance(params, list) else [params] * len(requests)
        return [SimpleNamespace(outputs=[sample() for _ in range(p.n)]) for p in per_request]


def test_engine_sleeps_through_every_train_step(tiny_model, smol_tokenizer, tmp_path, monkeypatch, world_of_one):
    """An eval mid-way through num_iterations wakes the engine (and pushes): it must sleep again before the next
    train step. Sleep mode is GPU-only, so this runs run()'s real schedule and ColocatedEngine's real sleep and wake
    with the memory plan's sleep on, a recording stand-in for the engine, and the push and its probe stubbed
    (no weights go anywhere); it checks the engine's state at every train step."""
    cfg = gc.Config(model=tiny_model(engine=True), num_generations=2, per_device_train_batch_size=2,
                    gradient_accumulation_steps=1, num_iterations=2, max_steps=2, eval_steps=1, save_steps=-1,
                    vllm_importance_sampling_correction=False, reward_funcs=["reward_len"], output_dir=str(tmp_path),
                    vllm_enable_sleep_mode="true")  # (GPU-only: no check_config here)
    engine, events, train_step = RecordingEngine(), [], gc.train_step

    def push_weights(llm, lm, env, bucket_mb):
        assert llm.awake is False  # woken for the weights only: its KV cache comes back after the push
        events.append("push")
        return 0

    def recording_train_step(*args):
        events.append("train, engine " + ("awake" if engine.awake else "asleep"))
        return train_step(*args)
    monkeypatch.setattr(gc, "make_engine", lambda *args: engine)
    monkeypatch.setattr(gc, "push_weights", push_weights)
    monkeypatch.setattr(gc, "probe_gap", lambda *args: 0.0)
    monkeypatch.setattr(gc, "train_step", recording_train_step)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (80 * GiB, 80 * GiB))  # the wake's
    rows = [{"prompt": f"p{i}", "answer": "1", "prompt_ids": [10 + i, 11]} for i in range(4)]
    plan = SimpleNamespace(token_budget=BUDGET, checkpointing=False, sleep=True, why="level 2")
    gc.run(cfg, cpu_env(), SimpleNamespace(model_config=None, data=(smol_tokenizer, rows, rows[:1]), state=None,
                                           plan=plan))
    # push, eval 0, rollout, train 1, eval 1 (wakes: push), train 2, push, eval 2
    assert events == ["push", "train, engine asleep", "push", "train, engine asleep", "push"]


def test_objects_freeze_once_after_the_first_step(tiny_model, smol_tokenizer, tmp_path, monkeypatch, world_of_one):
    """What lives after this process's first step (the model, on CUDA the compiled kernels) lives all run: run()
    hands it to gc.freeze() once, after step 1's push, after a gc.collect() (no garbage frozen for good), so
    Python's full collections skip it in every later step. run()'s real loop with a recording stand-in engine."""
    cfg = gc.Config(model=tiny_model(engine=True), num_generations=2, per_device_train_batch_size=2,
                    gradient_accumulation_steps=1, max_steps=3, eval_steps=0, save_steps=-1,
                    vllm_importance_sampling_correction=False, reward_funcs=["reward_len"], output_dir=str(tmp_path))
    events, train_step, collect = [], gc.train_step, gc.gc.collect
    monkeypatch.setattr(gc, "make_engine", lambda *args: RecordingEngine())
    monkeypatch.setattr(gc, "push_weights", lambda *args: events.append("push"))
    monkeypatch.setattr(gc, "probe_gap", lambda *args: 0.0)
    monkeypatch.setattr(gc, "train_step", lambda *args: events.append("train") or train_step(*args))
    monkeypatch.setattr(gc.gc, "collect", lambda *args: events.append("collect") or collect(*args))
    monkeypatch.setattr(gc.gc, "freeze", lambda: events.append("freeze"))
    rows = [{"prompt": f"p{i}", "answer": "1", "prompt_ids": [10 + i, 11]} for i in range(6)]
    plan = SimpleNamespace(token_budget=BUDGET, checkpointing=False, sleep=False, why="off")
    gc.run(cfg, cpu_env(), SimpleNamespace(model_config=None, data=(smol_tokenizer, rows, rows[:1]), state=None,
                                           plan=plan))
    assert events == ["push", "train", "push", "collect", "freeze", "train", "push", "train", "push"]


@pytest.mark.parametrize("correction,probed", [
    (True, [True, False, False]),
    (False, [True, True, True]),
])
def test_probe_after_every_push_unless_the_canary_runs(monkeypatch, world_of_one, correction, probed):
    """The parity probe runs after the first push, and after every later one when the IS correction
    is off (on, the canary of train_step checks every step's sampled tokens instead): no push goes
    unchecked."""
    cfg = gc.Config(vllm_importance_sampling_correction=correction)
    engine = gc.ColocatedEngine(RecordingEngine(), cfg, cpu_env(), False, [5, 6, 7])
    probes = []

    def probe_gap(llm, policy, probe_ids, env):  # the probe, recorded
        probes.append(probe_ids)
        return 0.0
    monkeypatch.setattr(gc, "push_weights", lambda *args: 1 << 30)
    monkeypatch.setattr(gc, "probe_gap", probe_gap)
    probe_ran = []
    for step in range(3):
        before = len(probes)
        engine.wake_and_push(SimpleNamespace(lm=None), step, {})  # a push (stubbed), then the probe or not
        probe_ran.append(len(probes) > before)
    assert probe_ran == probed and all(p == [5, 6, 7] for p in probes) and engine.pushes == 3
    assert ("probe_gap" in engine.probe_info) == probed[-1]  # the last push's
def test_canary_before_the_update(world_of_one):
    """train_step's canary (IS correction on): the sampled tokens' logprob gap, checked before the optimizer step.
    A gap beyond the tolerance stops the step with no update; NaN vLLM logprobs are left out of it
    and corrected by nothing (TRL's rule, weight 1): the step trains."""
    policy = gc.Policy(tiny_llama())
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    prompts, completions = [[1, 2], [3]], [[4, 5], [6, 7]]
    model_mask = completion_mask_of(completions)
    cfg = gc.Config(num_generations=2, per_device_train_batch_size=2, gradient_accumulation_steps=1)
    env = cpu_env()
    with torch.no_grad():  # what an engine holding the trainer's weights returns
        exact, _ = policy(*gc.pack(prompts, completions, model_mask), model_mask, 1.0)

    def step(vllm_logps):  # the canary runs: the batch has vLLM's logprobs
        batch = train_batch(prompts, completions, [-1.0, 1.0], vllm_logps=vllm_logps)
        return gc.train_step(policy, optimizer, scheduler, batch, cfg, env, BUDGET, {}, 4)
    before = [p.detach().clone() for p in policy.parameters()]
    with pytest.raises(RuntimeError, match="step 4: vLLM and the trainer disagree on the tokens vLLM sampled"):
        step(exact - 0.01)  # a stale engine: 0.01 nats per token > fp32's 1e-4
    assert all(torch.equal(a, b) for a, b in zip(before, policy.parameters()))  # stopped before the update
    optimizer.zero_grad(set_to_none=True)
    sums = step(exact)
    assert sums["sampled_gap/rank_max"] < 1e-6 and sums["skipped"] == 0.0
    optimizer.zero_grad(set_to_none=True)
    sums = step(torch.full_like(exact, math.nan))  # vLLM's NaN: not blamed, not a non-finite step
    assert sums["sampled_gap/rank_max"] == 0.0 and sums["skipped"] == 0.0


def test_lora_trains_adapters_only_and_pushes_merged_weights():
    """LoRA (peft) on the tiny Llama: only adapters train; full_weights yields W + (alpha / r) B A under the HF names
    (equal to peft's own merge_and_unload) while the trainer's W stays the base; the reference (adapters disabled)
    is the base model; lora_dropout acts in gradient forwards only."""
    import copy

    base = tiny_llama()
    hf_names = [n for n, _ in base.named_parameters()]
    cfg = gc.Config(use_peft=True, lora_r=4, lora_alpha=8, lora_dropout=0.5, lora_target_modules=["all-linear"],
                    loss_type="grpo", num_generations=2, per_device_train_batch_size=2, gradient_accumulation_steps=1,
                    vllm_importance_sampling_correction=False)
    lm = gc.add_lora(copy.deepcopy(base), cfg)
    policy = gc.Policy(lm)
    trainable = [n for n, p in policy.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    prompts, completions = [[1, 2], [3]], [[4, 5], [6, 7]]
    batch = train_batch(prompts, completions, [-1.0, 1.0])
    for step in (1, 2):
        assert gc.train_step(policy, optimizer, scheduler, batch, cfg, cpu_env(), BUDGET, {}, step)["skipped"] == 0.0
    args = (*gc.pack(prompts, completions, batch.model_mask), batch.model_mask, 1.0)
    with torch.no_grad():
        assert torch.equal(policy(*args)[0], policy(*args)[0])  # no dropout without grad: exact
        base_logps = gc.Policy(base)(*args)[0]
        with lm.disable_adapter():  # the reference with beta > 0
            assert torch.allclose(policy(*args)[0], base_logps, atol=1e-6)
        assert not torch.allclose(policy(*args)[0], base_logps, atol=1e-4)  # the adapters moved the policy
    assert not torch.equal(policy(*args)[0], policy(*args)[0])  # dropout in the gradient forward
    merged = dict(gc.full_weights(lm, torch.float32, "cpu", 1 << 10))
    assert list(merged) == hf_names  # HF names, in order, without the adapter tensors
    want = copy.deepcopy(lm).merge_and_unload().state_dict()
    assert all(torch.allclose(merged[n], want[n], atol=1e-6) for n in hf_names)
    name = "model.layers.0.mlp.down_proj.weight"
    assert not torch.equal(merged[name], base.get_parameter(name))
    for n, p in lm.named_parameters():  # the trainer's base weights were never merged in place
        if ".lora_" not in n:
            assert torch.equal(p, base.get_parameter(n.removeprefix("base_model.model.").replace(".base_layer.", ".")))


def test_train_step_entropy_terms_reach_the_policy():
    """Zero advantages: no policy gradient. The entropy bonus alone still moves the weights (the entropy carries a
    gradient through Policy only when entropy_coef != 0), also with top_entropy_quantile and sequence-level ratios."""
    batch = train_batch([[1, 2], [3]], [[4, 5, 6], [7, 8]], [0.0, 0.0])
    env = cpu_env()
    norms = []
    for flags in ({}, {"entropy_coef": 0.1}, {"entropy_coef": 0.1, "top_entropy_quantile": 0.5,
                                                 "importance_sampling_level": "sequence"}):
        cfg = gc.Config(num_generations=2, per_device_train_batch_size=2, gradient_accumulation_steps=1,
                        loss_type="grpo", vllm_importance_sampling_correction=False, **flags)
        policy = gc.wrap_policy(tiny_llama(), env, cfg, False)
        optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
        norms.append(gc.train_step(policy, optimizer, scheduler, batch, cfg, env, BUDGET, {}, 1)["grad_norm"])
    assert norms[0] == 0.0 and norms[1] > 0 and norms[2] > 0 and norms[2] != norms[1]  # the quantile: fewer tokens


def _save_twice_and_die(out, store):
    os.environ.update(RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    from transformers import AutoTokenizer

    policy = gc.Policy(tiny_llama())
    trainer = SimpleNamespace(lm=policy.lm, policy=policy, optimizer=torch.optim.AdamW(policy.parameters()))
    args = (gc.Config(output_dir=out), SimpleNamespace(is_main=True, device=torch.device("cpu")))
    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    gc.save_checkpoint(*args, 1, trainer, tokenizer, 4, gc.rows_digest([]))
    torch.save = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)  # killed half-way through the second save
    gc.save_checkpoint(*args, 2, trainer, tokenizer, 8, gc.rows_digest([]))


def test_checkpoint_killed_during_save_leaves_the_previous_one(tmp_path):
    from transformers import AutoModelForCausalLM

    out = str(tmp_path / "out")
    store = tmp_path / "store"  # the process group's rendezvous file
    child = mp.get_context("spawn").Process(target=_save_twice_and_die, args=(out, store))
    child.start()
    child.join(120)
    assert child.exitcode == -signal.SIGKILL
    # the half-written one is only a tmp dir, and `latest` still names checkpoint-1
    assert sorted(os.listdir(out)) == ["checkpoint-1", "checkpoint-2.tmp", "latest"]
    AutoModelForCausalLM.from_pretrained(os.path.join(out, "checkpoint-1"))
    assert gc.read_checkpoint_state(os.path.join(out, "checkpoint-1"))["step"] == 1
    assert gc.latest_checkpoint(out) == os.path.join(out, "checkpoint-1")


def test_checkpoint_saves_over_an_abandoned_save_of_its_step(tmp_path, world_of_one):
    """An abandoned branch's checkpoint-N (a run resumed from an older one reaches step N again) is
    replaced whole by the new save, and `latest` names it."""
    from transformers import AutoTokenizer

    policy = gc.Policy(tiny_llama())
    trainer = SimpleNamespace(lm=policy.lm, policy=policy, optimizer=torch.optim.AdamW(policy.parameters()))
    out = tmp_path / "out"
    (out / "checkpoint-1").mkdir(parents=True)
    (out / "checkpoint-1" / "stale").write_text("x")
    cfg = gc.Config(output_dir=str(out))
    env = SimpleNamespace(is_main=True, device=torch.device("cpu"))
    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    gc.save_checkpoint(cfg, env, 1, trainer, tokenizer, 4, gc.rows_digest([]))
    assert sorted(os.listdir(out)) == ["checkpoint-1", "latest"]
    assert gc.latest_checkpoint(str(out)) == str(out / "checkpoint-1")
    assert gc.read_checkpoint_state(str(out / "checkpoint-1"))["data_position"] == 4
    assert not (out / "checkpoint-1" / "stale").exists()


@pytest.mark.parametrize("before", [None, "0"])
def test_optimizer_load_leaves_weights_only_env_as_it_was(tmp_path, world_of_one, monkeypatch,
                                                          before):
    """load_optimizer forces TORCH_FORCE_WEIGHTS_ONLY_LOAD=1 for DCP's load only: afterwards a
    reward function's torch.load(weights_only=False) works as in a run that was not resumed."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    if before is None:
        monkeypatch.delenv("TORCH_FORCE_WEIGHTS_ONLY_LOAD", raising=False)
    else:
        monkeypatch.setenv("TORCH_FORCE_WEIGHTS_ONLY_LOAD", before)
    lm = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(lm.parameters())
    lm(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)  # as at a resume: no gradients yet
    state = {"optimizer": get_optimizer_state_dict(lm, optimizer)}
    dcp.save(state, checkpoint_id=str(tmp_path / "optimizer"))
    fresh = torch.optim.AdamW(lm.parameters())
    gc.load_optimizer(str(tmp_path), lm, fresh)
    assert torch.equal(fresh.state[lm.weight]["exp_avg"], optimizer.state[lm.weight]["exp_avg"])
    assert os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD") == before
    torch.save(SimpleNamespace(a=1), tmp_path / "x.pt")  # what a reward function might load
    assert torch.load(tmp_path / "x.pt", weights_only=False).a == 1


# ------------------------------------------------------------------------------------------------------------
# reward functions
# ------------------------------------------------------------------------------------------------------------

def test_extract_answer():
    assert rf.extract_answer("so 3 + 4 = 7\n#### 7") == 7
    assert rf.extract_answer("#### 1,234 and then 5") == 1234  # '####' wins over a later bare number
    assert rf.extract_answer("the answer is \\boxed{-12}.") == -12
    assert rf.extract_answer("it is 41, not 40") == 40
    assert rf.extract_answer("no digits here") is None


def test_accuracy_format_and_length_rewards():
    completions = ["#### 95", "95", "I think 96", "\\boxed{95}"]
    assert rf.accuracy_reward(None, completions, answer=["95"] * 4) == [1.0, 1.0, 0.0, 1.0]
    assert rf.accuracy_reward(None, ["#### 18"], answer=["Natalia sold 48/2 = 24 ... #### 18"]) == [1.0]
    assert rf.format_reward(None, completions) == [1.0, 0.0, 0.0, 1.0]
    assert rf.reward_len(None, ["x" * 20, "x" * 25, ""]) == [0.0, -5.0, -20.0]


MATH_CASES = [  # (reference, completion, reward): MATH-style references go through math-verify
    (r"\frac{1}{2}", r"The answer is \boxed{0.5}", 1.0),
    (r"\frac{1}{2}", r"so it is $\frac{2}{4}$", 1.0),
    (r"\frac{1}{2}", r"\boxed{\frac{1}{3}}", 0.0),
    (r"\sqrt{2}", r"\boxed{\sqrt{2}}", 1.0),
    (r"\sqrt{2}", r"\boxed{1.41}", 0.0),
    (r"x^2+1", r"\boxed{1 + x^2}", 1.0),
    (r"x^2+1", "#### x^2 - 1", 0.0),
    (r"The area is $\boxed{\frac{\sqrt{3}}{4}}$.", r"Therefore \boxed{\frac{\sqrt3}{4}}", 1.0),
]


def test_accuracy_reward_latex_answers_through_math_verify():
    pytest.importorskip("math_verify")
    refs, completions, want = zip(*MATH_CASES)
    assert rf.accuracy_reward(None, list(completions), answer=list(refs)) == list(want)
    # plain-number references keep the numeric path (the built-in task; GSM8K's '#### 18')
    assert rf.accuracy_reward(None, ["#### 0.5", "I think 96", "#### 18"],
                              answer=["0.5", "95", "48/2 = 24 ... #### 18"]) == [1.0, 0.0, 1.0]


def test_accuracy_reward_without_math_verify(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)  # what the GPU image looks like: import fails
    with pytest.warns(UserWarning, match="math-verify is not installed"):
        got = rf.accuracy_reward(None, [r"\boxed{0.5}", "#### 7"], answer=[r"\frac{1}{2}", "7"])
    assert got == [None, 1.0]  # not scored (the trainer counts None as 0), and numbers still work


def test_plot_curves(tmp_path, capsys, monkeypatch):
    spec = importlib.util.spec_from_file_location("plot_curves", os.path.join(HERE, "bench", "plot_curves.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)  # run.sh runs it after its runs
    records = [{"step": 0, "eval/accuracy_reward": 0.1}, {"step": 1, "reward": 0.2}, {"step": 2, "reward": 0.5,
                                                                                    "eval/accuracy_reward": 0.3}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    bench.plot_curves(str(tmp_path))
    assert (tmp_path / "curves.png").read_bytes()[:4] == b"\x89PNG"
    assert f"curves: {tmp_path / 'curves.png'}" in capsys.readouterr().out
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # not installed: say so, skip
    bench.plot_curves(str(tmp_path))
    assert "matplotlib is not installed" in capsys.readouterr().out
    monkeypatch.undo()
    fresh = tmp_path / "fresh"  # a resume at max_steps into a fresh output_dir: no metrics.jsonl
    fresh.mkdir()
    bench.plot_curves(str(fresh))
    assert f"no {fresh / 'metrics.jsonl'}: no curves.png" in capsys.readouterr().out
    assert not (fresh / "curves.png").exists()


def test_soft_overlong_punishment():
    # L_max 20, L_cache 0.2 * 20 = 4: 0 up to 16 tokens, then -1/4 per token, -1 at 20 and beyond (TRL's doc
    # example, L_max 100 and L_cache 20: 90 tokens -> -0.5)
    ids = [[7] * n for n in (0, 16, 17, 18, 20, 25)]
    assert rf.soft_overlong_punishment(None, None, ids, 20) == [0.0, 0.0, -0.25, -0.5, -1.0, -1.0]
    assert rf.soft_overlong_punishment(None, None, [[7] * 90], 100) == [-0.5]


# ------------------------------------------------------------------------------------------------
# tools: the calculator, a call's parsing and errors, the tool results' tokens, the tools' prompt
# ------------------------------------------------------------------------------------------------

def test_calculator_computes_arithmetic_and_refuses_the_rest(tmp_path):
    expressions = ("37 + 58", "(3 - 12) * 4", "7 / 2", "6 / 3", "-2 ** 10", "7 // 2 % 2")
    assert [rf.calculator(e) for e in expressions] == ["95", "-36", "3.5", "2", "-1024", "1"]
    marker = tmp_path / "ran"
    for bad in (f"__import__('os').system('touch {marker}')", "x + 1", "True + 1", "'a' * 3",
                "2 ** 1000", "((9 ** 99) ** 99) ** 99", "1 +", "1" * 201):
        with pytest.raises((ValueError, SyntaxError)):
            rf.calculator(bad)
    assert not marker.exists()  # the expression was parsed, never run
    with pytest.raises(ZeroDivisionError):
        rf.calculator("1 / 0")


def test_tool_calls_and_their_errors_become_messages():
    tools = {"calculator": rf.calculator}
    text = ('<tool_call>\n{"name": "calculator", "arguments": {"expression": "2 + 3"}}\n'
            '</tool_call> then <tool_call>{"name": "nope"}</tool_call> and <tool_call>{"name"')
    calls = rf.TOOL_CALL.findall(text)
    assert len(calls) == 2  # the unterminated third is text, not a call
    message = {"role": "tool", "name": "calculator", "content": "5"}
    assert rf.call_tool(tools, calls[0]) == (False, message)
    message = {"role": "tool", "name": "nope", "content": "{'error': 'Tool nope not found.'}"}
    assert rf.call_tool(tools, calls[1]) == (True, message)
    for call, error in [('{"name": "calculator", "arguments": {', "Expecting property name"),
                        ('{"name": "calculator", "arguments": {"expression": "1 / 0"}}', "by zero"),
                        ('{"name": "calculator", "arguments": {"x": 1}}', "unexpected keyword"),
                        ('[1, 2]', "list indices")]:
        failed, message = rf.call_tool(tools, call)
        assert failed and message["role"] == "tool" and error in message["content"], (call, message)


def test_tool_results_as_the_chat_template_renders_them():
    from transformers import AutoTokenizer
    from transformers.utils import get_json_schema

    tok = AutoTokenizer.from_pretrained(MODEL)
    tools = [get_json_schema(rf.calculator)]
    suffix = rf.tool_suffix_ids(tok, [{"role": "tool", "name": "calculator", "content": "5"}])
    # after the turn's EOS (<|im_end|>): SmolLM2's generic role block, the next assistant header
    assert tok.decode(suffix) == "\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n"
    # SmolLM2's template has no tools section: the tools go in a system message (the Hermes format)
    text = tok.decode(gc.encode_prompt(tok, "What is 2 + 3?", tools))
    assert text.startswith("<|im_start|>system\n# Tools\n") and '"name": "calculator"' in text
    assert text.endswith("<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n")
    # a template with a tools section (as Qwen's) renders them itself
    tok.chat_template = ("{% if tools %}TOOLS {{ tools | tojson }}\n{% endif %}"
                         "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
                         "<|im_end|>\n{% endfor %}<|im_start|>assistant\n")
    text = tok.decode(gc.encode_prompt(tok, "What is 2 + 3?", tools))
    assert text.startswith('TOOLS [{"type": "function", "function": {"name": "calculator"')
    assert "# Tools" not in text


class CharTokenizer:  # ids are character codes: enough to test scoring without a real tokenizer
    pad_token_id, eos_token_id = 0, 1

    def batch_decode(self, ids, skip_special_tokens=True):
        return ["".join(map(chr, i)) for i in ids]


def chars(*texts):
    return [list(map(ord, t)) for t in texts]


def test_score_passes_columns_and_repeats_per_group():
    rows = [{"prompt": "p0", "answer": "1", "prompt_ids": [0]}, {"prompt": "p1", "answer": "2", "prompt_ids": [1]}]
    funcs = [rf.accuracy_reward, rf.format_reward, rf.soft_overlong_punishment]
    table = gc.score(funcs, rows, chars("1", "#### 1", "2", "xxxxx"), 2, CharTokenizer(), max_completion_length=5)
    assert table.tolist() == [[1.0, 0.0, 0.0], [1.0, 1.0, -1.0], [1.0, 0.0, 0.0], [0.0, 0.0, -1.0]]


# ------------------------------------------------------------------------------------------------------------
# DAPO dynamic sampling: the group selection, and a rollout (with a stand-in engine) where some prompts' rewards
# are constant: those groups never reach the loss
# ------------------------------------------------------------------------------------------------------------

def constant_on_even_prompts(prompts, completions, **columns):  # prompt "k": reward len(completion) for odd k
    return [1.0 if int(p) % 2 == 0 else float(len(c)) for p, c in zip(prompts, completions)]


def tokens_of(k, j):  # completion j of prompt k: j + 1 tokens of k; the first ends with an EOS,
    return [48 + k] * (j + 1), "length" if j else "stop"  # the second is cut at the length limit


def stand_in_rollout(monkeypatch, prompt_numbers, factor, funcs=(constant_on_even_prompts,),
                     weights=None, sample=tokens_of, **flags):
    """run's rollout, score and make_batch on prompts "0", "1", ... with a stand-in for generate
    (sample(k, j): the token ids and finish reason of completion j of prompt k), G = 2, 2 prompts per
    step: factor 2 draws 4. Returns the batch."""
    cfg = gc.Config(num_generations=2, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                    dynamic_sampling_factor=factor, vllm_importance_sampling_correction=False,
                    reward_funcs=[fn.__name__ for fn in funcs], **flags)
    rows = [{"prompt": str(k), "answer": "", "prompt_ids": [100 + k]} for k in prompt_numbers]

    def generate(llm, env, prompt_ids, *args):
        samples = [[sample(ids[0] - 100, j) for j in range(2)] for ids in prompt_ids]
        return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=ids, finish_reason=reason,
                                                         logprobs=None)
                                         for ids, reason in group]) for group in samples]
    monkeypatch.setattr(gc, "generate", generate)
    monkeypatch.setattr(gc, "sampling_params", lambda *args, **kwargs: None)  # no vllm import
    env, tokenizer = cpu_env(), CharTokenizer()
    weights = torch.ones(len(funcs)) if weights is None else torch.tensor(weights)
    positions = range(len(rows))
    samples, tool_counts = gc.rollout(None, cfg, env, tokenizer, [row["prompt_ids"] for row in rows], positions)
    rewards_per_func = gc.score(list(funcs), rows, [s.token_ids for s in samples], cfg.num_generations, tokenizer,
                                cfg.max_completion_length)
    return gc.make_batch(cfg, env, tokenizer, rows, samples, rewards_per_func, weights, tool_counts)


def test_rollout_weighs_rewards_and_masks_truncated_completions(monkeypatch):
    """reward = sum_i w_i r_i over the reward functions; --mask_truncated_completions takes the
    truncated completions (the second of each group: no EOS at the length limit) out of the loss,
    and only them."""
    def length(prompts, completions, **columns):
        return [float(len(c)) for c in completions]
    batch = stand_in_rollout(monkeypatch, [1, 3], 1, funcs=(constant_on_even_prompts, length),
                             weights=(0.5, 2.0), mask_truncated_completions=True)
    # prompts 1 and 3 are odd: both functions give the completion's length
    assert batch.stats["rewards_per_func"].tolist() == [[1, 1], [2, 2], [1, 1], [2, 2]]
    assert batch.stats["rewards"].tolist() == [2.5, 5.0, 2.5, 5.0]  # 0.5 r_1 + 2 r_2
    assert batch.stats["truncated"].tolist() == [0, 1, 0, 1]
    assert batch.loss_mask.tolist() == [[1, 0], [0, 0], [1, 0], [0, 0]]


def test_dynamic_sampling_keeps_only_varied_groups(monkeypatch):
    batch = stand_in_rollout(monkeypatch, [0, 1, 2, 3], factor=2)  # prompts 0 and 2 have constant rewards
    assert [p[0] for p in batch.sample_prompt_ids] == [101, 101, 103, 103]  # only prompts 1 and 3 are trained on
    assert batch.stats["zero_std"].tolist() == [0.0, 0.0] and batch.loss_mask.sum() == 6  # 1 + 2 tokens each
    generated = [batch.stats[k] for k in ("generated_groups", "varied_groups", "generated_tokens")]
    assert generated == [4, 2, 12]
    off = stand_in_rollout(monkeypatch, [0, 1], factor=1)  # off: zero-std groups are trained on, as plain GRPO does
    assert off.stats["zero_std"].tolist() == [1.0, 0.0] and off.loss_mask.sum() == 6


def test_dynamic_sampling_tops_up_with_masked_zero_std_groups(monkeypatch):
    batch = stand_in_rollout(monkeypatch, [0, 1, 2, 4], factor=2)  # only prompt 1 varies: one filler group, masked out
    assert [p[0] for p in batch.sample_prompt_ids] == [101, 101, 100, 100]
    assert batch.stats["zero_std"].tolist() == [0.0, 1.0]
    assert batch.loss_mask.sum(1).tolist() == [1.0, 2.0, 0.0, 0.0]  # the filler never reaches the loss


def correct_on_even_prompts(prompts, completions, **columns):  # odd: only the 1-token one is right
    return [1.0 if int(p) % 2 == 0 or len(c) == 1 else 0.0 for p, c in zip(prompts, completions)]


def length_penalty(prompts, completions, **columns):
    return [-0.1 * len(c) for c in completions]


def test_dynamic_sampling_filters_on_one_reward(monkeypatch):
    """DAPO keeps a group when 0 < correct < G. The issue's example: an all-correct group (G 4,
    lengths 50/85/60/70 of 100, soft overlong penalty) sums to 1, 0.75, 1, 1, and group-std scaling
    makes that 0.5 / -1.5 / 0.5 / 0.5: a length penalty as full-size advantages. Here the
    all-correct even prompts vary only in length."""
    issue_example = gc.compute_advantages(torch.tensor([1, 0.75, 1, 1]), 4)  # std 0.125, + 1e-4
    assert torch.allclose(issue_example, torch.tensor([0.5, -1.5, 0.5, 0.5]) * 0.125 / 0.1251)
    funcs = (correct_on_even_prompts, length_penalty)
    batch = stand_in_rollout(monkeypatch, [0, 2, 1, 4], factor=2, funcs=funcs)  # on the first
    assert [p[0] for p in batch.sample_prompt_ids] == [101, 101, 100, 100]  # prompt 1, filler prompt 0
    assert batch.loss_mask.sum(1).tolist() == [1.0, 2.0, 0.0, 0.0]
    generated = [batch.stats[k] for k in ("generated_groups", "varied_groups", "generated_tokens")]
    assert generated == [4, 1, 12]  # varied: the informative groups
    by_length = stand_in_rollout(monkeypatch, [0, 2, 1, 4], factor=2, funcs=funcs,
                                 dynamic_sampling_reward="length_penalty")  # every group varies
    assert [p[0] for p in by_length.sample_prompt_ids] == [100, 100, 102, 102]


def test_truncation_counts_the_pad_token_as_an_end(monkeypatch):
    """TRL's end tokens: the EOS and the pad token (CharTokenizer's 1 and 0); vLLM ends on the other
    EOS tokens of generation_config itself, with finish_reason "stop" (the next test)."""
    def ends(k, j):  # both cut at max_tokens: completion 0 on the pad token, completion 1 not
        return [48, 0] if j == 0 else [48, 48], "length"
    batch = stand_in_rollout(monkeypatch, [1, 3], factor=1, sample=ends,
                             mask_truncated_completions=True)
    assert batch.stats["truncated"].tolist() == [0.0, 1.0, 0.0, 1.0]
    assert batch.loss_mask.sum(1).tolist() == [2.0, 0.0, 2.0, 0.0]


def test_vllm_stops_on_generation_config_eos(tmp_path):
    """What is_truncated relies on: vLLM adds generation_config's eos_token_id (Llama-3.1:
    128001/128008/128009) to every request's stop tokens (vllm/v1/engine/input_processor.py), so
    those end a completion with finish_reason "stop"."""
    from transformers import GenerationConfig
    from vllm import SamplingParams
    from vllm.transformers_utils.config import try_get_generation_config

    GenerationConfig(eos_token_id=[2, 7, 9]).save_pretrained(tmp_path)
    params = SamplingParams(max_tokens=8)
    generation_config = try_get_generation_config(str(tmp_path), trust_remote_code=False)
    params.update_from_generation_config(generation_config.to_diff_dict(), 2)
    assert params.eos_token_id == 2 and set(params.stop_token_ids) == {7, 9}


# ------------------------------------------------------------------------------------------------------------
# TP gather/slice with 4 real processes, tp = 2
# ------------------------------------------------------------------------------------------------------------

def model_mask_of(completions):
    """[N, T]: 1 on every completion token, left-aligned (T: the longest, >= 1)."""
    lengths = torch.tensor([len(c) for c in completions])
    return (torch.arange(max(1, int(lengths.max())))[None] < lengths[:, None]).long()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Params(msgspec.Struct):  # stands in for vLLM's SamplingParams (a msgspec struct too)
    seed: int = 0
    max_tokens: int = 8


class StandInEngine:
    """In place of vllm.LLM (test_tp_gather_slice_four_ranks): records the requests it got; its
    "completion" of a prompt is the prompt + shift, so a shift per rank makes the ranks differ."""
    def __init__(self, shift=0):
        self.seen = []
        self.shift = shift

    def generate(self, prompts, params, use_tqdm=False):
        self.seen.append([(p["prompt_token_ids"], q.seed) for p, q in zip(prompts, params)])
        return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[t + self.shift for t in p["prompt_token_ids"]],
                                                         finish_reason="stop", logprobs=None)])
                for p in prompts]


def _tp_worker(rank, world, store, results):
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    tp_group, _ = dist.new_subgroups_by_enumeration([[0, 1], [2, 3]])
    env = SimpleNamespace(rank=rank, tp=2, tp_group=tp_group)
    mine = [[rank, i] for i in range(rank + 1)]  # unequal counts per rank on purpose
    seeds = [100 * rank + i for i in range(rank + 1)]
    engine = StandInEngine()  # one "engine" per TP group: it must see the same requests on both of its ranks
    got = [list(out.outputs[0].token_ids) for out in gc.generate(engine, env, mine, Params(), seeds)]
    seen = engine.seen[0]
    # a shift per rank, as when the ranks of a group got different outputs: every rank stops
    try:
        gc.generate(StandInEngine(shift=rank), env, mine, Params(), seeds)
        mismatch = "not caught"
    except RuntimeError as e:
        mismatch = str(e)
    # top_entropy_quantile's threshold spans every rank's micro-batch: rank r holds r + 1 tokens of entropy
    # 10 r + 1 .. 10 r + r + 1 (and one masked token of 99), so all ranks see 1, 11, 12, 21, 22, 23, 31, .., 34
    entropy = torch.tensor([[10.0 * rank + i + 1 for i in range(rank + 1)] + [99.0]])
    mask = torch.tensor([[1.0] * (rank + 1) + [0.0]])
    kept = gc.top_entropy_mask(entropy, mask, 0.5, world)[0, :-1].tolist()
    results[rank] = (mine, got, seen, kept, mismatch)
    dist.destroy_process_group()


def test_tp_gather_slice_four_ranks(tmp_path):
    results = mp.Manager().dict()
    mp.spawn(_tp_worker, args=(4, tmp_path / "store", results), nprocs=4, join=True)
    for rank in range(4):
        mine, got, seen, kept, mismatch = results[rank]
        # the median of the 10 tokens of all ranks, 22.5, on every rank: 23 and above are kept
        assert kept == [float(10 * rank + i + 1 >= 22.5) for i in range(rank + 1)]
        assert "the ranks of a TP group sampled different tokens" in mismatch, mismatch
        assert got == mine  # exactly the completions of its own prompts (shift 0)
        partner = rank ^ 1
        assert seen == results[partner][2]  # both ranks of the group submitted identical requests...
        assert len(seen) == len(mine) + len(results[partner][0])
        assert [list(ids) for ids, _ in seen[:len(results[rank & ~1][0])]] == results[rank & ~1][0]  # ...in rank order
        assert [seed for ids, seed in seen if list(ids) in mine] == [100 * rank + i for i in range(rank + 1)]


# ------------------------------------------------------------------------------------------------------------
# FSDP2 vs DDP, 2 gloo ranks: same losses, same weights, and a sharded checkpoint that resumes exactly
# ------------------------------------------------------------------------------------------------------------

def run_processes(name, *args, nproc=1, timeout=600, **env_extra):
    """Run this file's function `name`(*args) in processes of its own: `python test_grpo_colocate.py
    name args`, under torchrun when nproc > 1 (which takes a free port itself). Returns what it
    printed after RESULT, as JSON."""
    launcher = [sys.executable]
    if nproc > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", "--local-addr=127.0.0.1",
                     f"--nproc_per_node={nproc}"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", **env_extra}
    proc = subprocess.run([*launcher, os.path.abspath(__file__), name, *map(str, args)],
                          capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stderr[-5000:]
    return json.loads(proc.stdout.split("RESULT ", 1)[1].splitlines()[0])


def fsdp_vs_ddp_ranks(model, out):
    """Each of 2 torchrun ranks (test_fsdp2_matches_ddp_...): 2 steps under DDP and under FSDP2 on
    this rank's batch, the weights compared, the FSDP2 checkpoint resumed, a third step of each."""
    flags = ["--model", model, "--output_dir", out, "--num_generations", "4",
             "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2",
             "--learning_rate", "1e-3", "--weight_decay", "0.1", "--max_grad_norm", "0.5",
             "--vllm_importance_sampling_correction", "false", "--weight_push_bucket_mb", "1",
             "--max_prompt_length", "8", "--max_completion_length", "8",
             "--max_tokens_per_microbatch", "20"]
    ddp_cfg = gc.parse_args(flags)
    fsdp_cfg = gc.parse_args(flags + ["--fsdp", "--gradient_checkpointing", "true"])
    env = gc.setup_env(ddp_cfg)
    gc.setup_distributed(ddp_cfg, env)
    torch.manual_seed(env.rank)  # each rank its own batch: 8 completions of random lengths
    prompts = [torch.randint(1, 60, (int(torch.randint(2, 6, ()).item()),)).tolist()
               for _ in range(8)]
    completions = [torch.randint(1, 60, (int(torch.randint(1, 7, ()).item()),)).tolist()
                   for _ in range(8)]
    mask = model_mask_of(completions)
    batch = SimpleNamespace(sample_prompt_ids=prompts, completion_ids=completions, model_mask=mask,
                            loss_mask=mask.float(), filler=torch.zeros(8, dtype=torch.bool),
                            advantages=torch.randn(8), vllm_logps=None, old_logps=None, ref_logps=None)

    def build(cfg, state=None):  # the trainer's own: the policy, AdamW (+ its state at a resume), the schedule
        t = gc.build_trainer(cfg, env, SimpleNamespace(checkpointing=cfg.fsdp), state)
        return t.policy, t.optimizer, t.scheduler

    def weights(policy):  # full fp32 tensors, gathered through the push's own bucketed path
        lm = gc.unwrap(policy).lm
        return {n: t.clone() for n, t in gc.full_weights(lm, torch.float32, env.device, 1 << 20)}

    def steps(run, cfg, n):
        return [gc.train_step(*run, batch, cfg, env, cfg.max_tokens_per_microbatch, {}, 1) for _ in range(n)]

    def max_diff(a, b):
        return max((a[n] - b[n]).abs().max().item() for n in a)

    from transformers import AutoModelForCausalLM

    def reads(cfg, state=None):  # build, counting the weight files this rank reads
        read = []
        original = AutoModelForCausalLM.from_pretrained
        AutoModelForCausalLM.from_pretrained = lambda *a, **k: read.append(1) or original(*a, **k)
        try:
            built = build(cfg, state)
        finally:
            AutoModelForCausalLM.from_pretrained = original
        everyone = [None, None]
        dist.all_gather_object(everyone, len(read))
        return built, everyone

    ddp = build(ddp_cfg)
    fsdp, fsdp_reads = reads(fsdp_cfg)
    result = {"sharded": all(isinstance(p, gc.DTensor) for p in fsdp[0].parameters()), "reads": fsdp_reads}
    result["ddp"] = steps(ddp, ddp_cfg, 2)
    result["fsdp"] = steps(fsdp, fsdp_cfg, 2)
    base = weights(build(ddp_cfg)[0])
    w_ddp = weights(ddp[0])
    w_fsdp = weights(fsdp[0])
    result["max_weight_diff"] = max_diff(w_ddp, w_fsdp)
    # the push's walk (by_layer): each layer's shards gathered once, all at its first weight; the
    # same tensors (the bucket, 1 MB, holds them all: copies, not the layers' freed gathers)
    unshard = mock.patch.object(gc.FSDPModule, "unshard", autospec=True, side_effect=gc.FSDPModule.unshard)
    with unshard as unshards:
        lm = gc.unwrap(fsdp[0]).lm
        walk = dict(gc.full_weights(lm, torch.float32, env.device, 1 << 20, by_layer=True))
    result["by_layer_diff"] = max_diff(walk, w_fsdp) if walk.keys() == w_fsdp.keys() else None
    result["unshards"] = unshards.call_count
    result["sharded_after_push"] = all(isinstance(p, gc.DTensor) for p in fsdp[0].parameters())
    result["min_weight_move"] = min((w_ddp[n] - base[n]).abs().max().item() for n in w_ddp)
    # sharded -> HF weights + DCP
    from transformers import AutoTokenizer

    trainer = SimpleNamespace(lm=gc.unwrap(fsdp[0]).lm, policy=fsdp[0], optimizer=fsdp[1])
    ckpt = gc.save_checkpoint(fsdp_cfg, env, 2, trainer, AutoTokenizer.from_pretrained(model), 0, gc.rows_digest([]))
    # the resume as the trainer does it: the weights, AdamW's state, the schedule at step 2 (reading
    # the state checks the DCP metadata of FSDP2 too)
    resumed_cfg = dataclasses.replace(fsdp_cfg, resume_from_checkpoint=ckpt)
    resumed, result["resumed_reads"] = reads(resumed_cfg, gc.read_checkpoint_state(ckpt))
    result["lr"] = [fsdp[1].param_groups[0]["lr"], resumed[1].param_groups[0]["lr"]]
    result["resumed_weight_diff"] = max_diff(weights(resumed[0]), w_fsdp)
    result["step3_fsdp"] = steps(fsdp, fsdp_cfg, 1)
    result["step3_resumed"] = steps(resumed, fsdp_cfg, 1)
    result["step3_ddp"] = steps(ddp, ddp_cfg, 1)
    result["lr_after_step3"] = [fsdp[1].param_groups[0]["lr"], resumed[1].param_groups[0]["lr"]]
    if env.rank == 0:
        print("RESULT", json.dumps(result), flush=True)
    dist.destroy_process_group()


def test_fsdp2_matches_ddp_and_resumes_from_its_checkpoint(tiny_model, tmp_path):
    """2 optimizer steps with DDP and with FSDP2 (+ activation checkpointing) from the same weights on the same
    per-rank batches: the same losses and the same updated weights to fp32 tolerance. Then the FSDP2 run's
    checkpoint (full HF weights gathered to rank 0, AdamW shards through torch.distributed.checkpoint) resumes to
    the same weights and the same third step."""
    r = run_processes("fsdp_vs_ddp_ranks", tiny_model(), tmp_path / "out", nproc=2)
    assert r["sharded"]
    # rank 0 alone read the weights (the model's, then the checkpoint's): the other built on the meta
    # device and got them by broadcast, so host memory holds one model, not one a rank
    assert r["reads"] == [1, 0] and r["resumed_reads"] == [1, 0]
    # (rtol, atol): fp32 sums in another order; the loss (terms that cancel) and the clip share (0)
    # also absolutely
    tolerances = {
        "loss": (1e-5, 1e-6),
        "grad_norm": (1e-5, 0),
        "clip_ratio/region": (0, 1e-9),
        "entropy": (1e-6, 0),
    }
    for ddp, fsdp in zip(r["ddp"] + r["step3_ddp"], r["fsdp"] + r["step3_fsdp"]):
        for key, (rtol, atol) in tolerances.items():
            assert close(ddp[key], fsdp[key], rtol, atol), (key, ddp[key], fsdp[key])
    assert r["min_weight_move"] > 1e-4  # every tensor was updated (lr 1e-3)...
    assert r["max_weight_diff"] < 1e-5  # ...and identically by both
    # the push gathers each of the 2 layers in one all-gather: the same weights, sharded again after
    assert r["by_layer_diff"] == 0.0 and r["unshards"] == 2 and r["sharded_after_push"]
    assert r["resumed_weight_diff"] == 0.0  # the checkpoint holds the exact fp32 masters
    assert r["lr"][0] == r["lr"][1] < 1e-3  # the linear schedule's rate at step 3, restored...
    assert r["lr_after_step3"][0] == r["lr_after_step3"][1] < r["lr"][0]  # ...and the schedule goes on from it
    # the same weights and AdamW state: the same step
    for key in ("loss", "grad_norm", "entropy"):
        assert close(r["step3_resumed"][0][key], r["step3_fsdp"][0][key], 1e-6, 1e-9), key


class GradientRecorder:
    """In place of AdamW (packing_ranks): keeps the step's full (all-reduced) gradients."""
    def __init__(self, lm):
        self.params = list(lm.parameters())

    def step(self):
        self.grads = [(p.grad.full_tensor() if isinstance(p.grad, gc.DTensor) else p.grad).clone()
                      for p in self.params]

    def zero_grad(self, set_to_none=True):
        for p in self.params:
            p.grad = None


def packing_ranks(model, out):
    """Each of 2 torchrun ranks (test_packed_gradient_...): the gradient of one step under each loss
    type and cut, against the gradient of both ranks' sequences as one batch, each run alone."""
    base = ["--model", model, "--output_dir", out, "--num_generations", "2",
            "--per_device_train_batch_size", "3", "--gradient_accumulation_steps", "2",
            "--max_prompt_length", "8", "--max_completion_length", "40",
            "--vllm_importance_sampling_correction", "false", "--max_grad_norm", "0"]
    env = gc.setup_env(gc.parse_args(base))
    gc.setup_distributed(gc.parse_args(base), env)
    g = torch.Generator().manual_seed(env.rank)

    def tokens(lo, hi):
        length = int(torch.randint(lo, hi, (), generator=g))
        return torch.randint(1, 60, (length,), generator=g).tolist()
    # very unequal lengths: rank 0 has two sequences of 48 tokens, every other sequence has 9-11;
    # so a budget of 100 cuts rank 0 into micro-batches of 2 and 4 sequences, and rank 1 into one
    # (which then has to become two)
    prompts = [tokens(8, 9) for _ in range(6)]
    completions = [tokens(40, 41) if env.rank == 0 and i < 2 else tokens(1, 4) for i in range(6)]
    mask = model_mask_of(completions)
    batch = SimpleNamespace(sample_prompt_ids=prompts, completion_ids=completions, model_mask=mask,
                            loss_mask=mask.float(), filler=torch.zeros(6, dtype=torch.bool),
                            advantages=torch.randn(6, generator=g), vllm_logps=None, old_logps=None,
                            ref_logps=None)

    def reference(loss_type):
        """The definition: both ranks' sequences as ONE batch, each alone (unpadded, unpacked)."""
        lm = gc.load_lm(model, "cpu")
        everyone = [None, None]
        dist.all_gather_object(everyone, (prompts, completions, batch.advantages))
        logps = []
        for rank_prompts, rank_completions, _ in everyone:
            for p, c in zip(rank_prompts, rank_completions):
                logits = lm(torch.tensor([p + c])).logits[0, len(p) - 1:-1]  # [len(c), V]
                logps.append(logits.log_softmax(-1)[torch.arange(len(c)), c])
        mask = model_mask_of([c for _, C, _ in everyone for c in C]).float()
        logps = torch.nn.utils.rnn.pad_sequence(logps, batch_first=True)
        advantages = torch.cat([a for *_, a in everyone])
        cfg = gc.Config(loss_type=loss_type, max_completion_length=40)
        loss, _ = gc.grpo_loss(logps, logps.detach(), advantages, mask, cfg)
        loss.backward()
        return [p.grad for p in lm.parameters()]

    lengths = [len(p) + len(c) for p, c in zip(prompts, completions)]
    result = {}
    for loss_type in ("grpo", "dr_grpo", "dapo"):
        want = reference(loss_type)
        for name, flags in (("ddp-100", ["--max_tokens_per_microbatch", "100"]),
                            ("ddp-4096", ["--max_tokens_per_microbatch", "4096"]),
                            ("fsdp-100", ["--max_tokens_per_microbatch", "100", "--fsdp"])):
            cfg = gc.parse_args(base + ["--loss_type", loss_type] + flags)
            policy = gc.wrap_policy(gc.load_lm(model, "cpu"), env, cfg, False)
            recorder = GradientRecorder(gc.unwrap(policy).lm)
            budget = cfg.max_tokens_per_microbatch
            gc.train_step(policy, recorder, SimpleNamespace(step=lambda: None), batch, cfg, env, budget, {}, 1)
            counts = [None, None]
            mine = len(gc.split_micro_batches(lengths, cfg.max_tokens_per_microbatch))
            dist.all_gather_object(counts, mine)
            diff = max(((a - b).abs().max() / b.abs().max().clamp(min=1)).item()
                       for a, b in zip(recorder.grads, want))
            result[f"{loss_type}/{name}"] = {"diff": diff, "counts": counts,
                                             "ran": len(gc.plan_micro_batches(batch, budget, env))}
    if env.rank == 0:
        print("RESULT", json.dumps(result), flush=True)
    dist.destroy_process_group()
    # skip interpreter teardown: the DDP wrappers left alive could abort it ("terminate called ...")
    os._exit(0)


def test_packed_gradient_equals_the_whole_batch_gradient_on_two_ranks(tiny_model, tmp_path):
    """grpo, dr_grpo and dapo: however the generation batch is cut into packed micro-batches (a budget of 100 tokens,
    or one micro-batch per rank), under DDP and FSDP2, the gradient equals the gradient of the loss of both ranks'
    sequences as one batch, each sequence run alone. Rank 0 has sequences 4x longer than rank 1's, so the budget
    alone would give the ranks different micro-batch counts: they agree on one (else FSDP2 hangs)."""
    r = run_processes("packing_ranks", tiny_model(), tmp_path / "out", nproc=2, timeout=300)
    for key, v in r.items():
        assert v["diff"] < 1e-5, (key, v)
        if key.endswith("-100"):
            assert v["counts"][0] > v["counts"][1] and v["ran"] == v["counts"][0], (key, v)
        else:
            assert v["counts"] == [1, 1] and v["ran"] == 1, (key, v)


# ------------------------------------------------------------------------------------------------------------
# end to end: the real engine and the real model, torchrun on the CPU
# ------------------------------------------------------------------------------------------------------------

SMALL = ["--num_generations", "4", "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2",
         "--mask_truncated_completions", "--reward_funcs", "accuracy_reward", "format_reward",
         "--max_prompt_length", "96", "--max_completion_length", "32", "--num_eval", "8", "--learning_rate", "1e-5"]
REQUIRED_KEYS = [
    "step", "lr", "reward", "reward_std", "rewards/accuracy_reward", "rewards/format_reward", "advantage_std",
    "frac_reward_zero_std", "completion_length/mean", "completion_length/min", "completion_length/max",
    "completion_clipped_ratio", "loss", "clip_ratio/low", "clip_ratio/high", "clip_ratio/region", "entropy",
    "grad_norm", "sampled_gap", "is_weight/mean", "time/generate", "time/reward", "time/logprobs",
    "time/fwd_bwd", "time/optimizer", "time/push", "time/sleep_wake", "time/other", "time/step", "completion_tokens_per_sec_per_gpu",
]
# a length term, so that every group has a reward spread and the policy moves whatever the samples
LEARNS = ["--reward_funcs", "accuracy_reward", "format_reward", "reward_len", "--reward_weights", "1", "1", "0.01"]
DYNAMIC = ["--dynamic_sampling_factor", "2"]  # the LoRA run: 2 prompts generated per rank, 1 trained


def run_trainer(args, nproc=2, timeout=900, check=True, **env_extra):
    """torchrun grpo_colocate.py args: --standalone takes a free port itself (a port picked here
    could be taken by the time torchrun binds it); --local-addr keeps the ranks on loopback."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--local-addr=127.0.0.1",
           f"--nproc_per_node={nproc}", os.path.join(HERE, "grpo_colocate.py"), *args]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", **env_extra}
    proc = subprocess.run(cmd, cwd=HERE, env=env, capture_output=True, text=True, timeout=timeout)
    if check:
        assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}"
        assert_clean_exit(proc, args[args.index("--output_dir") + 1])
    return proc


def assert_clean_exit(proc, marker):
    """No segfault, no leaked process group, and no process of the run left behind."""
    for bad in ("Segmentation fault", "destroy_process_group() was not called", "core dumped"):
        assert bad not in proc.stderr, bad
    assert subprocess.run(["pgrep", "-f", marker], capture_output=True).returncode == 1, "a process outlived the run"


def read_metrics(output_dir):
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory):
    assert os.path.isfile(os.path.join(MODEL, "model.safetensors")), \
        f"the embedded model is missing at {MODEL}: run the tests through `bash run.sh test`, which prepares it"
    out = str(tmp_path_factory.mktemp("e2e"))
    proc = run_trainer(["--model", MODEL, *SMALL, *LEARNS, "--max_steps", "2", "--save_steps", "1", "--eval_steps", "2",
                        "--output_dir", out])
    return out, proc


def test_e2e_metrics_have_every_key_and_are_finite(two_rank_run):
    out, proc = two_rank_run
    records = read_metrics(out)
    assert records[0]["step"] == 0 and "eval/accuracy_reward" in records[0]  # the base model's eval
    steps = [r for r in records if "reward" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        missing = [k for k in REQUIRED_KEYS if k not in r]
        assert not missing, missing
        bad = {k: v for k, v in r.items() if isinstance(v, float) and not math.isfinite(v)}
        assert not bad, bad
    # the reward is the weighted sum of the reward functions' (LEARNS: weights 1, 1, 0.01)
    for r in steps:
        weighted = r["rewards/accuracy_reward"] + r["rewards/format_reward"]
        weighted += 0.01 * r["rewards/reward_len"]
        assert close(r["reward"], weighted, 1e-6, 1e-9), (r["reward"], weighted)
    assert "eval/accuracy_reward" in steps[-1]
    line = next(line for line in proc.stdout.splitlines() if line.startswith("step 2/2 ("))  # the stdout line
    assert all(label in line for label in (" trunc ", " clip ", " sampled_gap ", " sleep_wake ", " fwd_bwd ")), line


def test_e2e_engine_checked_every_step(two_rank_run):
    out, proc = two_rank_run
    assert "checked on the sampled tokens" in proc.stdout and "first push and probe took" in proc.stdout
    for r in read_metrics(out):
        if "reward" in r:
            # the probe ran after the first push, and after the last (step 2's) alone...
            assert ("probe_gap" in r) == ("time/probe" in r) == (r["step"] == 2)
            assert 0 <= r["sampled_gap"] < 1e-4  # ...the sampled tokens' gap every step (fp32)
            assert r["time/push"] > 0


def test_e2e_policy_changed_and_checkpoint_loads_in_transformers(two_rank_run):
    from transformers import AutoModelForCausalLM

    out, _ = two_rank_run
    ckpt = os.path.join(out, "checkpoint-2")
    assert not os.path.exists(ckpt + ".tmp")
    trained = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    base = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)
    moved = [n for (n, p), (_, q) in zip(trained.named_parameters(), base.named_parameters()) if not torch.equal(p, q)]
    assert len(moved) > 100  # nearly every tensor moved
    state = gc.read_checkpoint_state(ckpt)
    assert state["step"] == 2 and state["data_position"] == 8  # 2 generations x 2 ranks x 2 prompts
    assert json.load(open(os.path.join(ckpt, "grpo_config.json")))["model"] == MODEL


def test_e2e_resume_on_one_rank_reproduces_step_two(two_rank_run, tmp_path):
    """checkpoint-1 of the 2-rank run resumed on 1 rank with twice the prompts per rank (the same global batch) and
    num_iterations 2 (so step 2 is mid-cycle for the new run): step 2 takes the same slice of the data stream, which
    both ranks drew from together, and samples the same completions (seeds from the data position, not the rank);
    step 3 reuses that batch."""
    out, _ = two_rank_run
    resumed = str(tmp_path / "resumed")
    run_trainer(["--model", MODEL, *SMALL, *LEARNS, "--gradient_accumulation_steps", "4", "--num_iterations", "2",
                 "--max_steps", "3", "--eval_steps", "0", "--save_steps", "-1",
                 "--output_dir", resumed,
                 "--resume_from_checkpoint", os.path.join(out, "checkpoint-1")], nproc=1)
    want = [r for r in read_metrics(out) if r["step"] == 2][0]
    got, step3 = [r for r in read_metrics(resumed) if "reward" in r]
    assert got["step"] == 2 and step3["step"] == 3 and "time/generate" not in step3
    # (rtol, atol) per quantity: the same completions and rewards, summed over 2 ranks or 1 (in
    # another order); the lr from the checkpoint's AdamW; the logprob gap is fp32 noise (~1e-6) and
    # the clip share 0: absolute tolerances
    # the rate: this run's flags at step 2, --max_steps 3 (not the checkpoint's 2): 1e-5 x (1 - 1/3)
    assert close(got["lr"], 1e-5 * (1 - 1 / 3), 1e-12) and close(want["lr"], 1e-5 * (1 - 1 / 2), 1e-12)
    tolerances = {
        "loss": (1e-4, 5e-5),
        "grad_norm": (1e-4, 0),
        "entropy": (1e-5, 0),
        "sampled_gap": (0, 2e-6),
        "is_weight/mean": (1e-4, 0),
        "clip_ratio/region": (0, 1e-9),
    }
    for key in want:
        if key.startswith("completion_") and "per_sec" not in key:  # lengths, not throughput
            assert got[key] == want[key], (key, got[key], want[key])
        elif key.startswith(("reward", "frac_", "advantage_std")):
            assert close(got[key], want[key], 1e-5, 1e-9), (key, got[key], want[key])
        elif key in tolerances:
            assert close(got[key], want[key], *tolerances[key]), (key, got[key], want[key])


def test_e2e_resume_continues_adamw_and_the_schedule(tiny_model, tmp_path):
    """The first update after a resume is the uninterrupted run's: 2 steps on 1 rank saving after
    each, and the same run resumed from checkpoint-1. Compared after step 2: the weights (AdamW's
    moments and step count carried on), the scheduler (the lr of the next step) and the data
    position. Besides: with the IS correction off the probe checks every push, here of an untied
    lm_head; with beta > 0 the KL is 0 at step 1 (the reference is the initial policy), and the
    resumed run's reference is the initial model too, not the checkpoint."""
    from safetensors.torch import load_file

    # head_dim 64, 2 heads: 50 MB in fp32
    model = tiny_model(engine=True, hidden=128, heads=2, kv_heads=1, tie=False)
    flags = ["--model", model, "--num_generations", "4", "--per_device_train_batch_size", "4",
             "--gradient_accumulation_steps", "1", "--max_prompt_length", "96",
             "--max_completion_length", "8", "--num_eval", "4", "--eval_steps", "0",
             "--reward_funcs", "reward_len", "--learning_rate", "1e-3", "--beta", "0.1",
             "--vllm_importance_sampling_correction", "false", "--max_steps", "2"]
    whole = str(tmp_path / "whole")
    resumed = str(tmp_path / "resumed")
    run_trainer([*flags, "--save_steps", "1", "--output_dir", whole], nproc=1)
    checkpoint_1 = os.path.join(whole, "checkpoint-1")
    run_trainer([*flags, "--output_dir", resumed, "--resume_from_checkpoint", checkpoint_1],
                nproc=1)
    steps = [r for r in read_metrics(whole) if "reward" in r]
    again = [r for r in read_metrics(resumed) if "reward" in r]
    assert [r["step"] for r in steps] == [1, 2] and [r["step"] for r in again] == [2]
    assert all(r["probe_gap"] < 1e-4 for r in steps + again)  # the probe after every push
    assert steps[0]["kl"] < 1e-7 < steps[1]["kl"]  # the policy of step 1 is the reference
    # the same rollout, the same reference
    for key in ("lr", "reward", "loss", "kl", "grad_norm"):
        assert close(again[0][key], steps[1][key], 1e-5, 1e-9), (key, again[0][key], steps[1][key])
    before = load_file(os.path.join(checkpoint_1, "model.safetensors"))
    after = load_file(os.path.join(whole, "checkpoint-2", "model.safetensors"))
    after_resume = load_file(os.path.join(resumed, "checkpoint-2", "model.safetensors"))
    assert "lm_head.weight" in after
    # the update of step 2, to 0.1% (a fresh AdamW's would differ by 25% and more)
    for name, w in after.items():
        moved = (w - before[name]).abs().max()
        assert moved > 0 and (after_resume[name] - w).abs().max() <= 1e-3 * moved, name
    state = gc.read_checkpoint_state(os.path.join(whole, "checkpoint-2"))
    state_resumed = gc.read_checkpoint_state(os.path.join(resumed, "checkpoint-2"))
    assert state_resumed["data_position"] == state["data_position"] == 2  # 1 prompt per generation


def test_e2e_tp2_tiny_llama_with_other_flags(tiny_model, tmp_path):
    """tp=2 on 2 ranks (one engine over both), with the non-default paths: FSDP2 with activation checkpointing and a
    1 MB push bucket (every rank gathers full tensors for the shared engine), a local dataset with other column
    names, beta > 0 (a sharded reference model), num_iterations 2 (old logps), grpo loss, batch-scaled rewards,
    token-level truncated IS, clip-higher, two weighted reward functions, a cosine schedule,
    fixed-length generations (so no masked truncation: it would mask every one), vLLM's INFO logs, GSPO
    sequence-level ratios (with a tiny epsilon, so that step 2's ratios get clipped), the entropy
    bonus and top_entropy_quantile (its threshold gathered over 2 ranks), the soft overlong
    punishment as a third reward."""
    model_dir = tiny_model(engine=True)
    data = tmp_path / "data.jsonl"
    with open(data, "w") as f:
        for i in range(40):
            f.write(json.dumps({"question": f"What is {i} + 1?", "solution": f"{i} + 1 = {i + 1}\n#### {i + 1}"}) + "\n")
    out = str(tmp_path / "out")
    proc = run_trainer([
        "--model", model_dir, "--vllm_tensor_parallel_size", "2", "--fsdp", "--gradient_checkpointing", "true",
        "--weight_push_bucket_mb", "1", "--dataset", str(data),
        "--prompt_column", "question", "--answer_column", "solution", "--num_eval", "4",
        "--num_generations", "4", "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2",
        "--max_prompt_length", "64", "--max_completion_length", "16", "--ignore_eos", "--max_tokens_per_microbatch", "90",
        "--max_steps", "2", "--num_iterations", "2", "--beta", "0.05", "--loss_type", "grpo",
        "--scale_rewards", "batch", "--vllm_importance_sampling_mode", "token_truncate",
        "--mask_truncated_completions", "false", "--epsilon", "1e-4", "--epsilon_high", "0.28",
        "--importance_sampling_level", "sequence", "--entropy_coef", "0.01", "--top_entropy_quantile", "0.5",
        "--reward_funcs", "reward_len", "format_reward", "soft_overlong_punishment",
        "--reward_weights", "0.1", "1.0", "1.0",
        "--temperature", "0.9", "--top_p", "0.9", "--top_k", "50", "--lr_scheduler_type", "cosine",
        "--weight_decay", "0.01", "--max_grad_norm", "0.5", "--seed", "7",
        "--learning_rate", "1e-4", "--eval_steps", "2", "--eval_split", "train",
        "--logging_steps", "2", "--save_steps", "-1", "--output_dir", out], VLLM_LOGGING_LEVEL="INFO")
    assert "trainer FSDP2 + activation checkpointing" in proc.stdout and "checked on the sampled tokens" in proc.stdout
    assert "INFO " in proc.stdout  # your VLLM_LOGGING_LEVEL wins
    records = read_metrics(out)
    steps = [r for r in records if "reward" in r]
    assert [r["step"] for r in steps] == [2]  # logging_steps 2
    r = steps[0]
    assert r["completion_length/min"] == r["completion_length/max"] == 16  # ignore_eos: fixed length
    assert r["sampled_gap"] < 1e-4 and r["probe_gap"] < 1e-4  # top-p/top-k scored as sampled; the last push probed
    assert "rewards/reward_len" in r and "rewards/format_reward" in r
    assert r["sampled_gap"] < 1e-3  # top_p 0.9 / top_k 50: the trainer scores the kept set vLLM sampled from
    assert "time/generate" not in r  # num_iterations 2: step 2 reuses step 1's rollout...
    assert r["kl"] > 0  # ...after one update, so the policy has left the reference
    assert r["rewards/soft_overlong_punishment"] == -1.0  # every completion has max_completion_length tokens
    # sequence level: a sequence is clipped whole, so of the 16 x 16 tokens a multiple of 16 are (token level: 118)
    clipped = r["clip_ratio/low"] * 16 * 16
    assert clipped > 0 and abs(clipped - 16 * round(clipped / 16)) < 1e-6, clipped
    assert "eval/reward_len" in records[0] and "eval/reward_len" in r
    assert not [d for d in os.listdir(out) if d.startswith("checkpoint")]  # save_steps -1: never


# ------------------------------------------------------------------------------------------------
# tools, end to end with the real engine and SmolLM2. On the built-in task it does not call the
# calculator; asked to repeat a call, it does (README, Tools): that drives real multi-turn rollouts
# ------------------------------------------------------------------------------------------------

def repeat_a_call_dataset(path, rows=24):
    """Prompts that make SmolLM2 emit a calculator call: 'Repeat exactly: <tool_call>...'."""
    with open(path, "w") as f:
        for i in range(rows):
            call = json.dumps({"name": "calculator", "arguments": {"expression": f"{i} + 7"}})
            f.write(json.dumps({"prompt": f"Repeat exactly: <tool_call>\n{call}\n</tool_call>",
                                "answer": str(i + 7)}) + "\n")
    return str(path)


TOOL_TURNS = """
import json, sys, torch
from msgspec.structs import replace
sys.path.insert(0, {here!r})
import grpo_colocate as gc
cfg = gc.parse_args(["--model", {model!r}, "--output_dir", {out!r}, "--dataset", {data!r},
                     "--tools", "calculator", "--num_generations", "4",
                     "--per_device_train_batch_size", "8", "--gradient_accumulation_steps", "1",
                     "--max_completion_length", "64",
                     "--num_eval", "3", "--temperature", "0.3", "--learning_rate", "1e-5"])
env = gc.setup_env(cfg)
gc.setup_distributed(cfg, env)
tokenizer, rows, eval_rows = gc.prepare_data(cfg)
llm = gc.make_engine(cfg, env, gc.load_model_config(cfg), False)
engine = gc.ColocatedEngine(llm, cfg, env, False, eval_rows[0]["prompt_ids"])
policy = gc.wrap_policy(gc.load_lm(cfg.model, env.device), env, cfg, False)
engine.wake_and_push(policy, 0, {{}})
funcs, weights = gc.load_reward_funcs(cfg)
tools = gc.load_tools(cfg)
positions = [5, 9]
samples, counts = gc.rollout(llm, cfg, env, tokenizer, [row["prompt_ids"] for row in rows[:2]], positions)
rewards = gc.score(funcs, rows[:2], [s.token_ids for s in samples], 4, tokenizer, 64)
batch = gc.make_batch(cfg, env, tokenizer, rows[:2], samples, rewards, weights, counts)
params = gc.sampling_params(cfg, logprobs=True)
mb = gc.micro_batch(batch, range(8), env.device)
logps, entropy = policy(*mb.packed, mb.model_mask, cfg.temperature)
is_weights = gc.vllm_importance_weights(logps.detach(), mb.vllm_logps, mb.model_mask,
                                        "token_truncate")
loss, _ = gc.grpo_loss(logps, logps.detach(), mb.advantages, mb.loss_mask, cfg, is_weights=is_weights)
grad, = torch.autograd.grad(loss, logps)
result = {{"multi_turn": 0, "counts": [counts[k] for k in ("tool_calls", "tool_failures", "turns")]}}
for k, ids in enumerate(batch.completion_ids):
    mask = batch.model_mask[k, :len(ids)].tolist()
    result["multi_turn"] += 0 in mask
    # cut the completion into turns: runs of model tokens (1) and of tool result tokens (0)
    turns, start = [], 0
    for t in range(1, len(ids) + 1):
        if t == len(ids) or mask[t] != mask[start]:
            turns.append((mask[start], start, t))
            start = t
    for (_, a, b), (kind, c, d) in zip(turns, turns[1:]):
        if kind == 0:  # the results of the model turn's calls, as the template renders them
            calls = gc.reward_fns.TOOL_CALL.findall(tokenizer.decode(ids[a:b]))
            want = gc.reward_fns.tool_suffix_ids(tokenizer, [gc.reward_fns.call_tool(tools, c)[1] for c in calls])
            assert ids[c:d] == want, (tokenizer.decode(ids[c:d]), tokenizer.decode(want))
            assert ids[b - 1] == tokenizer.eos_token_id  # the model's turn ended with its EOS
    tool = [t for t, m in enumerate(mask) if m == 0]
    model = [t for t, m in enumerate(mask) if m == 1]
    assert batch.loss_mask[k, tool].sum() == 0 and (batch.loss_mask[k, model] == 1).all()
    assert (batch.vllm_logps[k, tool] == 0).all() and (logps[k, tool] == 0).all()
    assert (entropy[k, tool] == 0).all() and (grad[k, tool] == 0).all()
    assert (logps[k, model] - batch.vllm_logps[k, model]).abs().max() < 1e-4  # every one scored
    if 0 in mask:  # turn 1 sampled alone, from its own seed (position, j, turn 1): the same tokens
        _, a, b = turns[2]
        seed = gc.derive_seed(cfg.seed, "rollout", positions[k // 4], k % 4, 1)
        prefix = rows[k // 4]["prompt_ids"] + ids[:a]
        out = gc.generate(llm, env, [prefix], replace(params, n=1), [seed],
                          [cfg.max_completion_length - a])
        assert list(out[0].outputs[0].token_ids) == ids[a:b]
# turn 0 is today's rollout: one request with n = G per prompt, seeds base + G i + j
seeds = [gc.derive_seed(cfg.seed, "rollout") + 4 * i for i in positions]
first = gc.generate(llm, env, [row["prompt_ids"] for row in rows[:2]], params, seeds)
for k, c in enumerate(c for out in first for c in out.outputs):
    assert batch.completion_ids[k][:len(c.token_ids)] == list(c.token_ids)
optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-5)
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
stats = gc.train_step(policy, optimizer, scheduler, batch, cfg, env, 4096, {{}}, 1)
result["canary"] = stats["sampled_gap/rank_max"]
result["eval"] = gc.evaluate(llm, cfg, env, tokenizer, eval_rows, funcs, 1)
print("RESULT", json.dumps(result))
del engine, llm
torch.distributed.destroy_process_group()
"""


def test_tool_turns_masked_token_by_token(tmp_path):
    """A real multi-turn rollout (SmolLM2 repeats a calculator call, reads the result, answers): the
    results' tokens are exactly the template's, outside the loss, entropy, IS weights and gradient;
    every model token is scored as vLLM sampled it; every turn has its own seed; turn 0 is the
    rollout of a run without tools; the canary and the greedy eval (with the tools) pass."""
    script = tmp_path / "tool_turns.py"
    data = repeat_a_call_dataset(tmp_path / "repeat.jsonl")
    script.write_text(TOOL_TURNS.format(here=HERE, model=MODEL, out=str(tmp_path / "out"),
                                        data=data))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-5000:]
    result = json.loads(proc.stdout.split("RESULT ", 1)[1].splitlines()[0])
    assert result["multi_turn"] >= 2, result  # of 8 samples
    calls, failed, turns = result["counts"]
    assert calls >= result["multi_turn"] and turns == 8 + result["multi_turn"]
    assert result["canary"] < 1e-4 and "eval/accuracy_reward" in result["eval"]


TOOL_FLAGS = ["--tools", "calculator", "--num_generations", "4",
              "--per_device_train_batch_size", "4", "--max_completion_length", "48",
              "--num_eval", "3", "--temperature", "0.3",
              "--learning_rate", "1e-5", "--reward_funcs", "accuracy_reward", "reward_len",
              "--reward_weights", "1", "0.01"]


def test_e2e_tools_on_two_ranks_then_a_resume_reproduces_the_next_step(tmp_path):
    """2 ranks with the calculator: tool calls, their metrics, the greedy eval with the tools. checkpoint-1 resumed on 1 rank with twice the prompts (the same
    global batch) samples step 2's turns again: each from its own seed (position, completion,
    turn)."""
    data = repeat_a_call_dataset(tmp_path / "repeat.jsonl")
    out, resumed = str(tmp_path / "out"), str(tmp_path / "resumed")
    flags = ["--model", MODEL, "--dataset", data, *TOOL_FLAGS, "--max_steps", "2"]
    run_trainer([*flags, "--gradient_accumulation_steps", "1", "--save_steps", "1",
                 "--eval_steps", "2", "--output_dir", out])
    records = read_metrics(out)
    steps = [r for r in records if "reward" in r]
    assert "eval/accuracy_reward" in records[0] and "eval/accuracy_reward" in steps[-1]
    for r in steps:
        assert r["tools/call_frequency"] > 0 and r["tools/turns"] > 1, r
        assert 0 <= r["tools/failure_frequency"] <= 1 and r["sampled_gap"] < 1e-4
    checkpoint = os.path.join(out, "checkpoint-1")
    run_trainer([*flags, "--gradient_accumulation_steps", "2", "--eval_steps", "0",
                 "--output_dir", resumed, "--resume_from_checkpoint", checkpoint], nproc=1)
    want, got = steps[1], [r for r in read_metrics(resumed) if "reward" in r][0]
    assert got["step"] == 2
    for key in want:
        if "per_sec" in key:  # throughput: a time
            continue
        if key.startswith(("completion_", "tools/", "reward")):  # the same samples, turns, rewards
            assert close(got[key], want[key], 1e-6), (key, got[key], want[key])
        elif key in ("loss", "grad_norm", "entropy", "is_weight/mean"):
            assert close(got[key], want[key], 1e-4), (key, got[key], want[key])
        elif key == "sampled_gap":  # fp32 on both sides: noise around 0 (about 7e-7)
            assert close(got[key], want[key], atol=1e-6), (key, got[key], want[key])


def test_e2e_tools_tp2(tmp_path, monkeypatch):
    """tp 2 with the calculator, on SmolLM2 with zero-padded heads (tp 2 cannot split its 9; the
    padding adds nothing), so that it calls the tool: the TP group takes every turn together, its
    ranks gathering and slicing their requests, until both are done, also in the greedy eval (rank 0
    has 2 prompts, rank 1 one)."""
    monkeypatch.syspath_prepend(os.path.join(HERE, "bench"))
    from bench import pad_heads

    os.symlink(MODEL, tmp_path / "smollm2")
    pad_heads(str(tmp_path / "smollm2"), 2)
    data = repeat_a_call_dataset(tmp_path / "repeat.jsonl")
    out = str(tmp_path / "out")
    proc = run_trainer(["--model", str(tmp_path / "smollm2-padded-tp2"),
                        "--vllm_tensor_parallel_size", "2", "--dataset", data, *TOOL_FLAGS,
                        "--gradient_accumulation_steps", "1", "--max_steps", "1",
                        "--eval_steps", "1", "--save_steps", "-1", "--output_dir", out])
    assert "world 2 = 1 engine(s) x tp 2" in proc.stdout
    r = [r for r in read_metrics(out) if "reward" in r][0]
    assert r["tools/call_frequency"] > 0 and r["tools/turns"] > 1 and r["sampled_gap"] < 1e-4, r
    assert "eval/accuracy_reward" in r


def dump_reward(prompts, completions, **columns):
    """A reward function (test_e2e_two_nodes_on_one_host): what each rank sampled, and the seed it
    sampled with."""
    with open(os.path.join(os.environ["DUMP_DIR"], f"rank{os.environ['RANK']}.json"), "w") as f:
        json.dump({"local_rank": os.environ["LOCAL_RANK"], "seed": torch.initial_seed(),
                   "texts": completions}, f)
    return [0.0] * len(completions)


TWO_NODES = ["--num_generations", "4", "--per_device_train_batch_size", "4",
             "--gradient_accumulation_steps", "1", "--max_prompt_length", "96",
             "--max_completion_length", "8", "--num_eval", "4", "--max_steps", "1",
             "--eval_steps", "0", "--save_steps", "-1"]


def launch_two_nodes(tmp_path, node_flags, timeout=600):
    """Two torchrun "nodes" of one process each, started together as on a cluster: RANK 0 and 1,
    LOCAL_RANK 0 on both. node_flags: each node's flags. Returns the exit codes and the outputs."""
    logs = [str(tmp_path / f"node{n}.log") for n in range(2)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "DUMP_DIR": str(tmp_path)}

    def launch(port):  # both nodes, as a cluster starts them; their exit codes
        nodes = []
        for n in range(2):
            torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2",
                        f"--node_rank={n}", "--nproc_per_node=1", "--master_addr=127.0.0.1",
                        f"--master_port={port}"]
            nodes.append(subprocess.Popen(
                [*torchrun, os.path.join(HERE, "grpo_colocate.py"), *node_flags[n]],
                cwd=HERE, env=env, stdout=open(logs[n], "w"), stderr=subprocess.STDOUT,
                start_new_session=True))
        try:
            return [node.wait(timeout=timeout) for node in nodes]
        finally:
            for node in nodes:
                if node.poll() is None:
                    os.killpg(node.pid, signal.SIGKILL)
    # node 0 binds the port that both are given: if another process took it since free_port(),
    # start again on another one
    for attempt in range(3):
        codes = launch(free_port())
        if "EADDRINUSE" not in open(logs[0]).read():
            break
    return codes, [open(log).read() for log in logs]


def test_e2e_two_nodes_on_one_host(tiny_model, tmp_path):
    """Two nodes, one real step with the tiny random Llama: both finish, the parity check passes,
    and the two engines sampled with different seeds (a seed from LOCAL_RANK would repeat across
    nodes)."""
    out = str(tmp_path / "out")
    flags = ["--model", tiny_model(engine=True), *TWO_NODES,
             "--reward_funcs", "test_grpo_colocate:dump_reward", "--output_dir", out]
    codes, logs = launch_two_nodes(tmp_path, [flags, flags])
    assert codes == [0, 0], [log[-4000:] for log in logs]
    assert "world 2 = 2 engine(s) x tp 1" in logs[0]
    assert read_metrics(out)[-1]["sampled_gap"] < 1e-4
    ranks = [json.load(open(tmp_path / f"rank{r}.json")) for r in range(2)]
    assert [r["local_rank"] for r in ranks] == ["0", "0"]
    assert ranks[0]["seed"] != ranks[1]["seed"] and ranks[0]["texts"] != ranks[1]["texts"]


@pytest.mark.parametrize("flag", ["output_dir", "dataset"])
def test_e2e_two_nodes_refuse_a_path_local_to_a_node(tmp_path, flag):
    """A path on each node's own disk: --output_dir (two directories: every rank writes its own
    checkpoint shards, and rank 0's checkpoint would miss node 1's), or a --dataset file that node
    1 lacks. Both nodes stop before any engine starts, with the error naming the flag; none waits
    for the other in a collective."""
    data = tmp_path / "node0" / "data.jsonl"  # only on node 0's disk
    data.parent.mkdir()
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    nodes = []
    for n in range(2):
        dataset = tmp_path / f"node{n}" / "data.jsonl" if flag == "dataset" else data
        output_dir = tmp_path / f"node{n}" / "out" if flag == "output_dir" else tmp_path / "out"
        nodes.append(["--model", MODEL, *TWO_NODES, "--dataset", str(dataset),
                      "--output_dir", str(output_dir)])
    # (a hang: rank 0 would wait in init_process_group for 30 minutes)
    codes, logs = launch_two_nodes(tmp_path, nodes, timeout=300)
    assert 0 not in codes, [log[-4000:] for log in logs]
    assert f"error: --{flag}: " in logs[0] and "(rank 1)" in logs[0], logs[0][-4000:]
    assert "engine ready" not in logs[0] + logs[1]
    assert not list(tmp_path.rglob(".shared-*"))  # rank 0's marker file is gone


@pytest.mark.gpu
@NEEDS_CUDA
@pytest.mark.parametrize("flags,steps", [
    # sleep level 2 (the engine's weights discarded while the trainer works: every wake pushes them
    # again), the IS correction off so that the probe checks every push; 1 process: fused AdamW
    (["--vllm_enable_sleep_mode", "true", "--vllm_sleep_level", "2",
      "--vllm_importance_sampling_correction", "false"], 3),
    # auto sleep (decided by memory_plan at start), level 1, FSDP2 (one rank: rank 0 reads, the
    # broadcast of its weights into the shards), the canary
    (["--vllm_enable_sleep_mode", "auto", "--vllm_sleep_level", "1", "--fsdp"], 2),
])
def test_gpu_one_rank_sleep_push_and_checks(tmp_path, flags, steps):
    """CUDA, 1 rank, the real SmolLM2 in bf16: the varlen kernel, the compiled logprob chunk, sleep
    and wake around every step, the load_weights push. Every push or step is checked against the
    engine (the run stops if not), and the gaps are logged within bf16's tolerance."""
    out = str(tmp_path / "out")
    proc = run_trainer(["--model", MODEL, *SMALL, *LEARNS, "--max_steps", str(steps),
                        "--eval_steps", "0", "--save_steps", "-1", *flags, "--output_dir", out],
                       nproc=1, timeout=300)
    for shown in ("device cuda", "(varlen)", "push via load_weights"):
        assert shown in proc.stdout, shown
    records = [r for r in read_metrics(out) if "reward" in r]
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    tolerance = gc.PARITY_TOLERANCE[torch.bfloat16]
    for r in records:
        assert math.isfinite(r["grad_norm"])
        if "--vllm_importance_sampling_correction" in flags:  # the probe, after every push
            assert r["probe_gap"] < tolerance and "sampled_gap" not in r
        else:  # the sampled tokens, every step
            assert r["sampled_gap"] < tolerance and ("probe_gap" in r) == (r["step"] == steps)  # the last push: probed
    if "--fsdp" in flags:
        assert "trainer FSDP2" in proc.stdout
        assert "(auto: " in proc.stdout
    else:
        assert "sleep level 2" in proc.stdout


NEEDS_2_CUDA = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")


@pytest.mark.gpu
@NEEDS_2_CUDA
@pytest.mark.parametrize("trainer", [[], ["--fsdp"]])
def test_gpu_full_determinism_repeats_two_rank_runs(tmp_path, trainer):
    """Issue 35 item 1: two identical 2-GPU runs with --full_determinism log the same losses and
    gradient norms at every step (without it, the gradients of step 1 already differ in the last
    bits: FlashAttention's backward adds with atomics), and a resume from step 2 repeats step 3."""
    logs = []
    for name in ("a", "b", "resumed"):
        out = str(tmp_path / name)
        resume = ["--resume_from_checkpoint", str(tmp_path / "a" / "checkpoint-2")] * (name == "resumed")
        run_trainer(["--model", MODEL, *SMALL, *LEARNS, "--max_steps", "3", "--eval_steps", "0",
                     "--save_steps", "2", "--full_determinism", *trainer, *resume, "--output_dir", out],
                    nproc=2, timeout=400)
        logs.append([(r["loss"], r["grad_norm"], r["reward"]) for r in read_metrics(out)])
    assert logs[0] == logs[1] and len(logs[0]) == 3
    assert logs[2] == logs[0][2:]  # the resumed run logs step 3 alone


def test_full_determinism_switches_to_deterministic_uncompiled_kernels(tiny_model):
    """--full_determinism: torch's deterministic algorithms from build_trainer on (after the
    engine), and no compiled kernel on CUDA; off again for the next run in this process."""
    cuda = torch.device("cuda")
    for on in (True, False):
        cfg = gc.Config(model=tiny_model(), full_determinism=on)
        gc.build_trainer(cfg, cpu_env(), SimpleNamespace(checkpointing=False), None)
        assert torch.are_deterministic_algorithms_enabled() == on
        assert gc.compiled(cuda) != on and not gc.compiled(torch.device("cpu"))
    with mock.patch.dict(os.environ):  # setup_env writes a lone process's RANK, ... too
        os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
        gc.setup_env(gc.Config(full_determinism=True))
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"


def test_e2e_plain_python_at_the_default_batch_on_the_cpu(tiny_model, tmp_path):
    """README's first launch line, `python grpo_colocate.py`, at the default batch (16 prompts x
    G 8): 128 seeded requests hold about 5,800 prompt tokens, more than the CPU engine's 4,096 per
    step. With chunked prefill on, vLLM-CPU died in the first rollout ("CPU Generator does not use
    offset"). The tiny random Llama and 8-token completions keep the training step cheap."""
    out = str(tmp_path / "out")
    flags = ["--model", tiny_model(engine=True), "--max_prompt_length", "128", "--max_completion_length", "8",
             "--max_steps", "1", "--eval_steps", "0", "--save_steps", "-1", "--num_eval", "2",
             "--output_dir", out]
    proc = subprocess.run([sys.executable, os.path.join(HERE, "grpo_colocate.py"), *flags],
                          cwd=HERE, env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "16 prompts (of 16 generated) x G 8 = 128 completions" in proc.stdout
    assert read_metrics(out)[-1]["step"] == 1


# ------------------------------------------------------------------------------------------------------------
# what a newcomer sees through run.sh: a quiet run, and a bad flag or bad data as the last line (issue 16)
# ------------------------------------------------------------------------------------------------------------

def run_sh(*args, timeout=900):
    """stdout and stderr together, in the order a terminal shows them."""
    return subprocess.run(["bash", os.path.join(HERE, "run.sh"), *args], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=timeout, env={**os.environ, "HF_HUB_OFFLINE": "1"})


@pytest.mark.skipif(torch.cuda.is_available(), reason="run.sh's CPU command")
def test_tqdm_disable_hides_a_bar_as_vllms_graph_capture_makes_it():
    """vLLM's CUDA-graph capture bars (its model runner's tqdm(descs, desc=...)) under the
    TQDM_DISABLE that check_inputs sets: nothing on stderr."""
    code = ("from tqdm import tqdm\nfor _ in tqdm(range(3), desc='Capturing CUDA graphs'): pass\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "TQDM_DISABLE": "1"})
    assert proc.returncode == 0 and proc.stderr == ""


def test_run_sh_default_cpu_run_is_quiet(tmp_path):
    proc = run_sh("--max_steps", "1", "--eval_steps", "0", "--num_eval", "2", "--per_device_train_batch_size", "4",
                  "--gradient_accumulation_steps", "1", "--max_completion_length", "16",
                  "--output_dir", str(tmp_path / "out"))
    out = proc.stdout
    assert proc.returncode == 0, out[-6000:]
    lines = [line for line in out.splitlines() if line.strip()]
    print(f"{len(lines)} lines:\n" + "\n".join(lines))
    assert not [line for line in lines if line.startswith("INFO ")]  # vLLM's INFO chatter
    for expected_noise in ("Failed to load weights", "global random seed", "Loading weights", "Writing model shards"):
        assert expected_noise not in out, expected_noise
    assert "engine ready" in out and "step 1/1 (0:00:" in out and "left) | reward" in out and lines[-2] == "done"
    assert lines[-1] == f"curves: {tmp_path / 'out' / 'curves.png'}"  # run.sh draws them after the run


def test_quiet_engine_logs_hide_only_the_expected_noise():
    """What a GPU run printed (vLLM 0.26): the logprob kernel's JIT warning, transformers'
    clean_up_tokenization_spaces note (the CUDA-graph capture bars go with TQDM_DISABLE, below).
    A warning that matters still shows."""
    import logging

    import vllm.logger  # noqa: F401  (vLLM's log handler)
    from transformers.utils import logging as hf_logging

    hf_logging.get_logger("transformers")  # (transformers' log handler)
    handlers = logging.getLogger("vllm").handlers + logging.getLogger("transformers").handlers
    saved = [list(h.filters) for h in handlers]
    try:
        gc.quiet_engine_logs()
        noise = [("vllm.utils.jit_monitor", "Triton kernel JIT compilation during inference: "
                  "_topk_log_softmax_kernel. This causes a latency spike"),
                 ("transformers.tokenization_utils_tokenizers",
                  "Ignoring clean_up_tokenization_spaces=True for BPE tokenizer"),
                 ("vllm.model_executor", "Failed to load weights for RotaryEmbedding")]
        for name, message in noise + [("vllm.worker", "KV cache is too small")]:
            record = logging.LogRecord(name, logging.WARNING, __file__, 0, message, None, None)
            shown = [bool(h.filter(record)) for h in handlers]
            assert shown == [message == "KV cache is too small"] * len(handlers), message
    finally:
        for h, filters in zip(handlers, saved):
            h.filters[:] = filters


@pytest.mark.parametrize("argv,error", [
    (["--max_steps", "0"], "error: --max_steps: is 0"),  # a bad flag
    (["--dataset", "DATA", "--prompt_column", "question"], "error: --prompt_column: "),  # bad data
])
def test_a_bad_input_through_run_sh_is_the_last_line(tmp_path, argv, error):
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS * 5))
    proc = run_sh(*[str(tmp_path / "data.jsonl") if a == "DATA" else a for a in argv],
                  "--output_dir", str(tmp_path / "out"), timeout=300)
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert proc.returncode != 0 and lines[-1].startswith(error), lines[-25:]
    assert "Generating train split" not in proc.stdout  # datasets' progress bar


# ------------------------------------------------------------------------------------------------------------
# world size 8 on the CPU: `torchrun --nproc_per_node 8` with tp 1, 2 and 4, and its checkpoint resumed on 2 ranks.
# Marked slow (about 2.5 minutes per 8-rank run on 2 cores, 12 GB of RAM in all): `bash run.sh test --slow`.
# ------------------------------------------------------------------------------------------------------------

WORLD8_PROBE = r"""
# Watches an unmodified run from outside the trainer, one file per RANK: vLLM's public LLM.generate is wrapped to
# record every training rollout the rank's engine returned (before the TP slice), and the reward function records
# the rank's rows, completions and rewards. The trainer imports this module (--reward_funcs) before its engine.
import json, os, zlib
import vllm

DUMP, RANK = os.environ["WORLD8_DUMP"], os.environ["RANK"]
_generate = vllm.LLM.generate


def _recording_generate(self, prompts, sampling_params=None, **kwargs):
    outputs = _generate(self, prompts, sampling_params, **kwargs)
    first = sampling_params[0] if isinstance(sampling_params, list) and sampling_params else sampling_params
    if getattr(first, "n", 1) > 1:  # a training rollout (the eval is greedy: n = 1)
        with open(os.path.join(DUMP, f"generate-{RANK}.jsonl"), "a") as f:
            f.write(json.dumps([[list(c.token_ids) for c in out.outputs] for out in outputs]) + "\n")
    return outputs


vllm.LLM.generate = _recording_generate


def reward(prompts, completions, row, **columns):  # varies with the text and the row, in quarters
    values = [(zlib.crc32(c.encode()) + 3 * r) % 5 / 4 for c, r in zip(completions, row)]
    with open(os.path.join(DUMP, f"reward-{RANK}.jsonl"), "a") as f:
        f.write(json.dumps({"row": row, "completions": completions, "rewards": values}) + "\n")
    return values
"""


@pytest.fixture(scope="module")
def world8(tmp_path_factory, tiny_model, smol_tokenizer):
    """A tiny random Llama (4 heads / 2 KV heads: tp 1, 2 and 4 all split it), 24 rows with a row index, the probe
    module; run(tp) launches (once) the 8-rank run with that tp."""
    root = tmp_path_factory.mktemp("world8")
    model = tiny_model(engine=True)
    with open(root / "data.jsonl", "w") as f:
        for i in range(24):
            f.write(json.dumps({"question": f"What is {i} + 1?", "solution": f"#### {i + 1}", "row": i}) + "\n")
    (root / "world8_probe.py").write_text(WORLD8_PROBE)
    w = SimpleNamespace(root=root, tokenizer=smol_tokenizer, runs={})

    def launch(name, nproc, flags):
        out = root / name
        (out / "dump").mkdir(parents=True)
        # 1 prompt x G 2 per rank, 8-token completions; 3 eval rows for 8 ranks: ranks 3-7 score none
        proc = run_trainer(["--model", model, "--dataset", str(root / "data.jsonl"),
                            "--prompt_column", "question", "--answer_column", "solution", "--eval_split", "train",
                            "--num_eval", "3", "--reward_funcs", "world8_probe:reward", "--num_generations", "2",
                            "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "1",
                            "--max_prompt_length", "64", "--max_completion_length", "8", "--ignore_eos",
                            "--learning_rate", "1e-4", "--lr_scheduler_type", "constant", *flags,
                            "--output_dir", str(out)], nproc=nproc,
                           PYTHONPATH=f"{root}:{os.environ.get('PYTHONPATH', '')}", WORLD8_DUMP=str(out / "dump"))

        def dumps(kind):
            return {r: [json.loads(line) for line in open(out / "dump" / f"{kind}-{r}.jsonl")] if
                    (out / "dump" / f"{kind}-{r}.jsonl").exists() else [] for r in range(nproc)}
        return SimpleNamespace(out=str(out), proc=proc, metrics=read_metrics(out), rewards=dumps("reward"),
                               rollouts=dumps("generate"))

    def run(tp, flags=()):
        if tp not in w.runs:
            w.runs[tp] = launch(f"tp{tp}", 8, ["--vllm_tensor_parallel_size", str(tp), "--max_steps", "1",
                                               "--eval_steps", "1", *flags])
        return w.runs[tp]
    w.launch, w.run = launch, run
    return w


SLOW = pytest.mark.skipif(os.environ.get("GRPO_SLOW_TESTS") != "1", reason="slow: `bash run.sh test --slow`")
WORLD8_FLAGS = {1: [], 2: ["--fsdp", "--scale_rewards", "batch"], 4: ["--loss_type", "grpo"]}


@SLOW
@pytest.mark.parametrize("tp", [1, 2, 4])  # 8, 4 and 2 engines; DDP, FSDP2 (+ the batch std), DDP
def test_world8_cpu(world8, tp):
    run = world8.run(tp, WORLD8_FLAGS[tp])
    assert f"world 8 = {8 // tp} engine(s) x tp {tp}" in run.proc.stdout
    # every rank trained on one prompt (G = 2 completions), and the 8 shards are disjoint rows
    train = {r: [c for c in run.rewards[r] if len(c["row"]) == 2] for r in range(8)}
    assert all(len(train[r]) == 1 and len(set(train[r][0]["row"])) == 1 for r in range(8)), train
    assert len({train[r][0]["row"][0] for r in range(8)}) == 8
    # each TP group's ranks got the same engine outputs (the trainer's fingerprint check passed), holding one
    # request per rank; each rank scored its own slice of them
    for r in range(8):
        assert len(run.rollouts[r]) == 1 and run.rollouts[r] == run.rollouts[r - r % tp]
        group = run.rollouts[r][0]
        assert len(group) == tp
        texts = world8.tokenizer.batch_decode(group[r % tp], skip_special_tokens=True)
        assert texts == train[r][0]["completions"]
    # different engines (seeds) sampled differently, and so did the G samples of a request. The random model is
    # near-uniform, so its samples follow the sampler's noise: two engines with one seed give the same tokens
    # even for different prompts (checked: 16 of 16 tokens equal)
    sampled = [tuple(c) for r in range(0, 8, tp) for request in run.rollouts[r][0] for c in request]
    assert len(sampled) == 16 and len(set(sampled)) == 16
    # the logged global metrics are what one process computes from all 8 ranks' rows
    m = [x for x in run.metrics if x["step"] == 1][0]
    rewards = torch.tensor([v for r in range(8) for v in train[r][0]["rewards"]], dtype=torch.float64)
    grouped = rewards.view(8, 2)  # [prompts, G]
    scale = rewards.std() if "batch" in WORLD8_FLAGS[tp] else grouped.std(1, keepdim=True)
    advantages = (grouped - grouped.mean(1, keepdim=True)) / (scale + 1e-4)
    # float64 sums of exact quarters (atol: a mean that is 0); the advantages are computed in fp32
    for key in ("reward", "rewards/reward"):
        assert close(m[key], rewards.mean(), 1e-6, 1e-9), key
    assert close(m["reward_std"], rewards.std(), 1e-6, 1e-9)
    assert close(m["advantage_std"], advantages.pow(2).mean().sqrt(), 1e-5, 1e-9)
    assert close(m["frac_reward_zero_std"], (grouped.std(1) == 0).double().mean(), 1e-6, 1e-9)
    assert m["completion_length/min"] == m["completion_length/max"] == 8 and m["completion_clipped_ratio"] == 1
    assert close(m["completion_tokens_per_sec_per_gpu"] * 8 * m["time/step"], 16 * 8)  # completion tokens of all ranks
    assert m["sampled_gap"] < 1e-4 and m["sampled_gap"] < 1e-3
    # the eval: 3 rows over 8 ranks, each scored once, the mean over the 3 (at step 0 and after step 1)
    evals = {r: [c for c in run.rewards[r] if len(c["row"]) == 1] for r in range(8)}
    records = [x for x in run.metrics if "eval/reward" in x]
    assert [x["step"] for x in records] == [0, 1]
    for i, record in enumerate(records):
        scored = [(c[i]["row"][0], c[i]["rewards"][0]) for c in evals.values() if c]
        assert sorted(row for row, _ in scored) == [0, 1, 2]
        assert close(record["eval/reward"], sum(v for _, v in scored) / 3, 1e-6, 1e-9)


@SLOW
def test_world8_checkpoint_resumes_on_2_ranks(world8):
    """The tp=2 run's checkpoint (FSDP2 over 8 ranks: 8 AdamW shards through torch.distributed.checkpoint, weights
    gathered to rank 0) continues for one step on 2 ranks under DDP."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    ckpt = os.path.join(world8.run(2, WORLD8_FLAGS[2]).out, "checkpoint-1")
    assert len([f for f in os.listdir(os.path.join(ckpt, "optimizer")) if f.endswith(".distcp")]) == 8
    run = world8.launch("resume2", 2, ["--vllm_tensor_parallel_size", "1", "--max_steps", "2", "--eval_steps", "0",
                                       "--resume_from_checkpoint", ckpt])
    assert [x["step"] for x in run.metrics] == [2]
    assert run.metrics[0]["sampled_gap"] < 1e-4 and math.isfinite(run.metrics[0]["grad_norm"])
    for path, step in ((ckpt, 1), (os.path.join(run.out, "checkpoint-2"), 2)):
        dcp_to_torch_save(os.path.join(path, "optimizer"), os.path.join(run.out, "optimizer.pt"))
        state = torch.load(os.path.join(run.out, "optimizer.pt"), weights_only=False)["optimizer"]["state"]
        assert len(state) == len(list(tiny_llama().parameters())) and {s["step"].item() for s in state.values()} == {step}  # AdamW's moments carried on


def vllm_prompt_logprobs_process(model_dir, ids):
    """One process (vllm_prompt_logprobs): a fresh vLLM engine (fp32, CPU) loads model_dir and
    scores ids (JSON)."""
    from vllm import LLM, SamplingParams

    ids = json.loads(ids)
    llm = LLM(model=model_dir, dtype="float32", enforce_eager=True, kv_cache_memory_bytes=16 << 20,
              max_model_len=64, seed=0, load_format="safetensors")
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
    logprobs = [lp[t].logprob for lp, t in zip(out.prompt_logprobs[1:], ids[1:])]
    print("RESULT", json.dumps(logprobs), flush=True)


def vllm_prompt_logprobs(model_dir, ids, tmp_path):
    """log p(ids[t] | ids[:t]) for t >= 1, scored by a fresh vLLM engine (fp32, CPU) loading model_dir."""
    logprobs = run_processes("vllm_prompt_logprobs_process", model_dir, json.dumps(ids),
                             timeout=300, VLLM_CACHE_ROOT=str(tmp_path / "vllm-cache"),
                             VLLM_HOST_IP="127.0.0.1")
    return torch.tensor(logprobs)


def test_e2e_lora_fsdp2_then_resume_under_ddp(tiny_model, smol_tokenizer, tmp_path):
    """LoRA with the real engine on 2 ranks: FSDP2, beta > 0 (the reference is the base with the adapters off), a
    parity check after every push of merged weights, adapter checkpoints; TensorBoard (rank 0 alone) and the
    curves; DAPO dynamic sampling; the final merged weights load in transformers and in a fresh vLLM engine (the
    same logprobs). Then resume from checkpoint-1 under DDP: the same step 2."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model_dir = tiny_model(engine=True)
    flags = ["--model", model_dir, "--use_peft", "--lora_r", "8", "--lora_alpha", "16", "--lora_dropout", "0",
             "--lora_target_modules", "all-linear", "--beta", "0.1", "--num_generations", "4",
             "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "1", "--max_prompt_length", "96",
             "--max_completion_length", "12", "--reward_funcs", "reward_len", "--learning_rate", "1e-2",
             "--num_eval", "4", "--eval_steps", "0", "--max_steps", "2", *DYNAMIC]
    out, resumed = str(tmp_path / "out"), str(tmp_path / "resumed")
    proc = run_trainer([*flags, "--fsdp", "--save_steps", "1", "--report_to", "tensorboard", "--output_dir", out])
    assert "trainer FSDP2 + LoRA r 8" in proc.stdout and "1 prompts (of 2 generated)" in proc.stdout
    for r in read_metrics(out):  # dynamic sampling: twice the prompts generated; the share of groups that vary
        if "reward" in r:
            assert r["dynamic_sampling/generated_per_trained_token"] > 1
            varied = r["dynamic_sampling/informative_fraction"] * 4  # of the 2 ranks x 2 groups generated
            trained_varied = (1 - r["frac_reward_zero_std"]) * 2  # of the 2 x 1 groups trained
            # each rank trains on one of its own varied groups before any zero-std filler
            assert min(varied, 1) - 1e-6 <= trained_varied <= min(varied, 2) + 1e-6, (varied, trained_varied)
    subprocess.run([sys.executable, os.path.join(HERE, "bench", "plot_curves.py"), "--output_dir", out], check=True)
    assert os.path.isfile(os.path.join(out, "curves.png"))
    steps = [r for r in read_metrics(out) if "reward" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(r["sampled_gap"] < 1e-4 for r in steps)  # the engine runs W + (alpha / r) B A, after every push
    assert steps[0]["kl"] < 1e-6 < steps[1]["kl"]  # B starts at 0: step 1's policy is the reference (the base)
    events = tensorboard_scalars(out)  # one run, written by rank 0 alone
    assert [step for step, _ in events["sampled_gap"]] == [1, 2] and events["reward"][1][1] == approx(steps[1]["reward"])
    ckpt1, ckpt2 = os.path.join(out, "checkpoint-1"), os.path.join(out, "checkpoint-2")
    assert os.path.isfile(os.path.join(ckpt1, "adapter", "adapter_config.json"))
    assert not os.path.exists(os.path.join(ckpt1, "model.safetensors"))  # merged weights: the final one only
    merged = AutoModelForCausalLM.from_pretrained(ckpt2, dtype=torch.float32).state_dict()
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    name = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(merged[name], base.state_dict()[name])  # what the engine got moved...
    want = PeftModel.from_pretrained(base, os.path.join(ckpt2, "adapter")).merge_and_unload().state_dict()
    assert all(torch.allclose(merged[n], want[n], atol=1e-6) for n in want)  # ...from the untouched base
    text = "Checkpoints: the adapter, and merged weights that vLLM loads as a plain model."
    ids = smol_tokenizer(text)["input_ids"]

    def hf_logprobs(model):  # log p(ids[t] | ids[:t]) for t >= 1, [T - 1]
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, :-1]
        return logits.log_softmax(-1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]

    from_vllm = vllm_prompt_logprobs(ckpt2, ids, tmp_path)  # the merged checkpoint, in a fresh engine
    vllm_gap, base_gap = ((from_vllm - hf_logprobs(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)))
                          .abs().mean() for path in (ckpt2, model_dir))
    assert vllm_gap < 1e-4, vllm_gap  # vLLM runs the merged checkpoint as transformers does (fp32: ~4e-7)...
    assert base_gap > 1e-2, base_gap  # ...and that is not the base model (~9e-2): the adapter moved it
    run_trainer([*flags, "--save_steps", "-1", "--output_dir", resumed, "--resume_from_checkpoint", ckpt1])
    want, got = steps[1], [r for r in read_metrics(resumed) if r["step"] == 2][0]
    assert got["reward"] == want["reward"] and got["completion_length/mean"] == want["completion_length/mean"]
    # FSDP2 then DDP: sums in another order; the canary gap is fp32 noise (~1e-7): absolutely
    tolerances = {
        "loss": (1e-4, 1e-6),
        "kl": (1e-4, 1e-9),
        "grad_norm": (1e-4, 0),
        "sampled_gap": (0, 2e-6),
        "entropy": (1e-5, 0),
    }
    for key, (rtol, atol) in tolerances.items():
        assert close(got[key], want[key], rtol, atol), (key, got[key], want[key])


# ------------------------------------------------------------------------------------------------------------
# faults: a crash on one rank, steps that keep going non-finite, a stale engine
# ------------------------------------------------------------------------------------------------------------

def boom_on_rank_1(prompts, completions, **columns):
    """A reward function (test_a_crash_on_one_rank_ends_every_rank) that raises on rank 1 at its
    third call: after the eval at step 0 and the rollout of step 1, in the final eval. BOOM names
    the kind: ValueError (a crash) or ConfigError (a bad input found late)."""
    boom_on_rank_1.calls = getattr(boom_on_rank_1, "calls", 0) + 1
    if os.environ["RANK"] == "1" and boom_on_rank_1.calls == 3:
        trainer = sys.modules["__main__"]  # (torchrun runs grpo_colocate.py as __main__)
        raise {"ValueError": ValueError, "ConfigError": trainer.ConfigError}[os.environ["BOOM"]]("boom on rank 1")
    return [0.0] * len(completions)


@pytest.mark.parametrize("kind", ["ValueError", "ConfigError"])
def test_a_crash_on_one_rank_ends_every_rank(tiny_model, tmp_path, kind):
    """A reward function that raises on rank 1 in the final eval: every rank ends (a rank left
    waiting in a collective would hold the run until the timeout), and the final checkpoint, written
    before the eval, is there. A ConfigError there is said, by rank 1 (issue 35 item e)."""
    out = str(tmp_path / "out")
    proc = run_trainer(["--model", tiny_model(engine=True), *SMALL,
                        "--reward_funcs", "accuracy_reward", "test_grpo_colocate:boom_on_rank_1",
                        "--max_steps", "1", "--eval_steps", "1", "--output_dir", out],
                       check=False, timeout=300, BOOM=kind)
    assert proc.returncode != 0
    if kind == "ValueError":
        assert proc.stderr.count("ValueError: boom on rank 1") == 1  # the first error, printed once
    else:
        assert "error: boom on rank 1 (rank 1)" in proc.stderr, proc.stderr[-3000:]
    assert subprocess.run(["pgrep", "-f", out], capture_output=True).returncode == 1
    assert gc.latest_checkpoint(out) == os.path.join(out, "checkpoint-1")


def test_e2e_two_nodes_stop_together_on_any_error_before_the_process_group(tiny_model, tmp_path):
    """Issue 35 item e: node 1's tokenizer cannot be read (not a config error: the tokenizer's own
    exception, before any process group). It is routed as a bad input is: node 1 says what failed,
    node 0 names rank 1, and neither waits in init_process_group for the other."""
    model = tiny_model(engine=True)
    broken = tmp_path / "broken"
    shutil.copytree(model, broken)
    (broken / "tokenizer.json").write_text("{ not json")
    nodes = [["--model", path, *TWO_NODES, "--reward_funcs", "reward_len", "--output_dir", str(tmp_path / "out")]
             for path in (model, str(broken))]
    codes, logs = launch_two_nodes(tmp_path, nodes, timeout=300)
    assert 0 not in codes, [log[-4000:] for log in logs]
    assert "[rank 1] failed:" in logs[1] and "error: " in logs[0] and "(rank 1)" in logs[0], logs[0][-4000:]
    assert "engine ready" not in logs[0] + logs[1]


def test_non_finite_steps_in_a_row_stop_the_run(tiny_model, tmp_path):
    # a learning rate of 1e30 turns every weight into +-1e30 after the first update; num_iterations 4 keeps the
    # engine out of it (no push before step 4), so steps 2, 3 and 4 compute non-finite losses on the same batch
    flags = ["--model", tiny_model(engine=True), "--num_generations", "4",
             "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "1",
             "--max_prompt_length", "96", "--max_completion_length", "8", "--num_eval", "4",
             "--max_steps", "4", "--num_iterations", "4", "--eval_steps", "0", "--save_steps", "-1",
             "--reward_funcs", "reward_len", "--learning_rate", "1e30", "--max_grad_norm", "0",
             "--output_dir", str(tmp_path / "out")]
    proc = run_trainer(flags, nproc=1, check=False)
    assert proc.returncode == 1
    assert "step 4: 3 non-finite steps in a row" in proc.stderr
    assert "step 2: non-finite loss or gradient" in proc.stdout


LONG_PREFILL = """
import json, sys, torch
sys.path.insert(0, {here!r})
import grpo_colocate as gc
cfg = gc.parse_args(["--model", {model!r}, "--output_dir", {out!r}, "--num_generations", "2",
                     "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "1",
                     "--max_prompt_length", "3000", "--max_completion_length", "4",
                     "--num_eval", "1"])
env = gc.setup_env(cfg)
gc.setup_distributed(cfg, env)
llm = gc.make_engine(cfg, env, gc.load_model_config(cfg), False)
# 3,000 + 1,500 tokens (x G 2): more than vLLM prefills in one step (4,096), which would split one
prompts = [torch.randint(10, 1000, (n,), generator=torch.Generator().manual_seed(n)).tolist()
           for n in (3000, 1500)]
outputs = gc.generate(llm, env, prompts, gc.sampling_params(cfg), seeds=[1, 2])
print("RESULT", json.dumps(sum(len(out.outputs) for out in outputs)))
del llm
torch.distributed.destroy_process_group()
"""


def test_cpu_engine_samples_seeded_prompts_longer_than_a_step(tmp_path):
    """Seeded requests whose prompts do not fit one engine step (tool turns make long prompts): the
    CPU engine prefills each whole (vllm-cpu 0.27.1 fails a seeded request with a split prefill)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(MODEL)
    lm = tiny_llama(vocab=len(tok), hidden=256)  # head_dim 64
    lm.config.max_position_embeddings = 4096
    lm.save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    script = tmp_path / "long_prefill.py"
    script.write_text(LONG_PREFILL.format(here=HERE, model=str(tmp_path / "model"),
                                          out=str(tmp_path / "out")))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.split("RESULT ", 1)[1].splitlines()[0]) == 4  # 2 prompts x G 2


def stale_engine_process(model, out):
    """One process (test_parity_check_catches_a_stale_engine): the real engine and SmolLM2; rollouts
    by seed, then the probe and the canary against an engine left stale by an optimizer step without
    a push, and after the push."""
    cfg = gc.parse_args(["--model", model, "--output_dir", out, "--num_generations", "4",
                         "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "1",
                         "--max_prompt_length", "96", "--max_completion_length", "16",
                         "--num_eval", "4"])
    env = gc.setup_env(cfg)
    gc.setup_distributed(cfg, env)
    tokenizer, rows, eval_rows = gc.prepare_data(cfg)
    probe = eval_rows[0]["prompt_ids"] + tokenizer("#### 1", add_special_tokens=False)["input_ids"]
    llm = gc.make_engine(cfg, env, gc.load_model_config(cfg), False)
    engine = gc.ColocatedEngine(llm, cfg, env, False, probe)
    policy = gc.wrap_policy(gc.load_lm(cfg.model, env.device), env, cfg, False)
    engine.wake_and_push(policy, 0, {})  # the first push, checked on the probe
    result = {"fresh": engine.probe_info["probe_gap"]}
    funcs, weights = gc.load_reward_funcs(cfg)

    def sample(seeds, prompts, torch_seed=0):  # per-request seeds, as rollout passes them
        # the process's generator must not matter: the GPU sampler ignores it
        torch.manual_seed(torch_seed)
        prompt_ids = [rows[i]["prompt_ids"] for i in prompts]
        outputs = gc.generate(llm, env, prompt_ids, gc.sampling_params(cfg), seeds)
        return [[list(c.token_ids) for c in o.outputs] for o in outputs]
    both = sample([100, 200], [0, 1])
    result["same_seed_same_rollout"] = both == sample([100, 200], [0, 1], torch_seed=5)
    # alone, as in another batch (another world size)
    result["alone_as_in_a_batch"] = both[1] == sample([200], [1])[0]
    result["other_seed_other_rollout"] = both[0] != sample([1000], [0])[0]
    # the n=G samples of one request: seeds s, s+1, ...
    result["group_differs"] = len({tuple(c) for c in both[0]}) > 1

    def canary(step):  # a real rollout, then train_step: its canary runs before the optimizer step
        samples, counts = gc.rollout(llm, cfg, env, tokenizer, [rows[0]["prompt_ids"]], [step])
        rewards = gc.score(funcs, rows[:1], [s.token_ids for s in samples], 4, tokenizer, 16)
        batch = gc.make_batch(cfg, env, tokenizer, rows[:1], samples, rewards, weights, counts)
        before = [p.detach().clone() for p in policy.parameters()]
        try:
            gap = gc.train_step(policy, optimizer, scheduler, batch, cfg, env, 4096, {}, step)["sampled_gap/rank_max"]
        except RuntimeError as e:
            gap = str(e)
            optimizer.zero_grad(set_to_none=True)
        return gap, all(torch.equal(a, b) for a, b in zip(before, policy.parameters()))

    def probe_check(step):
        return gc.check_gap(gc.probe_gap(llm, policy, probe, env), env, step, "the probe")

    # one optimizer step on the trainer and NO push: the engine is stale
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-5)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    scored = torch.ones(1, len(probe) - 1)
    logps, _ = policy(*gc.pack([probe[:1]], [probe[1:]], scored), scored, 1.0)
    (-logps.mean()).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    try:
        probe_check(7)
        result["stale_caught"] = False
    except RuntimeError as e:
        result["stale_caught"] = "step 7" in str(e)
    # the canary of every step (IS correction on): it must stop step 8, unchanged
    result["stale_canary"] = canary(8)
    # 1 MB buckets: most buckets hold a tensor or two
    gc.push_weights(llm, gc.unwrap(policy).lm, env, 1)
    result["after_push"] = probe_check(7)
    # the tensors the CPU backend keeps unpacked, compared exactly
    lm = gc.unwrap(policy).lm
    pushed = llm.apply_model(lambda m: [m.model.embed_tokens.weight.clone(),
                                        m.model.norm.weight.clone(),
                                        m.model.layers[0].input_layernorm.weight.clone()])[0]
    trained = [lm.model.embed_tokens.weight, lm.model.norm.weight,
               lm.model.layers[0].input_layernorm.weight]
    result["weights_equal"] = all(torch.equal(a, b.detach()) for a, b in zip(pushed, trained))
    # after the push: the canary passes and the step updates the policy
    result["fresh_canary"] = canary(9)
    print("RESULT", json.dumps(result), flush=True)
    del engine, llm  # the engine first (it holds process groups of its own), then ours
    dist.destroy_process_group()


def test_parity_check_catches_a_stale_engine(tmp_path):
    result = run_processes("stale_engine_process", MODEL, tmp_path / "out")
    assert result["fresh"] < 1e-4 and result["after_push"] < 1e-4
    assert result["stale_caught"] and result["weights_equal"]
    assert result["same_seed_same_rollout"] and result["alone_as_in_a_batch"]
    assert result["other_seed_other_rollout"] and result["group_differs"]
    message, unchanged = result["stale_canary"]
    assert "step 8: vLLM and the trainer disagree on the tokens vLLM sampled" in message, message
    assert unchanged  # stopped before the optimizer step
    gap, unchanged = result["fresh_canary"]
    assert gap < 1e-4 and not unchanged


# ------------------------------------------------------------------------------------------------------------
# issues 35 and 36: the faults at scale, and TRL's rules where README says the trainer follows them
# ------------------------------------------------------------------------------------------------------------

def test_memory_plan_floors_at_the_longest_sequence(monkeypatch):
    """Issue 34 item 1: with 16,384-token completions at 1.5B on 80 GiB, one sequence of 16,640
    tokens needs 45.8 GB of activations without checkpointing, more than the 45.2 GB of room: the
    plan checkpoints (the floor is the longest sequence, not 4,096 tokens) instead of planning a
    16,896-token budget past memory."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (0, 80 * GiB))
    gpu = cpu_env(device=SimpleNamespace(type="cuda"), dtype=torch.bfloat16)
    room = 0.85 * 80 * GiB - 18 * N15  # 45,227,586,560 bytes
    plan = gc.memory_plan(gc.Config(max_completion_length=16384), gpu, QWEN15, N15)
    per_token = 4 * 1536 * 28 + 64 * 1536  # checkpointed: 270,336 bytes
    assert plan.checkpointing and plan.token_budget == int(room // per_token) == 167_301
    assert plan.token_budget * per_token <= room and 16640 * 64 * 1536 * 28 > room


def test_filler_groups_do_not_count_as_sequences(monkeypatch):
    """Issue 36 item 2: dynamic sampling tops a short step up with zero-std groups (loss mask 0);
    the sequence normalisers (grpo, sapo, dr_grpo) count the trained sequences only, so the varied
    groups' gradient does not shrink by varied / all."""
    batch = stand_in_rollout(monkeypatch, [1, 0, 2, 4], 2)  # only prompt 1's group varies: + 1 filler
    assert (~batch.filler).tolist() == [True, True, False, False]
    for loss_type in ("grpo", "sapo", "dr_grpo"):
        count, scale, _ = gc.loss_normaliser(loss_type, batch, [range(len(batch.completion_ids))], cpu_env())
        assert count == 2 and scale == 1.0, loss_type  # not 4
    count, _, _ = gc.loss_normaliser("dapo", batch, [range(len(batch.completion_ids))], cpu_env())
    assert count == batch.loss_mask.sum().item()  # tokens: the fillers have none


def test_a_step_of_filler_groups_alone_has_loss_zero(monkeypatch):
    """No group varies on any rank (an easy batch late in training, or a hard one early): every
    group is a filler, the global count 0 is taken as 1, and each loss type gives loss 0, not 0/0
    (a NaN that skipped the step, and three in a row stopped the run)."""
    batch = stand_in_rollout(monkeypatch, [0, 2, 4, 6], 2)  # even prompts: no group varies
    assert batch.filler.all()
    T = batch.loss_mask.shape[1]
    logps = torch.full((4, T), -1.0, requires_grad=True)
    for loss_type in gc.NORMALISERS:
        count, _, _ = gc.loss_normaliser(loss_type, batch, [range(len(batch.completion_ids))], cpu_env())
        cfg = gc.Config(loss_type=loss_type, num_generations=2)
        loss, _ = gc.grpo_loss(logps, logps.detach(), torch.zeros(4), batch.loss_mask, cfg,
                               entropy_mask=torch.ones(4, T), global_count=count)
        assert count in (None, 1) and loss.item() == 0.0, loss_type
        loss.backward()
        assert torch.isfinite(logps.grad).all(), loss_type


def test_weight_decay_skips_biases_and_norms(tiny_model):
    """Issue 36 item 3: AdamW decays the matrices only, as HF's Trainer (and so TRL) does."""
    cfg = gc.Config(model=tiny_model(), weight_decay=0.1)
    trainer = gc.build_trainer(cfg, cpu_env(), SimpleNamespace(checkpointing=False), None)
    decayed, exempt = trainer.optimizer.param_groups
    names = {id(p): n for n, p in trainer.policy.named_parameters()}
    assert decayed["weight_decay"] == 0.1 and exempt["weight_decay"] == 0.0
    assert all(p.ndim == 2 for p in decayed["params"]) and len(decayed["params"]) > 0
    kinds = {names[id(p)].split(".")[-2] for p in exempt["params"]}  # the module of each .weight
    assert kinds == {"input_layernorm", "post_attention_layernorm", "norm"}, kinds


@pytest.mark.parametrize("config,extra,feature", [
    ("PhiConfig", {}, "lm_head has a bias"),
    ("GraniteConfig", {"logits_scaling": 8.0}, "logits are scaled"),
    ("CohereConfig", {}, "logits are scaled"),
    ("GptOssConfig", {"num_local_experts": 2, "num_experts_per_tok": 1, "layer_types": ["full_attention"]},
     "attention sinks"),
])
def test_output_layer_features_are_refused(config, extra, feature):
    """Issue 36 item 4: what the trainer's logprobs leave out (an lm_head bias, scaled logits,
    attention sinks) is refused at start, naming the feature, not caught later by the probe."""
    import transformers

    config = getattr(transformers, config)(vocab_size=64, hidden_size=32, intermediate_size=64,
                                           num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                           max_position_embeddings=256, **extra)
    cfg = gc.Config(max_prompt_length=64, max_completion_length=64)
    with pytest.raises(gc.ConfigError, match=f"--model: .*{feature}"):
        gc.check_model(cfg, config)


def test_logged_means_as_trl(world_of_one):
    """Issue 36 item 6: a reward function's None stays out of its mean (nanmean), an unscorable
    completion out of the reward's; the entropy is a mean over the loss tokens; the logprob gap over
    the tokens vLLM gave a logprob."""
    nan = math.nan
    per_func = torch.tensor([[1.0, nan], [nan, nan], [0.0, 1.0], [1.0, nan]])  # 2 functions
    rewards = torch.tensor([1.0, nan, 1.0, 1.0])  # weights 1, 1: nansum; all-None: NaN
    stats = {"rewards": rewards, "rewards_per_func": per_func, "advantages": torch.zeros(4),
             "zero_std": torch.zeros(2), "lengths": torch.tensor([3.0, 3, 3, 3]), "truncated": torch.zeros(4),
             "generated_groups": 2, "varied_groups": 2, "generated_tokens": 12, "prompt_tokens": 8,
             "tool_calls": 0, "tool_failures": 0, "turns": 4}
    train_stats = {"loss": 0.0, "tokens": 6.0, "completion_tokens": 12.0, "entropy": 3.0,
                   "sampled_gap_sum": 0.5, "sampled_gap_tokens": 5.0, "clip_ratio/low": 0.0, "clip_ratio/high": 0.0,
                   "clip_ratio/region": 0.0, "grad_norm": 1.0, "skipped": 0.0}
    funcs = [SimpleNamespace(__name__="a"), SimpleNamespace(__name__="b")]
    ledger = {"fwd_bwd": 1.0, "optimizer": 1.0}
    m = gc.reduce_metrics(gc.Config(), cpu_env(), SimpleNamespace(stats=stats), train_stats, ledger, {}, 1,
                          {}, funcs)
    assert m["reward"] == 1.0 and m["reward_std"] == 0.0  # over the 3 scored completions
    assert m["rewards/a"] == 2 / 3 and m["rewards/b"] == 1.0  # each over what it scored
    assert m["entropy"] == 0.5 and m["sampled_gap"] == 0.1  # / loss tokens, / tokens with a vLLM logprob


def test_train_step_entropy_and_gap_over_their_tokens(world_of_one, monkeypatch):
    """Issue 36 item 6, train_step's side: the entropy sums over the loss tokens (a truncated
    completion masked out is not in it); the gap's tokens leave out a NaN vLLM logprob."""
    policy = gc.Policy(tiny_llama())
    prompts, completions = [[1, 2], [3]], [[4, 5], [6, 7, 8]]
    batch = train_batch(prompts, completions, [1.0, -1.0])
    batch.loss_mask[1] = 0  # a masked truncated completion
    with torch.no_grad():
        _, entropy = policy(*gc.pack(prompts, completions, batch.model_mask), batch.model_mask, 1.0)
    batch.vllm_logps = torch.zeros(batch.model_mask.shape)  # not the model's: the canary is not read here
    batch.vllm_logps[0, 1] = math.nan
    monkeypatch.setattr(gc, "check_gap", lambda gap, env, step, what: gap)
    cfg = gc.Config(num_generations=2, per_device_train_batch_size=2, gradient_accumulation_steps=1)
    stats = gc.train_step(policy, StepGradients(policy), NO_SCHEDULE, batch, cfg, cpu_env(), BUDGET, {}, 1)
    assert close(stats["entropy"], entropy[0, :2].sum(), 1e-5)  # the first completion's 2 tokens only
    assert stats["sampled_gap_tokens"] == 4 and stats["completion_tokens"] == 5


def test_resume_refuses_other_training_rows(tiny_model, tmp_path, monkeypatch, capsys):
    """Issue 35 item a: a checkpoint records what identifies its training rows (their number and a
    digest of their prompt ids). Resumed with other rows (the dataset's content changed; --tools,
    which change which prompts fit) it is refused before any engine starts, naming the flag."""
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS * 3))
    out = tmp_path / "out"
    flags = ["--model", tiny_model(), "--dataset", str(data), "--max_prompt_length", "64",
             "--max_completion_length", "8", "--num_eval", "2", "--output_dir", str(out)]
    cfg = gc.parse_args(flags)
    _, train_rows, _ = gc.prepare_data(cfg)
    ckpt = out / "checkpoint-3"
    ckpt.mkdir()
    genuine_checkpoint(ckpt)
    torch.save({"step": 3, "data_position": 12, "rows": gc.rows_digest(train_rows)}, ckpt / "trainer_state.pt")
    (ckpt / "grpo_config.json").write_text(json.dumps(dataclasses.asdict(cfg)))
    resume = [*flags, "--resume_from_checkpoint", str(ckpt)]
    _, _, inputs, error = gc.check_inputs(resume)  # the same rows: fine
    assert error is None and inputs.state["step"] == 3
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS[::-1] * 3))  # the same rows, in another order
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        gc.check_inputs(resume)
    assert exit_.value.code == 2
    said = capsys.readouterr().err
    assert "error: --dataset: the training rows (28 rows, " in said and "are not the checkpoint's (28 rows" in said
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS * 3))
    with pytest.raises(gc.ConfigError, match="--tools: is \\['calculator'\\], but the checkpoint's run had \\[\\]"):
        gc.parse_args([*resume, "--tools", "calculator"])


class SlowStr:
    def __str__(self):
        raise RuntimeError("cannot render")


def test_tools_are_bounded(tmp_path):
    """Issue 35 item c: a stuck tool fails after the timeout, naming the tool; a result that str()
    cannot render is a failed call, not a crash; a result is cut to MAX_RESULT_CHARS."""
    import time

    tools = {"stuck": lambda: time.sleep(30), "bad": lambda: SlowStr(), "long": lambda: "x" * 10_000}
    start = time.perf_counter()
    failed, message = rf.call_tool(tools, '{"name": "stuck", "arguments": {}}', time.monotonic() + 0.5)
    assert failed and "tool stuck ran past 0.5 s" in message["content"] and time.perf_counter() - start < 5
    failed, message = rf.call_tool(tools, '{"name": "bad", "arguments": {}}')
    assert failed and "cannot render" in message["content"]
    failed, message = rf.call_tool(tools, '{"name": "long", "arguments": {}}')
    assert not failed and message["content"] == "x" * rf.MAX_RESULT_CHARS


class TurnParams(msgspec.Struct):  # stands in for SamplingParams in tool_turns
    n: int = 1
    seed: int = 0
    max_tokens: int = 8


def test_tool_calls_per_turn_are_capped(smol_tokenizer, world_of_one):
    """Issue 35 item c: a turn that writes 12 calls runs the first MAX_CALLS_PER_TURN."""
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "1 + 1"}}</tool_call>'
    turn = smol_tokenizer(call * 12, add_special_tokens=False)["input_ids"] + [smol_tokenizer.eos_token_id]
    samples = [gc.add_turn(SimpleNamespace(token_ids=turn, finish_reason="stop", logprobs=None))]
    cfg = gc.Config(tools=["calculator"], max_tool_calling_iterations=1, max_completion_length=4096)
    engine = StandInEngine()
    counts = gc.tool_turns(engine, cfg, SimpleNamespace(tp=1, rank=0), smol_tokenizer, [[1, 2]], samples,
                           TurnParams())
    assert counts["tool_calls"] == rf.MAX_CALLS_PER_TURN == 8 and counts["tool_failures"] == 0


def test_tool_turns_give_every_call_the_rollouts_deadline(smol_tokenizer, world_of_one, monkeypatch):
    """tool_turns gives every call of a rollout one deadline, a quarter of --ddp_timeout from its
    start (call_tool then fails every call past it at once)."""
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "1 + 1"}}</tool_call>'
    turn = smol_tokenizer(call * 3, add_special_tokens=False)["input_ids"] + [smol_tokenizer.eos_token_id]
    samples = [gc.add_turn(SimpleNamespace(token_ids=turn, finish_reason="stop", logprobs=None))]
    deadlines = []
    real = rf.call_tool
    monkeypatch.setattr(rf, "call_tool", lambda tools, c, deadline=math.inf: deadlines.append(deadline) or real(tools, c))
    cfg = gc.Config(tools=["calculator"], max_tool_calling_iterations=1, max_completion_length=4096, ddp_timeout=400)
    start = time.monotonic()
    gc.tool_turns(StandInEngine(), cfg, SimpleNamespace(tp=1, rank=0), smol_tokenizer, [[1, 2]], samples, TurnParams())
    assert len(deadlines) == 3 and len(set(deadlines)) == 1 and start < deadlines[0] <= time.monotonic() + 100


def test_a_template_that_cannot_render_a_tool_result_is_refused_at_start(tmp_path):
    """Issue 35 item c: Mistral's tool_call_id check, Gemma's role alternation: refused when the data
    loads, naming --tools, not at the first call."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(MODEL)
    tok.chat_template = ("{% for m in messages %}{% if m.role == 'tool' %}"
                         "{{ raise_exception('tool messages need a tool_call_id') }}{% endif %}"
                         "{{ m.role }}: {{ m.content }}\n{% endfor %}")
    tok.save_pretrained(tmp_path)
    cfg = gc.parse_args(["--tools", "calculator", "--model", str(tmp_path), "--num_eval", "2",
                         "--output_dir", str(tmp_path / "out")])
    with pytest.raises(gc.ConfigError, match="--tools: the model's chat template cannot render a tool result"):
        gc.prepare_data(cfg)


def disagreeing_ranks(out):
    """Each of 2 torchrun ranks (test_ranks_that_decided_apart_stop_together): rank 1's memory plan
    chose no sleep, rank 0's sleep; both stop in agree_at_start. Prints what rank 0 said."""
    import contextlib

    cfg = gc.parse_args(["--output_dir", out])
    env = gc.setup_env(cfg)
    said = io.StringIO()
    with contextlib.redirect_stderr(said):
        try:
            gc.setup_distributed(cfg, env, None, {"sleep mode": env.rank == 0})
            code = 0
        except SystemExit as e:
            code = e.code
    if env.rank == 0:
        print("RESULT", json.dumps({"code": code, "said": said.getvalue()}), flush=True)


def test_ranks_that_decided_apart_stop_together(tmp_path):
    """Issue 35 item d: every rank's start-up decisions are gathered once and compared; ranks that
    decided apart (sleep mode on mixed GPUs) all stop, naming the flag."""
    r = run_processes("disagreeing_ranks", tmp_path / "out", nproc=2)
    assert r["code"] == 2
    assert "error: sleep mode: the ranks differ ([True, False])" in r["said"]


def test_tp_groups_do_not_span_nodes(monkeypatch):
    """Issue 35 item h: 4 ranks on 2 nodes of 2: tp 4 would put one engine across the nodes."""
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(gc.ConfigError, match="--vllm_tensor_parallel_size: is 4; a TP group may not span nodes"):
        gc.parse_args(["--vllm_tensor_parallel_size", "4"])
    gc.parse_args(["--vllm_tensor_parallel_size", "2"])


def test_lora_target_on_lm_head_is_refused(tmp_path):
    """Issue 35 item f: the logprobs read lm_head's base weight, so an adapter there never trains."""
    tiny_llama(tie=False).save_pretrained(tmp_path)
    cfg = gc.Config(model=str(tmp_path), use_peft=True, lora_target_modules=["q_proj", "lm_head"],
                    max_prompt_length=128, max_completion_length=128)
    with pytest.raises(gc.ConfigError, match="--lora_target_modules: lm_head: the push merges"):
        gc.check_model(cfg, gc.load_model_config(cfg))


class PrefixRecorder(RecordingEngine):
    """RecordingEngine that scores the probe (logprob 0 per token) and counts prefix-cache resets."""
    resets = 0

    def reset_prefix_cache(self):
        self.resets += 1

    def generate(self, requests, params, use_tqdm=False):
        if getattr(params[0], "prompt_logprobs", None) == 0:  # the parity probe (through gc.generate)
            ids = requests[0]["prompt_token_ids"]
            logprobs = [None] + [{t: SimpleNamespace(logprob=0.0)} for t in ids[1:]]
            return [SimpleNamespace(prompt_logprobs=logprobs)]
        return super().generate(requests, params, use_tqdm)


def test_prefix_cache_reset_after_the_probe_and_the_eval(smol_tokenizer, world_of_one):
    """Issue 35 item g: the probe's and the eval's KV blocks would serve the next rollout's prefix
    hits (a resume at an eval step would not be exact in bf16): both reset the prefix cache."""
    engine = PrefixRecorder()
    gc.probe_gap(engine, gc.Policy(tiny_llama(vocab=len(smol_tokenizer))), [1, 2, 3], cpu_env())
    assert engine.resets == 1
    rows = [{"prompt": "p", "answer": "1", "prompt_ids": [10, 11]}]
    cfg = gc.Config(reward_funcs=["reward_len"])
    gc.evaluate(engine, cfg, cpu_env(tp_group=None), smol_tokenizer, rows, [rf.reward_len], 1)
    assert engine.resets == 2


def test_eval_means_leave_unscored_completions_out(smol_tokenizer, world_of_one):
    """The eval's mean of a reward function is over the completions it scored (None: not scored),
    as the training rewards/ means are (TRL's nanmean): not a 0 for every None."""
    def scores_answer_1(prompts, completions, answer, **columns):
        return [1.0 if a == "1" else None for a in answer]
    rows = [{"prompt": "p", "answer": a, "prompt_ids": [10, 11]} for a in ("1", "?", "?")]
    cfg = gc.Config(reward_funcs=["reward_len"])
    means = gc.evaluate(RecordingEngine(), cfg, cpu_env(tp_group=None), smol_tokenizer, rows,
                        [scores_answer_1, rf.reward_len], 1)
    assert means["eval/scores_answer_1"] == 1.0  # not 1/3
    assert means["eval/reward_len"] <= 0.0  # every completion scored


def test_a_none_reward_through_score_and_make_batch(monkeypatch):
    """Issue 36 item 9: a None passes through score() as NaN; a completion every function returns
    None for is NaN in the weighted sum (a single None counts 0 there), stays out of its group's
    mean and std, and gets advantage 0."""
    def half(prompts, completions, **columns):  # None for completion 0 of every prompt
        return [None if j % 2 == 0 else 1.0 for j in range(len(completions))]

    def ones_but_first(prompts, completions, **columns):  # None for the very first completion
        return [None if j == 0 else 1.0 for j in range(len(completions))]
    batch = stand_in_rollout(monkeypatch, [1, 3], 1, funcs=(half, ones_but_first))
    table = batch.stats["rewards_per_func"]
    assert math.isnan(table[0, 0]) and math.isnan(table[0, 1]) and math.isnan(table[2, 0])
    rewards = batch.stats["rewards"]
    assert math.isnan(rewards[0]) and rewards[1] == 2.0 and rewards[2] == 1.0 and rewards[3] == 2.0
    # group 0: completion 0 left out (A = 0); the other alone: no std, A = 0. Group 1: 1.0 and 2.0
    assert batch.advantages[0] == 0 and batch.advantages[1] == 0
    assert batch.advantages[2] < 0 < batch.advantages[3]


def test_e2e_lora_dropout_checks_every_step_and_resumes_with_your_rates(tiny_model, tmp_path, monkeypatch):
    """Issue 36 item 5: with --lora_dropout the training forward is noisy; the old logprobs (the IS
    weights' and the canary's) come from a dropout-free pass, so the fp32 canary (1e-4) passes at
    step 2, after B has moved. Issue 35 item f: that LoRA checkpoint resumed without --use_peft is
    refused; resumed with another --learning_rate and --weight_decay, AdamW takes them."""
    out = str(tmp_path / "out")
    flags = ["--model", tiny_model(engine=True), "--use_peft", "--lora_dropout", "0.5", "--num_generations", "4",
             "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "1",
             "--max_prompt_length", "96", "--max_completion_length", "8", "--num_eval", "4",
             "--reward_funcs", "reward_len", "--learning_rate", "1e-2", "--eval_steps", "0", "--max_steps", "2"]
    run_trainer([*flags, "--save_steps", "1", "--output_dir", out], nproc=1)
    steps = [r for r in read_metrics(out) if "reward" in r]
    assert [r["step"] for r in steps] == [1, 2] and all(r["sampled_gap"] < 1e-4 for r in steps)
    ckpt = os.path.join(out, "checkpoint-1")
    without = [f for f in flags if f != "--use_peft"]
    with pytest.raises(gc.ConfigError, match="^--use_peft: is False, but the checkpoint.s run had True"):
        gc.parse_args([*without, "--output_dir", out, "--resume_from_checkpoint", ckpt])
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    cfg = gc.parse_args([*flags, "--learning_rate", "3e-2", "--weight_decay", "0.5", "--output_dir", out,
                         "--resume_from_checkpoint", ckpt])
    trainer = gc.build_trainer(cfg, cpu_env(), SimpleNamespace(checkpointing=False), gc.read_checkpoint_state(ckpt))
    group = trainer.optimizer.param_groups[0]  # the adapters: decayed
    assert group["weight_decay"] == 0.5 and close(group["lr"], 3e-2 * (1 - 1 / 2), 1e-12)  # linear, at step 1
    assert len(trainer.optimizer.state) > 0  # AdamW's moments, from the checkpoint


def test_two_first_runs_convert_the_embedded_model_once(tmp_path):
    """Issue 36 item 8: two runs started together both convert the GGUF; the second to finish
    accepts the first's complete conversion instead of failing on its rename."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "MODEL_DIR": str(tmp_path / "model"),
           "PYTHON": os.path.join(HERE, ".venv", "bin", "python")}
    if not os.path.exists(env["PYTHON"]):
        env["PYTHON"] = sys.executable
    runs = [subprocess.Popen(["bash", os.path.join(HERE, "run.sh"), "--help"], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    logs = [run.communicate(timeout=600)[0] for run in runs]
    assert [run.returncode for run in runs] == [0, 0], [log[-3000:] for log in logs]
    assert os.path.isfile(tmp_path / "model" / "model.safetensors")
    assert sorted(os.listdir(tmp_path)) == ["model"]  # no conversion left half-way


# ------------------------------------------------------------------------------------------------------------
# at scale: ranks that agree on their inputs, a rank that fails before the process group, bounded tool time,
# one run's outputs, fillers that change nothing, the resume's pointer and schedule
# ------------------------------------------------------------------------------------------------------------

def agreement_ranks(out, case, model):
    """Each of 2 torchrun ranks: check_inputs with rank 1's inputs differing as `case` says, then
    setup_distributed. Prints rank 0's exit code and what it said."""
    import contextlib

    rank = int(os.environ["RANK"])
    argv = ["--model", model, "--output_dir", out, "--reward_funcs", "reward_len", "--num_eval", "4",
            "--max_prompt_length", "96", "--max_completion_length", "32"]
    if case == "flag" and rank == 1:  # node 1's own --eval_steps: it would evaluate while node 0 trains
        argv += ["--eval_steps", "25"]
    if case == "model" and rank == 1:  # another revision of the model in node 1's cache
        other = os.path.join(out, "other-model")
        shutil.copytree(model, other)
        config = json.load(open(os.path.join(other, "config.json")))
        json.dump({**config, "rms_norm_eps": 1e-3}, open(os.path.join(other, "config.json"), "w"))
        argv[1] = other
    if case in ("cuda", "broken") and rank == 1:  # node 1 sees a GPU: a working one, or a busy one
        def free_memory(device=None):
            if case == "broken":
                raise RuntimeError("CUDA error: all CUDA-capable devices are busy or unavailable")
            return 80 * GiB, 80 * GiB
        torch.cuda.is_available = lambda: True
        torch.cuda.mem_get_info = free_memory
    said = io.StringIO()
    with contextlib.redirect_stderr(said):
        cfg, env, inputs, error = gc.check_inputs(argv)
        try:
            gc.setup_distributed(cfg, env, error, inputs and inputs.facts)
            code = 0
        except SystemExit as e:
            code = e.code
    if rank == 0:
        print("RESULT", json.dumps({"code": code, "said": said.getvalue()}), flush=True)


@pytest.mark.parametrize("case,message", [
    ("flag", "error: --eval_steps: the ranks differ ([50, 25])"),
    ("model", "error: --model: the ranks differ"),
    ("cuda", "error: platform: the ranks differ ([['cpu'"),
    ("broken", "error: RuntimeError('CUDA error: all CUDA-capable devices are busy or unavailable') (rank 1)"),
])
def test_ranks_agree_on_flags_model_and_platform_before_any_nccl(tiny_model, tmp_path, case, message):
    """Every rank's flags (but the paths a node names its own way), its model's config, its device
    and versions are compared through torchrun's store before the process group starts: a node
    with its own --eval_steps, another model revision or CUDA where the others have none stops
    every rank, naming what differs. A rank whose setup fails (a busy GPU) tells the others through
    the store too, without a CUDA call: no rank waits in a collective."""
    (tmp_path / "out").mkdir()
    r = run_processes("agreement_ranks", tmp_path / "out", case, tiny_model(), nproc=2, timeout=300)
    assert r["code"] == 2 and message in r["said"], r["said"]


def test_free_gpu_memory_is_checked_at_start(monkeypatch):
    """Another process holding the GPU is found by setup_env, before the process group, naming
    --vllm_gpu_memory_utilization; not inside LLM(), after it."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10 * GiB, 80 * GiB))
    with pytest.raises(gc.ConfigError, match=r"^--vllm_gpu_memory_utilization: the engine's 24.0 GiB of cuda:0 "
                                             r"exceed its 10.0 GiB free"):
        gc.setup_env(gc.Config())
    assert gc.setup_env(gc.Config(vllm_gpu_memory_utilization=0.1)).engine_bytes == 0.1 * 80 * GiB + 2 * GiB


def test_a_fresh_run_starts_its_own_outputs(tmp_path):
    """A fresh run in an earlier run's --output_dir moves latest aside (a restart must not continue
    the earlier run's checkpoint) and its metrics; a resume points latest at its checkpoint at
    once (a restart before its first save continues it, not the newer one latest named)."""
    for name in ("latest", "metrics.jsonl"):
        (tmp_path / name).write_text("the earlier run's")
    cfg = gc.Config(output_dir=str(tmp_path))
    gc.start_outputs(cfg, None)
    assert sorted(os.listdir(tmp_path)) == ["previous-latest", "previous-metrics.jsonl"]
    with pytest.raises(gc.ConfigError, match="--resume_from_checkpoint: latest: none in"):
        gc.parse_args(["--output_dir", str(tmp_path), "--resume_from_checkpoint", "latest"])
    gc.point_latest(str(tmp_path), str(tmp_path / "checkpoint-4"))
    resumed = dataclasses.replace(cfg, resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    gc.start_outputs(resumed, {"step": 2})
    assert gc.latest_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-2")


def test_latest_is_replaced_whole_or_not_at_all(tmp_path, monkeypatch):
    """latest is written to latest.tmp, then renamed over: a save that dies before the rename
    leaves the old pointer whole."""
    gc.point_latest(str(tmp_path), str(tmp_path / "checkpoint-1"))

    def dies(src, dst):
        raise KeyboardInterrupt
    monkeypatch.setattr(os, "replace", dies)
    with pytest.raises(KeyboardInterrupt):
        gc.point_latest(str(tmp_path), str(tmp_path / "checkpoint-2"))
    assert (tmp_path / "latest").read_text() == "checkpoint-1"


def test_a_rollouts_tool_time_is_bounded_and_a_tool_may_not_kill_it(monkeypatch):
    """One deadline for all the tool calls of a rollout (a quarter of --ddp_timeout): a stuck tool
    costs at most TOOL_TIMEOUT a call until then, then every later call fails at once. A tool that
    raises SystemExit fails its call; its thread ends, the caller goes on."""
    monkeypatch.setattr(rf, "TOOL_TIMEOUT", 0.2)

    def stuck():
        """Never returns."""
        time.sleep(60)

    def leaves():
        """Raises SystemExit."""
        raise SystemExit(3)
    tools = {"stuck": stuck, "leaves": leaves}
    call = '{"name": "stuck", "arguments": {}}'
    start = time.monotonic()
    deadline = start + 0.5
    results = [rf.call_tool(tools, call, deadline) for _ in range(20)]
    assert time.monotonic() - start < 1.5  # not 20 x 0.2 s
    assert all(failed for failed, _ in results)
    assert "ran past 0.2 s" in results[0][1]["content"] and "ran out" in results[-1][1]["content"]
    failed, message = rf.call_tool(tools, '{"name": "leaves", "arguments": {}}')
    assert failed and "SystemExit(3)" in message["content"]


class DeterministicCheck:
    """Stands in for vllm.LLM: notes whether torch's deterministic mode was on while it generated."""
    def __init__(self):
        self.seen = []

    def generate(self, prompts, params, use_tqdm=False):
        self.seen.append((torch.are_deterministic_algorithms_enabled(), getattr(params[0], "temperature", None)))
        return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[1])], prompt_logprobs=[None, {2: None}])]


def test_full_determinism_is_off_while_vllm_samples(capsys):
    """--full_determinism switches torch's deterministic mode on for the trainer; vLLM's sampler
    (top-k/top-p at tp 2 among others) has ops without a deterministic kernel, so generate turns
    it off around the engine and back on after. The flag's limits are said at start."""
    llm = DeterministicCheck()
    torch.use_deterministic_algorithms(True)
    try:
        gc.generate(llm, cpu_env(), [[1, 2]], Params())
        assert torch.are_deterministic_algorithms_enabled()
    finally:
        torch.use_deterministic_algorithms(False)
    assert llm.seen == [(False, None)]
    cfg = gc.Config(full_determinism=True, lora_dropout=0.1)
    plan = SimpleNamespace(token_budget=100, checkpointing=False, why="off")
    inputs = SimpleNamespace(data=(None, [], []))
    gc.print_setup(cfg, cpu_env(), plan, tiny_llama(), inputs, 0, 16)
    assert "warning: --full_determinism does not hold across a resume with --lora_dropout" in capsys.readouterr().out
    # a save in the middle of a --num_iterations cycle: at max_steps, or at a multiple of save_steps; never without saves
    for max_steps, save_steps, warned in ((10, -1, False), (10, 0, False), (9, 0, True), (10, 4, False), (10, 3, True)):
        cfg = gc.Config(full_determinism=True, num_iterations=2, max_steps=max_steps, save_steps=save_steps)
        gc.print_setup(cfg, cpu_env(), plan, tiny_llama(), inputs, 0, 16)
        assert ("warning: --full_determinism" in capsys.readouterr().out) == warned, (max_steps, save_steps)


def test_the_probe_is_greedy(monkeypatch):
    """The probe's one generated token is greedy: it draws from no generator (an unseeded sample
    after the per-rank reseed would differ between runs)."""
    llm = DeterministicCheck()
    with pytest.raises(AttributeError):  # the stand-in returns no real logprobs: the call is what is checked
        gc.probe_gap(llm, None, [1, 2, 3], cpu_env())
    assert llm.seen and llm.seen[0][1] == 0.0


def test_batch_std_leaves_the_fillers_out(world_of_one, monkeypatch):
    """--scale_rewards batch with dynamic sampling: the std spans the trained groups' rewards only,
    so fillers change nothing. One varied group [0, 1] (G = 2: mean 0.5, std sqrt(0.5)) gets
    -0.707 / 0.707 alone and beside an all-0 filler (over [0, 1, 0, 0] it would get -0.5 / 1.5)."""
    def one_right(prompts, completions, **columns):  # prompt "1": its second completion right
        return [float(p == "1" and len(c) == 2) for p, c in zip(prompts, completions)]

    def four(k, j):  # completion j of prompt k: j + 1 tokens; an EOS last
        return [k] * j + [0], "stop"
    flags = dict(scale_rewards="batch", sample=four, funcs=(one_right,))
    alone = stand_in_rollout(monkeypatch, [1], 1, **flags)
    want = torch.tensor([-0.5, 0.5]) / (0.5 ** 0.5 + 1e-4)
    assert torch.allclose(alone.advantages, want, rtol=1e-6)
    with_filler = stand_in_rollout(monkeypatch, [1, 0], 2, **flags)
    assert with_filler.filler.tolist() == [False, False, True, True]
    assert torch.allclose(with_filler.advantages[:2], want, rtol=1e-6)


def filler_batch(with_filler: bool):
    """One varied group of 2 (advantages -1, 1), and, after it, a filler group of 2: loss mask 0."""
    prompts, completions = [[1, 2], [3]], [[4, 5], [6, 7, 8]]
    advantages = [-1.0, 1.0]
    if with_filler:
        prompts, completions, advantages = prompts + [[9], [10]], completions + [[11], [12, 13]], advantages + [0.0, 0.0]
    batch = train_batch(prompts, completions, advantages)
    if with_filler:
        batch.filler = torch.tensor([False, False, True, True])
        batch.loss_mask[2:] = 0
    return batch


@pytest.mark.parametrize("loss_type", ["bnpo", "dapo", "grpo"])
def test_filler_micro_batches_change_neither_bnpo_nor_the_entropy_bonus(world_of_one, loss_type):
    """bnpo's mean over micro-batches and the entropy bonus's count only the micro-batches that hold
    a loss token: a micro-batch of fillers alone changes neither the gradient nor the logged loss
    (it was 0.5x before)."""
    cfg = gc.Config(loss_type=loss_type, num_generations=2, per_device_train_batch_size=2,
                    gradient_accumulation_steps=1, entropy_coef=0.1, max_grad_norm=0,
                    vllm_importance_sampling_correction=False)
    runs = []
    for with_filler in (False, True):
        torch.manual_seed(0)
        policy = gc.Policy(tiny_llama(), entropy_grad=True)
        optimizer = StepGradients(policy)
        budget = 5  # one sequence a micro-batch: the fillers' are micro-batches of their own
        stats = gc.train_step(policy, optimizer, NO_SCHEDULE, filler_batch(with_filler), cfg, cpu_env(), budget, {}, 1)
        runs.append((optimizer.grads, stats["loss"]))
    (without, loss_without), (with_, loss_with) = runs
    assert close(loss_with, loss_without, 1e-6)
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-8) for a, b in zip(without, with_))


def test_a_step_of_fillers_alone_moves_no_weight(monkeypatch, world_of_one):
    """No group varies anywhere: nothing trains, so AdamW is not called (its momentum and weight
    decay would move the weights), and the schedule still advances, as a resume would set it."""
    batch = filler_batch(True)
    batch.filler[:] = True
    batch.loss_mask[:] = 0
    policy = gc.Policy(tiny_llama())
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-2, weight_decay=0.5)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (step + 1))
    train_batch_of = train_batch([[1]], [[2, 3]], [1.0])
    cfg = gc.Config(num_generations=2, per_device_train_batch_size=2, gradient_accumulation_steps=1,
                    vllm_importance_sampling_correction=False)
    gc.train_step(policy, optimizer, scheduler, train_batch_of, cfg, cpu_env(), BUDGET, {}, 1)
    before = [p.detach().clone() for p in policy.parameters()]
    stats = gc.train_step(policy, optimizer, scheduler, batch, cfg, cpu_env(), BUDGET, {}, 2)
    assert stats["loss"] == 0.0 and stats["skipped"] == 0.0
    assert all(torch.equal(a, b) for a, b in zip(before, policy.parameters()))  # AdamW had momentum
    assert scheduler.last_epoch == 2


def test_make_batch_masks_tool_results_out_of_the_loss(monkeypatch):
    """make_batch alone: a tool result's tokens (model_mask 0, in the middle of a completion) get
    loss mask 0, the model's own tokens 1, whatever follows the completion 0."""
    cfg = gc.Config(num_generations=2, per_device_train_batch_size=2, gradient_accumulation_steps=1,
                    vllm_importance_sampling_correction=False, reward_funcs=["reward_len"])
    samples = [SimpleNamespace(token_ids=[5, 6, 7, 8, 2], model_mask=[1, 0, 0, 1, 1], vllm_logps=[], finish_reason="stop"),
               SimpleNamespace(token_ids=[5, 2], model_mask=[1, 1], vllm_logps=[], finish_reason="stop")]
    rows = [{"prompt": "p", "answer": "", "prompt_ids": [1]}]
    rewards = torch.tensor([[1.0], [0.0]])
    batch = gc.make_batch(cfg, cpu_env(), SimpleNamespace(eos_token_id=2, pad_token_id=0), rows, samples,
                          rewards, torch.ones(1), {})
    assert batch.loss_mask.tolist() == [[1, 0, 0, 1, 1], [1, 1, 0, 0, 0]]
    assert batch.model_mask.tolist() == [[1, 0, 0, 1, 1], [1, 1, 0, 0, 0]]


def test_score_turns_none_into_nan():
    """A reward function's None (it cannot score that completion) is NaN in score's table."""
    def half(prompts, completions, **columns):
        return [None if i % 2 else 1.0 for i in range(len(completions))]
    table = gc.score([half], [{"prompt": "p"}], [[1], [2]], 2, CharTokenizer(), 8)
    assert table[0, 0] == 1.0 and math.isnan(table[1, 0])


def tensorboard_scalars(out):
    """{tag: [(step, value), ...]} of the one TensorBoard run under <out>/runs."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    runs = os.listdir(os.path.join(out, "runs"))
    assert len(runs) == 1, runs
    events = EventAccumulator(os.path.join(out, "runs", runs[0]), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_report_to_tensorboard_and_wandb(tiny_model, tmp_path):
    """--report_to tensorboard wandb on the CPU: rank 0 gives every key of metrics.jsonl to both, at
    its step, and the config once; W&B in offline mode (no network). TensorBoard's event file read
    back holds every logged key at steps 1 and 2; W&B's offline run is on disk, finished."""
    out = str(tmp_path / "out")
    flags = ["--model", tiny_model(engine=True), "--num_generations", "4", "--per_device_train_batch_size", "4",
             "--gradient_accumulation_steps", "1", "--max_prompt_length", "96", "--max_completion_length", "8",
             "--reward_funcs", "reward_len", "--num_eval", "4", "--eval_steps", "2", "--max_steps", "2",
             "--save_steps", "-1", "--report_to", "tensorboard", "wandb", "--output_dir", out]
    proc = run_trainer(flags, nproc=1, WANDB_MODE="offline", WANDB_SILENT="true", WANDB_ERROR_REPORTING="false",
                       WANDB_CACHE_DIR=str(tmp_path / "wandb-cache"), WANDB_CONFIG_DIR=str(tmp_path / "wandb-config"))
    records = read_metrics(out)
    scalars = tensorboard_scalars(out)
    for record in records:
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)):
                assert (record["step"], approx(value, rel=1e-6, abs=1e-6)) in scalars[key], key
    assert {step for r in records for step in [r["step"]] if "reward" in r} == {1, 2}
    assert len(scalars["reward"]) == 2
    runs = [p for p in os.listdir(os.path.join(out, "wandb")) if p.startswith("offline-run-")]
    assert len(runs) == 1 and any(f.endswith(".wandb") for f in os.listdir(os.path.join(out, "wandb", runs[0])))
    assert "step 2/2 (" in proc.stdout and " elapsed, ~0:00:00 left)" in proc.stdout


def test_report_to_refuses_a_tracker_that_is_not_installed(monkeypatch, tmp_path):
    """A tracker asked for but not installed is refused at start, naming the flag and the pip line;
    a stray ./wandb folder (what an offline run leaves) is not taken for the package."""
    real = importlib.util.find_spec
    (tmp_path / "wandb").mkdir()
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: real("wandb_is_not_here") if name == "wandb"
                        else real(name, *a))
    with pytest.raises(gc.ConfigError, match="^--report_to: pip install wandb$"):
        gc.parse_args(["--report_to", "wandb", "--output_dir", str(tmp_path / "out")])
    monkeypatch.setattr(importlib.util, "find_spec", real)
    gc.parse_args(["--report_to", "tensorboard", "--output_dir", str(tmp_path / "out")])


class Tracker:
    def __init__(self):
        self.closed = []

    def pair(self):
        return (lambda record: None, self.closed.append)


def test_trackers_close_when_the_run_fails(monkeypatch):
    """The trackers close before the failure's os._exit (an offline W&B run left open keeps
    nothing), with failed=True; after a run that ends well, with False."""
    tracker = Tracker()
    cfg = gc.Config()
    env = cpu_env()
    monkeypatch.setattr(gc, "check_inputs", lambda argv: (cfg, env, None, None))
    monkeypatch.setattr(gc, "setup_distributed", lambda *args: None)
    monkeypatch.setattr(gc, "open_trackers", lambda cfg: [tracker.pair()])
    monkeypatch.setattr(gc.dist, "barrier", lambda: None)
    monkeypatch.setattr(gc.dist, "destroy_process_group", lambda: None)

    def fails(*args):
        raise ValueError("a step failed")
    monkeypatch.setattr(gc, "run", fails)

    def leaves(code):
        raise SystemExit(code)
    monkeypatch.setattr(os, "_exit", leaves)
    with pytest.raises(SystemExit):
        gc.main([])
    monkeypatch.setattr(gc, "run", lambda *args: None)
    gc.main([])
    assert tracker.closed == [True, False]


def test_progress_leaves_the_first_step_out():
    """The time left: the median step so far x the steps left, this process's first step (it
    compiles; a resume's restarts the engine) left out once there are others."""
    started = time.time() - 75
    assert gc.progress(started, [60.0], 10) == "0:01:15 elapsed, ~0:10:00 left"
    assert gc.progress(started, [60.0, 2.0, 3.0, 100.0], 10) == "0:01:15 elapsed, ~0:00:30 left"


def test_lr_schedules_tell_cosine_from_linear(tiny_model):
    """Halfway through (where test_lr_schedules looks), linear and cosine are both at 1/2 of the
    peak. At progress p = 0.2 (step 2 of --max_steps 10, no warmup) linear is at 1 - p = 0.8 and
    cosine at (1 + cos(pi p)) / 2 = 0.9045: the two tell apart."""
    (linear,) = lr_factors(tiny_model, (2,), lr_scheduler_type="linear")
    (cosine,) = lr_factors(tiny_model, (2,), lr_scheduler_type="cosine")
    assert linear == 0.8 and cosine == round((1 + math.cos(math.pi * 0.2)) / 2, 4) == 0.9045


# `python test_grpo_colocate.py NAME ARGS...`: the processes that the tests above start
if __name__ == "__main__":
    globals()[sys.argv[1]](*sys.argv[2:])
