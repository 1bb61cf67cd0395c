"""precision_bench.py: the train phase alone (no engine), by precision path and logprob-chunk implementation.

    python bench/precision_bench.py all [SHAPES...]        # the variants of $VARIANTS, each in a fresh process
    python bench/precision_bench.py one SHAPE VARIANT [--profile FILE]
    python bench/precision_bench.py check                  # today's hand-written chunk vs autograd (gradients)
    PREC_BUDGET=TOKENS ...                                 # micro-batches of TOKENS, not the memory plan's budget

One rank's generation batch as train_step sees it: 32 prompts x G 8, prompts of 30-60 tokens, 256-token completions,
random weights of the shape, grpo_colocate's defaults (dapo, IS correction, the memory plan's token budget and
checkpointing: train_bench.py's setup). Prints one JSON line per run: seconds of step 1 (compiles included) and the
median of steps 3-6 (train + optimizer), MFU (6 N per prompt + completion token), peak memory, and mean |logp - logp
of `main`| on the batch before any update (precision drift). The batch's vLLM logprobs are NaN, as train_bench.py's
(IS weight 1 and canary gap 0, the same ops): the one batch is trained on at every step, with no engine to push to.

A variant is `main` or words joined by '-', each changing one thing of `main`:
    main       the trainer as it is (the module is the working tree's grpo_colocate.py): fp32 parameters under bf16
               autocast, gc.wrap_policy (each decoder layer compiled whole on CUDA), gc.TokenLogprobs with its
               compiled kernels (gc.COMPILED)
    manual     TokenLogprobs' kernels eager (logit_stats, logit_grads not compiled)
    eager      the chunk before issue 24 instead (autograd through a checkpoint per chunk, kept in
               logprobs_bench.py as an OLD variant), eager
    ckpt       the same chunk compiled, as CUDA ran it before issue 24 (its graphs compile for about a minute)
    noregions  no part of the layers compiled
    parts      each layer's norms and MLP compiled, not the layer whole (the trainer at 9eacaa1)
    fsdp       FSDP2 on one rank: fp32 masters, bf16 compute parameters (MixedPrecisionPolicy), as --fsdp
    keep       with fsdp: reshard_after_forward=False (bf16 copies kept from forward to backward)
    bf16       plain bf16 parameters and AdamW, no masters (an upper bound for bf16 compute)
    attn       with parts: each layer's self-attention compiled too (projections' casts, RoPE, the attention's casts)
    onecast    train_step inside one outer autocast context: autocast caches each fp32 weight's bf16 copy until the
               outermost context exits, so the eager linears cast their weights once a step, not once a micro-batch
BENCHMARKS.md "The train phase" names its rows by these variants. The fuller table of 906b95e (in git history) in
these words (its `main` was the chunk before issue 24, its `manual` and `cchunk` the hand-written chunk that became
TokenLogprobs, and no norms or MLP were compiled unless `regions`):
main = ckpt-noregions, eager = eager-noregions, manual = manual-noregions, fsdp = fsdp-ckpt-noregions,
fsdp-manual = fsdp-manual-noregions, fsdp-keep = fsdp-keep-manual-noregions, fsdp-regions = fsdp-keep-manual, bf16 = bf16-manual-noregions,
manual-regions = manual, cchunk = noregions, cchunk-regions = main (adopted), fsdp-cchunk-regions = fsdp-keep,
bf16-cchunk-regions = bf16.

Updated to the API of issue 33: today's setup (setup_env, setup_distributed), memory_plan(cfg, env, model_config,
num_params), train_step's budget and step, the batch's model_mask, transformers' get_scheduler (lr_lambda is gone);
the chunk variants swap gc.TokenLogprobs or gc.COMPILED (gc.chunked_logprobs, gc._logprobs_and_entropy and
gc._compiled_logprobs_and_entropy are gone; the hand-written chunk this driver carried is the trainer's
TokenLogprobs since issue 24, so it uses that). The .stage/i24 module is no longer read. Verified on the CPU only:
pyflakes, `check`, and `one` of a tiny shape with a small batch for main, manual, eager, noregions,
eager-noregions, ckpt-noregions, bf16, bf16-manual, fsdp, fsdp-keep and fsdp-keep-manual (on the CPU in fp32: no
autocast, no compiled norms or MLP, sdpa attention). Not run on a GPU after the update: the CUDA paths (bf16
autocast, compiled kernels and regions, varlen attention, FSDP2's bf16 compute, peak memory) and every timing.
"""

import contextlib
import dataclasses
import functools
import json
import os
import statistics
import subprocess
import sys
import time

