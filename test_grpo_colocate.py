"""Tests for grpo_colocate.py, all on the CPU: `bash run.sh test`.

1. Pure functions against values computed by hand: advantages, every loss normalisation, clipping on both sides,
   masks, the KL term, the importance weights, chunked logprobs, the Policy forward, data order, reward functions.
2. The TP prompt gather/slice with 4 real gloo processes (tp=2).
3. End to end with the REAL vLLM engine and the REAL embedded SmolLM2-135M-Instruct (torchrun, 2 ranks), the
   resume of that run, and tp=2 on a tiny random Llama (SmolLM2's 9 heads only split for tp in {1, 3}).
No mocks of vLLM or the model in the end-to-end tests.
"""

import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
import zlib
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import grpo_colocate as gc
import reward_fns as rf

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may download
HERE = os.path.dirname(os.path.abspath(__file__))
MODEL = gc.DEFAULT_MODEL


def close(a, b, tol=1e-5):
    return abs(float(a) - float(b)) <= tol * max(1.0, abs(float(b)))


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


def test_advantages_bad_scale():
    with pytest.raises(ValueError):
        gc.compute_advantages(REWARDS, 4, "global")


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


@pytest.mark.parametrize("loss_type,expected", [
    ("grpo", (sum(ROW0) / 3 + (ROW1[0] + ROW1[1]) / 2) / 2),  # per-sequence means, then the batch mean
    ("bnpo", MASKED_SUM / 5),  # token mean over the batch
    ("dr_grpo", MASKED_SUM / (2 * 4)),  # B * max_completion_length (= 4)
    ("dapo", MASKED_SUM / 5),  # num_items=None: this batch's tokens
])
def test_grpo_loss_normalisations(loss_type, expected):
    loss, stats = gc.grpo_loss(LOGPS, OLD, ADV, MASK, loss_type, 0.2, 0.2, max_completion_length=4)
    assert close(loss, expected)
    # one of 5 tokens clipped high (row 0, t0), one clipped low (row 1, t0)
    assert close(stats["clip_ratio/high"], 0.2) and close(stats["clip_ratio/low"], 0.2)
    assert close(stats["clip_ratio/region"], 0.4)
    assert "kl" not in stats


def test_grpo_loss_dapo_global_token_count():
    loss, _ = gc.grpo_loss(LOGPS, OLD, ADV, MASK, "dapo", num_items=10)
    assert close(loss, MASKED_SUM / 10)


def test_grpo_loss_clip_higher():
    # epsilon_high 0.25: row 0 t0 (r = 1.2214) is no longer clipped, l = -1.2214
    loss, stats = gc.grpo_loss(LOGPS, OLD, ADV, MASK, "bnpo", 0.2, 0.25)
    assert close(loss, (MASKED_SUM + 1.2 - math.exp(0.2)) / 5)
    assert close(stats["clip_ratio/high"], 0.0)


def test_grpo_loss_kl():
    ref = torch.full_like(LOGPS, -1.0)
    d = (ref - LOGPS).tolist()  # [[0, 1, -0.5], [0.5, -0.8, 2 (masked)]]
    kl = [[math.exp(x) - x - 1 for x in row] for row in d]
    kl_sum = sum(kl[0]) + kl[1][0] + kl[1][1]
    loss, stats = gc.grpo_loss(LOGPS, OLD, ADV, MASK, "bnpo", ref_logps=ref, beta=0.1)
    assert close(loss, (MASKED_SUM + 0.1 * kl_sum) / 5)
    assert close(stats["kl"], kl_sum / 5)
    assert kl[0][0] == 0 and all(x >= 0 for row in kl for x in row)


def test_grpo_loss_gradient_is_policy_gradient_on_policy():
    # with old = logp (num_iterations = 1) the bnpo gradient w.r.t. logp_t is -A_t m_t / sum(m)
    logps = LOGPS.clone().requires_grad_(True)
    loss, _ = gc.grpo_loss(logps, logps.detach(), ADV, MASK, "bnpo")
    loss.backward()
    assert torch.allclose(logps.grad, -ADV[:, None] * MASK / 5)


def test_grpo_loss_is_weights():
    w = torch.tensor([[2.0], [0.0]])  # sequence-level: row 1 masked out by its weight
    loss, _ = gc.grpo_loss(LOGPS, OLD, ADV, MASK, "bnpo", is_weights=w)
    assert close(loss, 2 * sum(ROW0) / 5)


def test_grpo_loss_dr_grpo_needs_length():
    with pytest.raises(ValueError):
        gc.grpo_loss(LOGPS, OLD, ADV, MASK, "dr_grpo")


# GSPO: one ratio per sequence, exp of the mean masked log ratio. Row 0: mean(0.2, -0.5, 0) = -0.1, r = e^-0.1,
# A = +1; row 1: mean(-0.5, 0.2) = -0.15 (the masked token ignored), r = e^-0.15 = 0.8607, A = -2.
# With eps 0.05: row 0 -> -min(0.9048, 0.95) = -0.9048 (unclipped: A > 0); row 1 -> -min(-1.7214, -1.9) = 1.9,
# clipped low: both of its tokens, so no gradient reaches row 1.
SEQ_R0, SEQ_R1 = math.exp(-0.1), math.exp(-0.15)


def test_grpo_loss_sequence_level_gspo():
    logps = LOGPS.clone().requires_grad_(True)
    loss, stats = gc.grpo_loss(logps, OLD, ADV, MASK, "grpo", 0.05, 0.05, importance_sampling_level="sequence")
    assert close(loss.detach(), (-SEQ_R0 + 1.9) / 2)  # per-sequence means: every token of a row has the same loss
    assert close(stats["clip_ratio/low"], 2 / 5) and close(stats["clip_ratio/high"], 0.0)
    loss.backward()  # d/dlogp_t of -r A / 2 (grpo: mean of 2 sequences) = -A r / n_tokens / 2, shared by the row
    assert torch.allclose(logps.grad, torch.tensor([[-SEQ_R0 / 6] * 3, [0.0, 0.0, 0.0]]))
    token, _ = gc.grpo_loss(LOGPS, OLD, ADV, MASK, "bnpo", 0.05, 0.05)  # the token level differs
    seq, _ = gc.grpo_loss(LOGPS, OLD, ADV, MASK, "bnpo", 0.05, 0.05, importance_sampling_level="sequence")
    assert close(seq, (-3 * SEQ_R0 + 2 * 1.9) / 5) and not close(token, seq)


