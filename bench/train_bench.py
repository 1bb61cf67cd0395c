"""train_bench.py: the train phase alone (no engine), timed and profiled on one GPU.

    python bench/train_bench.py all                      # every variant below, each in a fresh process
    python bench/train_bench.py one SHAPE LENGTHS VARIANT [--profile FILE]

One rank's generation batch as train_step sees it after a rollout: 32 prompts x G 8, prompts of 30-60 tokens,
completions of 256 tokens (fixed) or uniform in 20-256 (spread); random weights of the shape (SmolLM2-135M or the
Qwen2.5-1.5B shape), fp32 masters under bf16 autocast, fused AdamW, grpo_colocate's defaults (dapo, IS correction,
token budget and checkpointing auto; `head`: 8,192 tokens). Prints one JSON line per run: median seconds of train_step
(train + optimizer phases) over steps 3-6, trained tokens per second, MFU (6 N per prompt + completion token).
Variants: `head` (grpo_colocate.py of the commit carried as .stage/head), `new` (the working tree), `new-8192` (the
working tree at `head`'s budget, 8,192 tokens, instead of auto), `new-eager`
(the working tree with the logprob chunk not compiled), `new-gqa` (the working tree with varlen_attn given the
grouped K/V heads as they are, no repeat_interleave).
"""

import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from types import SimpleNamespace

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
SHAPES = {
    "smollm2-135m": dict(model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=64, vocab_size=49152,
                         tie_word_embeddings=True, rope_theta=1e5, rms_norm_eps=1e-5),
    "qwen2.5-1.5b": dict(model_type="qwen2", hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True,
                         rope_theta=1e6, rms_norm_eps=1e-6),
}


def load_module(variant):
    path = os.path.join(ROOT, ".stage/head/grpo_colocate.py" if variant == "head" else "grpo_colocate.py")
    spec = importlib.util.spec_from_file_location("grpo_colocate", path)
    gc = importlib.util.module_from_spec(spec)
    sys.modules["grpo_colocate"] = gc
    spec.loader.exec_module(gc)
    if variant == "new-eager":
        gc._compiled_logprobs_and_entropy = gc._logprobs_and_entropy
    if variant == "new-gqa":  # (adopted since, with grpo_colocate at 8aefd8c as `head`: 2.55 -> 2.50 s at 1.5B)
        def varlen_attention(module, query, key, value, attention_mask, scaling=None, cu_seq_lens_q=None,
                             max_length_q=None, **kwargs):
            from torch.nn.attention.varlen import varlen_attn
            q, k, v = (x[0].transpose(0, 1).to(torch.bfloat16, memory_format=torch.contiguous_format)
                       for x in (query, key, value))
            out = varlen_attn(q, k, v, cu_seq_lens_q, cu_seq_lens_q, max_length_q, max_length_q, scale=scaling,
                              window_size=(-1, 0))
            return out.to(query.dtype).unsqueeze(0), None
        gc.varlen_attention = varlen_attention
    return gc


def bench_env(device):
    """The one-rank env a trainer of any commit reads (push: before issue 27; push_in_place: after)."""
    return SimpleNamespace(device=device, dtype=torch.bfloat16, world=1, rank=0, local_rank=0, sleep=True,
                           engine_bytes=0, attention="varlen", push="load_weights", push_in_place=True)


def random_batch(gc, lengths="fixed"):
    """One rank's generation batch, seeded: 32 prompts of 30-60 random tokens x G 8 completions of 256
    tokens (lengths "fixed") or 20-256 (else), random advantages and vLLM logprobs."""
    g = torch.Generator().manual_seed(1)
    P, G = 32, 8
    prompts = [torch.randint(100, 40000, (int(torch.randint(30, 61, (1,), generator=g)),), generator=g).tolist()
               for _ in range(P)]
    prompt_ids = [p for p in prompts for _ in range(G)]
    lens = [256] * (P * G) if lengths == "fixed" else torch.randint(20, 257, (P * G,), generator=g).tolist()
    completion_ids = [torch.randint(100, 40000, (n,), generator=g).tolist() for n in lens]
    mask = gc.completion_mask_of(completion_ids)
    return SimpleNamespace(prompt_ids=prompt_ids, completion_ids=completion_ids, completion_mask=mask,
                           loss_mask=mask.float(), advantages=torch.randn(P * G, generator=g),
                           vllm_logps=-torch.rand(mask.shape, generator=g) * mask, old_logps=None, ref_logps=None)


