"""Time to a reward level, from runs' metrics.jsonl (ours or bench_trl.py's): the summed step time (step 1 included,
engine start excluded) until the 5-step mean training reward first reaches each level.

    python bench/reach.py /tmp/s19-a/learn-*/metrics.jsonl [--levels 0.1 0.15 0.2]
"""
import argparse
import json
import statistics

parser = argparse.ArgumentParser()
parser.add_argument("files", nargs="+")
parser.add_argument("--levels", type=float, nargs="+", default=[0.10, 0.15, 0.20])
args = parser.parse_args()
for path in args.files:
    rows = [r for r in map(json.loads, open(path)) if "reward" in r and "time/step" in r]
    clock, rewards, reached = 0.0, [], {}
    for r in rows:
        clock += r["time/step"]
        rewards.append(r["reward"])
        mean = statistics.mean(rewards[-5:])
        for level in args.levels:
            if len(rewards) >= 5 and mean >= level and level not in reached:
                reached[level] = f"step {r['step']}, {clock:.1f} s"
    steps = [r["time/step"] for r in rows]
    print(f"{path}: {len(rows)} steps, {clock:.1f} s in all, step 1 {steps[0]:.1f} s, median "
          f"{statistics.median(steps[1:] or steps):.2f} s, last 5 mean reward {statistics.mean(rewards[-5:]):.3f}")
    for level in args.levels:
        print(f"  {level:.2f}: {reached.get(level, 'not reached')}")