# entropies H of the 6 tokens (the masked one is 9.0) and a threshold of 1.0: e = [[0, 1, 1], [1, 0, .]]
ENTROPY = torch.tensor([[0.5, 2.0, 1.0], [3.0, 0.1, 9.0]])


def test_grpo_loss_top_entropy_tokens_only():
    loss, stats = gc.grpo_loss(LOGPS, OLD, ADV, MASK, "bnpo", entropy=ENTROPY, entropy_threshold=1.0)
    assert close(loss, (ROW0[1] + ROW0[2] + ROW1[0]) / 5)  # the policy term of the 3 kept tokens; still / 5 tokens
    assert close(stats["clip_ratio/low"], 0.2)  # the stats still count every token, as TRL's


def test_grpo_loss_entropy_bonus():
    entropy = ENTROPY.clone().requires_grad_(True)
    loss, _ = gc.grpo_loss(LOGPS, OLD, ADV, MASK, "bnpo", entropy=entropy, entropy_coef=0.1)
    assert close(loss.detach(), (MASKED_SUM - 0.1 * (0.5 + 2.0 + 1.0 + 3.0 + 0.1)) / 5)  # normalised like the loss
    loss.backward()
    assert torch.allclose(entropy.grad, -0.1 * MASK / 5)  # a gradient that raises the entropy, masked tokens none
    with_mask, _ = gc.grpo_loss(LOGPS, OLD, ADV, MASK, "bnpo", entropy=ENTROPY, entropy_coef=0.1, entropy_threshold=1.0)
    assert close(with_mask, (ROW0[1] + ROW0[2] + ROW1[0] - 0.1 * (2.0 + 1.0 + 3.0)) / 5)  # on the kept tokens only


def test_entropy_quantile_one_rank():
    # the 5 loss tokens sorted: 0.1 0.5 1 2 3; the 0.6-quantile (top_entropy_quantile 0.4) at 0.6 * 4 = 2.4: 1.4
    assert close(gc.entropy_quantile(ENTROPY, MASK, 0.6, world=1), 1.4)
    assert close(gc.entropy_quantile(ENTROPY, MASK, 1.0, world=1), 3.0)  # top_entropy_quantile 0: the top token
    assert gc.entropy_quantile(ENTROPY, torch.zeros_like(MASK), 0.5, world=1) == math.inf  # no tokens: none kept


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


def test_importance_weights_uncapped_value():
    got = gc.vllm_importance_weights(TRAINER, VLLM, IS_MASK, "token_truncate", clip_max=3.0)
    assert close(got[0, 0], math.exp(0.5))


# ------------------------------------------------------------------------------------------------------------
# logprobs: chunked == full log_softmax (values and gradients); the Policy forward on a padded batch
# ------------------------------------------------------------------------------------------------------------

def test_chunked_logprobs_match_full_softmax():
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(7, 5, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(11, 5, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 11, (7,), generator=g)
    lp, ent = gc.chunked_logprobs(hidden, weight, targets, temperature=0.7, chunk_size=3)
    logits = hidden @ weight.T / 0.7
    ref = logits.log_softmax(-1)
    ref_lp = ref.gather(-1, targets[:, None])[:, 0]
    assert torch.allclose(lp, ref_lp.float(), atol=1e-6)
    assert torch.allclose(ent, -(ref.exp() * ref).sum(-1).float(), atol=1e-5)
    (g1h, g1w) = torch.autograd.grad(lp.sum(), (hidden, weight))
    (g2h, g2w) = torch.autograd.grad(ref_lp.sum(), (hidden, weight))
    assert torch.allclose(g1h, g2h, atol=1e-6) and torch.allclose(g1w, g2w, atol=1e-6)
    assert not ent.requires_grad  # the entropy is only logged unless --entropy_coef needs its gradient
    lp, ent = gc.chunked_logprobs(hidden, weight, targets, temperature=0.7, chunk_size=3, entropy_grad=True)
    (g1h,) = torch.autograd.grad(ent.sum(), (hidden,))
    ref = (hidden @ weight.T / 0.7).log_softmax(-1)  # a fresh graph: the first one was freed
    (g2h,) = torch.autograd.grad(-(ref.exp() * ref).sum(), (hidden,))
    assert torch.allclose(g1h, g2h, atol=1e-5)  # the chunk computes in fp32


def tiny_llama(vocab=64, hidden=32, heads=4, kv_heads=2):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=256,
                         tie_word_embeddings=True, attn_implementation="sdpa")
    return LlamaForCausalLM(config).eval()


def test_policy_forward_matches_unpadded_model():
    lm = tiny_llama()
    prompts, completions = [[5, 6, 7], [8, 9]], [[10, 11], [12, 13, 14]]
    input_ids, attention, completion_mask = gc.collate(prompts, completions, pad_id=0)
    assert input_ids.tolist() == [[5, 6, 7, 10, 11, 0], [0, 8, 9, 12, 13, 14]]
    assert completion_mask.tolist() == [[1, 1, 0], [1, 1, 1]]
    logps, _ = gc.Policy(lm)(input_ids, attention, completion_mask, 1.0)
    for i, (p, c) in enumerate(zip(prompts, completions)):  # each row alone, no padding at all
        ids = torch.tensor([p + c])
        full = lm(ids).logits[0].log_softmax(-1)
        want = [full[len(p) - 1 + t, tok].item() for t, tok in enumerate(c)]
        assert torch.allclose(logps[i, :len(c)], torch.tensor(want), atol=1e-5)
        assert (logps[i, len(c):] == 0).all()


