"""gen_settings.py: the trainer's rollout through one vLLM engine, under one engine setting at a time.

    python bench/gen_settings.py run --model KEY=DIR [--model KEY=DIR ...] --jobs "KEY:VARIANT[:WORKLOADS] ..."
                                     --out RESULTS.jsonl --logs DIR [--budget_s S] [--repeats 5] [--cpu]
        each job in a fresh subprocess (engine settings are fixed at init), in the order given; one JSON line per
        variant appended to RESULTS.jsonl (a failed or timed-out job: its error, first line + type), each job's log
        in DIR; a job that would start with less than --min_job_s of the budget left is recorded as skipped
    python bench/gen_settings.py one --model DIR --variant VARIANT [--workloads fixed,natural] ...
        one job in this process: prints `GEN_SETTINGS_RESULT [json, ...]` after each phase (the last one counts)
    python bench/gen_settings.py table RESULTS.jsonl          the summary tables
    python bench/gen_settings.py ledger NAME=METRICS.jsonl ... [--skip 2]
        the trainer's runs: median s/step and the time ledger (every time/* phase), generate tok/s, memory

The workload is `run.sh bench`'s: 32 prompts x n=8 completions of the built-in arithmetic task (chat template, prompts
as token ids, grpo_colocate.prepare_data), max 256 tokens, temperature 1, per-request seeds as the trainer derives them
(derive_seed(seed, "rollout") + G x data position), detokenize=False, through grpo_colocate.generate. Workloads:
`fixed` (ignore_eos: 256 tokens each) and `natural` (ignore_eos off: each stops at its EOS). Each timed call takes the
next 32 prompts of the trainer's data order, with the prefix cache reset first (the trainer resets it at every push).
tok/s = completion tokens / wall seconds of one generate call; the median of --repeats calls after 1 warm-up.

The engine is grpo_colocate.make_engine's: make_engine builds its kwargs inside and calls vllm.LLM(**kwargs), with no
way to add any from outside, so a variant's engine kwargs go in by swapping vllm.LLM for a wrapper that merges them
over make_engine's (every other kwarg, and the sleep mode the trainer's memory plan picks, stay the trainer's own).

Variants (each one change from `base`, which is what the trainer does today for this workload: logprobs=0 requested,
as the IS correction is on by default; max_num_seqs = grpo_colocate.max_num_seqs (256 here); async scheduling at
vLLM's default (on, with external_launcher); sleep mode as memory_plan decides (on, for both models)):
    base          also measures no_logprobs on the same engine (written as its own line: a sampling setting, not an
                  engine one), the mean |logprob gap| engine vs a transformers forward (bf16 on CUDA), the weight push
                  tests (bf16: the control for fp8's) and, with sleep mode on, the sleep/wake/push timings (the push
                  through apply_model, as the trainer's; through reload_weights where only that one kept the output)
    no_logprobs   logprobs=None (run alone only if asked; base measures it)
    async_off / async_on      LLM(async_scheduling=False / True)  (vllm/engine/arg_utils.py: EngineArgs.async_scheduling)
    mnsN          max_num_seqs=N (e.g. mns512, mns1024, mns128). A rollout of 256 sequences never reaches a limit
                  >= 256, and graphs are captured up to 512 either way: mns1024 is then a second base (the noise)
    cg_fit        compilation_config={"max_cudagraph_capture_size": max_num_seqs}: vLLM 0.26 captures up to
                  min(2 x max_num_seqs, 512) by default, sizes no rollout step can reach
    cg_pow2       compilation_config={"cudagraph_capture_sizes": [1, 2, 4, ..., max_num_seqs]}: 9 graphs, not 51
    fp8           quantization="fp8" (online dynamic FP8 of the bf16 checkpoint), sleep mode as base; then the gap vs
                  a bf16 transformers forward, and bf16 weights pushed through collective_rpc("reload_weights") and
                  through apply_model(load_weights): does greedy output still match the pre-push greedy output?
                  If its engine does not start, the driver runs fp8_nosleep next (the same, sleep mode off)
    sleep         enable_sleep_mode=True forced (base has it when memory_plan picks it) + the sleep timings
    sleep_off     enable_sleep_mode=False (bench.py standalone's engine)
    v1_runner     VLLM_USE_V2_MODEL_RUNNER=0 (vLLM 0.26 picks its V2 model runner for dense models)
On a machine without CUDA (or --cpu): tiny sizes (2 prompts x n=2, 16 tokens, 2 timed calls), and sleep / fp8 /
cudagraph variants are refused: a plumbing test with the CPU vLLM.
"""

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULT = "GEN_SETTINGS_RESULT "
# run.sh bench's workload (its flags; --model and --output_dir added per job)
GPU_FLAGS = ["--num_generations", "8", "--per_device_train_batch_size", "32", "--gradient_accumulation_steps", "8",
             "--max_prompt_length", "128", "--max_completion_length", "256", "--ignore_eos", "--max_steps", "8",
             "--eval_steps", "0", "--save_steps", "-1", "--learning_rate", "1e-6"]
