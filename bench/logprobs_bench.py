"""logprobs_bench.py: per-token logprobs through the lm_head, forward + backward, variants timed on one GPU.

    python bench/logprobs_bench.py [--tokens 10000] [--hidden 1536] [--vocab 151936] [--repeat 5]

The Qwen2.5-1.5B shape's lm_head by default: fp32 master weights, hidden states from the decoder, bf16 autocast as
the trainer runs it. Every variant computes logp[target] (and the logged entropy) for --tokens rows, then the
backward of sum(logp) into the hidden states and the weight. Prints one markdown table: median ms, peak GiB above
the inputs, and the max |difference| of the logprobs and of both gradients against an fp32 reference (no autocast,
no TF32, the whole [N, V] log_softmax at once). Keep the fastest variant whose differences match `current`'s.
`current` is the trainer's: under autocast the lm_head matmul runs in bf16, its logits are copied to fp32 and the
log-sum-exp and entropy run in fp32; in backward each chunk's logits are recomputed (checkpoint). torch.compile of
the chunk can fuse the fp32 upcast into the reductions, so that no fp32 [N, V] copy is made.
Section 0's driver: it imports the chunk of its day (`gc._logprobs_and_entropy`), which issue 24 replaced by
`TokenLogprobs` (bench/precision_bench.py measures that one): run it beside `git show 5b8bd57:grpo_colocate.py`.
"""

import argparse
import os
import statistics
import sys

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # grpo_colocate.py: the repo root
import grpo_colocate as gc  # noqa: E402


def chunked(fn, hidden, weight, targets, chunk, remat=True):
    """gc.chunked_logprobs's loop with another chunk function, chunk size, or without the recompute."""
    out = []
    for s in range(0, hidden.shape[0], chunk):
        args = (hidden[s:s + chunk], weight, targets[s:s + chunk], 1.0)
        out.append(checkpoint(fn, *args, use_reentrant=False) if remat else fn(*args))
    return torch.cat([lp for lp, _ in out]), torch.cat([e for _, e in out])


def no_entropy(hidden, weight, targets, temperature):
    """The chunk without the entropy (only logged): what the extra softmax pass costs."""
    logits = F.linear(hidden, weight).float() / temperature
    return logits.gather(-1, targets[:, None])[:, 0] - torch.logsumexp(logits, -1), logits.new_zeros(0)


def bf16_logits(hidden, weight, targets, temperature):
    """The logits left in bf16 (no fp32 [N, V] copy) and torch's logsumexp on them: what that costs in numerics."""
    logits = F.linear(hidden, weight) / temperature  # bf16 under autocast
    return logits.gather(-1, targets[:, None])[:, 0].float() - torch.logsumexp(logits, -1).float(), logits.new_zeros(0)


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
    policy_chunk = max(1, (1 << 30) // (4 * a.vocab))  # Policy's: 1 GiB of fp32 logits per chunk

    torch.backends.cuda.matmul.allow_tf32 = False
    ref_lp = torch.log_softmax(F.linear(hidden, weight), -1).gather(-1, targets[:, None])[:, 0]
    ref_gh, ref_gw = torch.autograd.grad(ref_lp.sum(), (hidden, weight))
    ref_lp = ref_lp.detach()

    compiled = torch.compile(gc._logprobs_and_entropy, dynamic=False)
    variants = {
        f"current (gc.chunked_logprobs, {policy_chunk} rows, recompute)":
            lambda: gc.chunked_logprobs(hidden, weight, targets, 1.0, policy_chunk),
        f"no recompute, {policy_chunk} rows": lambda: chunked(gc._logprobs_and_entropy, hidden, weight, targets,
                                                              policy_chunk, remat=False),
        "4096 rows, recompute": lambda: chunked(gc._logprobs_and_entropy, hidden, weight, targets, 4096),
        "8192 rows, recompute": lambda: chunked(gc._logprobs_and_entropy, hidden, weight, targets, 8192),
        f"no entropy, {policy_chunk} rows": lambda: chunked(no_entropy, hidden, weight, targets, policy_chunk),
        f"bf16 logits, bf16 logsumexp, no entropy, {policy_chunk} rows":
            lambda: chunked(bf16_logits, hidden, weight, targets, policy_chunk),
        f"torch.compile chunk, {policy_chunk} rows": lambda: chunked(compiled, hidden, weight, targets, policy_chunk),
        "torch.compile chunk, 4096 rows": lambda: chunked(compiled, hidden, weight, targets, 4096),
    }
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
