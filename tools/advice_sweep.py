"""Predicted against measured speedup over a sweep of bench experiments: a markdown table and a plot.

After a sweep of the bench stage over spec.num_steps (one experiment per value, run one at a time
on a shared CPU):

    for n in 1 2 3 5 7; do dvc exp run --queue -S spec.num_steps=$n -n steps-$n; done
    dvc queue start -j 1            # then `dvc queue status` until every task is done
    python tools/advice_sweep.py --out reports/advice_sweep

Each run is one experiment's reports/bench.json: `dvc exp show --json` names the experiments (and
the baseline commit) with their commits, and the whole file is read from the commit with
`git show REV:reports/bench.json` (bench.json is committed in each experiment's ref, `cache: false`;
`dvc exp show` alone drops the lists, e.g. the candidates). --files reads bench.json copies instead.

Per run, two predictions of the configuration it ran:
  own run: the run's own advice (its costs, its acceptance, the loop calibrated on this very
           configuration's offline rounds): how far the served speedup is from the in-process model;
  from REF: one reference run's advice for every configuration (one run's costs and acceptance
           predict the others): the test of the cost model's shape over num_steps.
Writes OUT/sweep.md (the table) and OUT/sweep.png, and prints the table.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

BENCH = "reports/bench.json"


def config_of(report: dict) -> tuple[int, int, int]:
    """(num_steps, topk, num_draft_tokens) the run served."""
    f = report["settings"] if "num_steps" in report.get("settings", {}) else report["flags"]["effective"]
    return int(f["num_steps"]), int(f["topk"]), int(f["num_draft_tokens"])


def candidate(report: dict, config: tuple) -> dict | None:
    """The report's advice row for `config`, or None."""
    return next((c for c in report.get("advice", {}).get("candidates") or []
                 if (c["num_steps"], c["topk"], c["num_draft_tokens"]) == tuple(config)), None)


def own_prediction(report: dict) -> tuple[float | None, float | None]:
    """(predicted tau, predicted speedup) of the configuration the run served, from its own advice."""
    adv = report.get("advice", {})
    row = adv.get("ran") or next(iter(adv.get("predicted_vs_measured") or []), None) or candidate(report, config_of(report))
    return (row.get("predicted_tau"), row.get("predicted_speedup")) if row else (None, None)


def _error(predicted, measured):
    return predicted / measured - 1.0 if predicted is not None and measured else None


def table_rows(runs: list[tuple[str, dict]], reference: dict | None = None) -> list[dict]:
    """One row per run (name, bench report), sorted by (topk, num_steps, num_draft_tokens): measured
    tau and speedup, the own run's and the reference's predictions and their errors (predicted /
    measured - 1)."""
    rows = []
    for name, report in runs:
        steps, topk, ndt = config_of(report)
        tau, speedup = report.get("tau", report.get("spec", {}).get("tau")), report.get("speedup")
        ptau, pspeed = own_prediction(report)
        ref = candidate(reference, (steps, topk, ndt)) if reference else None
        rows.append({"run": name, "num_steps": steps, "topk": topk, "num_draft_tokens": ndt,
                     "measured_tau": tau, "predicted_tau": ptau, "measured_speedup": speedup,
                     "predicted_speedup": pspeed, "error": _error(pspeed, speedup),
                     "reference_speedup": ref["predicted_speedup"] if ref else None,
                     "reference_error": _error(ref["predicted_speedup"], speedup) if ref else None})
    return sorted(rows, key=lambda r: (r["topk"], r["num_steps"], r["num_draft_tokens"], r["run"]))


def markdown(rows: list[dict], reference_name: str | None = None) -> str:
    """The table; the reference's columns only when a reference is named."""
    def num(x, fmt):
        return "n/a" if x is None else format(x, fmt)

    def pct(x):
        return "n/a" if x is None else f"{100 * x:+.1f}%"

    head = ["run", "num_steps", "topk", "draft tokens", "measured tau", "predicted tau", "measured speedup",
            "predicted speedup (own run)", "error"]
    if reference_name:
        head += [f"predicted speedup (from {reference_name})", "error (from it)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["run"], str(r["num_steps"]), str(r["topk"]), str(r["num_draft_tokens"]), num(r["measured_tau"], ".2f"),
                 num(r["predicted_tau"], ".2f"), num(r["measured_speedup"], ".3f"), num(r["predicted_speedup"], ".3f"), pct(r["error"])]
        if reference_name:
            cells += [num(r["reference_speedup"], ".3f"), pct(r["reference_error"])]
        lines.append("| " + " | ".join(cells) + " |")
    errors = [abs(r["error"]) for r in rows if r["error"] is not None]
    ref_errors = [abs(r["reference_error"]) for r in rows if r["reference_error"] is not None]
    foot = []
    if errors:
        foot.append(f"largest error, own run: {100 * max(errors):.1f}%")
    if reference_name and ref_errors:
        foot.append(f"from {reference_name}: {100 * max(ref_errors):.1f}%")
    return "\n".join(lines) + ("\n\n" + "; ".join(foot) + " (error = predicted / measured - 1)\n" if foot else "\n")


