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


def write_configuration_plots(out: Path, report: dict) -> None:
    """configurations.csv (bs=1 speedup and tau of each configuration measured, with the advice's
    prediction), concurrency.csv (speedup and both servers' tokens/s at every concurrency measured,
    one row per configuration and concurrency) and configurations.png, from bench.json's
    `configurations` (spec.*'s first, then bench.sweep's)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in report["configurations"] if r.get("speedup") is not None]

    def num(v):
        return "" if v is None else f"{v:.4f}"

    def nan(values):  # a point the advice did not predict: a gap in the line
        return [float("nan") if v is None else v for v in values]

    atomic_write_text(out / "configurations.csv", "configuration,speedup,predicted_speedup,tau,predicted_tau\n" + "".join(
        f"{r['configuration']},{num(r['speedup'])},{num(r['predicted_speedup'])},{num(r['tau'])},{num(r['predicted_tau'])}\n" for r in rows))
    # concurrency 1: the bs=1 pairing (speedup of per-request medians, single-stream tokens/s); n > 1: whole batches
    points = [(r, 1, r["speedup"], r["predicted_speedup"], r["baseline_tokens_per_s"], r["tokens_per_s"]) for r in rows]
    points += [(r, p["concurrency"], p["speedup"], p["predicted_speedup"], p["baseline_tokens_per_s"], p["tokens_per_s"])
               for r in rows for p in r["concurrency"]]
    points.sort(key=lambda x: (x[0]["configuration"], x[1]))
    atomic_write_text(out / "concurrency.csv", "configuration,concurrency,speedup,predicted_speedup,baseline_tokens_per_s,tokens_per_s\n"
                      + "".join(f"{r['configuration']},{n},{num(s)},{num(ps)},{num(b)},{num(t)}\n" for r, n, s, ps, b, t in points))
    fig, ax = plt.subplots(1, 3, figsize=(14, 3.8))
    names = [r["configuration"] for r in rows]
    ax[0].barh(names, [r["speedup"] for r in rows], label="measured")
    ax[0].scatter(nan([r["predicted_speedup"] for r in rows]), names,
                  color="black", marker="|", s=200, label="predicted", zorder=3)
    ax[0].axvline(1.0, color="grey", lw=0.8)
    ax[0].set(title="speedup by configuration (bs=1, paired)", xlabel="speedup over the baseline")
    for r in rows:
        ns = [1] + [p["concurrency"] for p in r["concurrency"]]
        line, = ax[1].plot(ns, [r["speedup"]] + [p["speedup"] for p in r["concurrency"]], marker="o", label=r["configuration"])
        ax[1].plot(ns, nan([r["predicted_speedup"]] + [p["predicted_speedup"] for p in r["concurrency"]]), ls="--", color=line.get_color())
        ax[2].plot(ns, [r["tokens_per_s"]] + [p["tokens_per_s"] for p in r["concurrency"]], marker="o", color=line.get_color(),
                   label=r["configuration"])
    if rows:  # the baseline of the first pairing (every pairing measures the same baseline server)
        ax[2].plot([1] + [p["concurrency"] for p in rows[0]["concurrency"]],
                   [rows[0]["baseline_tokens_per_s"]] + [p["baseline_tokens_per_s"] for p in rows[0]["concurrency"]],
                   marker="s", color="black", label="baseline")
    ax[1].axhline(1.0, color="grey", lw=0.8)
    ax[1].set(title="speedup by concurrency (dashed: predicted)", xlabel="requests in flight", ylabel="speedup")
    ax[2].set(title="tokens/s by concurrency", xlabel="requests in flight", ylabel="tokens/s (bs=1: per request)")
    for a in ax if rows else []:  # nothing measured against a baseline (bench.backend url): empty panels
        a.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "configurations.png", dpi=110)
    plt.close(fig)


def write_category_plots(out: Path, report: dict) -> None:
    """categories.csv (per prompt set, configuration and group: tau, speedup at bs=1) and
    categories.png (per prompt set, tau by category for each configuration; by turn where the set
    has no categories), from bench.json's `prompt_sets`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sets = report.get("prompt_sets") or []
    lines = ["prompt_set,configuration,group,requests,tau,speedup"]
    for s in sets:
        for c in s["configurations"]:
            groups = [("pooled", c["pooled"])] + [(f"turn {t}", g) for t, g in c["by_turn"].items()] + list(c["by_category"].items())
            lines += [f"{s['name']},{c['configuration']},{name},{g['requests']},{_num(g['tau'])},{_num(g['speedup'])}" for name, g in groups]
    atomic_write_text(out / "categories.csv", "\n".join(lines) + "\n")
    fig, axes = plt.subplots(1, max(1, len(sets)), figsize=(6.5 * max(1, len(sets)), 3.8), squeeze=False)
    for ax, s in zip(axes[0], sets):
        configs = s["configurations"]
        kind = "by_category" if any(c["by_category"] for c in configs) else "by_turn"
        groups = list(dict.fromkeys(g for c in configs for g in c[kind]))
        width = 0.8 / max(1, len(configs))
        for j, c in enumerate(configs):
            taus = [(c[kind].get(g) or {}).get("tau") for g in groups]
            ax.bar([i + j * width for i in range(len(groups))], [t if t is not None else 0.0 for t in taus], width, label=c["configuration"])
        ax.set_xticks([i + width * (len(configs) - 1) / 2 for i in range(len(groups))])
        ax.set_xticklabels([g if kind == "by_category" else f"turn {g}" for g in groups], rotation=30, ha="right", fontsize=8)
        ax.set(title=f"{s['name']}: served tau {'by category' if kind == 'by_category' else 'by turn'}", ylabel="tau (tokens per verify)")
        ax.axhline(1.0, color="grey", lw=0.8)
        if configs:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "categories.png", dpi=110)
    plt.close(fig)


def _num(v) -> str:
    return "" if v is None else f"{v:.4f}"
