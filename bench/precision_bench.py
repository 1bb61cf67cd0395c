"""precision_bench.py: the train phase alone (no engine), by precision path and logprob-chunk implementation.

    python bench/precision_bench.py all [SHAPES...]        # every variant below, each in a fresh process
    python bench/precision_bench.py one SHAPE VARIANT [--profile FILE]
    python bench/precision_bench.py check                  # the hand-written chunk vs autograd (gradients)

One rank's generation batch as train_step sees it: 32 prompts x G 8, prompts of 30-60 tokens, 256-token completions,
random weights of the shape, grpo_colocate's defaults (dapo, IS correction, auto token budget). Prints one JSON line
per run: seconds of step 1 (compiles included) and the median of steps 3-6 (train + optimizer), MFU (6 N per prompt +
completion token), peak memory, and mean |logp - logp of `main`| on the batch before any update (precision drift).

Variants (the module is the working tree's grpo_colocate.py, or .stage/i24/grpo_colocate.py when present):
    main          fp32 parameters under bf16 autocast, the compiled logprob chunk (the code as it is)
    eager         main with the chunk eager (checkpointed autograd, no compile)
    manual        main with the hand-written autograd chunk (no compile)
    fsdp          FSDP2 on one rank: fp32 masters, bf16 compute parameters (MixedPrecisionPolicy), compiled chunk
    fsdp-manual   fsdp with the hand-written chunk
    fsdp-keep     fsdp-manual, reshard_after_forward=False (bf16 copies kept from forward to backward)
    fsdp-regions  fsdp-keep + torch.compile of each layer's RMSNorms and MLP (regional, dynamic shapes)
    bf16          plain bf16 parameters and AdamW, no masters (an upper bound for bf16 compute), manual chunk
"""

import json
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STAGED = os.path.join(ROOT, ".stage/i24")
sys.path.insert(0, STAGED if os.path.isfile(os.path.join(STAGED, "grpo_colocate.py")) else ROOT)
import grpo_colocate as gc  # noqa: E402
from train_bench import SHAPES, bench_env, random_batch  # noqa: E402


def _chunk_forward(z, targets, temperature):
    """z: [n, V] logits of a chunk -> logp of the targets, entropy, logsumexp: [n] each, fp32."""
    z = z.float() / temperature  # [n, V]
    lse = torch.logsumexp(z, dim=-1)  # [n]
    entropy = lse - (torch.exp(z - lse[:, None]) * z).sum(-1)  # [n]: H = logsumexp(z) - sum_v p_v z_v
    logps = z.gather(-1, targets[:, None]).squeeze(-1) - lse  # [n]
    return logps, entropy, lse


def _chunk_backward(z, targets, temperature, lse, entropy, grad_logps, grad_entropy, dtype):
    """dL/dz of a chunk: g_logp (onehot(y) - p) + g_H (-p (log p + H)), / T, in dtype. All but z: [n]."""
    z = z.float() / temperature  # [n, V]
    log_p = z - lse[:, None]  # [n, V]
    p = log_p.exp()
    dz = -p * (grad_logps[:, None] + grad_entropy[:, None] * (log_p + entropy[:, None]))
    dz = dz.scatter_add(-1, targets[:, None], grad_logps[:, None])
    return (dz / temperature).to(dtype)


KERNELS = {"forward": _chunk_forward, "backward": _chunk_backward}


def compile_kernels():
    KERNELS["forward"] = torch.compile(_chunk_forward, dynamic=True)
    KERNELS["backward"] = torch.compile(_chunk_backward, dynamic=True)


