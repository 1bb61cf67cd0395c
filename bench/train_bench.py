"""train_bench.py: the train phase alone (no engine), timed and profiled on one GPU.

    python bench/train_bench.py all                      # every variant below, each in a fresh process
    python bench/train_bench.py one SHAPE LENGTHS VARIANT [--profile FILE]
    python bench/train_bench.py gqa                      # does this torch's varlen_attn take grouped K/V heads?

One rank's generation batch as train_step sees it after a rollout: 32 prompts x G 8, prompts of 30-60 tokens,
completions of 256 tokens (fixed) or uniform in 20-256 (spread); random weights of the shape (SmolLM2-135M or the
Qwen2.5-1.5B shape), fp32 masters under bf16 autocast, fused AdamW and the lr schedule as build_trainer makes them,
grpo_colocate's defaults (dapo, IS correction, token budget, checkpointing and sleep from memory_plan, as
check_inputs resolves them; `new-8192`: 8,192 tokens). Prints one JSON line per run: median seconds of train_step
(train + optimizer phases) over steps 3-6, trained tokens per second, MFU (6 N per prompt + completion token).
The batch's vLLM logprobs are NaN on every completion token (a logprob vLLM did not give): the IS weights and the
canary run their ops as in training, with weight 1 and gap 0, so that train_step's canary passes on random weights.
Variants: `head` (grpo_colocate.py of the commit carried as .stage/head, at its own defaults; it must have the API of
issue 33 or later, and is skipped by `all` when absent), `new` (the working tree), `new-8192` (the working tree at
8,192 tokens instead of the auto budget), `new-eager` (the working tree with the logprob kernels, gc.COMPILED, not
compiled), `new-gqa` (an OLD variant, kept here: varlen_attention before issue 11 adopted it, grouped K/V heads passed
as they are; the trainer does so since, so this now differs from `new` only in ignoring sliding windows, and on
torch >= 2.12, which wants enable_gqa, it fails on GQA shapes).

Updated to the API of issue 33: memory_plan(cfg, env, model_config, num_params) gives the budget and checkpointing
(passed to wrap_policy and train_step), the env and process group are setup_env's and setup_distributed's (train_step's
canary all-reduces), the scheduler is transformers' get_scheduler (lr_lambda is gone), the batch carries model_mask
and trained as make_batch builds them (completion_mask_of is gone). Verified on the CPU only: pyflakes, and `one` of a
tiny shape with a small batch (fp32, sdpa) for new (with --profile), new-8192, new-eager and head (a copy of today's
grpo_colocate.py as the staged module). Not run on a GPU after the update: `gqa`, new-gqa, the CUDA paths and every
timing.
"""

import functools
import importlib.util
import inspect
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
HEAD = os.path.join(ROOT, ".stage/head/grpo_colocate.py")
SHAPES = {
    "smollm2-135m": dict(model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=64, vocab_size=49152,
                         tie_word_embeddings=True, rope_theta=1e5, rms_norm_eps=1e-5),
    "qwen2.5-1.5b": dict(model_type="qwen2", hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True,
                         rope_theta=1e6, rms_norm_eps=1e-6),
}
BATCH = (32, 8, 256)  # prompts, G, completion tokens at most


def old_gqa_varlen_attention(module, query, key, value, attention_mask, scaling=None, cu_seq_lens_q=None,
                             max_length_q=None, **kwargs):
    """[OLD, `new-gqa`] varlen_attention as issue 11 measured it: grouped K/V heads as they are, no sliding window,
    no enable_gqa (today's gc.varlen_attention has both)."""
    from torch.nn.attention.varlen import varlen_attn
    q, k, v = (x[0].transpose(0, 1).to(torch.bfloat16, memory_format=torch.contiguous_format)
               for x in (query, key, value))
    out = varlen_attn(q, k, v, cu_seq_lens_q, cu_seq_lens_q, max_length_q, max_length_q, scale=scaling,
                      window_size=(-1, 0))
    return out.to(query.dtype).unsqueeze(0), None


