"""The bench stage's plots: CSV files for `dvc plots` and one PNG for a quick look."""
from __future__ import annotations

from pathlib import Path

from draftlab.fsutil import atomic_write_text


def write_plots(out: Path, report: dict) -> None:
    """acceptance.csv, accept_hist.csv, tokens_per_s.csv and bench.png in `out`, from the bench report."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    served = report["spec"].get("acceptance") or []
    offline = report["offline"]["acceptance"]
    lines = ["position,served,offline"] + [f"{i + 1},{served[i] if i < len(served) else ''},{offline[i]}" for i in range(len(offline))]
    atomic_write_text(out / "acceptance.csv", "\n".join(lines) + "\n")
    hist = report["spec"].get("accept_hist") or []
    atomic_write_text(out / "accept_hist.csv", "accepted_drafts,steps\n" + "".join(f"{i},{n}\n" for i, n in enumerate(hist)))
    speeds = [("baseline", (report["baseline"] or {}).get("tokens_per_s")), ("speculative", report["spec"]["tokens_per_s"])]
    atomic_write_text(out / "tokens_per_s.csv", "mode,tokens_per_s\n" + "".join(f"{m},{s['median']:.2f}\n" for m, s in speeds if s))
    fig, ax = plt.subplots(1, 3, figsize=(13, 3.6))
    x = range(1, len(offline) + 1)
    ax[0].bar([i - 0.2 for i in x], served + [0] * (len(offline) - len(served)), 0.4, label="served")
    ax[0].bar([i + 0.2 for i in x], offline, 0.4, label="offline")
    ax[0].set(title="per-position acceptance a_i", xlabel="draft position", ylim=(0, 1.05))
    ax[0].legend()
    ax[1].bar(range(len(hist)), hist)
    ax[1].set(title="accepted drafts per verify step", xlabel="drafts accepted", ylabel="steps")
    names = [m for m, s in speeds if s]
    ax[2].bar(names, [s["median"] for _, s in speeds if s], yerr=[[s["median"] - s["p10"] for _, s in speeds if s], [s["p90"] - s["median"] for _, s in speeds if s]])
    ax[2].set(title=f"tokens/s (speedup {report['speedup']:.2f}x)" if report["speedup"] else "tokens/s", ylabel="tokens/s per request")
    fig.tight_layout()
    fig.savefig(out / "bench.png", dpi=110)
    plt.close(fig)