def plot(rows: list[dict], reference: dict | None, reference_name: str | None, path: Path) -> None:
    """Speedup against num_steps: measured (dots), the own run's prediction (crosses), the
    reference's predicted chain curve (line); trees in a second colour."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4))
    for tree, colour in ((False, "C0"), (True, "C1")):
        rs = [r for r in rows if (r["topk"] > 1) == tree]
        kind = "tree" if tree else "chain"
        if not rs:
            continue
        ax.plot([r["num_steps"] for r in rs], [r["measured_speedup"] for r in rs], "o", color=colour, label=f"measured ({kind})")
        ax.plot([r["num_steps"] for r in rs], [r["predicted_speedup"] for r in rs], "x", color=colour, ms=9,
                label=f"predicted by its own run ({kind})")
    if reference:
        chain = sorted((c["num_steps"], c["predicted_speedup"]) for c in reference["advice"]["candidates"] if c["topk"] == 1)
        ax.plot([s for s, _ in chain], [p for _, p in chain], "-", color="C0", alpha=0.6, label=f"predicted from {reference_name} (chains)")
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set(xlabel="spec.num_steps", ylabel="speedup (tokens/s against the baseline)", title="bench: predicted against measured speedup")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def experiments(show: list) -> list[tuple[str, str, dict]]:
    """(name, rev, metrics data of reports/bench.json or {}) of every commit in `dvc exp show --json`
    output (the baseline commits and their experiments; the workspace left out)."""
    out = []

    def visit(entry):
        if not isinstance(entry, dict):
            return
        rev = entry.get("rev")
        if rev and rev != "workspace" and "data" in entry:
            metrics = ((entry.get("data") or {}).get("metrics") or {}).get(BENCH) or {}
            out.append((entry.get("name") or rev[:7], rev, metrics.get("data") or {}))
        for exp in entry.get("experiments") or []:
            for r in exp.get("revs") or []:
                visit(r)

    for entry in show:
        visit(entry)
    return out


def fitted(report: dict) -> bool:
    """Whether the report's advice comes from the fitted cost model (its costs hold the fit)."""
    return "fit_s" in (report.get("costs") or {})


def collect(root: Path, keep_all: bool = False) -> tuple[list[tuple[str, dict]], str | None]:
    """(runs as (name, bench report), the default reference's name) from the repo's experiments.

    Left out: queued or failed experiments (no bench.json with a speedup), a run seen twice (an
    experiment that reproduced nothing has the baseline commit's report), and unless keep_all, runs
    whose advice predates the fitted model. The default reference: a run with the baseline
    commit's configuration, an experiment before the baseline commit itself (whose committed report
    may be older than the experiments')."""
    show = json.loads(subprocess.run(["dvc", "exp", "show", "--json"], cwd=root, check=True, capture_output=True, text=True).stdout)
    baseline_revs = {e.get("rev") for e in show if isinstance(e, dict)}
    runs, seen, baseline = [], set(), None
    for name, rev, data in experiments(show):
        got = subprocess.run(["git", "show", f"{rev}:{BENCH}"], check=False, cwd=root, capture_output=True, text=True)
        report = json.loads(got.stdout) if got.returncode == 0 else data  # the metrics alone lack the lists
        if not report.get("advice") or report.get("speedup") is None or not (keep_all or fitted(report)):
            continue
        key = (report.get("config_hash"), report.get("speedup"))
        if key in seen:
            continue
        seen.add(key)
        runs.append((name, report))
        if rev in baseline_revs and baseline is None:
            baseline = (name, config_of(report))
    if baseline is None:
        return runs, None
    same = [n for n, r in runs if config_of(r) == baseline[1] and n != baseline[0]]
    return runs, (same[0] if same else baseline[0])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("reports/advice_sweep"), help="where sweep.md and sweep.png go")
    ap.add_argument("--files", nargs="*", type=Path, help="bench.json copies to read instead of the repo's experiments "
                                                          "(each run named by its file's stem)")
    ap.add_argument("--reference", help="the run whose advice predicts every configuration: a run name (an experiment's "
                                        "name, a file's path); default: an experiment with the baseline "
                                        "commit's configuration, else the baseline commit's run, else the first")
    ap.add_argument("--all", action="store_true", help="keep runs whose advice predates the fitted cost model")
    ap.add_argument("--root", type=Path, default=Path("."), help="the repository (for dvc exp show)")
    args = ap.parse_args(argv)
    if args.files:
        stems = [f.stem for f in args.files]  # a run is named by its file's stem where the stems differ
        names = stems if len(set(stems)) == len(stems) else [str(f) for f in args.files]
        runs, baseline = [(n, json.loads(f.read_text())) for n, f in zip(names, args.files)], None
    else:
        runs, baseline = collect(args.root, args.all)
    if not runs:
        sys.exit("advice_sweep: no finished bench run found (none in dvc exp show --json with a reports/bench.json from "
                 "the fitted cost model; --all keeps older ones)")
    ref_name = args.reference or baseline or runs[0][0]
    if args.files and ref_name in map(str, args.files):  # a file's path names its run
        ref_name = runs[[str(f) for f in args.files].index(ref_name)][0]
    reference = next((r for n, r in runs if n == ref_name or n.startswith(ref_name)), None)
    if reference is None:
        sys.exit(f"advice_sweep: --reference {ref_name}: no such run among {[n for n, _ in runs]}")
    rows = table_rows(runs, reference)
    table = markdown(rows, ref_name)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sweep.md").write_text(table)
    plot(rows, reference, ref_name, args.out / "sweep.png")
    print(table)
    print(f"advice_sweep: {args.out / 'sweep.md'}, {args.out / 'sweep.png'}")


if __name__ == "__main__":
    main()