def load_module(variant):
    path = HEAD if variant == "head" else os.path.join(ROOT, "grpo_colocate.py")
    spec = importlib.util.spec_from_file_location("grpo_colocate", path)
    gc = importlib.util.module_from_spec(spec)
    sys.modules["grpo_colocate"] = gc
    spec.loader.exec_module(gc)
    if variant == "new-eager":  # the kernels as the CPU and --full_determinism run them
        for f in list(gc.COMPILED):
            gc.COMPILED[f] = f
    if variant == "new-gqa":
        gc.varlen_attention = old_gqa_varlen_attention
    return gc


def bench_cfg(gc, batch=BATCH, **flags):
    """The trainer's defaults (gc.Config) for one rank's batch of random_batch's sizes."""
    P, G, T = batch
    return gc.Config(max_completion_length=T, num_generations=G, per_device_train_batch_size=P * G,
                     gradient_accumulation_steps=1, **flags)


def setup(gc, cfg):
    """This process's env (setup_env: bf16 and varlen attention on CUDA) and a process group of one
    (setup_distributed): train_step's canary all-reduces its gap."""
    env = gc.setup_env(cfg)
    gc.setup_distributed(cfg, env)
    return env


def random_lm(gc, shape, env):
    """Random weights of SHAPES[shape], as load_lm leaves a model: fp32, on env.device, eval(), env.attention."""
    from transformers import AttentionInterface, AutoConfig, AutoModelForCausalLM
    if env.attention == "varlen":  # load_lm's registration (these models come from a config, not a directory)
        from torch.nn.attention.varlen import varlen_attn
        gqa = {} if "enable_gqa" not in inspect.signature(varlen_attn).parameters else {"enable_gqa": True}
        AttentionInterface.register("varlen", functools.partial(gc.varlen_attention, gqa=gqa))
    config = AutoConfig.for_model(**SHAPES[shape])
    torch.manual_seed(0)
    with env.device:
        lm = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=env.attention)
    lm.config.use_cache = False
    return lm.eval()


def optimizer_and_scheduler(cfg, env, policy):
    """AdamW (weight decay on the matrices only) and the lr schedule, as build_trainer makes them."""
    from transformers import get_scheduler
    decay = {"params": [], "weight_decay": cfg.weight_decay}
    no_decay = {"params": [], "weight_decay": 0.0}
    for name, p in policy.named_parameters():
        if p.requires_grad:
            exempt = p.ndim < 2 or "bias" in name or "norm" in name.lower()
            (no_decay if exempt else decay)["params"].append(p)
    groups = [g for g in (decay, no_decay) if g["params"]]
    optimizer = torch.optim.AdamW(groups, lr=cfg.learning_rate,
                                  fused=env.device.type == "cuda")
    schedule = {"constant": "constant_with_warmup"}.get(cfg.lr_scheduler_type, cfg.lr_scheduler_type)
    return optimizer, get_scheduler(schedule, optimizer, cfg.warmup_steps, cfg.max_steps)


def random_batch(gc, lengths="fixed", batch=BATCH):
    """One rank's generation batch as make_batch returns it, seeded: P prompts of 30-60 random tokens x G
    completions of T tokens (lengths "fixed") or 20-T (else), random advantages, every completion token a model
    and loss token, every sequence trained, vLLM's logprobs NaN on the model's tokens (see the docstring)."""
    P, G, T = batch
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(100, 40000, (int(torch.randint(30, 61, (1,), generator=g)),), generator=g).tolist()
               for _ in range(P)]
    prompt_ids = [p for p in prompts for _ in range(G)]
    lens = [T] * (P * G) if lengths == "fixed" else torch.randint(min(20, T), T + 1, (P * G,), generator=g).tolist()
    completion_ids = [torch.randint(100, 40000, (n,), generator=g).tolist() for n in lens]
    # model_mask [N, T] as make_batch builds it: 1 on the tokens the model wrote (all here), left-aligned
    model_mask = torch.nn.utils.rnn.pad_sequence([torch.ones(n, dtype=torch.long) for n in lens], batch_first=True)
    vllm_logps = torch.zeros(model_mask.shape).masked_fill(model_mask.bool(), float("nan"))
    return SimpleNamespace(sample_prompt_ids=prompt_ids, completion_ids=completion_ids, model_mask=model_mask,
                           loss_mask=model_mask.float(), filler=torch.zeros(P * G, dtype=torch.bool),
                           advantages=torch.randn(P * G, generator=g), vllm_logps=vllm_logps, old_logps=None,
                           ref_logps=None)