import torch
from torch.utils.checkpoint import checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import grpo_colocate as gc  # noqa: E402
import train_bench as tb  # noqa: E402 (SHAPES and the one-rank setup: the same batch and env as train_bench.py)
from logprobs_bench import pre24_chunked_logprobs, pre24_logprobs_and_entropy  # noqa: E402

WORDS = ("manual", "eager", "ckpt", "noregions", "fsdp", "keep", "bf16", "parts", "attn", "onecast")
BATCH = (32, 8, 256)  # prompts, G, completion tokens


def parse(variant: str) -> set:
    words = set() if variant == "main" else set(variant.split("-"))
    unknown = words - set(WORDS)
    if unknown or len(words & {"manual", "eager", "ckpt"}) > 1 or "keep" in words and "fsdp" not in words:
        raise SystemExit(f"variant {variant!r}: main, or words of {WORDS} joined by '-' (one chunk word at most; "
                         "keep needs fsdp)")
    return words


class Pre24Logprobs:
    """[OLD] stands in for gc.TokenLogprobs in Policy.forward: the chunk before issue 24 (pre24_chunked_logprobs,
    logprobs_bench.py), eager or compiled. Policy detaches the entropy (no --entropy_coef), as this chunk did."""

    chunk = staticmethod(pre24_logprobs_and_entropy)

    @classmethod
    def apply(cls, hidden, weight, targets, temperature, top_k, top_p, chunk_size):
        return pre24_chunked_logprobs(hidden, weight, targets, temperature, chunk_size, top_k, top_p,
                                      chunk=cls.chunk)


def use_chunk(words):
    """The logprob chunk of the variant, patched into this process's grpo_colocate."""
    if "manual" in words:
        for f in list(gc.COMPILED):
            gc.COMPILED[f] = f
    if "eager" in words or "ckpt" in words:
        if "ckpt" in words:  # as _compiled_logprobs_and_entropy was
            Pre24Logprobs.chunk = staticmethod(torch.compile(pre24_logprobs_and_entropy, dynamic=True))
        gc.TokenLogprobs = Pre24Logprobs


def build(lm, words, env, cfg, checkpointing):
    """The policy of a variant: gc.wrap_policy itself (main, bf16, fsdp), or its steps here, changed (noregions,
    parts, attn, keep)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if "bf16" in words:
        lm = lm.to(torch.bfloat16)
    if not words & {"noregions", "keep", "parts", "attn"}:
        return gc.wrap_policy(lm, env, dataclasses.replace(cfg, fsdp="fsdp" in words), checkpointing)
    policy = gc.Policy(lm)
    layers = lm.get_decoder().layers
    regions = ("mlp", "self_attn") if "attn" in words else ("mlp",)
    for layer in layers if "noregions" not in words and gc.compiled(env.device) else ():
        if not words & {"parts", "attn"}:  # as the trainer: each layer whole
            layer.compile(dynamic=True)
            continue
        for name, module in layer.named_children():
            if name in regions or name.endswith("norm"):
                module.compile(dynamic=True)
    for layer in layers if checkpointing else ():
        layer.forward = functools.partial(checkpoint, layer.forward, use_reentrant=False)
    if "fsdp" not in words:
        return policy
    shard = dict(mp_policy=MixedPrecisionPolicy(param_dtype=env.dtype, reduce_dtype=torch.float32),
                 reshard_after_forward="keep" not in words)
    for layer in layers:
        fully_shard(layer, **shard)
    return fully_shard(policy, **shard)


def check():
    """Today's hand-written gradients (gc.TokenLogprobs) against autograd through the chunk before issue 24
    (float64, CPU or GPU; the kernels are compiled on CUDA), without and with top-k / top-p."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    h = torch.randn(300, 64, device=device, dtype=torch.float64, requires_grad=True)
    w = torch.randn(500, 64, device=device, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, 500, (300,), device=device)
    gl, ge = torch.randn(300, device=device, dtype=torch.float64), torch.randn(300, device=device, dtype=torch.float64)
    for top_k, top_p in ((0, 1.0), (50, 0.9)):
        h.grad = w.grad = None
        lp, ent = pre24_logprobs_and_entropy(h, w, y, 0.7, top_k, top_p, entropy_grad=True)
        torch.autograd.backward([lp, ent], [gl, ge])
        ref = h.grad.clone(), w.grad.clone(), lp.detach(), ent.detach()
        h.grad = w.grad = None
        lp2, ent2 = gc.TokenLogprobs.apply(h, w, y, 0.7, top_k, top_p, 128)
        torch.autograd.backward([lp2, ent2], [gl.float(), ge.float()])
        for name, a, b in (("grad_h", h.grad, ref[0]), ("grad_w", w.grad, ref[1]), ("logp", lp2, ref[2]),
                           ("entropy", ent2, ref[3])):
            print(f"top_k {top_k} top_p {top_p}", name, "max rel diff",
                  ((a.double() - b).abs().max() / b.abs().max()).item())