CPU_FLAGS = ["--num_generations", "2", "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "1",
             "--max_prompt_length", "128", "--max_completion_length", "16", "--ignore_eos", "--max_steps", "8",
             "--eval_steps", "0", "--save_steps", "-1", "--learning_rate", "1e-6"]
CUDA_ONLY = ("fp8", "fp8_nosleep", "sleep", "cg_fit", "cg_pow2")
FALLBACK = {"fp8": "fp8_nosleep"}  # run next when the variant's engine did not start (sleep mode + online fp8?)
EXTRAS = ("base", "fp8", "fp8_nosleep", "sleep")  # gap, push tests, sleep timings (with sleep mode on)


def error_of(e: BaseException) -> dict:
    lines = str(e).strip().splitlines()
    return {"type": type(e).__name__, "line": (lines[0] if lines else "")[:300]}


# ============================== one job, in its own process ======================================
def variant_settings(variant: str, mns: int):
    """(engine kwargs merged over make_engine's, sleep: None = the memory plan's / True / False, env)."""
    if variant in ("base", "no_logprobs"):
        return {}, None, {}
    if variant in ("async_off", "async_on"):
        return {"async_scheduling": variant == "async_on"}, None, {}
    if m := re.fullmatch(r"mns(\d+)", variant):
        return {"max_num_seqs": int(m.group(1))}, None, {}
    if variant == "cg_fit":
        return {"compilation_config": {"max_cudagraph_capture_size": mns}}, None, {}
    if variant == "cg_pow2":
        sizes = [2 ** k for k in range(mns.bit_length()) if 2 ** k < mns] + [mns]
        return {"compilation_config": {"cudagraph_capture_sizes": sizes}}, None, {}
    if variant in ("fp8", "fp8_nosleep"):
        return {"quantization": "fp8"}, False if variant == "fp8_nosleep" else None, {}
    if variant in ("sleep", "sleep_off"):
        return {}, variant == "sleep", {}
    if variant == "v1_runner":
        return {}, None, {"VLLM_USE_V2_MODEL_RUNNER": "0"}
    raise ValueError(f"unknown variant {variant!r}")


def one(a):
    """Measure one variant; print the cumulative results after each phase (a kill keeps what was printed)."""
    lines = []  # the JSON lines this job writes (base also writes no_logprobs')
    head = {"model": a.key or os.path.basename(a.model.rstrip("/")), "model_dir": a.model, "variant": a.variant}
    out = dict(head, error=None)
    lines.append(out)

    def emit():
        print(RESULT + json.dumps(lines), flush=True)

    try:
        measure(a, out, lines, emit)
    except BaseException as e:  # noqa: BLE001 - recorded, never raised: the driver goes on
        import traceback
        traceback.print_exc()
        out["error"] = error_of(e)
    emit()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no engine teardown (it can hang at exit); the process group dies with us