def one(shape, lengths, variant, profile=None, steps=6):
    from transformers import AttentionInterface, AutoConfig, AutoModelForCausalLM

    gc = load_module(variant)
    AttentionInterface.register("varlen", gc.varlen_attention)
    device = torch.device("cuda")
    config = AutoConfig.for_model(**SHAPES[shape])
    torch.manual_seed(0)
    with device:
        lm = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="varlen").eval()
    cfg = gc.Config(max_completion_length=256, max_tokens_per_microbatch=8192 if variant in ("head", "new-8192") else 0)
    env = bench_env(device)
    if hasattr(gc, "memory_plan"):  # the auto budget and checkpointing, as train() resolves them
        budget, checkpointing = gc.memory_plan(cfg, lm, env)[:2]  # (older code: no third value)
        cfg = gc.dataclasses.replace(cfg, max_tokens_per_microbatch=budget,
                                     gradient_checkpointing=str(checkpointing).lower())
    policy = gc.wrap_policy(lm, env, cfg)
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=1e-6, fused=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, gc.lr_lambda(cfg))

    batch = random_batch(gc, lengths)
    tokens = sum(map(len, batch.prompt_ids)) + sum(map(len, batch.completion_ids))
    times, compile_s = [], None
    for step in range(steps):
        ledger = {}
        torch.cuda.synchronize()
        start = time.perf_counter()
        gc.train_step(policy, optimizer, scheduler, batch, cfg, env, ledger)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        compile_s = times[0] if step == 0 else compile_s
    if profile:
        from torch.profiler import ProfilerActivity, profile as torch_profile
        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            gc.train_step(policy, optimizer, scheduler, batch, cfg, env, {})
            torch.cuda.synchronize()
        averages = prof.key_averages()
        with open(profile, "w") as f:
            f.write(averages.table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=70) + "\n")
            f.write(averages.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=70) + "\n")
        syncs = {e.key: e.count for e in averages if any(s in e.key for s in (
            "Synchronize", "_local_scalar_dense", "aten::item", "aten::nonzero"))}
        kernels = sum(e.count for e in averages if e.device_type == torch.autograd.DeviceType.CUDA)
        gpu_busy = sum(e.self_device_time_total for e in averages) / 1e6
    else:
        syncs, kernels, gpu_busy = None, None, None
    median = statistics.median(times[2:])
    n = gc.matmul_params(lm)
    peak = gc.peak_flops(env) or 989e12
    print(json.dumps({"shape": shape, "lengths": lengths, "variant": variant, "step_s": round(median, 4),
                      "first_step_s": round(compile_s, 2), "tokens": tokens, "tok_per_s": round(tokens / median),
                      "mfu": round(6 * n * tokens / median / peak, 4), "microbatches": len(gc.plan_micro_batches(
                          batch, cfg, env)), "budget": cfg.max_tokens_per_microbatch,
                      "checkpointing": cfg.gradient_checkpointing,
                      "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1), "syncs_in_profiled_step": syncs,
                      "cuda_kernels": kernels, "gpu_busy_s": gpu_busy}), flush=True)


def gqa_check():
    """Does this torch's varlen_attn take grouped K/V heads as they are, and give what repeating them gives?"""
    import inspect
    from torch.nn.attention import varlen
    print("varlen_attn", inspect.signature(varlen.varlen_attn))
    if hasattr(varlen, "_should_use_cudnn"):
        print(inspect.getsource(varlen._should_use_cudnn))
    L, cu = 600, torch.tensor([0, 100, 350, 600], dtype=torch.int32, device="cuda")
    q = torch.randn(L, 12, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(L, 2, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    ref = varlen.varlen_attn(q, k.repeat_interleave(6, 1), v.repeat_interleave(6, 1), cu, cu, 250, 250,
                             window_size=(-1, 0))
    try:
        out = varlen.varlen_attn(q, k, v, cu, cu, 250, 250, window_size=(-1, 0))
        print("GQA as is: max |diff| vs repeated", (out.float() - ref.float()).abs().max().item())
    except Exception as e:  # noqa: BLE001
        print("GQA as is: failed", type(e).__name__, str(e).splitlines()[0][:200])


if __name__ == "__main__":
    if sys.argv[1] == "gqa":
        gqa_check()
    elif sys.argv[1] == "one":
        prof = sys.argv[sys.argv.index("--profile") + 1] if "--profile" in sys.argv else None
        one(*sys.argv[2:5], profile=prof)
    else:  # all: each variant in a fresh process (its own memory, compile caches shared on disk)
        out = os.environ.get("OUT", "/tmp/out")
        subprocess.run([sys.executable, __file__, "gqa"])
        runs = [("smollm2-135m", "fixed", v) for v in ("head", "new", "new-8192", "new-eager")] + \
               [("qwen2.5-1.5b", "fixed", v) for v in ("head", "new")] + \
               [("qwen2.5-1.5b", "spread", v) for v in ("head", "new")]
        for shape, lengths, variant in runs:
            extra = ["--profile", f"{out}/profile-{shape}-{lengths}-{variant}.txt"] \
                if variant in ("head", "new") and lengths == "fixed" else []
            subprocess.run([sys.executable, __file__, "one", shape, lengths, variant, *extra])