def test_micro_batch_trims_padding_columns():
    prompts, completions = [[1, 2, 3, 4], [5], [6, 7]], [[8], [9, 10, 11], [12]]
    input_ids, attention, completion_mask = gc.collate(prompts, completions, pad_id=0)
    batch = gc.SimpleNamespace(input_ids=input_ids, attention_mask=attention, completion_mask=completion_mask,
                               loss_mask=completion_mask.float(), advantages=torch.arange(3.0), vllm_logps=None,
                               old_logps=None, ref_logps=None)
    mb = gc.micro_batch(batch, 1, 2, "cpu")  # rows 1-2: longest prompt 2, longest completion 3
    assert mb.input_ids.tolist() == [[0, 5, 9, 10, 11], [6, 7, 12, 0, 0]]
    assert mb.completion_mask.tolist() == [[1, 1, 1], [1, 0, 0]]
    assert mb.advantages.tolist() == [1.0, 2.0]


# ------------------------------------------------------------------------------------------------------------
# data, seeds, schedule, flags
# ------------------------------------------------------------------------------------------------------------

def test_arithmetic_task_is_deterministic_and_split():
    train, held = gc.arithmetic_task(seed=1, num_eval=50)
    train2, held2 = gc.arithmetic_task(seed=1, num_eval=50)
    assert train == train2 and held == held2 and len(held) == 50
    assert {r["prompt"] for r in train}.isdisjoint(r["prompt"] for r in held)
    assert gc.arithmetic_task(seed=2, num_eval=50)[0][:20] != train[:20]  # the seed changes the order
    for row in held[:10]:
        a, op, b = row["prompt"].split("?")[0].split()[2:5]
        assert int(row["answer"]) == (int(a) + int(b) if op == "+" else int(a) - int(b))


def test_rows_for_step_disjoint_across_ranks_and_resumable():
    rows = list(range(10))
    step0 = [gc.rows_for_step(rows, 0, r, 2, 3, seed=0) for r in range(2)]
    assert set(step0[0]).isdisjoint(step0[1])
    assert gc.rows_for_step(rows, 0, 1, 2, 3, seed=0) == step0[1]  # a pure function of (step, rank, seed)
    # generation 1 needs indices 6..11: the end of epoch 0 and the start of epoch 1 (another permutation)
    epoch0 = gc.epoch_permutation(10, 0, 0)
    assert gc.rows_for_step(rows, 1, 0, 2, 3, seed=0) == [epoch0[6], epoch0[7], epoch0[8]]
    assert sorted(epoch0) == rows


def test_derive_seed_stable_and_distinct():
    assert gc.derive_seed(1, "rollout", 3, 0) == gc.derive_seed(1, "rollout", 3, 0)
    assert len({gc.derive_seed(s, "rollout", 3, e) for s in range(3) for e in range(3)}) == 9


def test_lr_schedules():
    cfg = gc.Config(max_steps=10, warmup_steps=2, lr_scheduler_type="linear")
    f = gc.lr_lambda(cfg)
    assert [round(f(s), 4) for s in (0, 1, 2, 6, 12)] == [0.3333, 0.6667, 1.0, 0.5, 0.0]
    cfg.lr_scheduler_type = "cosine"
    assert round(gc.lr_lambda(cfg)(6), 4) == 0.5
    cfg.lr_scheduler_type = "constant"
    assert gc.lr_lambda(cfg)(9) == 1.0


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
    (["--vllm_importance_sampling_mode", "seq"], "--vllm_importance_sampling_mode"),
    (["--dtype", "float16"], "--dtype"),
    (["--lr_scheduler_type", "step"], "--lr_scheduler_type"),
    (["--save_steps", "3", "--num_iterations", "2"], "--save_steps"),
    (["--resume_from_checkpoint", "/nonexistent"], "--resume_from_checkpoint"),
    (["--weight_push_bucket_mb", "0"], "--weight_push_bucket_mb"),
    (["--fsdp_cpu_offload"], "--fsdp_cpu_offload"),  # without --fsdp
    (["--importance_sampling_level", "seq"], "--importance_sampling_level"),
    (["--top_entropy_quantile", "1.5"], "--top_entropy_quantile"),
    (["--entropy_coef", "nan"], "--entropy_coef"),
    (["--dynamic_sampling_factor", "0.5"], "--dynamic_sampling_factor"),
    (["--dynamic_sampling_factor", "inf"], "--dynamic_sampling_factor"),
])
def test_bad_flags_rejected_with_the_flag_named(argv, flag):
    with pytest.raises(gc.ConfigError, match=flag):
        gc.parse_args(argv)


