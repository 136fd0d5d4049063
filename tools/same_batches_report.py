#!/usr/bin/env python3
"""Concurrency on the same batches: how well one configuration's batches predict another's, and
how far the measurement itself moves between repeats.

    python tools/same_batches_report.py reports/gpu-8b/same-batches/run reports/gpu-8b/run/bench.json \\
        reports/gpu-8b/same-batches

RUN holds a sweep whose configurations all ran in flight on the same batches
(sweep.json) and the Decode lines of each server's SGLang log (decode-baseline.log,
decode-spec-S-K-W.log). BENCH is a bench.json of the same target and draft shape: its in-process
costs give the round's shape across steps, topk and width (the bench stage's model). Writes
OUT/results.json and OUT/same-batches.png and prints the README's tables. Needs no GPU.

Three readings per configuration and concurrency:
  repeats      the speedup of each ABBA pair of batches and their spread (max / min - 1)
  predicted    the bench stage's per-concurrency model calibrated on another configuration's batches
               (gpu_8b_report.same_batch_predictions), with and without the verify's batch growth
  SGLang round the server's own time per decode round at exactly n requests running: n * accept len /
               gen throughput over its Decode lines (n / throughput for the baseline), median
"""
from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

import gpu_8b_report as report  # noqa: E402
from draftlab.sglang.launch import read_log  # noqa: E402

LEVELS = (1, 4, 8, 16)  # requests in flight measured (1: the bs=1 pairs)
LOG_LEVELS = (4, 8, 16)  # running requests whose log lines give a round (see log_rounds)


def repeat_spread(base_batches: list[dict], spec_batches: list[dict]) -> dict:
    """The speedup of each ABBA pair of batches (same prompts, back to back) and their spread
    (max / min - 1): how far the measurement itself moves between repeats. A prediction cannot be
    checked more finely than this; on one H200 two repeats of 64-prompt batches differed by up to
    32% at 8 and 16 in flight (reports/gpu-8b/same-batches)."""
    pairs = [s["tokens_per_s"] / b["tokens_per_s"] for b, s in zip(base_batches, spec_batches)]
    return {"repeat_speedups": pairs, "repeat_spread": max(pairs) / min(pairs) - 1.0 if pairs else None}

def log_rounds(path: Path) -> dict:
    """SGLang's own ms per decode round at exactly n running requests (median over its Decode lines).
    A line's throughput spans the last 40 decode steps, so lines at n = 1 between paired requests also
    count the idle time while the other server ran: only n in LOG_LEVELS are read."""
    by: dict[int, list[float]] = {}
    for d in read_log(path).decode:
        if d.gen_throughput and d.running_req in LOG_LEVELS:
            by.setdefault(d.running_req, []).append(1e3 * d.running_req * (d.accept_len or 1.0) / d.gen_throughput)
    return {str(n): {"median_ms": statistics.median(v), "lines": len(v)} for n, v in sorted(by.items())}


def build(run: Path, bench_path: Path) -> dict:
    sweep = json.loads((run / "sweep.json").read_text())
    bench = json.loads(bench_path.read_text())
    scaled = report.scaled_costs(bench)
    in_flight = {report.name(report.key(e)): e for e in sweep["configs"].values() if e.get("concurrency")}
    served_tau = {k: e["served_tau"] for k, e in in_flight.items()}
    configs = {}
    for cfg, e in in_flight.items():
        rows = [{"concurrency": 1, "speedup": e["speedup"], "served_tau": e["served_tau"]}]
        for r in e["concurrency"]:
            spread = repeat_spread(r["baseline"]["batches"], r["spec"]["batches"])
            rows.append({"concurrency": r["concurrency"], "speedup": r["speedup"], "per_request_speedup": r["per_request_speedup"],
                         "baseline_tokens_per_s": r["baseline"]["tokens_per_s"], "spec_tokens_per_s": r["spec"]["tokens_per_s"],
                         **spread})
        configs[cfg] = rows
    request_s = report.probe_seconds(sweep.get("baseline_prefill_probe"))
    preds = report.same_batch_predictions(in_flight, scaled, served_tau, request_s or None)
    spread_of = {(c, r["concurrency"]): r.get("repeat_spread") for c, rows in configs.items() for r in rows}
    for p in preds:
        p["repeat_spread"] = spread_of[(p["config"], p["concurrency"])]
    logs = {f.stem.removeprefix("decode-"): log_rounds(f) for f in sorted(run.glob("decode-*.log"))}
    probes = {"baseline": sweep.get("baseline_prefill_probe")} | {f"spec-{c}": e.get("prefill_probe") for c, e in in_flight.items()}
    probe_ms = {server: {n: v["ms_per_request"] for n, v in probe.items()} for server, probe in probes.items() if probe}
    errors = [abs(p["error_same_batches"]) for p in preds]
    spreads = [r["repeat_spread"] for rows in configs.values() for r in rows if r.get("repeat_spread") is not None]
    return {"gpu": sweep.get("gpu"), "sglang_version": sweep.get("sglang_version"), "method": sweep["method"],
            "draft": sweep["draft"], "costs_from": bench_path.name, "configs": configs, "predictions": preds,
            "sglang_rounds_ms": logs, "prefill_probe_ms": probe_ms,
            "tokens_per_request": {c: report.tokens_per_request(e) for c, e in in_flight.items()},
            "summary": {"max_abs_error": max(errors) if errors else None,
                        "within_10pct": sum(e <= 0.10 for e in errors), "predictions": len(errors),
                        "max_abs_error_amortized": max((abs(p["error_amortized"]) for p in preds), default=None) if probe_ms else None,
                        "max_repeat_spread": max(spreads) if spreads else None,
                        "median_repeat_spread": statistics.median(spreads) if spreads else None}}


