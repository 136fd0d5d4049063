"""Plot the results of reports/gpu-8b/earlier/ (the sweep of the run): paired speedup by configuration (served tau on each bar),
and, where measured, throughput speedup against concurrency.

    python tools/plot_gpu_8b.py reports/gpu-8b/earlier/inflated-draft.json reports/gpu-8b/earlier/inflated-draft.png
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def main(argv=None) -> None:
    src, dst = (argv or sys.argv[1:])[:2]
    results = json.loads(Path(src).read_text())
    done = {k: v for k, v in results["configs"].items() if "speedup" in v}
    sweeps = {k: v["concurrency"] for k, v in done.items() if v.get("concurrency")}
    fig, axes = plt.subplots(1, 2 if sweeps else 1, figsize=(11 if sweeps else 6, 4), squeeze=False)
    ax = axes[0][0]
    names = list(done)
    bars = ax.bar(names, [done[n]["speedup"] for n in names], color=["C0" if done[n]["topk"] == 1 else "C1" for n in names])
    for bar, n in zip(bars, names):
        ax.annotate(f"tau {done[n]['served_tau']:.2f}", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center", va="bottom", fontsize=9)
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xlabel("steps-topk-draft tokens (blue: chain, orange: tree)")
    ax.set_ylabel("paired speedup, bs=1 (spec tok/s / baseline tok/s)")
    ax.set_title(f"8B-cost twin + EAGLE-3 draft, {results.get('gpu') or 'GPU'}", fontsize=10)
    if sweeps:
        ax2 = axes[0][1]
        for n, rows in sweeps.items():
            cs = [1] + [r["concurrency"] for r in rows]
            ax2.plot(cs, [done[n]["speedup"]] + [r["speedup"] for r in rows], marker="o", label=n)
        ax2.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax2.set_xscale("log", base=2)
        ax2.set_xlabel("concurrent requests")
        ax2.set_ylabel("throughput speedup")
        ax2.legend(fontsize=8)
        ax2.set_title("speedup vs concurrency (1 = paired bs=1)", fontsize=10)
    fig.tight_layout()
    fig.savefig(dst, dpi=120)


if __name__ == "__main__":
    main()