def test_bad_tp_for_world(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(gc.ConfigError, match="--vllm_tensor_parallel_size"):
        gc.parse_args(["--vllm_tensor_parallel_size", "3"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusals")
@pytest.mark.parametrize("argv,flag", [
    (["--vllm_enable_sleep_mode", "true"], "--vllm_enable_sleep_mode"),
    (["--fsdp", "--fsdp_cpu_offload"], "--fsdp_cpu_offload"),
])
def test_gpu_only_flags_refused_on_cpu(argv, flag):
    with pytest.raises(gc.ConfigError, match=flag):
        gc.parse_args(argv)


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


def test_resume_latest_needs_a_complete_checkpoint(tmp_path):
    (tmp_path / "checkpoint-3.tmp").mkdir()  # a save that was cut short does not count
    with pytest.raises(gc.ConfigError, match="--resume_from_checkpoint"):
        gc.parse_args(["--output_dir", str(tmp_path), "--resume_from_checkpoint", "latest"])


def test_model_missing():
    with pytest.raises(gc.ConfigError, match="--model"):
        gc.load_model_config(gc.Config(model="/nonexistent/model-dir"))


SMOL_SHAPE = SimpleNamespace(num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192)


@pytest.mark.parametrize("flags,flag", [
    ({"vllm_tensor_parallel_size": 2}, "--vllm_tensor_parallel_size"),  # 9 heads / 3 KV heads: tp in {1, 3}
    ({"vllm_tensor_parallel_size": 4}, "--vllm_tensor_parallel_size"),
    ({"max_prompt_length": 4096, "max_completion_length": 8192}, "--max_prompt_length"),  # > 8192 context
])
def test_model_shape_checks(flags, flag):
    with pytest.raises(gc.ConfigError, match=flag):
        gc.check_model(gc.Config(**flags), SMOL_SHAPE)
    gc.check_model(gc.Config(vllm_tensor_parallel_size=3), SMOL_SHAPE)  # fine


def test_resume_from_another_model(tmp_path):
    (tmp_path / "grpo_config.json").write_text(json.dumps({"model": "someone/else"}))
    with pytest.raises(gc.ConfigError, match="--resume_from_checkpoint"):
        gc.check_model(gc.Config(resume_from_checkpoint=str(tmp_path)), SMOL_SHAPE)


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
    (ROWS, {"num_eval": 10}, "--num_eval"),  # no training rows left
])
def test_bad_datasets(tmp_path, rows, flags, flag):
    with pytest.raises(gc.ConfigError, match=flag):
        gc.prepare_data(data_config(tmp_path, rows, **flags))


def test_long_prompts_are_dropped_and_counted(tmp_path, capsys):
    rows = ROWS + [{"prompt": "word " * 300, "answer": "0"}]
    _, train, held = gc.prepare_data(data_config(tmp_path, rows, max_prompt_length=64, num_eval=1))
    assert len(train) + len(held) == 10
    assert "dropped 1 of" in capsys.readouterr().out


# ------------------------------------------------------------------------------------------------------------
# non-finite steps, atomic checkpoints
# ------------------------------------------------------------------------------------------------------------

def test_non_finite_step_is_skipped():
    lm = tiny_llama()
    policy = gc.Policy(lm)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    input_ids, attention, completion_mask = gc.collate([[1, 2], [3]], [[4, 5], [6, 7]], pad_id=0)
    cfg = gc.Config(num_generations=2, per_device_train_batch_size=2, gradient_accumulation_steps=1,
                    loss_type="grpo", vllm_importance_sampling_correction=False)
    env = SimpleNamespace(device=torch.device("cpu"), world=1, dtype=torch.float32)

    def batch(advantages):
        return SimpleNamespace(input_ids=input_ids, attention_mask=attention, completion_mask=completion_mask,
                               loss_mask=completion_mask.float(), advantages=torch.tensor(advantages),
                               vllm_logps=None, old_logps=None, ref_logps=None)
    before = [p.detach().clone() for p in policy.parameters()]
    sums = gc.train_step(policy, optimizer, scheduler, batch([float("nan"), 1.0]), cfg, env, {})
    assert sums["skipped"] == 1.0 and not math.isfinite(sums["grad_norm"])
    assert all(torch.equal(a, b) for a, b in zip(before, policy.parameters()))  # no update
    assert all(p.grad is None for p in policy.parameters()) and scheduler.last_epoch == 0
    sums = gc.train_step(policy, optimizer, scheduler, batch([-1.0, 1.0]), cfg, env, {})
    assert sums["skipped"] == 0.0 and not all(torch.equal(a, b) for a, b in zip(before, policy.parameters()))


def test_train_step_entropy_terms_reach_the_policy():
    """Zero advantages: no policy gradient. The entropy bonus alone still moves the weights (the entropy carries a
    gradient through Policy only when entropy_coef != 0), also with top_entropy_quantile and sequence-level ratios."""
    input_ids, attention, completion_mask = gc.collate([[1, 2], [3]], [[4, 5, 6], [7, 8]], pad_id=0)
    batch = SimpleNamespace(input_ids=input_ids, attention_mask=attention, completion_mask=completion_mask,
                            loss_mask=completion_mask.float(), advantages=torch.zeros(2), vllm_logps=None,
                            old_logps=None, ref_logps=None)
    env = SimpleNamespace(device=torch.device("cpu"), world=1, dtype=torch.float32)
    norms = []
    for flags in ({}, {"entropy_coef": 0.1}, {"entropy_coef": 0.1, "top_entropy_quantile": 0.5,
                                                 "importance_sampling_level": "sequence"}):
        cfg = gc.Config(num_generations=2, per_device_train_batch_size=2, gradient_accumulation_steps=1,
                        loss_type="grpo", vllm_importance_sampling_correction=False, **flags)
        policy = gc.wrap_policy(tiny_llama(), env, cfg)
        optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
        norms.append(gc.train_step(policy, optimizer, scheduler, batch, cfg, env, {})["grad_norm"])
    assert norms[0] == 0.0 and norms[1] > 0 and norms[2] > 0 and norms[2] != norms[1]  # the quantile: fewer tokens


def _save_twice_and_die(out, port):
    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo")
    from transformers import AutoTokenizer

    policy = gc.Policy(tiny_llama())
    optimizer = torch.optim.AdamW(policy.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    args = (gc.Config(output_dir=out), SimpleNamespace(is_main=True, device=torch.device("cpu")))
    rest = (policy, optimizer, scheduler, AutoTokenizer.from_pretrained(MODEL))
    gc.save_checkpoint(*args, 1, *rest)
    torch.save = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)  # killed half-way through the second save
    gc.save_checkpoint(*args, 2, *rest)


def test_checkpoint_killed_during_save_leaves_the_previous_one(tmp_path):
    from transformers import AutoModelForCausalLM

    out = str(tmp_path)
    child = mp.get_context("spawn").Process(target=_save_twice_and_die, args=(out, free_port()))
    child.start()
    child.join(120)
    assert child.exitcode == -signal.SIGKILL
    assert sorted(os.listdir(out)) == ["checkpoint-1", "checkpoint-2.tmp"]  # the half-written one is only a tmp dir
    AutoModelForCausalLM.from_pretrained(os.path.join(out, "checkpoint-1"))
    assert torch.load(os.path.join(out, "checkpoint-1", "trainer_state.pt"), weights_only=False)["step"] == 1
    assert gc.latest_checkpoint(out) == os.path.join(out, "checkpoint-1")


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


def test_soft_overlong_punishment():
    # L_max 20, L_cache 0.2 * 20 = 4: 0 up to 16 tokens, then -1/4 per token, -1 at 20 and beyond (TRL's doc
    # example, L_max 100 and L_cache 20: 90 tokens -> -0.5)
    ids = [[7] * n for n in (0, 16, 17, 18, 20, 25)]
    assert rf.soft_overlong_punishment(None, None, ids, 20) == [0.0, 0.0, -0.25, -0.5, -1.0, -1.0]
    assert rf.soft_overlong_punishment(None, None, [[7] * 90], 100) == [-0.5]


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

def test_select_groups_varied_first_then_fillers():
    zero_std = torch.tensor([True, False, True, False, False])
    assert gc.select_groups(zero_std, 2).tolist() == [1, 3]  # the first groups whose rewards vary
    assert gc.select_groups(zero_std, 4).tolist() == [1, 3, 4, 0]  # too few vary: zero-std fillers, in order


def constant_on_even_prompts(prompts, completions, **columns):  # prompt "k": reward len(completion) for odd k
    return [1.0 if int(p) % 2 == 0 else float(len(c)) for p, c in zip(prompts, completions)]


def stand_in_rollout(monkeypatch, prompt_numbers, factor):
    """rollout() on prompts "0", "1", ... with a stand-in for generate (completion j of prompt k: j + 1 tokens of
    k), G = 2, 2 prompts per step, so factor 2 draws 4 prompts."""
    cfg = gc.Config(num_generations=2, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                    dynamic_sampling_factor=factor, vllm_importance_sampling_correction=False)
    rows = [{"prompt": str(k), "answer": "", "prompt_ids": [100 + k]} for k in prompt_numbers]

    def generate(llm, env, prompt_ids, *args):
        return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[48 + ids[0] - 100] * (j + 1), finish_reason="stop")
                                         for j in range(2)]) for ids in prompt_ids]
    monkeypatch.setattr(gc, "generate", generate)
    monkeypatch.setattr(gc, "sampling_params", lambda *args, **kwargs: None)  # no vllm import
    env = SimpleNamespace(tp=1, world=1, rank=0, engine_index=0, device=torch.device("cpu"))
    return gc.rollout(None, cfg, env, CharTokenizer(), rows, [constant_on_even_prompts], torch.ones(1), 0, {})


