"""bench.py: the measurements behind BENCHMARKS.md. Not needed to train; `bash run.sh bench ...` drives it.

    torchrun --nproc_per_node N bench/bench.py standalone OUT.json <grpo_colocate flags>
        vLLM alone (no trainer, no sleep) on exactly the requests the trainer's first steps generate
    torchrun --nproc_per_node 1 bench/bench.py sleep OUT.json <grpo_colocate flags>
        sleep(1) / sleep(2): GPU memory freed and the time to sleep and wake; then one real GRPO step and a
        level-2 wake WITHOUT the weight push, which the parity check must reject
    python bench/bench.py make-model SHAPE DIR TOKENIZER_DIR      random-init model of a real shape (qwen2.5-1.5b, ...)
    python bench/bench.py pad-heads SRC TP                        SmolLM2 with zero-padded heads, so tp=2/4 can split it
    python bench/bench.py summarize NAME METRICS.jsonl STANDALONE.json [SKIP]   one BENCHMARKS.md row (median of steps)
    python bench/bench.py plot OUT.png LABEL=METRICS.jsonl [...]   reward and held-out accuracy curves (matplotlib)
"""

import json
import math
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # grpo_colocate.py: the repo root
import grpo_colocate as gc  # noqa: E402

SHAPES = {  # public configs of real models; the weights are random (mechanics and speed only)
    "qwen2.5-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
    "qwen2.5-14b": dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=48, num_attention_heads=40,
                        num_key_value_heads=8, vocab_size=152064, tie_word_embeddings=False),
    "qwen2.5-32b": dict(hidden_size=5120, intermediate_size=27648, num_hidden_layers=64, num_attention_heads=40,
                        num_key_value_heads=8, vocab_size=152064, tie_word_embeddings=False),
}


def make_model(shape, out, tokenizer_dir):
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**SHAPES[shape], max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6)
    torch.set_default_dtype(torch.bfloat16)  # initialised in bf16 directly: a 32B shape fits one GPU
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(config)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(out)
    print(f"{shape}: {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B params -> {out}")