def measure(a, out, lines, emit):
    cpu = a.cpu
    engine_kw, force_sleep, env_vars = variant_settings(a.variant, 0)  # validates the name first
    if cpu and a.variant in CUDA_ONLY:
        raise ValueError(f"{a.variant}: CUDA only")
    os.environ.update(env_vars)
    deadline = a.deadline or float("inf")
    sys.path.insert(0, ROOT)
    import torch
    import grpo_colocate as gc

    cuda = torch.cuda.is_available() and not cpu
    flags = (CPU_FLAGS if cpu else GPU_FLAGS) + ["--model", a.model, "--output_dir", a.output_dir]
    if force_sleep is not None:
        flags += ["--vllm_enable_sleep_mode", "true" if force_sleep else "false"]
    cfg, env, inputs, error = gc.check_inputs(flags)  # the trainer's own checks, data and memory plan
    if error:
        raise error
    gc.setup_distributed(cfg, env)
    tokenizer, rows, _ = inputs.data
    mns = gc.max_num_seqs(cfg, env)
    engine_kw, _, _ = variant_settings(a.variant, mns)
    sleep = inputs.plan.sleep
    out.update(device=torch.cuda.get_device_name() if cuda else "cpu", sleep_mode=sleep, sleep_why=inputs.plan.why,
               overrides=engine_kw, env=env_vars, prompts=cfg.completions_per_rank // cfg.num_generations,
               n=cfg.num_generations, max_tokens=cfg.max_completion_length, repeats=a.repeats)
    import vllm
    out["versions"] = {"vllm": vllm.__version__, "torch": torch.__version__}
    real_llm = vllm.LLM
    seen = {}

    def llm_with_overrides(**kwargs):  # make_engine's kwargs, the variant's merged over them
        kwargs.update(engine_kw)
        seen.update(kwargs)
        return real_llm(**kwargs)

    vllm.LLM = llm_with_overrides
    try:
        start = time.perf_counter()
        llm = gc.make_engine(cfg, env, inputs.model_config, sleep)
        out["init_s"] = round(time.perf_counter() - start, 2)
    finally:
        vllm.LLM = real_llm
    out["engine_kwargs"] = {k: v if isinstance(v, (int, float, str, bool, dict, list, type(None))) else str(v)
                            for k, v in seen.items()}
    out["engine"] = resolved_config(llm)
    emit()

    def sync():
        if cuda:
            torch.cuda.synchronize()

    per_rank = cfg.completions_per_rank // cfg.num_generations
    calls = 1 + a.repeats
    slot = [0]  # the next data position: each call takes fresh prompts, as the trainer's steps do
    kept = {}  # a workload's last outputs and prompts (the gap measurement reads them)

    def workload(name, ignore_eos, logprobs):
        import dataclasses
        wcfg = dataclasses.replace(cfg, ignore_eos=ignore_eos)
        params = gc.sampling_params(wcfg, logprobs=logprobs)
        per_call = []
        for k in range(calls):
            positions, mine = gc.rows_for_rollout(rows, slot[0] * per_rank, env.rank, per_rank, cfg.seed)
            slot[0] += 1
            seeds = [gc.derive_seed(cfg.seed, "rollout") + cfg.num_generations * i for i in positions]  # as rollout's
            prompt_ids = [r["prompt_ids"] for r in mine]
            llm.reset_prefix_cache()
            sync()
            t0 = time.perf_counter()
            outputs = gc.generate(llm, env, prompt_ids, params, seeds)
            sync()
            seconds = time.perf_counter() - t0
            completions = [c for o in outputs for c in o.outputs]
            tokens = sum(len(c.token_ids) for c in completions)
            truncated = sum(c.finish_reason == "length" for c in completions)
            if k:  # call 0 warms up
                per_call.append({"tokens": tokens, "seconds": seconds, "truncated": truncated / len(completions)})
            kept[name] = (prompt_ids, outputs)
        tok_s = [c["tokens"] / c["seconds"] for c in per_call]
        return {"tok_s": round(statistics.median(tok_s), 1), "s": round(statistics.median(c["seconds"] for c in per_call), 4),
                "tok_s_all": [round(t) for t in tok_s], "mean_len": round(statistics.mean(c["tokens"] for c in per_call)
                                                                          / per_rank / cfg.num_generations, 1),
                "truncated": round(statistics.mean(c["truncated"] for c in per_call), 3), "logprobs": logprobs}

    names = [w for w in a.workloads.split(",") if w]
    logprobs = cfg.vllm_importance_sampling_correction and a.variant != "no_logprobs"  # the trainer's choice
    out["workloads"] = {}
    for name in names:
        out["workloads"][name] = workload(name, name == "fixed", logprobs)
        emit()
    if a.variant == "base":  # no_logprobs: a per-request setting, measured on the same engine
        nolp = dict(out, variant="no_logprobs", workloads={}, note="measured on base's engine")
        nolp.pop("engine_kwargs", None)
        lines.append(nolp)
        for name in names:
            nolp["workloads"][name] = workload(f"{name}_nolp", name == "fixed", False)
            emit()

    extras = a.variant in EXTRAS
    margin = 60 if cuda else 0
    if extras and time.time() < deadline - margin:
        try:
            out["gap"] = logprob_gap(cfg, env, kept.get("fixed"), a.model, cuda)
        except Exception as e:  # noqa: BLE001
            out["gap"] = {"error": error_of(e)}
        emit()
    state_dict = None
    if extras and time.time() < deadline - margin:
        try:
            state_dict = load_state_dict(a.model, "cuda" if cuda else "cpu")
        except Exception as e:  # noqa: BLE001
            out["push"] = {"error": error_of(e)}
    greedy_prompts = [r["prompt_ids"] for r in gc.rows_for_rollout(rows, 0, 0, 8, cfg.seed)[1]]
    ways = push_ways(llm, state_dict, cuda, inputs.model_config)
    if extras and state_dict is not None and time.time() < deadline - margin:
        out["push"] = push_tests(llm, ways, greedy_prompts, sync)
        emit()
    if sleep and extras and state_dict is not None and time.time() < deadline - margin:
        # the push the trainer makes (apply_model), unless the push tests found only reload_weights working
        tested = out.get("push") or {}
        via = "apply_model"
        if not tested.get("apply_model", {}).get("greedy_match") and tested.get("reload_weights", {}).get("greedy_match"):
            via = "reload_weights"
        try:
            out["sleep"] = dict(sleep_timings(llm, ways[via], state_dict, greedy_prompts, a.repeats, sync), push_via=via)
        except Exception as e:  # noqa: BLE001
            out["sleep"] = {"error": error_of(e), "push_via": via}
        emit()