def test_dynamic_sampling_keeps_only_varied_groups(monkeypatch):
    batch = stand_in_rollout(monkeypatch, [0, 1, 2, 3], factor=2)  # prompts 0 and 2 have constant rewards
    assert batch.input_ids[:, 0].tolist() == [101, 101, 103, 103]  # only prompts 1 and 3 are trained on
    assert batch.stats["zero_std"].tolist() == [0.0, 0.0] and batch.loss_mask.sum() == 6  # 1 + 2 tokens each
    assert batch.stats["generated"].tolist() == [4, 2, 12]  # groups, varied groups, completion tokens
    off = stand_in_rollout(monkeypatch, [0, 1], factor=1)  # off: zero-std groups are trained on, as plain GRPO does
    assert off.stats["zero_std"].tolist() == [1.0, 0.0] and off.loss_mask.sum() == 6


def test_dynamic_sampling_tops_up_with_masked_zero_std_groups(monkeypatch):
    batch = stand_in_rollout(monkeypatch, [0, 1, 2, 4], factor=2)  # only prompt 1 varies: one filler group, masked out
    assert batch.input_ids[:, 0].tolist() == [101, 101, 100, 100]
    assert batch.stats["zero_std"].tolist() == [0.0, 1.0]
    assert batch.loss_mask.sum(1).tolist() == [1.0, 2.0, 0.0, 0.0]  # the filler never reaches the loss


# ------------------------------------------------------------------------------------------------------------
# TP gather/slice with 4 real processes, tp = 2
# ------------------------------------------------------------------------------------------------------------

def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tp_worker(rank, world, port, results):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    tp_group, _ = dist.new_subgroups_by_enumeration([[0, 1], [2, 3]])
    mine = [f"r{rank}-p{i}" for i in range(rank + 1)]  # unequal counts per rank on purpose
    seen = []

    def engine(requests):  # one "engine" per TP group: it must see the same requests on both of its ranks
        seen.append(list(requests))
        return [f"out({r})" for r in requests]
    # str hashes are salted per process: fingerprint with a stable hash (the trainer hashes ints, which are not)
    got = gc.tp_generate(engine, mine, tp_group, 2, fingerprint=lambda outs: zlib.crc32(repr(outs).encode()))
    # top_entropy_quantile's threshold spans every rank's micro-batch: rank r holds r + 1 tokens of entropy
    # 10 r + 1 .. 10 r + r + 1 (and one masked token of 99), so all ranks see 1, 11, 12, 21, 22, 23, 31, .., 34
    entropy = torch.tensor([[10.0 * rank + i + 1 for i in range(rank + 1)] + [99.0]])
    mask = torch.tensor([[1.0] * (rank + 1) + [0.0]])
    results[rank] = (mine, got, seen[0], gc.entropy_quantile(entropy, mask, 0.5, world).item())
    dist.destroy_process_group()


def test_tp_gather_slice_four_ranks():
    results = mp.Manager().dict()
    mp.spawn(_tp_worker, args=(4, free_port(), results), nprocs=4, join=True)
    for rank in range(4):
        mine, got, seen, threshold = results[rank]
        assert threshold == 22.5  # the median of the 10 tokens of all ranks, the same on every rank
        assert got == [f"out({p})" for p in mine]  # exactly the completions of its own prompts
        partner = rank ^ 1
        assert seen == results[partner][2]  # both ranks of the group submitted identical requests
        assert len(seen) == len(mine) + len(results[partner][0])


# ------------------------------------------------------------------------------------------------------------
# FSDP2 vs DDP, 2 gloo ranks: same losses, same weights, and a sharded checkpoint that resumes exactly
# ------------------------------------------------------------------------------------------------------------