def pad_heads(src, tp):
    """SmolLM2-135M has 9 query / 3 KV heads, which tp=2 or 4 cannot split. Pad the KV heads (with their query
    heads) with zero heads and zero o_proj columns up to a multiple of tp: the padded heads add exactly nothing."""
    from safetensors.torch import load_file, save_file

    cfg = json.load(open(os.path.join(src, "config.json")))
    h, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d, g = cfg.get("head_dim") or cfg["hidden_size"] // h, h // kv
    extra = -(-kv // tp) * tp - kv
    dst = f"{src}-padded-tp{tp}"
    sd = load_file(os.path.join(src, "model.safetensors"))
    for k, w in sd.items():
        if k.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")):
            sd[k] = torch.cat([w, w.new_zeros(extra * d * (g if "q_proj" in k else 1), w.shape[1])])
        elif k.endswith("o_proj.weight"):
            sd[k] = torch.cat([w, w.new_zeros(w.shape[0], extra * d * g)], 1)
    os.makedirs(dst, exist_ok=True)
    save_file(sd, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    for f in os.listdir(src):
        if f not in ("model.safetensors", "config.json"):
            with open(os.path.join(src, f), "rb") as a, open(os.path.join(dst, f), "wb") as b:
                b.write(a.read())
    cfg.update(num_attention_heads=(kv + extra) * g, num_key_value_heads=kv + extra, head_dim=d)
    json.dump(cfg, open(os.path.join(dst, "config.json"), "w"), indent=1)
    print(dst)


def setup(argv):
    cfg = gc.parse_args(argv)
    env = gc.setup_env(cfg)
    gc.setup_distributed(cfg, env)
    tokenizer, rows, _ = gc.prepare_data(cfg)
    return cfg, env, tokenizer, rows, gc.load_model_config(cfg)


def one_rollout(llm, cfg, env, tokenizer, rows, position, funcs, weights):
    """The trainer's generate, score and advantages phases at data position `position`: a batch."""
    per_rank = cfg.completions_per_rank // cfg.num_generations
    positions, mine = gc.rows_for_rollout(rows, position, env.rank, per_rank, cfg.seed)
    samples, counts = gc.rollout(llm, cfg, env, tokenizer, [r["prompt_ids"] for r in mine], positions)
    rewards = gc.score(funcs, mine, [s.token_ids for s in samples], cfg.num_generations, tokenizer,
                       cfg.max_completion_length)
    return gc.make_batch(cfg, env, tokenizer, mine, samples, rewards, weights, counts)


def standalone(out, argv, iterations=6):
    """The trainer's generate phase without the trainer: same engine settings, same requests, same seeds."""
    cfg, env, tokenizer, rows, model_config = setup([*argv, "--vllm_enable_sleep_mode", "false"])
    llm = gc.make_engine(cfg, env, model_config, False)
    per_rank = cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps // cfg.num_generations
    results = []
    for gen_index in range(iterations):
        positions, mine = gc.rows_for_rollout(rows, gen_index * env.world * per_rank, env.rank, per_rank, cfg.seed)
        seeds = [gc.derive_seed(cfg.seed, "rollout") + cfg.num_generations * i for i in positions]  # as rollout's
        params = gc.sampling_params(cfg, logprobs=cfg.vllm_importance_sampling_correction)
        dist.barrier()
        start = time.perf_counter()
        outputs = gc.generate(llm, env, [r["prompt_ids"] for r in mine], params, seeds)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
        totals = torch.tensor([tokens, seconds], dtype=torch.float64, device=env.device)
        slowest = totals.clone()
        dist.all_reduce(totals)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        results.append({"tokens": totals[0].item(), "seconds": slowest[1].item(),
                        "tokens_per_sec_per_gpu": totals[0].item() / env.world / slowest[1].item()})
    warm = results[1:]  # the first call warms up
    summary = {"tokens_per_sec_per_gpu": statistics.median(r["tokens_per_sec_per_gpu"] for r in warm),
               "seconds": statistics.median(r["seconds"] for r in warm), "iterations": results}
    if env.is_main:
        json.dump(summary, open(out, "w"), indent=1)
        print(f"standalone vLLM: {summary['tokens_per_sec_per_gpu']:.0f} tok/s/GPU, "
              f"{summary['seconds']:.3f} s per generation batch")
    del llm
    dist.destroy_process_group()


def sleep_bench(out, argv):
    """Sleep levels measured, then the trained-weights proof: one real GRPO step, a level-2 sleep and a wake
    with the push skipped (the parity check and the sampled-token canary must fail), then the push (it must pass)."""
    cfg, env, tokenizer, rows, model_config = setup([*argv, "--vllm_enable_sleep_mode", "true"])
    probe = rows[0]["prompt_ids"] + tokenizer(f"#### {rows[0]['answer']}", add_special_tokens=False)["input_ids"]
    llm = gc.make_engine(cfg, env, model_config, True)
    engine = gc.ColocatedEngine(llm, cfg, env, True, probe)

    def free_gib():
        torch.cuda.synchronize()
        return torch.cuda.mem_get_info()[0] / 2**30

    def timed(fn):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        return time.perf_counter() - start

    report = {"gpu": torch.cuda.get_device_name(), "free_gib_engine_awake": free_gib()}
    for level in (1, 2):
        before = free_gib()
        t_sleep = timed(lambda: llm.sleep(level=level))
        after = free_gib()
        t_weights = timed(lambda: llm.wake_up(tags=["weights"]))
        t_kv = timed(lambda: llm.wake_up(tags=["kv_cache"]))
        report[f"level{level}"] = {"free_gib_before": before, "free_gib_asleep": after, "freed_gib": after - before,
                                   "sleep_s": t_sleep, "wake_weights_s": t_weights, "wake_kv_s": t_kv}
        print(f"sleep({level}): free {before:.1f} -> {after:.1f} GiB in {t_sleep:.3f}s; wake weights "
              f"{t_weights:.3f}s + kv {t_kv:.3f}s", flush=True)

    # one real GRPO step, exactly as the trainer does it
    lm = gc.load_lm(cfg.model, env.device, env.attention)
    policy = gc.wrap_policy(lm, env, cfg, False)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=cfg.learning_rate)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    funcs, weights = gc.load_reward_funcs(cfg)
    ledger = {}
    engine.sleep(ledger)  # as the trainer does: the engine sleeps (level 2) while the policy loads, then gets it pushed
    engine.wake_and_push(policy, 0, ledger)
    report["probe_gap_before_training"] = engine.info["probe_gap"]
    per_rank = cfg.completions_per_rank // cfg.num_generations
    batch = one_rollout(llm, cfg, env, tokenizer, rows, 0, funcs, weights)
    llm.sleep(level=2)
    gc.train_step(policy, optimizer, scheduler, batch, cfg, env, 8192, ledger, 1)
    torch.cuda.empty_cache()
    llm.wake_up(tags=["weights"])  # ...and NO push: the engine's weights were discarded by the level-2 sleep
    llm.wake_up(tags=["kv_cache"])
    llm.reset_prefix_cache()
    gap = gc.probe_gap(llm, policy, probe, env)
    report["probe_gap_level2_wake_without_push"] = gap
    report["skipped_push_caught"] = not gap <= gc.PARITY_TOLERANCE[env.dtype]
    try:  # the canary of every step: a rollout from the stale engine, scored by train_step before its update
        stale = one_rollout(llm, cfg, env, tokenizer, rows, per_rank, funcs, weights)
        report["sampled_gap_stale_missed"] = gc.train_step(policy, optimizer, scheduler, stale, cfg, env, 8192,
                                                           ledger, 1)["sampled_gap/rank_max"]
    except RuntimeError as e:  # expected: "step 1: vLLM and the trainer disagree on the tokens vLLM sampled ..."
        report["sampled_gap_stale_caught"] = str(e).split(". The engine")[0]
    optimizer.zero_grad(set_to_none=True)
    engine.sleep(ledger)
    engine.pushes = 0  # the probe checks this push too
    engine.wake_and_push(policy, 1, ledger)
    report["probe_gap_after_push"] = engine.info["probe_gap"]
    report["push_s"] = ledger["push"] / 2
    print(json.dumps(report, indent=1), flush=True)
    json.dump(report, open(out, "w"), indent=1)
    del llm
    dist.destroy_process_group()


def summarize(name, metrics_path, standalone_path, skip=2):
    steps = [json.loads(line) for line in open(metrics_path)]
    steps = [m for m in steps if "reward" in m][skip:]  # warm-up steps out

    def med(key):
        values = [m[key] for m in steps if key in m]
        return statistics.median(values) if values else 0.0
    alone = {"tokens_per_sec_per_gpu": math.nan}  # STANDALONE=0 runs have no standalone pass
    if os.path.exists(standalone_path):
        alone = json.load(open(standalone_path))
    step = med("time/step")
    phases = ["generate", "reward", "logprobs", "fwd_bwd", "optimizer", "push", "sleep_wake", "probe"]
    split = {p: med(f"time/{p}") for p in phases}
    colocation = split["push"] + split["sleep_wake"] + split["probe"]
    other = step - split["generate"] - split["fwd_bwd"] - split["optimizer"] - split["logprobs"]
    row = {
        "name": name, "steps": len(steps), "step_s": step, **{f"{p}_s": v for p, v in split.items()},
        "tok_s_gpu": med("completion_tokens_per_sec_per_gpu") or med("tokens_per_sec_per_gpu"), "gen_tok_s_gpu": med("generate_tokens_per_sec_per_gpu"),
        "standalone_tok_s_gpu": alone["tokens_per_sec_per_gpu"],
        "generate_vs_standalone": med("generate_tokens_per_sec_per_gpu") / alone["tokens_per_sec_per_gpu"],
        "colocation_overhead": colocation / step, "not_generate_or_train": other / step,
        "mfu": med("mfu"), "peak_alloc_gib": max(m.get("memory/peak_allocated_gib", 0) for m in steps),
        "device_used_gib": max(m.get("memory/device_used_gib", 0) for m in steps),
        "push_extra_gib": max(m.get("memory/push_extra_gib", 0) for m in steps),
    }
    print("| " + " | ".join([
        name, f"{step:.3f}", " / ".join(f"{split[p]:.3f}" for p in phases), f"{row['tok_s_gpu']:.0f}",
        f"{row['gen_tok_s_gpu']:.0f} / {row['standalone_tok_s_gpu']:.0f} = {100 * row['generate_vs_standalone']:.0f}%",
        f"{100 * row['colocation_overhead']:.1f}%", f"{100 * row['not_generate_or_train']:.1f}%",
        f"{100 * row['mfu']:.1f}%", f"{row['peak_alloc_gib']:.1f} / {row['device_used_gib']:.1f}"]) + " |")
    print("ROW " + json.dumps(row))


def plot(out, runs):
    """Training reward (10-step trailing mean over the raw line) per run, and held-out accuracy where a run has it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = {run.split("=", 1)[0]: [json.loads(line) for line in open(run.split("=", 1)[1])] for run in runs}
    with_eval = any("eval/accuracy_reward" in r for rs in records.values() for r in rs)
    fig, axes = plt.subplots(1, 2 if with_eval else 1, figsize=(11 if with_eval else 6.5, 4), squeeze=False)
    left = axes[0][0]
    for label, rs in records.items():
        steps = [r for r in rs if "reward" in r]
        x, y = [r["step"] for r in steps], [r["reward"] for r in steps]
        smooth = [statistics.mean(y[max(0, i - 9):i + 1]) for i in range(len(y))]  # trailing mean of 10 steps
        line, = left.plot(x, smooth, label=label)
        left.plot(x, y, color=line.get_color(), alpha=0.2, linewidth=0.8)
        evals = [(r["step"], r["eval/accuracy_reward"]) for r in rs if "eval/accuracy_reward" in r]
        if with_eval and evals:
            axes[0][1].plot(*zip(*evals), marker="o", color=line.get_color(), label=label)
    left.set(xlabel="step", ylabel="training reward (mean of the step's completions)", title="reward (10-step mean)")
    if with_eval:
        axes[0][1].set(xlabel="step", ylabel="greedy accuracy", title="held-out accuracy", ylim=(0, 1))
    for ax in axes[0]:
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(out)


if __name__ == "__main__":
    command, args = sys.argv[1], sys.argv[2:]
    if command == "standalone":
        standalone(args[0], args[1:])
    elif command == "sleep":
        sleep_bench(args[0], args[1:])
    elif command == "make-model":
        make_model(*args)
    elif command == "pad-heads":
        pad_heads(args[0], int(args[1]))
    elif command == "plot":
        plot(args[0], args[1:])
    elif command == "summarize":
        summarize(args[0], args[1], args[2], *(int(a) for a in args[3:]))
    else:
        sys.exit(__doc__)
