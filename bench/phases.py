"""phases.py: grpo_colocate with a per-rank timeline, to see where a multi-GPU step loses its time.

    torchrun --nproc_per_node N bench/phases.py OUT_DIR <grpo_colocate flags>
    python bench/phases.py report OUT_DIR [FIRST_STEP]

The trainer runs unchanged; its functions are wrapped (a CUDA synchronise at both ends) and each call is written to
OUT_DIR/rank{R}.jsonl as {step, name, start, end} (wall clock, shared by the ranks of one host): the phases (rollout,
score, make_batch, train_step, push_weights, probe_gap, reduce_metrics), vLLM's sleep and each wake_up tag, the
empty_cache before a wake, and Python's garbage collections over 2 ms. The report gives, per name, each rank's
median time per step from FIRST_STEP (default 3), and for the phases every rank runs the spread of their ends (how
long the first rank to finish waits at the next collective); then rank 0's ledger from OUT_DIR/out/metrics.jsonl
(run with --output_dir OUT_DIR/out). Each rollout's event also holds its engine steps (count, median, p90, the
slowest three) and the host's counters over it: the main thread's CPU time, its context switches and the machine's
steal time (BENCHMARKS.md "Four GPUs: the driver, the host's CPU, and sleep mode").
PHASES_DDP='{"bucket_cap_mb": 100}' adds keyword arguments to the trainer's DDP; PHASES_PIN=C pins rank r to cores
[r C, (r + 1) C).
"""
import functools
import gc
import json
import os
import resource
import statistics
import sys
import time
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import grpo_colocate as gcol  # noqa: E402

EVENTS, STEP = [], [1]
ENGINE_STEPS = []  # the seconds of each LLMEngine.step in the rollout under way
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
        if torch.cuda.is_available():
            torch.cuda.synchronize()
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
            record(name(args, kwargs) if callable(name) else name, start, **extra)
            STEP[0] += name == "train_step"
    return timed_call


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

    for phase in PHASES:
        setattr(gcol, phase, wrap(getattr(gcol, phase), phase))
    LLM.sleep = wrap(LLM.sleep, "vllm_sleep")
    LLM.wake_up = wrap(LLM.wake_up, lambda a, k: "wake_" + "_".join(k.get("tags") or ["all"]))
    torch.cuda.empty_cache = wrap(torch.cuda.empty_cache, "empty_cache")
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
    for r, events in ranks.items():  # each rollout's engine steps and host counters (steps >= 1)
        rollouts = [e for e in events if e["name"] == "rollout" and "engine_steps" in e]
        if rollouts:
            walls = [e["end"] - e["start"] for e in rollouts]
            cpu_share = sum(e["thread_cpu"] for e in rollouts) / sum(walls)
            print(f"rank {r} rollouts (s / median engine step ms): "
                  + " ".join(f"{w:.2f}/{e['engine_step_p50'] * 1e3:.1f}" for w, e in zip(walls, rollouts))
                  + f"; thread CPU / wall {cpu_share:.2f}, involuntary switches <="
                  f" {max(e['involuntary_switches'] for e in rollouts)}, steal {sum(e['steal_s'] for e in rollouts):.2f} s")
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
    instrument()
    try:
        gcol.main(argv)
    finally:
        with open(os.path.join(out_dir, f"rank{os.environ.get('RANK', '0')}.jsonl"), "w") as f:
            f.writelines(json.dumps(e) + "\n" for e in EVENTS)