def resolved_config(llm) -> dict:
    """What the engine settled on (async scheduling, graph sizes, runner...)."""
    got = {}
    try:
        vc = llm.llm_engine.vllm_config
        sizes = vc.compilation_config.cudagraph_capture_sizes or []
        got = {"async_scheduling": vc.scheduler_config.async_scheduling,
               "max_num_seqs": vc.scheduler_config.max_num_seqs,
               "max_num_batched_tokens": vc.scheduler_config.max_num_batched_tokens,
               "cudagraph_mode": str(vc.compilation_config.cudagraph_mode),
               "cudagraph_sizes": len(sizes), "cudagraph_max": max(sizes) if sizes else 0,
               "quantization": vc.model_config.quantization, "dtype": str(vc.model_config.dtype),
               "kv_blocks": vc.cache_config.num_gpu_blocks}
        got["v2_model_runner"] = bool(vc.use_v2_model_runner)
    except Exception as e:  # noqa: BLE001 - a field vLLM moved: report what was read
        got["read_error"] = error_of(e)
    try:  # the linear layers' method (fp8: which scaled-mm kernel vLLM picked)
        from vllm.model_executor.layers.linear import LinearBase

        def linear_method(model):
            for module in model.modules():
                if isinstance(module, LinearBase):
                    method = module.quant_method
                    kernel = getattr(method, "fp8_linear", None)
                    return type(method).__name__ + (f" / {type(kernel).__name__}" if kernel is not None else "")
            return None
        got["linear_method"] = llm.apply_model(linear_method)[0]
    except Exception as e:  # noqa: BLE001
        got["linear_method"] = f"unread: {error_of(e)}"
    return got


def load_state_dict(model_dir: str, device: str) -> dict:
    """The checkpoint's own weights (bf16 as saved), HF names, on `device`: what the trainer would push."""
    from safetensors.torch import load_file
    weights = {}
    for f in sorted(os.listdir(model_dir)):
        if f.endswith(".safetensors"):
            weights.update(load_file(os.path.join(model_dir, f), device=device))
    return weights


def greedy(llm, prompts, max_tokens=48):
    from vllm import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def compare(after, before) -> dict:
    same = sum(x == y for x, y in zip(after, before))
    first = [next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), len(x)) for x, y in zip(after, before)]
    return {"greedy_match": same == len(before), "same_seqs": f"{same}/{len(before)}",
            "mean_first_diff": round(statistics.mean(first), 1)}


