"""The training reward and each held-out eval score per step, from a run's metrics.jsonl, into curves.png.

    python bench/plot_curves.py --output_dir outputs/cpu-run   # run.sh calls it after its runs, with
                                                               # the run's flags (the last --output_dir wins)
"""
import argparse
import json
import os
import sys


def plot_curves(output_dir: str):
    try:
        import matplotlib.pyplot as plt
    except ImportError:
        return print("matplotlib is not installed: no curves.png (pip install matplotlib)")
    path = os.path.join(output_dir, "metrics.jsonl")
    if not os.path.exists(path):  # e.g. a resume at max_steps
        return print(f"no {path}: no curves.png")
    records = [json.loads(line) for line in open(path)]
    fig, ax = plt.subplots(figsize=(7, 4))
    for key in ["reward"] + sorted({k for r in records for k in r if k.startswith("eval/")}):
        points = [(r["step"], r[key]) for r in records if r.get(key) is not None]
        ax.plot(*zip(*points), "o-" if "/" in key else "-", label=key)
    ax.set(xlabel="step", title=f"{output_dir}: training reward and held-out scores")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.savefig(os.path.join(output_dir, "curves.png"), dpi=110)
    print(f"curves: {os.path.join(output_dir, 'curves.png')}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--output_dir", default="outputs/grpo")  # grpo_colocate.py's default
    plot_curves(parser.parse_known_args(sys.argv[1:])[0].output_dir)