class ManualLogprobs(torch.autograd.Function):
    """logp_t = z_t[y_t] - logsumexp(z_t), H_t = logsumexp(z_t) - sum_v p_v z_v, z = h W^T / T, chunk_size rows at a
    time. Backward recomputes each chunk's logits and applies d logp / dz = onehot(y) - p, dH / dz = -p (log p + H)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, chunk_size):
        dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else weight.dtype
        w = weight.to(dtype)
        parts = []
        for start in range(0, len(hidden), chunk_size):
            rows = slice(start, start + chunk_size)
            z = F.linear(hidden[rows].to(dtype), w)  # [n, V]
            parts.append(KERNELS["forward"](z, targets[rows], temperature))
        logps, entropy, lse = (torch.cat(x) for x in zip(*parts))
        ctx.save_for_backward(hidden, weight, targets, lse, entropy)
        ctx.temperature, ctx.chunk_size, ctx.dtype = temperature, chunk_size, dtype
        ctx.set_materialize_grads(False)
        return logps, entropy

    @staticmethod
    def backward(ctx, grad_logps, grad_entropy):
        hidden, weight, targets, lse, entropy = ctx.saved_tensors
        if grad_logps is None and grad_entropy is None:
            return None, None, None, None, None
        grad_logps = torch.zeros_like(lse) if grad_logps is None else grad_logps
        grad_entropy = torch.zeros_like(lse) if grad_entropy is None else grad_entropy
        w = weight.to(ctx.dtype)
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros_like(weight, dtype=torch.float32)
        for start in range(0, len(hidden), ctx.chunk_size):
            rows = slice(start, start + ctx.chunk_size)
            h = hidden[rows].to(ctx.dtype)
            dz = KERNELS["backward"](F.linear(h, w), targets[rows], ctx.temperature, lse[rows], entropy[rows],
                                     grad_logps[rows], grad_entropy[rows], ctx.dtype)  # [n, V]
            grad_hidden[rows] = (dz @ w).to(hidden.dtype)
            grad_weight += (dz.T @ h).float()
        return grad_hidden, grad_weight.to(weight.dtype), None, None, None


def manual_chunked_logprobs(hidden, weight, targets, temperature=1.0, chunk_size=1024, top_k=0, top_p=1.0,
                            entropy_grad=False):
    assert top_k == 0 and top_p == 1.0
    logps, entropy = ManualLogprobs.apply(hidden, weight, targets, temperature, chunk_size)
    return logps, entropy if entropy_grad else entropy.detach()


def check():
    """The hand-written gradients against autograd through gc._logprobs_and_entropy (fp32, CPU or GPU)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    h = torch.randn(300, 64, device=device, dtype=torch.float64, requires_grad=True)
    w = torch.randn(500, 64, device=device, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, 500, (300,), device=device)
    gl, ge = torch.randn(300, device=device, dtype=torch.float64), torch.randn(300, device=device, dtype=torch.float64)
    lp, ent = gc._logprobs_and_entropy(h, w, y, 0.7, entropy_grad=True)
    torch.autograd.backward([lp, ent], [gl, ge])
    ref = h.grad.clone(), w.grad.clone(), lp.detach(), ent.detach()
    h.grad = w.grad = None
    lp2, ent2 = ManualLogprobs.apply(h, w, y, 0.7, 128)
    torch.autograd.backward([lp2, ent2], [gl.float(), ge.float()])
    for name, a, b in (("grad_h", h.grad, ref[0]), ("grad_w", w.grad, ref[1]), ("logp", lp2, ref[2]),
                       ("entropy", ent2, ref[3])):
        print(name, "max rel diff", ((a - b).abs().max() / b.abs().max()).item())


def build(shape, variant, env, cfg):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**SHAPES[shape])
    torch.manual_seed(0)
    with env.device:
        lm = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="varlen").eval()
    if variant.startswith("bf16"):
        lm = lm.to(torch.bfloat16)
    regions = "regions" in variant
    if not variant.startswith("fsdp"):
        for layer in lm.get_decoder().layers if regions else ():
            for m in (layer.input_layernorm, layer.post_attention_layernorm, layer.mlp):
                m.compile(dynamic=True)
        return gc.Policy(lm)
    policy = gc.Policy(lm)
    keep = variant != "fsdp" and variant != "fsdp-manual"
    shard = dict(mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
                 reshard_after_forward=not keep)
    for layer in lm.get_decoder().layers:
        if regions:
            for m in (layer.input_layernorm, layer.post_attention_layernorm, layer.mlp):
                m.compile(dynamic=True)
        fully_shard(layer, **shard)
    return fully_shard(policy, **shard)