def logprob_gap(cfg, env, kept, model_dir, cuda, sequences=8) -> dict:
    """Mean |logp engine - logp transformers| over the sampled tokens of a few fixed-workload completions."""
    import torch
    from transformers import AutoModelForCausalLM
    if kept is None:
        return {"error": {"type": "Skipped", "line": "no fixed workload with logprobs"}}
    prompt_ids, outputs = kept
    pairs = [(p, c) for p, o in zip(prompt_ids, outputs) for c in o.outputs][:sequences]
    if pairs[0][1].logprobs is None:
        return {"error": {"type": "Skipped", "line": "the engine returned no logprobs"}}
    dtype = torch.bfloat16 if cuda else torch.float32
    device = "cuda" if cuda else "cpu"
    lm = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa").to(device).eval()
    gaps, worst = [], 0.0
    with torch.no_grad():
        for p, c in pairs:
            ids = torch.tensor([p + list(c.token_ids)], device=device)
            logits = lm(ids).logits[0, len(p) - 1:-1].float() / cfg.temperature  # processed_logprobs: after T
            hf = torch.log_softmax(logits, -1).gather(1, ids[0, len(p):, None])[:, 0].cpu()
            engine = torch.tensor(list(c.logprobs.logprobs), dtype=torch.float32)  # logprobs=0: the sampled token's
            if len(engine) != len(hf):
                raise ValueError(f"{len(engine)} engine logprobs for {len(hf)} tokens")
            d = (hf - engine).abs()
            gaps.append(d.mean().item())
            worst = max(worst, d.max().item())
    del lm
    if cuda:
        torch.cuda.empty_cache()
    return {"mean_abs": round(statistics.mean(gaps), 5), "max_abs": round(worst, 4), "sequences": len(pairs),
            "reference": f"transformers {str(dtype).removeprefix('torch.')} forward, sdpa"}


def sleep_timings(llm, push, state_dict, prompts, repeats, sync) -> dict:
    """As grpo_colocate.ColocatedEngine: level 1 (weights to CPU) and wake; level 2, wake the weights, push the full
    state dict (`push`: apply_model -> load_weights, as the trainer), wake the KV cache, reset the prefix cache.
    Medians of `repeats`; greedy output before vs after each level (the same weights: it must match)."""
    import torch

    def timed(fn):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - t0

    def free_gib():
        sync()
        return torch.cuda.mem_get_info()[0] / 2**30

    before = greedy(llm, prompts)
    rec = {"level1": [], "level2": []}
    for _ in range(repeats):
        awake = free_gib()
        s = timed(lambda: llm.sleep(level=1))
        freed = free_gib() - awake
        w = timed(lambda: llm.wake_up())
        rec["level1"].append({"sleep": s, "wake": w, "freed_gib": freed})
    after1 = greedy(llm, prompts)
    for _ in range(repeats):
        awake = free_gib()
        s = timed(lambda: llm.sleep(level=2))
        freed = free_gib() - awake
        ww = timed(lambda: llm.wake_up(tags=["weights"]))
        p = timed(push)
        wk = timed(lambda: llm.wake_up(tags=["kv_cache"]))
        r = timed(lambda: llm.reset_prefix_cache())
        rec["level2"].append({"sleep": s, "wake_weights": ww, "push": p, "wake_kv": wk, "reset_cache": r,
                              "freed_gib": freed})
    after2 = greedy(llm, prompts)
    med = {lvl: {k: round(statistics.median(r[k] for r in rs), 4) for k in rs[0]} for lvl, rs in rec.items()}
    med["level1"]["total"] = round(statistics.median(r["sleep"] + r["wake"] for r in rec["level1"]), 4)
    med["level2"]["total"] = round(statistics.median(sum(v for k, v in r.items() if k != "freed_gib")
                                                     for r in rec["level2"]), 4)
    med["push_gb"] = round(sum(t.nbytes for t in state_dict.values()) / 1e9, 3)
    med["after_level1"] = compare(after1, before)
    med["after_level2_push"] = compare(after2, before)
    return med