FSDP_VS_DDP = '''
import json, os, sys, torch
sys.path.insert(0, {here!r})
import grpo_colocate as gc
from types import SimpleNamespace
flags = ["--model", {model!r}, "--output_dir", {out!r}, "--num_generations", "4", "--per_device_train_batch_size",
         "4", "--gradient_accumulation_steps", "2", "--learning_rate", "1e-3", "--weight_decay", "0.1",
         "--max_grad_norm", "0.5", "--vllm_importance_sampling_correction", "false", "--weight_push_bucket_mb", "1"]
ddp_cfg, fsdp_cfg = gc.parse_args(flags), gc.parse_args(flags + ["--fsdp", "--gradient_checkpointing"])
env = gc.setup_distributed(ddp_cfg)
torch.manual_seed(env.rank)  # each rank its own batch: 8 completions of random lengths
prompts = [torch.randint(1, 60, (int(torch.randint(2, 6, ()).item()),)).tolist() for _ in range(8)]
completions = [torch.randint(1, 60, (int(torch.randint(1, 7, ()).item()),)).tolist() for _ in range(8)]
input_ids, attention, completion_mask = gc.collate(prompts, completions, pad_id=0)
batch = SimpleNamespace(input_ids=input_ids, attention_mask=attention, completion_mask=completion_mask,
                        loss_mask=completion_mask.float(), advantages=torch.randn(8), vllm_logps=None,
                        old_logps=None, ref_logps=None)

def build(cfg, path):
    policy = gc.wrap_policy(gc.load_lm(path, "cpu"), env, cfg)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
    return policy, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, gc.lr_lambda(cfg))

def weights(policy):  # full fp32 tensors, gathered through the push's own bucketed path
    return {{n: t.clone() for n, t in gc.full_weights(gc.unwrap(policy).lm, torch.float32, env.device, 1 << 20)}}

def steps(run, cfg, n):
    return [gc.train_step(*run, batch, cfg, env, {{}}) for _ in range(n)]

ddp, fsdp = build(ddp_cfg, {model!r}), build(fsdp_cfg, {model!r})
result = {{"sharded": all(isinstance(p, gc.DTensor) for p in fsdp[0].parameters())}}
result["ddp"], result["fsdp"] = steps(ddp, ddp_cfg, 2), steps(fsdp, fsdp_cfg, 2)
base, w_ddp, w_fsdp = weights(build(ddp_cfg, {model!r})[0]), weights(ddp[0]), weights(fsdp[0])
result["max_weight_diff"] = max((w_ddp[n] - w_fsdp[n]).abs().max().item() for n in w_ddp)
result["min_weight_move"] = min((w_ddp[n] - base[n]).abs().max().item() for n in w_ddp)
ckpt = gc.save_checkpoint(fsdp_cfg, env, 2, *fsdp, gc.load_tokenizer({model!r}))  # sharded -> HF + DCP
resumed = build(fsdp_cfg, ckpt)
gc.load_optimizer(ckpt, resumed[0], resumed[1])
resumed[2].load_state_dict(torch.load(os.path.join(ckpt, "trainer_state.pt"), weights_only=False)["scheduler"])
result["resumed_weight_diff"] = max((weights(resumed[0])[n] - w_fsdp[n]).abs().max().item() for n in w_fsdp)
result["step3_fsdp"], result["step3_resumed"] = steps(fsdp, fsdp_cfg, 1), steps(resumed, fsdp_cfg, 1)
result["step3_ddp"] = steps(ddp, ddp_cfg, 1)
if env.rank == 0:
    print("RESULT", json.dumps(result))
torch.distributed.destroy_process_group()
'''


def test_fsdp2_matches_ddp_and_resumes_from_its_checkpoint(tmp_path):
    """2 optimizer steps with DDP and with FSDP2 (+ activation checkpointing) from the same weights on the same
    per-rank batches: the same losses and the same updated weights to fp32 tolerance. Then the FSDP2 run's
    checkpoint (full HF weights gathered to rank 0, AdamW shards through torch.distributed.checkpoint) resumes to
    the same weights and the same third step."""
    from transformers import AutoTokenizer

    model_dir = str(tmp_path / "tiny-llama")
    tiny_llama().save_pretrained(model_dir)
    AutoTokenizer.from_pretrained(MODEL).save_pretrained(model_dir)
    script = tmp_path / "fsdp_vs_ddp.py"
    script.write_text(FSDP_VS_DDP.format(here=HERE, model=model_dir, out=str(tmp_path / "out")))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", str(script)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-5000:]
    r = json.loads(proc.stdout.split("RESULT ", 1)[1].splitlines()[0])
    assert r["sharded"]
    for ddp, fsdp in zip(r["ddp"] + r["step3_ddp"], r["fsdp"] + r["step3_fsdp"]):
        for key in ("loss", "grad_norm", "clip_ratio/region", "entropy"):
            assert close(ddp[key], fsdp[key], 1e-5), (key, ddp[key], fsdp[key])
    assert r["min_weight_move"] > 1e-4  # every tensor was updated (lr 1e-3)...
    assert r["max_weight_diff"] < 1e-5  # ...and identically by both
    assert r["resumed_weight_diff"] == 0.0  # the checkpoint holds the exact fp32 masters
    for key in ("loss", "grad_norm", "entropy"):
        assert close(r["step3_resumed"][0][key], r["step3_fsdp"][0][key], 1e-6), key


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
    "grad_norm", "logprob_gap", "is_weight/mean", "parity_gap", "time/generate", "time/reward", "time/logprobs",
    "time/train", "time/optimizer", "time/push", "time/sleep", "time/other", "time/step", "tokens_per_sec_per_gpu",
]
NOT_REPRODUCIBLE = ("time/", "tokens_per_sec", "generate_tokens_per_sec")
DYNAMIC = ["--dynamic_sampling_factor", "2"]  # the two-rank run and its resume: 4 prompts generated, 2 trained


def run_trainer(args, nproc=2, timeout=900, check=True, **env_extra):
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
           "--master_addr=127.0.0.1", f"--master_port={free_port()}", os.path.join(HERE, "grpo_colocate.py"), *args]
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
    proc = run_trainer(["--model", MODEL, *SMALL, *DYNAMIC, "--max_steps", "2", "--save_steps", "1",
                        "--eval_steps", "2", "--output_dir", out])
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
    assert "eval/accuracy_reward" in steps[-1]
    assert "step 2/2 | reward" in proc.stdout  # the stdout line


def test_e2e_dynamic_sampling(two_rank_run):
    out, proc = two_rank_run
    assert "2 prompts (of 4 generated)" in proc.stdout
    for r in read_metrics(out):
        if "reward" in r:  # twice the prompts generated; of their groups, the share whose rewards vary
            assert r["dynamic_sampling/generated_per_trained_token"] > 1
            varied = r["dynamic_sampling/informative_fraction"] * 8  # of the 2 ranks x 4 groups generated
            trained_varied = (1 - r["frac_reward_zero_std"]) * 4  # of the 2 x 2 groups trained
            # each rank trains on up to 2 of its own varied groups before any zero-std filler
            assert min(varied, 2) - 1e-6 <= trained_varied <= min(varied, 4) + 1e-6, (varied, trained_varied)


