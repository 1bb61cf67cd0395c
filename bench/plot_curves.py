"""The training reward and each held-out eval score per step, from a run's metrics.jsonl, into curves.png.

    python bench/plot_curves.py outputs/cpu-run      # run.sh calls it after every run
"""
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
    plot_curves(sys.argv[1])