def push_ways(llm, state_dict, cuda, model_config) -> dict:
    """The two ways to push the checkpoint's weights: vLLM's reload (re-runs the layers' weight processing, e.g.
    online fp8 quantization) and the trainer's CUDA push (load_weights straight into the model's parameters)."""
    def reload():
        llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(state_dict.items())})
        if not cuda and getattr(model_config, "tie_word_embeddings", False):  # as grpo_colocate.push_weights
            llm.apply_model(lambda m: m.lm_head.quant_method.process_weights_after_loading(m.lm_head))

    return {"reload_weights": reload,
            "apply_model": lambda: llm.apply_model(lambda m: len(m.load_weights(iter(state_dict.items())) or ()))}


def push_tests(llm, ways, prompts, sync) -> dict:
    """The checkpoint's own weights pushed back each way; greedy output before vs after each (the same weights:
    it must match). reload_weights first: a failed apply_model push may leave the weights broken; then, if
    apply_model broke them and reload_weights worked, reload_weights once more (restored: must match again)."""
    result = {}
    try:
        before = greedy(llm, prompts)
    except Exception as e:  # noqa: BLE001
        return {"error": error_of(e)}
    for name, push in ways.items():
        try:
            sync()
            t0 = time.perf_counter()
            push()
            sync()
            seconds = time.perf_counter() - t0
            llm.reset_prefix_cache()
            result[name] = dict(compare(greedy(llm, prompts), before), s=round(seconds, 4))
        except Exception as e:  # noqa: BLE001
            result[name] = {"error": error_of(e)}
    if not result.get("apply_model", {}).get("greedy_match") and result.get("reload_weights", {}).get("greedy_match"):
        try:
            ways["reload_weights"]()
            llm.reset_prefix_cache()
            result["restored_by_reload"] = compare(greedy(llm, prompts), before)
        except Exception as e:  # noqa: BLE001
            result["restored_by_reload"] = {"error": error_of(e)}
    return result


# ============================== the driver: jobs in subprocesses ==================================
def last_error_line(log: str) -> dict:
    """A crashed job's error from its log: the last `SomethingError: ...` line, else the last line."""
    lines = [ln.strip() for ln in log.splitlines() if ln.strip()]
    for ln in reversed(lines):
        m = re.match(r"^([\w.]*(Error|Exception|Interrupt|Exit)\w*)(: (.*))?$", ln)
        if m:
            return {"type": m.group(1).rsplit(".", 1)[-1], "line": (m.group(4) or "")[:300]}
    return {"type": "Crash", "line": (lines[-1] if lines else "no output")[:300]}


def run(a):
    models = dict(m.split("=", 1) for m in a.model)
    os.makedirs(a.logs, exist_ok=True)
    start = time.time()
    end = start + a.budget_s
    queue = a.jobs.split()
    while queue:
        job = queue.pop(0)
        key, variant, *rest = job.split(":")
        workloads = rest[0] if rest else a.workloads
        left = end - time.time()
        head = {"model": key, "model_dir": models.get(key), "variant": variant}
        if key not in models:
            write(a.out, [dict(head, error={"type": "Skipped", "line": f"no --model {key}=DIR"})])
            continue
        if left < a.min_job_s:
            write(a.out, [dict(head, error={"type": "Skipped", "line": f"out of time ({left:.0f}s of the budget left)"})])
            print(f"== {key}:{variant}: skipped ({left:.0f}s left)", flush=True)
            continue
        log_path = os.path.join(a.logs, f"{key}-{variant}.log")
        cmd = [sys.executable, "-u", os.path.abspath(__file__), "one", "--model", models[key], "--key", key,
               "--variant", variant, "--workloads", workloads, "--repeats", str(a.repeats),
               "--output_dir", os.path.join(a.logs, "out"), "--deadline", str(end - 5)]
        if a.cpu:
            cmd.append("--cpu")
        print(f"== {key}:{variant} ({workloads}), {left:.0f}s of the budget left", flush=True)
        t0 = time.time()
        with open(log_path, "w") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
            timed_out = False
            try:
                proc.wait(timeout=max(min(left - 3, a.job_cap_s), 1))
            except subprocess.TimeoutExpired:
                timed_out = True
                os.killpg(proc.pid, signal.SIGKILL)  # the job and what it started (compile workers)
                proc.wait()
        text = open(log_path, errors="replace").read()
        found = [ln for ln in text.splitlines() if ln.startswith(RESULT)]
        lines = json.loads(found[-1][len(RESULT):]) if found else [dict(head)]
        for line in lines:
            line["job_s"] = round(time.time() - t0, 1)
            if timed_out:
                line["error"] = line.get("error") or {"type": "Timeout", "line": f"killed after {time.time() - t0:.0f}s "
                                                                                 "(the budget's end or --job_cap_s)"}
            elif not found or proc.returncode:
                line["error"] = line.get("error") or last_error_line(text)
                line["returncode"] = proc.returncode
        write(a.out, lines)
        for line in lines:
            print("   " + brief(line), flush=True)
        if variant in FALLBACK and "init_s" not in lines[0]:  # its engine never started
            queue.insert(0, ":".join([key, FALLBACK[variant], *rest]))
    print(f"== all jobs: {time.time() - start:.0f}s", flush=True)