def test_e2e_parity_checked_after_every_push(two_rank_run):
    out, proc = two_rank_run
    for r in read_metrics(out):
        if "reward" in r:
            assert 0 <= r["parity_gap"] < 1e-4  # fp32 on the CPU: trainer and engine agree to ~1e-5
            assert r["time/push"] > 0 and r["push_gb"] > 0.5  # 134.5M fp32 params
            assert r["logprob_gap"] < 1e-3  # the sampled tokens too


def test_e2e_policy_changed_and_checkpoint_loads_in_transformers(two_rank_run):
    from transformers import AutoModelForCausalLM

    out, _ = two_rank_run
    ckpt = os.path.join(out, "checkpoint-2")
    assert not os.path.exists(ckpt + ".tmp")
    trained = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    base = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)
    moved = [n for (n, p), (_, q) in zip(trained.named_parameters(), base.named_parameters()) if not torch.equal(p, q)]
    assert len(moved) > 100  # nearly every tensor moved
    assert torch.load(os.path.join(ckpt, "trainer_state.pt"), weights_only=False)["step"] == 2
    assert json.load(open(os.path.join(ckpt, "grpo_config.json")))["model"] == MODEL


def test_e2e_resume_reproduces_step_two(two_rank_run, tmp_path):
    out, _ = two_rank_run
    resumed = str(tmp_path / "resumed")
    run_trainer(["--model", MODEL, *SMALL, *DYNAMIC, "--max_steps", "2", "--eval_steps", "2",
                 "--output_dir", resumed,
                 "--resume_from_checkpoint", os.path.join(out, "checkpoint-1")])
    want = [r for r in read_metrics(out) if r["step"] == 2][0]
    got = [r for r in read_metrics(resumed) if r["step"] == 2][0]
    assert set(got) == set(want)
    for key in want:
        if key.startswith(NOT_REPRODUCIBLE):
            continue
        assert close(got[key], want[key], 1e-6), (key, got[key], want[key])
    assert got["completion_length/mean"] == want["completion_length/mean"]  # the same sampled completions
    assert got["reward"] == want["reward"]