def one(shape, variant, profile=None, steps=6, batch=BATCH):
    words = parse(variant)
    use_chunk(words)
    cfg = tb.bench_cfg(gc, batch)
    env = tb.setup(gc, cfg)
    cuda = env.device.type == "cuda"
    lm = tb.random_lm(gc, shape, env)
    plan = gc.memory_plan(cfg, env, lm.config, sum(p.numel() for p in lm.parameters()))
    if os.environ.get("PREC_BUDGET"):  # a micro-batch's tokens other than the plan's (fewer, larger micro-batches)
        plan.token_budget = int(os.environ["PREC_BUDGET"])
    policy = build(lm, words, env, cfg, plan.checkpointing)
    lm = gc.unwrap(policy).lm
    optimizer, scheduler = tb.optimizer_and_scheduler(cfg, env, policy)

    batch = tb.random_batch(gc, "fixed", batch)
    mask = batch.model_mask
    # precision: the batch's logprobs before any update, against those `main` computes (saved by its run)
    logps = gc.no_grad_logps(policy, batch, cfg, env, plan.token_budget)
    ref_path = f"/tmp/precision_ref_{shape}.pt"
    drift = None
    if variant == "main":
        torch.save(logps, ref_path)
    elif os.path.exists(ref_path):
        drift = ((logps - torch.load(ref_path)).abs() * mask).sum().item() / mask.sum().item()
    tokens = sum(map(len, batch.sample_prompt_ids)) + sum(map(len, batch.completion_ids))
    times = []
    for step in range(steps):
        gc.cuda_sync(env)
        start = time.perf_counter()
        with gc.autocast(env) if "onecast" in words else contextlib.nullcontext():
            stats = gc.train_step(policy, optimizer, scheduler, batch, cfg, env, plan.token_budget, {}, step + 1)
        gc.cuda_sync(env)
        times.append(time.perf_counter() - start)
        if stats["skipped"]:
            raise RuntimeError(f"step {step + 1}: train_step skipped a non-finite step")
    if profile:
        from torch.profiler import ProfilerActivity, profile as torch_profile
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with torch_profile(activities=activities) as prof, \
                gc.autocast(env) if "onecast" in words else contextlib.nullcontext():
            gc.train_step(policy, optimizer, scheduler, batch, cfg, env, plan.token_budget, {}, steps + 1)
            gc.cuda_sync(env)
        with open(profile, "w") as f:
            f.write(prof.key_averages().table(sort_by="cuda_time_total", row_limit=45, max_name_column_width=80))
    median = statistics.median(times[2:])
    peak = gc.peak_flops(env) or 989e12
    print(json.dumps({"shape": shape, "variant": variant, "step1_s": round(times[0], 2), "median_s": round(median, 4),
                      "mfu": round(6 * gc.matmul_params(lm) * tokens / median / peak, 4),
                      "microbatches": len(gc.plan_micro_batches(batch, plan.token_budget, env)), "budget": plan.token_budget,
                      "checkpointing": plan.checkpointing,
                      "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1) if cuda else None,
                      "drift_vs_main": drift}), flush=True)
    gc.dist.destroy_process_group()


if __name__ == "__main__":
    if sys.argv[1] == "check":
        check()
    elif sys.argv[1] == "one":
        prof = sys.argv[sys.argv.index("--profile") + 1] if "--profile" in sys.argv else None
        one(sys.argv[2], sys.argv[3], profile=prof)
    else:  # all: each variant in a fresh process, with a fresh inductor cache (a fresh machine's compile)
        out = os.environ.get("OUT", "/tmp/out")
        shapes = sys.argv[2:] or ["qwen2.5-1.5b", "smollm2-135m"]
        variants = os.environ.get("VARIANTS", "main manual noregions eager ckpt fsdp fsdp-keep bf16").split()
        for variant in variants:
            parse(variant)  # a misspelt one stops here, before any run
        profiled = os.environ.get("PROFILE", "").split()
        for shape in shapes:
            for variant in variants:  # `main` first: the others' drift is against its logprobs
                env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=f"/tmp/inductor-{shape}-{variant}")
                extra = ["--profile", f"{out}/profile-{shape}-{variant}.txt"] if variant in profiled else []
                subprocess.run([sys.executable, __file__, "one", shape, variant, *extra], env=env, timeout=400)