def write(path, lines):
    with open(path, "a") as f:
        for line in lines:
            f.write(json.dumps(line) + "\n")


def brief(r) -> str:
    w = r.get("workloads") or {}
    parts = [f"{r['model']}:{r['variant']}", f"init {r.get('init_s', '-')}s"]
    parts += [f"{k} {v['tok_s']:.0f} tok/s" for k, v in w.items()]
    if r.get("error"):
        parts.append(f"ERROR {r['error'].get('type')}: {r['error'].get('line')}")
    return ", ".join(parts)


# ============================== tables ===========================================================
def table(path):
    rows = [json.loads(line) for line in open(path) if line.strip()]
    base = {r["model"]: r for r in rows if r["variant"] == "base" and r.get("workloads")}

    def tok(r, w):
        v = (r.get("workloads") or {}).get(w)
        if not v:
            return "-"
        b = (base.get(r["model"], {}).get("workloads") or {}).get(w)
        rel = f" ({v['tok_s'] / b['tok_s']:.2f}x)" if b and r["variant"] != "base" else ""
        extra = f", len {v['mean_len']:.0f}" if w == "natural" else ""
        return f"{v['tok_s']:,.0f}{rel}{extra}"

    print("\n| model | variant | init s | fixed tok/s (vs base) | natural tok/s (vs base), mean len | engine | error |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        e = r.get("engine") or {}
        eng = (f"async {e.get('async_scheduling')}, mns {e.get('max_num_seqs')}, graphs {e.get('cudagraph_sizes')}"
               f"<= {e.get('cudagraph_max')}, q {e.get('quantization')}, sleep {r.get('sleep_mode')}") if e else "-"
        err = f"{r['error'].get('type')}: {r['error'].get('line', '')[:90]}" if r.get("error") else ""
        print(f"| {r['model']} | {r['variant']} | {r.get('init_s', '-')} | {tok(r, 'fixed')} | {tok(r, 'natural')} "
              f"| {eng} | {err} |")
    for r in rows:
        if r["variant"] == "no_logprobs":
            continue
        gap, push, sl = r.get("gap"), r.get("push"), r.get("sleep")
        if (r.get("engine") or {}).get("quantization"):
            print(f"{r['model']}:{r['variant']} linear layers: {r['engine'].get('linear_method')}")
        if gap:
            g = gap.get("error") or f"mean {gap.get('mean_abs')}, max {gap.get('max_abs')} over {gap.get('sequences')} seqs"
            print(f"{r['model']}:{r['variant']} logprob gap vs transformers: {g}")
        for way, v in (push or {}).items():
            print(f"{r['model']}:{r['variant']} push {way}: {v}")
        if sl and "error" not in sl:
            l1, l2 = sl["level1"], sl["level2"]
            print(f"{r['model']}:{r['variant']} sleep(1)+wake {l1['total']:.3f}s (sleep {l1['sleep']:.3f}, wake "
                  f"{l1['wake']:.3f}, freed {l1['freed_gib']:.1f} GiB); sleep(2)+wake weights+push+wake kv "
                  f"{l2['total']:.3f}s (sleep {l2['sleep']:.3f}, weights {l2['wake_weights']:.3f}, push {l2['push']:.3f}"
                  f" for {sl['push_gb']} GB, kv {l2['wake_kv']:.3f}, freed {l2['freed_gib']:.1f} GiB); greedy after: "
                  f"{sl['after_level1']['same_seqs']} / {sl['after_level2_push']['same_seqs']}, push via {sl.get('push_via')}")
        elif sl:
            print(f"{r['model']}:{r['variant']} sleep: {sl}")


def ledger(runs, skip=2):
    """Medians over the steps after `skip` of each run's metrics.jsonl: step time and every time/* phase."""
    phases, table_rows = [], []
    for run_ in runs:
        name, path = run_.split("=", 1)
        if not os.path.exists(path):
            table_rows.append((name, None))
            continue
        steps = [json.loads(line) for line in open(path) if line.strip()]
        steps = [m for m in steps if "reward" in m]
        used = steps[skip:] or steps
        keys = sorted({k for m in used for k in m if k.startswith("time/") and k != "time/step"})
        phases += [k for k in keys if k not in phases]

        def med(k):
            v = [m[k] for m in used if k in m]
            return statistics.median(v) if v else float("nan")
        table_rows.append((name, {"steps": len(steps), "step": med("time/step"), "step1": steps[0].get("time/step"),
                                  **{k: med(k) for k in keys}, "gen_tok_s": med("generate_tokens_per_sec_per_gpu"),
                                  "len": med("completion_length/mean"), "peak": max(m.get("memory/peak_allocated_gib", 0)
                                                                                     for m in steps),
                                  "used": max(m.get("memory/device_used_gib", 0) for m in steps)}))
    cols = [p.removeprefix("time/") for p in phases]
    print(f"\n| run | steps | step 1 s | median s/step | {' | '.join(cols)} | gen tok/s | mean len | GiB peak / used |")
    print("|---|---|---|---|" + "---|" * len(cols) + "---|---|---|")
    for name, r in table_rows:
        if r is None:
            print(f"| {name} | no metrics.jsonl (failed: see its log) |")
            continue
        ph = " | ".join(f"{r.get(p, float('nan')):.3f}" for p in phases)
        print(f"| {name} | {r['steps']} | {r['step1'] or float('nan'):.1f} | **{r['step']:.3f}** | {ph} | "
              f"{r['gen_tok_s']:,.0f} | {r['len']:.0f} | {r['peak']:.1f} / {r['used']:.1f} |")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run")
    r.add_argument("--model", action="append", required=True, help="KEY=DIR (repeat)")
    r.add_argument("--jobs", required=True, help="space-separated KEY:VARIANT[:WORKLOADS], run in this order")
    r.add_argument("--out", required=True)
    r.add_argument("--logs", required=True)
    r.add_argument("--workloads", default="fixed,natural")
    r.add_argument("--budget_s", type=float, default=480)
    r.add_argument("--min_job_s", type=float, default=45)
    r.add_argument("--job_cap_s", type=float, default=240, help="a job is killed after this long")
    r.add_argument("--repeats", type=int, default=5)
    r.add_argument("--cpu", action="store_true")
    o = sub.add_parser("one")
    o.add_argument("--model", required=True)
    o.add_argument("--key", default="")
    o.add_argument("--variant", default="base")
    o.add_argument("--workloads", default="fixed,natural")
    o.add_argument("--repeats", type=int, default=5)
    o.add_argument("--output_dir", default="/tmp/gen_settings_out")
    o.add_argument("--deadline", type=float, default=0.0, help="epoch seconds: optional phases skipped near it")
    o.add_argument("--cpu", action="store_true")
    t = sub.add_parser("table")
    t.add_argument("results")
    lg = sub.add_parser("ledger")
    lg.add_argument("runs", nargs="+", help="NAME=METRICS.jsonl")
    lg.add_argument("--skip", type=int, default=2)
    a = p.parse_args()
    if a.command in ("run", "one"):
        import importlib.util
        if not a.cpu and importlib.util.find_spec("torch"):
            import torch
            a.cpu = not torch.cuda.is_available()
        if a.command == "run" and a.cpu and a.repeats == 5:
            a.repeats = 2
    if a.command == "run":
        run(a)
    elif a.command == "one":
        one(a)
    elif a.command == "table":
        table(a.results)
    else:
        ledger(a.runs, a.skip)


if __name__ == "__main__":
    main()