def test_e2e_tp2_tiny_llama_with_other_flags(tmp_path):
    """tp=2 on 2 ranks (one engine over both), with the non-default paths: FSDP2 with activation checkpointing and a
    1 MB push bucket (every rank gathers full tensors for the shared engine), a local dataset with other column
    names, beta > 0 (a sharded reference model), num_iterations 2 (old logps), grpo loss, batch-scaled rewards,
    token-level truncated IS, masked truncation, clip-higher, three weighted reward functions (one the soft overlong
    punishment), a cosine schedule, fixed-length generations, GSPO sequence-level ratios (with a tiny epsilon, so that
    step 2's ratios get clipped), the entropy bonus and top_entropy_quantile (its threshold gathered over 2 ranks)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(MODEL)
    model_dir = str(tmp_path / "tiny-llama")
    tiny_llama(vocab=len(tok), hidden=256).save_pretrained(model_dir)  # head_dim 64: vLLM-CPU's attention needs it
    tok.save_pretrained(model_dir)
    data = tmp_path / "data.jsonl"
    with open(data, "w") as f:
        for i in range(40):
            f.write(json.dumps({"question": f"What is {i} + 1?", "solution": f"{i} + 1 = {i + 1}\n#### {i + 1}"}) + "\n")
    out = str(tmp_path / "out")
    proc = run_trainer([
        "--model", model_dir, "--vllm_tensor_parallel_size", "2", "--fsdp", "--gradient_checkpointing",
        "--weight_push_bucket_mb", "1", "--dataset", str(data),
        "--prompt_column", "question", "--answer_column", "solution", "--num_eval", "4",
        "--num_generations", "4", "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2",
        "--max_prompt_length", "64", "--max_completion_length", "16", "--ignore_eos",
        "--max_steps", "2", "--num_iterations", "2", "--beta", "0.05", "--loss_type", "grpo",
        "--scale_rewards", "batch", "--vllm_importance_sampling_mode", "token_truncate",
        "--mask_truncated_completions", "false", "--epsilon", "1e-4", "--epsilon_high", "0.28",
        "--importance_sampling_level", "sequence", "--entropy_coef", "0.01", "--top_entropy_quantile", "0.5",
        "--reward_funcs", "reward_len", "format_reward", "soft_overlong_punishment",
        "--reward_weights", "0.1", "1.0", "1.0",
        "--temperature", "0.9", "--top_p", "0.95", "--top_k", "50", "--lr_scheduler_type", "cosine",
        "--warmup_steps", "1", "--weight_decay", "0.01", "--max_grad_norm", "0.5", "--seed", "7",
        "--learning_rate", "1e-4", "--eval_steps", "2", "--eval_split", "train", "--dataset_split", "train",
        "--logging_steps", "2", "--save_steps", "-1", "--output_dir", out])
    assert "trainer FSDP2 + activation checkpointing" in proc.stdout
    records = read_metrics(out)
    steps = [r for r in records if "reward" in r]
    assert [r["step"] for r in steps] == [2]  # logging_steps 2
    r = steps[0]
    assert r["completion_length/min"] == r["completion_length/max"] == 16  # ignore_eos: fixed length
    assert r["parity_gap"] < 1e-4 and "rewards/reward_len" in r and "rewards/format_reward" in r
    assert "time/generate" not in r  # num_iterations 2: step 2 reuses step 1's rollout...
    assert r["kl"] > 0  # ...after one update, so the policy has left the reference
    assert r["rewards/soft_overlong_punishment"] == -1.0  # every completion has max_completion_length tokens
    # sequence level: a sequence is clipped whole, so of the 16 x 16 tokens a multiple of 16 are (token level: 118)
    clipped = r["clip_ratio/low"] * 16 * 16
    assert clipped > 0 and abs(clipped - 16 * round(clipped / 16)) < 1e-6, clipped
    assert "eval/reward_len" in records[0] and "eval/reward_len" in r
    assert not [d for d in os.listdir(out) if d.startswith("checkpoint")]  # save_steps -1: never


# ------------------------------------------------------------------------------------------------------------
# faults: a crash on one rank, steps that keep going non-finite, a stale engine
# ------------------------------------------------------------------------------------------------------------

FAILING_REWARD = '''
import os, time
calls = 0
def boom(prompts, completions, **columns):
    global calls
    calls += 1
    if os.environ["RANK"] == "1" and calls == 2:  # rank 1, step 2
        open(os.environ["BOOM_FILE"], "w").write(repr(time.time()))
        raise ValueError("boom on rank 1 at step 2")
    return [0.0] * len(completions)
'''


def test_a_crash_on_one_rank_ends_every_rank(tmp_path):
    (tmp_path / "failing_rewards.py").write_text(FAILING_REWARD)
    out, boom_file = str(tmp_path / "out"), str(tmp_path / "boom")
    proc = run_trainer(["--model", MODEL, *SMALL, "--reward_funcs", "accuracy_reward", "failing_rewards:boom",
                        "--max_steps", "4", "--eval_steps", "0", "--output_dir", out], check=False,
                       PYTHONPATH=f"{tmp_path}:{os.environ.get('PYTHONPATH', '')}", BOOM_FILE=boom_file)
    seconds_after_the_error = time.time() - float(open(boom_file).read())
    assert proc.returncode != 0
    print(f"every rank ended {seconds_after_the_error:.1f} s after the error")
    assert seconds_after_the_error < 60, seconds_after_the_error  # nobody waited in a collective
    assert proc.stderr.count("ValueError: boom on rank 1 at step 2") == 1  # the first error, printed once
    assert subprocess.run(["pgrep", "-f", out], capture_output=True).returncode == 1


def test_non_finite_steps_in_a_row_stop_the_run(tmp_path):
    # a learning rate of 1e30 turns every weight into +-1e30 after the first update; num_iterations 4 keeps the
    # engine out of it (no push before step 4), so steps 2, 3 and 4 compute non-finite losses on the same batch
    from transformers import AutoTokenizer

    model_dir = str(tmp_path / "tiny-llama")
    tiny_llama(vocab=len(AutoTokenizer.from_pretrained(MODEL)), hidden=256).save_pretrained(model_dir)
    AutoTokenizer.from_pretrained(MODEL).save_pretrained(model_dir)
    proc = run_trainer(["--model", model_dir, "--num_generations", "4", "--per_device_train_batch_size", "4",
                        "--gradient_accumulation_steps", "1", "--max_prompt_length", "96", "--max_completion_length",
                        "8", "--num_eval", "4", "--max_steps", "4", "--num_iterations", "4", "--eval_steps", "0",
                        "--reward_funcs", "reward_len", "--learning_rate", "1e30", "--max_grad_norm", "0",
                        "--output_dir", str(tmp_path / "out")], nproc=1, check=False)
    assert proc.returncode == 1
    assert "step 4: 3 steps in a row had a non-finite loss or gradient" in proc.stderr
    assert "step 2: non-finite loss or gradient" in proc.stdout


STALE_ENGINE = '''
import json, sys, torch
sys.path.insert(0, {here!r})
import grpo_colocate as gc
cfg = gc.parse_args(["--model", {model!r}, "--output_dir", {out!r}, "--num_generations", "4",
                     "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "1",
                     "--max_prompt_length", "96", "--max_completion_length", "16", "--num_eval", "4"])
env = gc.setup_distributed(cfg)
tokenizer, rows, eval_rows = gc.prepare_data(cfg)
llm = gc.make_engine(cfg, env, gc.load_model_config(cfg))
policy = gc.wrap_policy(gc.load_lm(cfg.model, env.device), env, cfg)
probe = eval_rows[0]["prompt_ids"] + tokenizer("#### 1", add_special_tokens=False)["input_ids"]
result = {{"fresh": gc.sync_engine(llm, policy, env, probe, {{}}, 0, 1)["parity_gap"]}}

def sample(seed):  # the rollout seeding the trainer uses
    torch.manual_seed(gc.derive_seed(seed, "rollout", 0, env.engine_index))
    out = gc.generate(llm, env, [rows[0]["prompt_ids"]], gc.sampling_params(cfg))
    return [list(c.token_ids) for c in out[0].outputs]
result["same_seed_same_rollout"] = sample(1) == sample(1)
result["other_seed_other_rollout"] = sample(1) != sample(2)

# one optimizer step on the trainer and NO push: the engine is stale
optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-5)
ids = torch.tensor([probe])
logps, _ = policy(ids, torch.ones_like(ids), torch.ones_like(ids[:, 1:]), 1.0)
(-logps.mean()).backward()
optimizer.step()
try:
    gc.check_parity(llm, policy, probe, env, step=7)
    result["stale_caught"] = False
except RuntimeError as e:
    result["stale_caught"] = "step 7" in str(e)
gc.push_weights(llm, gc.unwrap(policy).lm, env, 1)  # 1 MB buckets: most buckets hold a tensor or two
result["after_push"] = gc.check_parity(llm, policy, probe, env, step=7)
lm = gc.unwrap(policy).lm  # the tensors the CPU backend keeps unpacked, compared exactly
engine = llm.apply_model(lambda m: [m.model.embed_tokens.weight.clone(), m.model.norm.weight.clone(),
                                    m.model.layers[0].input_layernorm.weight.clone()])[0]
result["weights_equal"] = all(torch.equal(a, b.detach()) for a, b in zip(engine, [
    lm.model.embed_tokens.weight, lm.model.norm.weight, lm.model.layers[0].input_layernorm.weight]))
print("RESULT", json.dumps(result))
del llm
torch.distributed.destroy_process_group()
'''


def test_parity_check_catches_a_stale_engine(tmp_path):
    script = tmp_path / "stale.py"
    script.write_text(STALE_ENGINE.format(here=HERE, model=MODEL, out=str(tmp_path / "out")))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-5000:]
    result = json.loads(proc.stdout.split("RESULT ", 1)[1].splitlines()[0])
    assert result["fresh"] < 1e-4 and result["after_push"] < 1e-4
    assert result["stale_caught"] and result["weights_equal"]
    assert result["same_seed_same_rollout"] and result["other_seed_other_rollout"]
