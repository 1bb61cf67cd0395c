"""phases.py: grpo_colocate with a per-rank timeline, to see where a multi-GPU step loses its time.

    torchrun --nproc_per_node N bench/phases.py OUT_DIR <grpo_colocate flags>
    python bench/phases.py report OUT_DIR [FIRST_STEP]

The trainer runs unchanged; its functions are wrapped (a CUDA synchronise at both ends) and each call is written to
OUT_DIR/rank{R}.jsonl as {step, name, start, end} (wall clock, shared by the ranks of one host): the phases (rollout,
score, make_batch, train_step, push_weights, probe_gap, reduce_metrics), vLLM's sleep and each wake_up tag, the
empty_cache before a wake, and Python's garbage collections over 2 ms; train_step's events hold its peak allocated
GPU memory (the trainer's logged peak_allocated then counts from train_step on) and its micro-batches. The report
gives, per name, each rank's median time per step from FIRST_STEP (default 3), and for the phases every rank runs the
spread of their ends (how long the first rank to finish waits at the next collective); then rank 0's ledger from
OUT_DIR/out/metrics.jsonl (run with --output_dir OUT_DIR/out). Each rollout's event also holds its engine steps
(count, median, p90, the slowest three) and the host's counters over it: the main thread's CPU time, its context
switches and the machine's steal time (BENCHMARKS.md "Four GPUs: the driver, the host's CPU, and sleep mode").
PHASES_DDP='{"bucket_cap_mb": 100}' adds keyword arguments to the trainer's DDP; PHASES_PIN=C pins rank r to cores
[r C, (r + 1) C). PHASES_PYSPY=PATH (the py-spy binary) samples each of rank 0's rollouts with py-spy (every thread,
200 Hz, not pausing the process) into OUT_DIR/pyspy/rollout{K}.txt (K counts from 0); the report then sets the
fastest rollout's functions against the slowest's (seconds of samples in each, self and inclusive): which host work
grows when a rollout is slow. The trainer freezes Python's objects after its first step (gc.freeze(): full
collections then skip them); PHASES_GC_FREEZE=0 turns that off, to see what the gc2 lines cost without it.
PHASES_KV=1 sizes the engine to its rollout instead of its --vllm_gpu_memory_utilization share: vLLM's
kv_cache_memory_bytes set to one rollout's KV cache (max_num_seqs x max_model_len tokens, as the trainer sizes the CPU
engine's; tp 1 only), and the memory plan's engine_bytes to its bf16 weights + that + 2 GiB (activations, CUDA graphs)
+ the usual 2 GiB: the room, micro-batches and sleep choice an engine sized so would leave the trainer.
"""
import functools
import gc
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import grpo_colocate as gcol  # noqa: E402

EVENTS, STEP = [], [1]
OUT, PYSPY = {}, []  # OUT["dir"]: this run's OUT_DIR; PYSPY: the py-spy processes started (stopped, not yet reaped)
PYSPY_HZ = 200
ENGINE_STEPS = []  # the seconds of each LLMEngine.step in the rollout under way
CUTS = [0]  # the micro-batches of the latest plan_micro_batches (train_step's)
PHASES = ("rollout", "score", "make_batch", "train_step", "push_weights", "probe_gap", "reduce_metrics")


def record(name, start, **extra):
    if name == "empty_cache" and time.time() - start < 0.001:  # vLLM calls it often, at no cost
        return
    EVENTS.append({"step": STEP[0], "name": name, "start": start, "end": time.time(), **extra})


def steal_ticks():
    with open("/proc/stat") as f:  # cpu user nice system idle iowait irq softirq steal
        return int(f.readline().split()[8])


def host_counters():
    usage = resource.getrusage(resource.RUSAGE_THREAD)
    return time.thread_time(), time.process_time(), usage.ru_nvcsw, usage.ru_nivcsw, steal_ticks()