def one(shape, lengths, variant, profile=None, steps=6, batch=BATCH):
    gc = load_module(variant)
    cfg = bench_cfg(gc, batch, max_tokens_per_microbatch=8192 if variant == "new-8192" else 0)
    env = setup(gc, cfg)
    cuda = env.device.type == "cuda"
    lm = random_lm(gc, shape, env)
    # the auto budget, checkpointing and sleep, as check_inputs resolves them before the engine starts
    plan = gc.memory_plan(cfg, env, lm.config, sum(p.numel() for p in lm.parameters()))
    policy = gc.wrap_policy(lm, env, cfg, plan.checkpointing)
    optimizer, scheduler = optimizer_and_scheduler(cfg, env, policy)

    batch = random_batch(gc, lengths, batch)
    tokens = sum(map(len, batch.sample_prompt_ids)) + sum(map(len, batch.completion_ids))
    times, compile_s = [], None
    for step in range(steps):
        ledger = {}
        gc.cuda_sync(env)
        start = time.perf_counter()
        stats = gc.train_step(policy, optimizer, scheduler, batch, cfg, env, plan.token_budget, ledger, step + 1)
        gc.cuda_sync(env)
        times.append(time.perf_counter() - start)
        compile_s = times[0] if step == 0 else compile_s
        if stats["skipped"]:
            raise RuntimeError(f"step {step + 1}: train_step skipped a non-finite step")
    if profile:
        from torch.profiler import ProfilerActivity, profile as torch_profile
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with torch_profile(activities=activities) as prof:
            gc.train_step(policy, optimizer, scheduler, batch, cfg, env, plan.token_budget, {}, steps + 1)
            gc.cuda_sync(env)
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
                          batch, plan.token_budget, env)), "budget": plan.token_budget,
                      "checkpointing": plan.checkpointing, "sleep": plan.why,
                      "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1) if cuda else None,
                      "syncs_in_profiled_step": syncs, "cuda_kernels": kernels, "gpu_busy_s": gpu_busy}), flush=True)
    gc.dist.destroy_process_group()


def gqa_check():
    """Does this torch's varlen_attn take grouped K/V heads as they are, and give what repeating them gives?"""
    from torch.nn.attention import varlen
    print("varlen_attn", inspect.signature(varlen.varlen_attn))
    if hasattr(varlen, "_should_use_cudnn"):
        print(inspect.getsource(varlen._should_use_cudnn))
    gqa = {"enable_gqa": True} if "enable_gqa" in inspect.signature(varlen.varlen_attn).parameters else {}
    L, cu = 600, torch.tensor([0, 100, 350, 600], dtype=torch.int32, device="cuda")
    q = torch.randn(L, 12, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(L, 2, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    ref = varlen.varlen_attn(q, k.repeat_interleave(6, 1), v.repeat_interleave(6, 1), cu, cu, 250, 250,
                             window_size=(-1, 0))
    try:
        out = varlen.varlen_attn(q, k, v, cu, cu, 250, 250, window_size=(-1, 0), **gqa)
        print(f"GQA as is{' (enable_gqa)' if gqa else ''}: max |diff| vs repeated",
              (out.float() - ref.float()).abs().max().item())
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
        head = ["head"] if os.path.isfile(HEAD) else []
        if not head:
            print(f"no {HEAD}: the head variant is skipped", flush=True)
        runs = [("smollm2-135m", "fixed", v) for v in (*head, "new", "new-8192", "new-eager")] + \
               [("qwen2.5-1.5b", "fixed", v) for v in (*head, "new")] + \
               [("qwen2.5-1.5b", "spread", v) for v in (*head, "new")]
        for shape, lengths, variant in runs:
            extra = ["--profile", f"{out}/profile-{shape}-{lengths}-{variant}.txt"] \
                if variant in ("head", "new") and lengths == "fixed" else []
            subprocess.run([sys.executable, __file__, "one", shape, lengths, variant, *extra])
