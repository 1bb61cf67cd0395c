"""logprobs_bench.py: per-token logprobs through the lm_head, forward + backward, variants timed on one GPU.

    python bench/logprobs_bench.py [--tokens 10000] [--hidden 1536] [--vocab 151936] [--repeat 5]

The Qwen2.5-1.5B shape's lm_head by default: fp32 master weights, hidden states from the decoder, bf16 autocast as
the trainer runs it. Every variant computes logp[target] (and the logged entropy) for --tokens rows, then the
backward of sum(logp) into the hidden states and the weight. Prints one markdown table: median ms, peak GiB above
the inputs, and the max |difference| of the logprobs and of both gradients against an fp32 reference (no autocast,
no TF32, the whole [N, V] log_softmax at once). Keep the fastest variant whose differences match `current`'s.

`current` is the trainer's (issue 24 on): gc.TokenLogprobs, Policy's chunk size, the lm_head matmul in bf16 under
autocast, the log-sum-exp, entropy and backward in the compiled kernels gc.COMPILED (logit_stats, logit_grads), each
chunk's logits recomputed in backward by hand. Every other row runs the older chunk, which issue 24 replaced (its
table, measured at 5b8bd57, is in BENCHMARKS.md's git history): `pre24_logprobs_and_entropy` below, a copy of
grpo_colocate's `_logprobs_and_entropy` of its day (the fp32 logits as an [N, V] copy, autograd through a
checkpoint), kept in this driver as the old variant; its `pre-issue-24 chunk, ... recompute` row is that table's
`current`.

Updated to the API of issue 33: gc._logprobs_and_entropy and gc.chunked_logprobs are gone; `current` calls
gc.TokenLogprobs, the old chunk lives here. Verified on the CPU only (pyflakes, and each variant's forward and
backward at a small size against the fp32 reference, eager; the two torch.compile rows not run); not run on a GPU
after the update.
"""

import argparse
import math
import os
import statistics
import sys
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # grpo_colocate.py: the repo root
import grpo_colocate as gc  # noqa: E402


# ---- The old variant: the chunk before issue 24 (not in the trainer any more), kept here as it was ----
def pre24_logprobs_and_entropy(hidden, weight, targets, temperature, top_k=0, top_p=1.0, entropy_grad=False):
    """[OLD, pre-issue-24 grpo_colocate._logprobs_and_entropy] One chunk: log softmax(h W^T / temperature)[target]
    and the (full distribution's) entropy. hidden: [N, H], targets: [N]. top_k / top_p: logp = logit_target -
    logsumexp over the kept set + the target (finite in bf16)."""
    logits = F.linear(hidden, weight).float() / temperature  # [N, V] in fp32
    kept = logits
    if top_k > 0 or top_p < 1:
        mask = gc.top_k_top_p_mask(logits.detach(), top_k, top_p).scatter_(-1, targets.unsqueeze(-1), True)
        kept = logits.masked_fill(~mask, -math.inf)  # [N, V]
    logps = kept.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(kept, dim=-1)  # [N]
    with nullcontext() if entropy_grad else torch.no_grad():  # a gradient only for --entropy_coef
        # H = logz - sum_v p_v * logit_v
        entropy = torch.logsumexp(logits, dim=-1) - (torch.softmax(logits, dim=-1) * logits).sum(-1)  # [N]
    return logps, entropy


def pre24_chunked_logprobs(hidden, weight, targets, temperature=1.0, chunk_size=1024, top_k=0, top_p=1.0,
                           entropy_grad=False, chunk=pre24_logprobs_and_entropy):
    """[OLD, pre-issue-24 grpo_colocate.chunked_logprobs] Per-token logprobs and entropies, chunk_size rows at a
    time; under autograd each chunk is checkpointed (its logits recomputed in backward). chunk: the chunk function
    (pre24_logprobs_and_entropy, or its torch.compile, which CUDA ran)."""
    logps, entropies = [], []
    for rows in (slice(start, start + chunk_size) for start in range(0, hidden.shape[0], chunk_size)):
        args = (hidden[rows], weight, targets[rows], temperature, top_k, top_p, entropy_grad)
        if torch.is_grad_enabled():
            lp, ent = checkpoint(chunk, *args, use_reentrant=False)
        else:
            lp, ent = chunk(*args)
        logps.append(lp)
        entropies.append(ent)
    if not logps:
        return hidden.new_zeros(0, dtype=torch.float32), hidden.new_zeros(0, dtype=torch.float32)
    return torch.cat(logps), torch.cat(entropies)  # [N], [N]


def chunked(fn, hidden, weight, targets, chunk, remat=True):
    """[OLD] pre24_chunked_logprobs's loop (temperature 1) with another chunk function `fn`, chunk size, or each
    chunk not checkpointed (remat False: its [n, V] logits kept for backward)."""
    out = []
    for s in range(0, hidden.shape[0], chunk):
        args = (hidden[s:s + chunk], weight, targets[s:s + chunk], 1.0)
        out.append(checkpoint(fn, *args, use_reentrant=False) if remat else fn(*args))
    return torch.cat([lp for lp, _ in out]), torch.cat([e for _, e in out])