def rollout_extra(before):
    """Where a rollout's wall time went on the host: its engine steps (count, sum, the slowest) and the main
    thread's CPU time, context switches, and the machine's steal time (a hypervisor's other guests)."""
    after = host_counters()
    steps = sorted(ENGINE_STEPS)
    n = len(steps)
    return {"engine_steps": n, "engine_step_sum": sum(steps), "engine_step_p50": steps[n // 2] if n else 0,
            "engine_step_p90": steps[int(n * 0.9)] if n else 0, "engine_step_top3": steps[-3:],
            "thread_cpu": after[0] - before[0], "process_cpu": after[1] - before[1],
            "voluntary_switches": after[2] - before[2], "involuntary_switches": after[3] - before[3],
            "steal_s": (after[4] - before[4]) / os.sysconf("SC_CLK_TCK")}


def wrap(fn, name):
    @functools.wraps(fn)
    def timed_call(*args, **kwargs):
        extra, before = {}, None
        if name == "rollout":
            ENGINE_STEPS.clear()
            before = host_counters()
            pyspy_start()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            if name == "train_step":  # its peak: the trainer's, beside the engine asleep or awake
                torch.cuda.reset_peak_memory_stats()
            if name == "empty_cache":  # what it has to give back: the caching allocator's segments
                stats = torch.cuda.memory_stats()
                extra = {"segments": stats.get("segment.all.current", 0),
                         "reserved_gib": stats.get("reserved_bytes.all.current", 0) / 2**30}
        start = time.time()
        try:
            return fn(*args, **kwargs)
        finally:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            if before is not None:
                extra = rollout_extra(before)
                pyspy_stop()
            if name == "train_step" and torch.cuda.is_available():
                extra = {"peak_gib": torch.cuda.max_memory_allocated() / 2**30, "micro_batches": CUTS[0]}
            record(name(args, kwargs) if callable(name) else name, start, **extra)
            if name == "train_step" and STEP[0] <= 2:  # vLLM froze its start's objects; the trainer, step 1's
                print(f"phases: after step {STEP[0]}'s train_step: {gc.get_freeze_count()} objects frozen, "
                      f"{len(gc.get_objects())} others tracked", flush=True)
            STEP[0] += name == "train_step"
    return timed_call


def pyspy_start():
    """py-spy samples this process until pyspy_stop, writing raw stacks ("frame;frame;... count" lines)."""
    if not os.environ.get("PHASES_PYSPY") or os.environ.get("RANK", "0") != "0":
        return
    path = pyspy_path(OUT["dir"], sum(e["name"] == "rollout" for e in EVENTS))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    PYSPY.append(subprocess.Popen([os.environ["PHASES_PYSPY"], "record", "--pid", str(os.getpid()), "--rate",
                                   str(PYSPY_HZ), "--threads", "--nonblocking", "--format", "raw", "-o", path],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))


def pyspy_stop():  # py-spy writes its file on SIGINT; it is reaped at exit, so that no wait falls in a phase
    if PYSPY and PYSPY[-1].poll() is None:
        PYSPY[-1].send_signal(signal.SIGINT)


def pyspy_path(out_dir, k):  # the k-th rollout's profile, k from 0
    return os.path.join(out_dir, "pyspy", f"rollout{k}.txt")


def pyspy_seconds(path):
    """Seconds of samples per function in one profile: (self, inclusive), a function counted once per stack. A
    stack reads "thread (ID): NAME;func (path/file.py:line);..."; a function is "func (file.py)", the thread
    "thread NAME" (its inclusive time: the thread's)."""
    own, total = defaultdict(float), defaultdict(float)
    for line in open(path):
        stack, _, count = line.rstrip().rpartition(" ")
        thread, *calls = stack.split(";")
        frames = ["thread " + thread.rpartition(": ")[2]]
        for call in calls:
            func, _, where = call.rpartition(" (")
            frames.append(f"{func} ({where.rsplit('/', 1)[-1].split(':')[0]})")
        own[frames[-1]] += int(count) / PYSPY_HZ
        for frame in set(frames):
            total[frame] += int(count) / PYSPY_HZ
    return own, total


def pyspy_report(out_dir, rollouts, first_step):
    """rollouts: rank 0's rollout events in order. The fastest and the slowest profiled rollout from first_step,
    function by function."""
    have = {k: e["end"] - e["start"] for k, e in enumerate(rollouts)
            if e["step"] >= first_step and os.path.exists(pyspy_path(out_dir, k))}
    if len(have) < 2:
        return
    fast, slow = min(have, key=have.get), max(have, key=have.get)
    (fast_own, fast_total), (slow_own, slow_total) = (pyspy_seconds(pyspy_path(out_dir, k)) for k in (fast, slow))
    print(f"py-spy, rank 0: the fastest rollout (step {rollouts[fast]['step']}, {have[fast]:.2f} s) against the slowest"
          f" (step {rollouts[slow]['step']}, {have[slow]:.2f} s); sampled seconds fast -> slow, the 12 that grew most")
    threads = sorted(f for f in slow_total if f.startswith("thread "))
    print("  threads: " + ", ".join(f"{t[7:]} {fast_total.get(t, 0):.2f} -> {slow_total[t]:.2f}" for t in threads))
    # inclusive: below the call chain that holds the whole rollout (frames under 80% of the slowest's busiest frame)
    chain = 0.8 * max(slow_total.values())
    below = {f: t for f, t in slow_total.items() if t < chain and not f.startswith("thread ")}
    for what, a, b in (("self", fast_own, slow_own), ("inclusive", fast_total, below)):
        print(f"  {what}:")
        for frame in sorted(b, key=lambda f: a.get(f, 0) - b[f])[:12]:
            print(f"    {a.get(frame, 0):6.2f} -> {b[frame]:6.2f}  {frame[:150]}")


def instrument():
    from vllm import LLM
    from vllm.v1.engine.llm_engine import LLMEngine

    engine_step = LLMEngine.step

    def timed_step(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return engine_step(self, *args, **kwargs)
        finally:
            ENGINE_STEPS.append(time.perf_counter() - start)
    LLMEngine.step = timed_step

    extra = json.loads(os.environ.get("PHASES_DDP", "{}"))
    if extra:
        class TunedDDP(gcol.DDP):  # isinstance(policy, gcol.DDP) in the trainer still holds
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **{**kwargs, **extra})
        gcol.DDP = TunedDDP

    plan_micro_batches = gcol.plan_micro_batches

    def counted_cuts(*args, **kwargs):
        cuts = plan_micro_batches(*args, **kwargs)
        CUTS[0] = len(cuts)
        return cuts
    gcol.plan_micro_batches = counted_cuts

    for phase in PHASES:
        setattr(gcol, phase, wrap(getattr(gcol, phase), phase))
    LLM.sleep = wrap(LLM.sleep, "vllm_sleep")
    LLM.wake_up = wrap(LLM.wake_up, lambda a, k: "wake_" + "_".join(k.get("tags") or ["all"]))
    torch.cuda.empty_cache = wrap(torch.cuda.empty_cache, "empty_cache")
    if os.environ.get("PHASES_KV") == "1":  # the engine sized to one rollout (the docstring)
        import vllm
        memory_plan, engine_class, kv = gcol.memory_plan, vllm.LLM, {}

        def sized_plan(cfg, env, model_config, num_params):
            kv["bytes"] = gcol.cpu_kv_cache_bytes(cfg, env, model_config)
            env.engine_bytes = env.dtype.itemsize * num_params + kv["bytes"] + 2 * 2**31
            return memory_plan(cfg, env, model_config, num_params)
        gcol.memory_plan = sized_plan
        vllm.LLM = lambda *args, **kwargs: engine_class(*args, **{**kwargs, "kv_cache_memory_bytes": kv["bytes"]})
    if os.environ.get("PHASES_GC_FREEZE") == "0":  # the trainer's gc.collect() and gc.freeze() after step 1: none
        gcol.gc = SimpleNamespace(collect=lambda: 0, freeze=lambda: None)
    gc_start = {}

    def on_gc(phase, info):
        if phase == "start":
            gc_start["t"] = time.time()
        elif "t" in gc_start and time.time() - gc_start["t"] > 0.002:
            record(f"gc{info['generation']}", gc_start.pop("t"))
    gc.callbacks.append(on_gc)


def report(out_dir, first_step=3):
    ranks = {}
    for f in sorted(os.listdir(out_dir)):
        if f.startswith("rank") and f.endswith(".jsonl"):
            ranks[int(f[4:-6])] = [json.loads(line) for line in open(os.path.join(out_dir, f))]
    names = sorted({e["name"] for events in ranks.values() for e in events})
    print(f"{out_dir}: {len(ranks)} ranks, steps >= {first_step}: median seconds per step, per rank")
    print(f"{'name':16s} " + " ".join(f"rank{r:<3d}" for r in ranks) + "  end spread (median, max)")
    for name in names:
        per_rank, ends = [], defaultdict(list)
        for r, events in ranks.items():
            by_step = defaultdict(float)
            for e in events:
                if e["name"] == name and e["step"] >= first_step:
                    by_step[e["step"]] += e["end"] - e["start"]
                    ends[e["step"]].append(e["end"])
            per_rank.append(statistics.median(by_step.values()) if by_step else 0.0)
        spread = [max(v) - min(v) for v in ends.values() if len(v) == len(ranks) > 1]
        tail = f"  {statistics.median(spread):.3f} {max(spread):.3f}" if spread and name in PHASES else ""
        print(f"{name:16s} " + " ".join(f"{t:7.3f}" for t in per_rank) + tail)
    for r, events in ranks.items():  # the empty_cache before a wake: what it gave back
        freed = [e for e in events if e["name"] == "empty_cache" and e["step"] >= first_step and "segments" in e]
        if freed:
            print(f"rank {r} empty_cache before a wake: {statistics.median(e['end'] - e['start'] for e in freed):.3f} s,"
                  f" {statistics.median(e['segments'] for e in freed)} segments,"
                  f" {statistics.median(e['reserved_gib'] for e in freed):.1f} GiB cached (medians)")
    for r, events in ranks.items():  # train_step's peak memory and micro-batches
        trains = [e for e in events if e["name"] == "train_step" and e["step"] >= first_step and "peak_gib" in e]
        if trains:
            print(f"rank {r} train_step: peak allocated {max(e['peak_gib'] for e in trains):.1f} GiB,"
                  f" {statistics.median(e['micro_batches'] for e in trains)} micro-batches (median)")
    for r, events in ranks.items():  # each rollout's engine steps and host counters (steps >= 1)
        rollouts = [e for e in events if e["name"] == "rollout" and "engine_steps" in e]
        if rollouts:
            walls = [e["end"] - e["start"] for e in rollouts]
            cpu_share = sum(e["thread_cpu"] for e in rollouts) / sum(walls)
            print(f"rank {r} rollouts (s / median engine step ms): "
                  + " ".join(f"{w:.2f}/{e['engine_step_p50'] * 1e3:.1f}" for w, e in zip(walls, rollouts))
                  + f"; thread CPU / wall {cpu_share:.2f}, involuntary switches <="
                  f" {max(e['involuntary_switches'] for e in rollouts)}, steal {sum(e['steal_s'] for e in rollouts):.2f} s")
            if r == 0:
                pyspy_report(out_dir, [e for e in events if e["name"] == "rollout"], first_step)
    metrics = os.path.join(out_dir, "out", "metrics.jsonl")  # rank 0's ledger, if the run wrote there
    if os.path.exists(metrics):
        steps = [r for r in map(json.loads, open(metrics)) if "time/step" in r and r["step"] >= first_step]
        keys = [k for k in steps[0] if k.startswith(("time/", "mfu", "completion_tokens", "generate_tokens"))] if steps else []
        print("rank 0's ledger, median of steps >=", first_step, ":",
              " ".join(f"{k.removeprefix('time/')} {statistics.median(r[k] for r in steps):.3f}" for k in keys))


if __name__ == "__main__":
    if sys.argv[1] == "report":
        report(sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 3)
        sys.exit()
    out_dir, argv = sys.argv[1], sys.argv[2:]
    os.makedirs(out_dir, exist_ok=True)
    if os.environ.get("PHASES_PIN"):  # PHASES_PIN=C: rank r on cores [r C, (r + 1) C)
        cores = int(os.environ["PHASES_PIN"])
        local = int(os.environ.get("LOCAL_RANK", 0))
        os.sched_setaffinity(0, range(local * cores, (local + 1) * cores))
    OUT["dir"] = out_dir
    instrument()
    try:
        gcol.main(argv)
    finally:
        for spy in PYSPY:
            spy.wait(timeout=30)
        with open(os.path.join(out_dir, f"rank{os.environ.get('RANK', '0')}.jsonl"), "w") as f:
            f.writelines(json.dumps(e) + "\n" for e in EVENTS)