def plots(r: dict, out: Path) -> None:
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    first = next(iter(r["configs"]))
    for i, (cfg, rows) in enumerate(r["configs"].items()):
        cs = [row["concurrency"] for row in rows]
        a1.plot(cs, [row["speedup"] for row in rows], marker="o", color=f"C{i}", label=f"{cfg} measured (pooled)")
        for row in rows:
            for s in row.get("repeat_speedups") or []:
                a1.scatter([row["concurrency"]], [s], color=f"C{i}", s=12, alpha=0.6)
        pred = [(p["concurrency"], p["predicted_same_batches"]) for p in r["predictions"]
                if p["config"] == cfg and p["calibrated_on"] == first]
        if pred:
            a1.plot(*zip(*sorted(pred)), ls="--", marker="^", color=f"C{i}", label=f"{cfg} predicted from {first}'s batches")
    a1.set_ylabel("throughput speedup (dots: each ABBA repeat)")
    a1.axhline(1.0, color="grey", lw=0.8, ls="--")
    for i, (server, rounds) in enumerate(r["sglang_rounds_ms"].items()):
        pts = [(int(n), v["median_ms"]) for n, v in rounds.items()]
        if pts:
            a2.plot(*zip(*pts), marker="s", color="k" if server == "baseline" else f"C{i - 1}",
                    label="baseline step" if server == "baseline" else f"{server.removeprefix('spec-')} round")
    a2.set_ylabel("SGLang's own ms per decode round (log lines)")
    for a in (a1, a2):
        a.set_xscale("log", base=2)
        a.set_xticks(list(LEVELS), [str(n) for n in LEVELS])
        a.set_xlabel("requests in flight")
        a.legend(fontsize=7)
    fig.suptitle(f"same 64-prompt batches, {r['gpu']}, SGLang {r['sglang_version']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(out / "same-batches.png", dpi=120)
    plt.close(fig)


def tables(r: dict) -> str:
    pct = report.pct
    lines = ["| config | in flight | speedup (pooled) | each repeat | repeat spread |", "|---|---|---|---|---|"]
    for cfg, rows in r["configs"].items():
        for row in rows:
            reps = " ".join(f"{s:.2f}" for s in row.get("repeat_speedups") or []) or "-"
            spread = f"{100 * row['repeat_spread']:.0f}%" if row.get("repeat_spread") is not None else "-"
            lines.append(f"| {cfg} | {row['concurrency']} | {row['speedup']:.2f}x | {reps} | {spread} |")
    probed = bool(r.get("prefill_probe_ms"))
    extra = " error, prefills amortized |" if probed else ""
    lines += ["", "| calibrated on | predicted | in flight | measured | predicted | error | error, no batch growth |" + extra
              + " that point's repeat spread |", "|---|---|---|---|---|---|---|---|" + ("---|" if probed else "")]
    for p in r["predictions"]:
        amortized = f" {pct(p['error_amortized'])} |" if probed else ""
        lines.append(f"| {p['calibrated_on']} | {p['config']} | {p['concurrency']} | {p['measured']:.2f}x | "
                     f"{p['predicted_same_batches']:.2f}x | {pct(p['error_same_batches'])} | {pct(p['error_same_batches_no_growth'])} |"
                     f"{amortized} {100 * p['repeat_spread']:.0f}% |")
    if probed:
        servers = list(r["prefill_probe_ms"])
        levels = sorted({int(n) for v in r["prefill_probe_ms"].values() for n in v})
        lines += ["", "| prompt-only requests in flight | " + " | ".join(servers) + " |", "|---|" + "---|" * len(servers)]
        for n in levels:
            cells = [f"{v[str(n)]:.1f} ms" if str(n) in v else "-" for v in r["prefill_probe_ms"].values()]
            lines.append(f"| {n} | " + " | ".join(cells) + " |")
    servers = list(r["sglang_rounds_ms"])
    lines += ["", "| requests running | " + " | ".join(servers) + " |", "|---|" + "---|" * len(servers)]
    for n in map(str, LOG_LEVELS):
        cells = [f"{v[n]['median_ms']:.1f} ms ({v[n]['lines']})" if n in v else "-" for v in r["sglang_rounds_ms"].values()]
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> None:
    args = argv or sys.argv[1:]
    run, bench, out = Path(args[0]), Path(args[1]), Path(args[2])
    r = build(run, bench)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(r, indent=1) + "\n")
    plots(r, out)
    print(tables(r))


if __name__ == "__main__":
    main()