def no_entropy(hidden, weight, targets, temperature):
    """[OLD] The pre-issue-24 chunk without the entropy (only logged): what the extra softmax pass costs."""
    logits = F.linear(hidden, weight).float() / temperature
    return logits.gather(-1, targets[:, None])[:, 0] - torch.logsumexp(logits, -1), logits.new_zeros(0)


def bf16_logits(hidden, weight, targets, temperature):
    """[OLD] The logits left in bf16 (no fp32 [N, V] copy) and torch's logsumexp on them: what that costs in
    numerics."""
    logits = F.linear(hidden, weight) / temperature  # bf16 under autocast
    return logits.gather(-1, targets[:, None])[:, 0].float() - torch.logsumexp(logits, -1).float(), logits.new_zeros(0)


def make_variants(hidden, weight, targets, policy_chunk, compile_old=True):
    """name -> a function computing (logps, entropies) [N] of the rows; the caller runs the backward."""
    variants = {
        f"current (gc.TokenLogprobs, {policy_chunk} rows, compiled kernels on CUDA)":
            lambda: gc.TokenLogprobs.apply(hidden, weight, targets, 1.0, 0, 1.0, policy_chunk),
        f"pre-issue-24 chunk, {policy_chunk} rows, recompute":
            lambda: chunked(pre24_logprobs_and_entropy, hidden, weight, targets, policy_chunk),
        f"pre-issue-24 chunk, no recompute, {policy_chunk} rows":
            lambda: chunked(pre24_logprobs_and_entropy, hidden, weight, targets, policy_chunk, remat=False),
        "pre-issue-24 chunk, 4096 rows, recompute":
            lambda: chunked(pre24_logprobs_and_entropy, hidden, weight, targets, 4096),
        "pre-issue-24 chunk, 8192 rows, recompute":
            lambda: chunked(pre24_logprobs_and_entropy, hidden, weight, targets, 8192),
        f"no entropy, {policy_chunk} rows": lambda: chunked(no_entropy, hidden, weight, targets, policy_chunk),
        f"bf16 logits, bf16 logsumexp, no entropy, {policy_chunk} rows":
            lambda: chunked(bf16_logits, hidden, weight, targets, policy_chunk),
    }
    if compile_old:
        compiled = torch.compile(pre24_logprobs_and_entropy, dynamic=False)
        variants.update({
            f"torch.compile of the pre-issue-24 chunk, {policy_chunk} rows":
                lambda: chunked(compiled, hidden, weight, targets, policy_chunk),
            "torch.compile of the pre-issue-24 chunk, 4096 rows":
                lambda: chunked(compiled, hidden, weight, targets, 4096),
        })
    return variants


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=10000)
    p.add_argument("--hidden", type=int, default=1536)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--repeat", type=int, default=5)
    a = p.parse_args()
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    weight = (torch.randn(a.vocab, a.hidden, device=dev, generator=g) * 0.02).requires_grad_(True)
    hidden = torch.randn(a.tokens, a.hidden, device=dev, generator=g).requires_grad_(True)
    targets = torch.randint(0, a.vocab, (a.tokens,), device=dev, generator=g)
    policy_chunk = max(1, (1 << 30) // (4 * a.vocab))  # gc.Policy's chunk_size: 1 GiB of fp32 logits per chunk

    torch.backends.cuda.matmul.allow_tf32 = False
    ref_lp = torch.log_softmax(F.linear(hidden, weight), -1).gather(-1, targets[:, None])[:, 0]
    ref_gh, ref_gw = torch.autograd.grad(ref_lp.sum(), (hidden, weight))
    ref_lp = ref_lp.detach()

    variants = make_variants(hidden, weight, targets, policy_chunk)
    print(f"lm_head {a.vocab} x {a.hidden}, {a.tokens} tokens, fp32 weights, bf16 autocast, "
          f"{torch.cuda.get_device_name()}, torch {torch.__version__}\n")
    print("| variant | ms fwd+bwd | peak GiB | max abs dlogp | max abs dgrad hidden | max abs dgrad weight |")
    print("|---|---|---|---|---|---|")
    for name, fn in variants.items():
        try:
            times = []
            for i in range(a.repeat + 2):  # 2 warm-up calls (and compilation)
                hidden.grad = weight.grad = None
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    lp, _ = fn()
                lp.sum().backward()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end))
                peak = (torch.cuda.max_memory_allocated() - base) / 2**30
            d_lp = (lp.detach().float() - ref_lp).abs().max().item()
            d_gh = (hidden.grad - ref_gh).abs().max().item()
            d_gw = (weight.grad - ref_gw).abs().max().item()
            print(f"| {name} | {statistics.median(times[2:]):.1f} | {peak:.2f} | {d_lp:.2e} | {d_gh:.2e} | "
                  f"{d_gw:.2e} |", flush=True)
        except Exception as e:  # noqa: BLE001 - one failing variant (e.g. compile) must not hide the others
            print(f"| {name} | failed: {type(e).__name__}: {str(e).splitlines()[0][:80]} | | | | |", flush=True)


if __name__ == "__main__":
    main()