def one(shape, variant, profile=None, steps=6):
    import torch.distributed as dist
    from transformers import AttentionInterface

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29533"), RANK="0",
                      WORLD_SIZE="1")
    dist.init_process_group("nccl", device_id=torch.device("cuda", 0))
    AttentionInterface.register("varlen", gc.varlen_attention)
    if variant == "eager":
        gc._compiled_logprobs_and_entropy = gc._logprobs_and_entropy
    if "manual" in variant or "cchunk" in variant or variant.startswith(("fsdp-", "bf16")):
        gc.chunked_logprobs = manual_chunked_logprobs
    if "cchunk" in variant:
        compile_kernels()
    device = torch.device("cuda")
    torch.cuda.set_device(0)
    env = bench_env(device)
    cfg = gc.Config(max_completion_length=256)
    policy = build(shape, variant, env, cfg)
    lm = policy.lm
    budget = gc.memory_plan(cfg, lm, env)[0]
    cfg = gc.dataclasses.replace(cfg, max_tokens_per_microbatch=budget, gradient_checkpointing="false")
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=1e-6, fused=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, gc.lr_lambda(cfg))

    batch = random_batch(gc)
    mask = batch.completion_mask
    # precision: the batch's logprobs before any update, against those `main` computes (saved by its run)
    logps = gc.no_grad_logps(policy, batch, cfg, env)
    ref_path = f"/tmp/precision_ref_{shape}.pt"
    drift = None
    if variant == "main":
        torch.save(logps, ref_path)
    elif os.path.exists(ref_path):
        drift = ((logps - torch.load(ref_path)).abs() * mask).sum().item() / mask.sum().item()
    tokens = sum(map(len, batch.prompt_ids)) + sum(map(len, batch.completion_ids))
    times = []
    for step in range(steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        gc.train_step(policy, optimizer, scheduler, batch, cfg, env, {})
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    if profile:
        from torch.profiler import ProfilerActivity, profile as torch_profile
        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            gc.train_step(policy, optimizer, scheduler, batch, cfg, env, {})
            torch.cuda.synchronize()
        with open(profile, "w") as f:
            f.write(prof.key_averages().table(sort_by="cuda_time_total", row_limit=45, max_name_column_width=80))
    median = statistics.median(times[2:])
    peak = gc.peak_flops(env) or 989e12
    print(json.dumps({"shape": shape, "variant": variant, "step1_s": round(times[0], 2), "median_s": round(median, 4),
                      "mfu": round(6 * gc.matmul_params(lm) * tokens / median / peak, 4),
                      "microbatches": len(gc.plan_micro_batches(batch, cfg, env)), "budget": budget,
                      "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1),
                      "drift_vs_main": drift}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    if sys.argv[1] == "check":
        check()
    elif sys.argv[1] == "one":
        prof = sys.argv[sys.argv.index("--profile") + 1] if "--profile" in sys.argv else None
        one(sys.argv[2], sys.argv[3], profile=prof)
    else:  # all: each variant in a fresh process, with a fresh inductor cache (a fresh machine's compile)
        out = os.environ.get("OUT", "/tmp/out")
        shapes = sys.argv[2:] or ["qwen2.5-1.5b", "smollm2-135m"]
        variants = os.environ.get("VARIANTS", "main eager manual fsdp fsdp-manual fsdp-keep fsdp-regions bf16").split()
        profiled = os.environ.get("PROFILE", "").split()
        for shape in shapes:
            for variant in variants:
                env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=f"/tmp/inductor-{shape}-{variant}",
                           MASTER_PORT=str(29500 + len(os.listdir("/tmp")) % 400))
                extra = ["--profile", f"{out}/profile-{shape}-{variant}.txt"] if variant in profiled else []
                subprocess.run([sys.executable, __file__, "one", shape, variant, *extra], env=env, timeout=400)
