#!/usr/bin/env python3
"""The report of one 8B run (reports/gpu-8b/run): results.json, three plots and the README's tables.

    python tools/gpu_8b_report.py reports/gpu-8b/run reports/gpu-8b

RUN holds what the run wrote (from its RESULTS and WORK folders): sweep.json (the sweep of the run, before it was the bench stage's),
bench.json and check.json (the bench and check stages), train-metrics.json, pipeline.json
(the run's stage timings) and versions.json. Writes OUT/results.json and three plots:
  speedup.png      bs=1 speedup by configuration, measured, with what each advice predicted
  concurrency.png  speedup and throughput with 1, 4, 8 and 16 requests in flight
  tau.png          train-predicted, offline-predicted and served tau per configuration
and prints the Markdown tables of OUT/README.md. Needs no GPU.

Every speedup here is pooled: total completion tokens / total request seconds of one server over
total / total of the other, the same prompts, paired (the bench stage's own `speedup` is the ratio
of per-request medians; both are in results.json). Advice, each against every point:
  as run      what the bench stage of the run printed
  scaled      the in-process round model scaled to the served round of the configuration the bench
              stage ran (draftlab.bench.fits.round_scale), at the tau predicted from its acceptance, and at the
              tau each configuration served (the cost model alone)
  served fit  the line R0 + d * s + v * w fitted on the sweep's served rounds (draftlab.bench.fits.advise_served),
              in sample and with the configuration left out
and the recommendations: the bench stage's and the sweep's as run, and by the advice as it is now
(advice.recommend: no depth past the acceptance measured), the sweep's after its first three
configurations (the point where it picks what to measure next).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from draftlab.bench import advice  # noqa: E402
from draftlab.bench.fits import advise_served, served_round  # noqa: E402


def measured_rounds(configs: dict) -> dict:
    """{(steps, topk, tokens): draftlab.bench.fits.served_round} of every configuration whose paired requests were kept."""
    out = {}
    for entry in configs.values():
        rows = entry.get("requests")
        if not rows:
            continue
        base = [(tok, sec) for _, mode, sec, tok, _ in rows if mode == "baseline"]
        spec = [(tok, ver, sec) for _, mode, sec, tok, ver in rows if mode == "spec"]
        got = served_round(base, spec)
        if got:
            out[(entry["num_steps"], entry["topk"], entry["num_draft_tokens"])] = got
    return out

def served_advice(results: dict, bench: dict) -> dict:
    """draftlab.bench.fits.advise_served over the bench stage's candidates (their tau from the measured
    acceptance), with every served configuration's predicted and measured speedup side by side."""
    rounds = measured_rounds(results["configs"])
    out = advise_served(bench["advice"]["candidates"], rounds)
    rows = {(c["num_steps"], c["topk"], c["num_draft_tokens"]): c for c in out["candidates"]}
    loo = {(h["num_steps"], h["topk"], h["num_draft_tokens"]): h for h in out["held_out"]}
    out["predicted_vs_measured"] = []
    for key, m in rounds.items():
        entry = results["configs"]["-".join(map(str, key))]
        row, held = rows.get(key), loo.get(key)
        if row is None:
            continue
        out["predicted_vs_measured"].append({
            "config": "-".join(map(str, key)), "predicted_tau": row["predicted_tau"], "served_tau": m["served_tau"],
            "predicted_speedup": row["predicted_speedup"], "measured_speedup": entry["speedup"],
            "speedup_error": row["predicted_speedup"] / entry["speedup"] - 1.0,
            "held_out_speedup": held["predicted_speedup"] if held else None,
            "held_out_error": held["predicted_speedup"] / entry["speedup"] - 1.0 if held else None,
            "round_ms": 1e3 * m["round_s"]})
    return out

def name(k) -> str:
    return "-".join(str(x) for x in k)


def key(row) -> tuple[int, int, int]:
    return (row["num_steps"], row["topk"], row["num_draft_tokens"])


def costs_in_seconds(costs_ms: dict) -> dict:
    """bench.json's costs (keys ending _s hold milliseconds there) back in seconds."""
    def s(v):
        return {k: s(x) for k, x in v.items()} if isinstance(v, dict) else v / 1e3
    out = {k: (s(v) if k.endswith("_s") else v) for k, v in costs_ms.items()}
    out["fit_s"] = s(costs_ms["fit_s"])
    return out


def scaled_costs(bench: dict) -> dict:
    """The bench stage's in-process costs (seconds), scaled to the served round of the configuration it
    ran (draftlab.bench.fits.round_scale): its model for a server that is not the reference engine."""
    costs = costs_in_seconds(bench["costs"])
    return {**costs, "round_scale": (bench_point(bench)["round_ms"] / 1e3) / costs["offline_round_s"]}


def bench_point(bench: dict) -> dict:
    """The bench stage's configuration as a pooled, paired bs=1 point with its served round."""
    base, spec = bench["baseline"]["tokens_per_s"], bench["spec"]
    n, tokens = base["requests"], spec["tokens_per_s"]["completion_tokens"]
    spec_s = tokens / spec["tokens_per_s"]["throughput"]
    request_s = bench["costs"]["server_request_s"] / 1e3
    flags = bench["flags"]["effective"]
    return {"config": name((flags["num_steps"], flags["topk"], flags["num_draft_tokens"])), "source": "bench stage",
            "served_tau": spec["tau"], "speedup": spec["tokens_per_s"]["throughput"] / base["throughput"],
            "speedup_median_of_requests": bench["speedup"], "baseline_tokens_per_s": base["throughput"],
            "spec_tokens_per_s": spec["tokens_per_s"]["throughput"], "offline_tau": bench["offline_tau"],
            "round_ms": 1e3 * (spec_s - n * request_s) / spec["verify_ct"], "greedy_identical": None}


def sweep_point(entry: dict, rounds: dict | None) -> dict:
    """A sweep configuration's bs=1 point; rounds: its draftlab.bench.fits.served_round (measured_rounds)."""
    return {"config": name(key(entry)), "source": "sweep", "served_tau": entry["served_tau"], "speedup": entry["speedup"],
            "baseline_tokens_per_s": entry["baseline"]["tokens_per_s"], "spec_tokens_per_s": entry["spec"]["tokens_per_s"],
            "per_prompt_speedup": entry.get("per_prompt_speedup"), "greedy_identical": entry["greedy_identical"],
            "round_ms": 1e3 * rounds["round_s"] if rounds else None}


def level(n: int, base_tokens_per_s: float, spec_tokens_per_s: float, per_request_speedup: float | None = None) -> dict:
    """One concurrency point: throughput of both servers and their ratio."""
    row = {"concurrency": n, "speedup": spec_tokens_per_s / base_tokens_per_s,
           "baseline_tokens_per_s": base_tokens_per_s, "spec_tokens_per_s": spec_tokens_per_s}
    if per_request_speedup is not None:
        row["per_request_speedup"] = per_request_speedup
    return row


def tokens_per_request(entry: dict) -> float | None:
    """Completion tokens per request over every counted baseline batch of an in-flight entry."""
    batches = [b for r in entry.get("concurrency", []) for b in r["baseline"].get("batches", [])]
    requests = sum(b.get("requests", 0) for b in batches)
    return sum(b["completion_tokens"] for b in batches) / requests if requests else None


def probe_seconds(probe: dict | None) -> dict:
    """{n: seconds per admitted request} from a sweep's prefill probe ({n: {"ms_per_request": ..}})."""
    return {int(n): v["ms_per_request"] / 1e3 for n, v in (probe or {}).items()}


def same_batch_predictions(in_flight: dict, scaled: dict, served_tau: dict, request_s: dict | None = None) -> list[dict]:
    """Each configuration measured in flight, predicted from every other one's batches (the same
    prompts and baseline server): the bench stage's per-concurrency model (advice.costs_by_concurrency,
    the in-process round shape `scaled`) calibrated on configuration x's b_n and served round at n,
    then asked for y at y's served tau; with and without the verify's batch growth (gemm_s). With
    request_s (the baseline's prefill probe, {n: s per request}) the prefills come out of the step
    and the round (`error_amortized`: the same prediction with them amortized)."""
    out = []
    for x, ex in in_flight.items():
        kx, tau_x = key(ex), served_tau[x]
        cx = {**scaled, "offline_round_s": advice.round_cost(scaled, *kx, tau_x)["round"]}
        base_x = [{"concurrency": r["concurrency"], "throughput": r["baseline"]["tokens_per_s"]} for r in ex["concurrency"]]
        spec_x = [{"concurrency": r["concurrency"], "throughput": r["spec"]["tokens_per_s"]} for r in ex["concurrency"]]
        T = tokens_per_request(ex) if request_s else None
        per = advice.costs_by_concurrency(cx, base_x, spec_x, tau_x, kx[2], request_s, T)
        flat = advice.costs_by_concurrency({k: v for k, v in cx.items() if k != "gemm_s"}, base_x, spec_x, tau_x, kx[2],
                                           request_s, T)
        amortized = advice.costs_by_concurrency(cx, base_x, spec_x, tau_x, kx[2])
        for y, ey in in_flight.items():
            if y == x:
                continue
            ky = key(ey)
            for r in ey["concurrency"]:
                n = r["concurrency"]
                if n in per and n > 1:
                    pred = advice.predict(per[n], served_tau[y], *ky)
                    out.append({"calibrated_on": x, "config": y, "concurrency": n, "measured": r["speedup"],
                                "predicted_same_batches": pred, "error_same_batches": pred / r["speedup"] - 1.0,
                                "error_same_batches_no_growth": advice.predict(flat[n], served_tau[y], *ky) / r["speedup"] - 1.0,
                                "error_amortized": advice.predict(amortized[n], served_tau[y], *ky) / r["speedup"] - 1.0})
    return out


def build(run: Path) -> dict:
    sweep = json.loads((run / "sweep.json").read_text())
    bench = json.loads((run / "bench.json").read_text())
    train = json.loads((run / "train-metrics.json").read_text())
    check = json.loads((run / "check.json").read_text()) if (run / "check.json").exists() else None  # parity may be skipped for time
    pipeline = json.loads((run / "pipeline.json").read_text())
    versions = json.loads((run / "versions.json").read_text())

    rounds = measured_rounds(sweep["configs"])
    points = [sweep_point(e, rounds.get(key(e))) for e in sweep["configs"].values() if "speedup" in e] + [bench_point(bench)]
    points.sort(key=lambda p: (int(p["config"].split("-")[1]) > 1, [int(x) for x in p["config"].split("-")]))
    cands = {name(key(c)): c for c in bench["advice"]["candidates"]}
    train_tau = {f"{n}-1-{n + 1}": v for n, v in ((int(k.split("_")[1]), v) for k, v in train["tau_by_steps"].items())}

    # the bench stage's model, as run and scaled to the served round of its configuration
    ran = bench_point(bench)
    scaled = scaled_costs(bench)
    scaled_rows = {name(key(c)): advice.predict(scaled, c["predicted_tau"], *key(c)) for c in bench["advice"]["candidates"]}
    bench_now = advice.recommend([{**c, "predicted_speedup": scaled_rows[name(key(c))]} for c in bench["advice"]["candidates"]])
    # the served-round fit: as the sweep ran it (its pick), and by the advice as it is now, after the
    # first three configurations (what the sweep measures next) and over every one measured
    served_as_run = sweep.get("served_advice") or {}
    order = list(sweep["configs"])
    first3 = served_advice({"configs": {k: sweep["configs"][k] for k in order[:3]}}, bench)
    served = served_advice(sweep, bench)
    fit_rows = {name(key(c)): c["predicted_speedup"] for c in served.get("candidates", [])}
    held = {name(key(h)): h["predicted_speedup"] for h in served.get("held_out", [])}
    for p in points:
        c = p["config"]
        p["predicted_tau"] = cands[c]["predicted_tau"] if c in cands else None
        p["tau_extrapolated"] = cands[c]["extrapolated"] if c in cands else None
        p["train_predicted_tau"] = train_tau.get(c)
        p["advice"] = {
            "as_run": cands[c]["predicted_speedup"] if c in cands else None,
            "scaled": scaled_rows.get(c),
            # the cost model alone: the same scaled rounds at the tau this configuration served
            "scaled_at_served_tau": advice.predict(scaled, p["served_tau"], *key(cands[c])) if c in cands else None,
            "served_fit": fit_rows.get(c),
            "served_fit_held_out": held.get(c) if p["source"] == "sweep" else fit_rows.get(c),  # bench point: never in the fit
        }
        p["advice_error"] = {k: (v / p["speedup"] - 1.0 if v else None) for k, v in p["advice"].items()}

    # concurrency: measured (bench stage's configuration and the sweep's) and the bench stage's model
    # per concurrency (scaled on its batches, plus the verify's batch growth), at each config's served tau
    by_c_costs = advice.costs_by_concurrency(scaled, bench["sweep"]["baseline"], bench["sweep"]["speculative"], bench["spec"]["tau"],
                                             int(ran["config"].split("-")[2]))  # + the verify's batch growth where timed
    concurrency = {}
    b = {r["concurrency"]: r for r in bench["sweep"]["baseline"]}
    s = {r["concurrency"]: r for r in bench["sweep"]["speculative"]}
    concurrency[ran["config"]] = [level(1, ran["baseline_tokens_per_s"], ran["spec_tokens_per_s"])] + [
        level(n, b[n]["throughput"], s[n]["throughput"], s[n]["median"] / b[n]["median"]) for n in sorted(b) if n in s]
    for e in sweep["configs"].values():
        if e.get("concurrency"):
            concurrency[name(key(e))] = [level(1, e["baseline"]["tokens_per_s"], e["spec"]["tokens_per_s"])] + [
                level(r["concurrency"], r["baseline"]["tokens_per_s"], r["spec"]["tokens_per_s"], r["per_request_speedup"])
                for r in e["concurrency"]]
    served_tau = {p["config"]: p["served_tau"] for p in points}
    for cfg, rows in concurrency.items():
        c = cands.get(cfg)
        for r in rows:
            costs_n = by_c_costs.get(r["concurrency"])
            if c and costs_n and r["concurrency"] > 1:
                r["predicted_speedup"] = advice.predict(costs_n, served_tau[cfg], *key(c))
                r["batch_growth_ms"] = 1e3 * advice.batch_growth(costs_n, c["num_draft_tokens"])
                r["error"] = r["predicted_speedup"] / r["speedup"] - 1.0
    # the same model calibrated on the other configuration the sweep measured in flight, with the
    # same batches (64 prompts, the same baseline server): the shape across configurations alone,
    # with and without the verify's batch growth
    in_flight = {name(key(e)): e for e in sweep["configs"].values() if e.get("concurrency")}
    for p in same_batch_predictions(in_flight, scaled, served_tau):
        for r in concurrency[p["config"]]:
            if r["concurrency"] == p["concurrency"]:
                r.update({k: p[k] for k in ("calibrated_on", "predicted_same_batches", "error_same_batches",
                                            "error_same_batches_no_growth")})
    crossover = {n: max(advice.predict(cn, c["predicted_tau"], *key(c)) for c in bench["advice"]["candidates"])
                 for n, cn in by_c_costs.items()}

    floor = sweep["bandwidth_floor"]
    return {
        "versions": versions, "gpu": sweep.get("gpu"), "target": sweep["target"], "draft": sweep["draft"],
        "method": sweep["method"], "pipeline": {"stage_seconds": pipeline["stage_seconds"], "train_epochs": pipeline["train_epochs"],
                                               "train_rate": pipeline.get("train_rate"), "run": pipeline["run"]},
        "train": {k: train[k] for k in ("tau_pred", "tau_by_steps", "accept", "tokens_per_s", "seconds", "optimizer_steps", "settings")},
        "bs1": points,
        "best": max(points, key=lambda p: p["speedup"])["config"],
        "advice": {"bench_as_run": bench["advice"]["advice"], "bench_now": bench_now["advice"],
                   "round_scale": scaled["round_scale"],
                   "sweep_as_run": served_as_run.get("advice"), "sweep_now_after_first_3": first3.get("advice"),
                   "served_fit": {k: served.get(k) for k in ("advice", "fit_ms")},
                   "best_predicted_at_concurrency": crossover},
        "concurrency": concurrency,
        "tau": {"train_predicted": train["tau_pred"], "offline": bench["offline_tau"], "served": bench["spec"]["tau"],
                "server_log_accept_len": bench["server_accept_length"]},
        "check": {"errors": sum(f["severity"] == "error" for f in check.get("findings", [])),
                  "findings": [f"{f['severity']}: {f['name']}" for f in check.get("findings", [])]} if check else None,
        "baseline_vs_floor": {"floor_tokens_per_s_at_nominal": floor["tokens_per_s_at_nominal"],
                              "floor_tokens_per_s_at_measured_copy": floor["tokens_per_s_at_measured_copy"],
                              "measured_copy_bandwidth": sweep.get("measured_copy_bandwidth"),
                              "sglang_log_decode_bs1": sweep.get("baseline_decode_log"),
                              "client_pooled_bs1": [p["baseline_tokens_per_s"] for p in points]},
    }


def plots(r: dict, out: Path) -> None:
    pts = r["bs1"]
    x = range(len(pts))
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.bar(x, [p["speedup"] for p in pts], color=["C0" if p["config"].split("-")[1] == "1" else "C1" for p in pts], label="measured")
    for k, marker, label in (("scaled", "^", "advice: in-process shape, served scale"), ("served_fit", "x", "advice: served-round fit"),
                             ("served_fit_held_out", "o", "served-round fit, this point left out")):
        ax.scatter(x, [p["advice"][k] or float("nan") for p in pts], marker=marker, color="k", zorder=3, label=label,
                   facecolors="none" if marker == "o" else None)
    for i, p in enumerate(pts):
        ax.annotate(f"tau {p['served_tau']:.2f}", (i, p["speedup"] / 2), ha="center", color="white", fontsize=8)
    ax.set_xticks(list(x), [p["config"] for p in pts])
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xlabel("steps-topk-draft tokens (blue: chain, orange: tree)")
    ax.set_ylabel("paired speedup at bs=1")
    ax.set_title(f"own EAGLE-3 draft on an 8B-cost target, {r['gpu']}, SGLang {r['versions']['sglang']}", fontsize=10)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(out / "speedup.png", dpi=120)
    plt.close(fig)

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    for i, (cfg, rows) in enumerate(r["concurrency"].items()):
        cs = [row["concurrency"] for row in rows]
        a1.plot(cs, [row["speedup"] for row in rows], marker="o", color=f"C{i}", label=f"{cfg} measured")
        pred = [(row["concurrency"], row["predicted_speedup"]) for row in rows if "predicted_speedup" in row]
        if pred:
            a1.plot(*zip(*pred), ls="--", marker="^", color=f"C{i}", label=f"{cfg} advice (bench stage's batches)")
        same = [(row["concurrency"], row["predicted_same_batches"]) for row in rows if "predicted_same_batches" in row]
        if same:
            a1.plot(*zip(*same), ls=":", marker="x", color=f"C{i}", label=f"{cfg} advice (from {rows[-1]['calibrated_on']}'s batches)")
        a2.plot(cs, [row["spec_tokens_per_s"] for row in rows], marker="o", color=f"C{i}", label=f"{cfg} EAGLE3")
        a2.plot(cs, [row["baseline_tokens_per_s"] for row in rows], marker="s", ls=":", color=f"C{i}", label=f"baseline ({cfg} run)")
    for a in (a1, a2):
        a.set_xscale("log", base=2)
        a.set_xlabel("requests in flight")
        a.legend(fontsize=7)
    a1.axhline(1.0, color="grey", lw=0.8, ls="--")
    a1.set_ylabel("throughput speedup (paired batches)")
    a2.set_ylabel("total tokens/s")
    fig.tight_layout()
    fig.savefig(out / "concurrency.png", dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 4))
    w = 0.27
    for j, (k, label) in enumerate((("train_predicted_tau", "train-predicted (eval TTT)"), ("predicted_tau", "offline-predicted (advice)"),
                                     ("served_tau", "served (SGLang meta_info)"))):
        ax.bar([i + (j - 1) * w for i in x], [p.get(k) or 0.0 for p in pts], w, label=label)
    ax.set_xticks(list(x), [p["config"] for p in pts])
    ax.set_ylabel("tau (tokens per verify round)")
    ax.set_title("tau: training, offline and served agree", fontsize=10)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "tau.png", dpi=120)
    plt.close(fig)


def pct(v) -> str:
    """A relative error as the tables print it (+1.2%), or '-' where there is none."""
    return "-" if v is None else f"{100 * v:+.1f}%"


def tables(r: dict) -> str:
    lines = ["| config | source | served tau | predicted tau (offline / train) | baseline tok/s | EAGLE3 tok/s | speedup | "
             "advice: scaled (at served tau) | advice: served fit (held out) | served round |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for p in r["bs1"]:
        a, e = p["advice"], p["advice_error"]
        train = f" / {p['train_predicted_tau']:.2f}" if p.get("train_predicted_tau") else ""
        mark = "*" if p.get("tau_extrapolated") else ""
        lines.append(f"| {p['config']} | {p['source']} | {p['served_tau']:.2f} | {p['predicted_tau']:.2f}{mark}{train} | "
                     f"{p['baseline_tokens_per_s']:.1f} | {p['spec_tokens_per_s']:.1f} | **{p['speedup']:.2f}x** | "
                     f"{a['scaled']:.2f}x ({pct(e['scaled'])}; {pct(e['scaled_at_served_tau'])}) | "
                     f"{a['served_fit']:.2f}x ({pct(e['served_fit'])}; {pct(e['served_fit_held_out'])}) | {p['round_ms']:.2f} ms |")
    lines.append("\n\\* deeper than the acceptance the bench stage measured (5 steps): tau extrapolated")
    lines += ["", "| config | requests in flight | baseline tok/s | EAGLE3 tok/s | speedup | per-request speedup | "
              "advice: bench stage's batches | batch growth | advice: the sweep's batches (no growth) |",
              "|---|---|---|---|---|---|---|---|---|"]
    for cfg, rows in r["concurrency"].items():
        for row in rows:
            pred = f"{row['predicted_speedup']:.2f}x ({pct(row['error'])})" if "predicted_speedup" in row else "-"
            per = f"{row['per_request_speedup']:.2f}x" if "per_request_speedup" in row else "-"
            grow = f"{row['batch_growth_ms']:+.2f} ms" if "batch_growth_ms" in row else "-"
            same = (f"{row['predicted_same_batches']:.2f}x ({pct(row['error_same_batches'])}; "
                    f"{pct(row['error_same_batches_no_growth'])}) from {row['calibrated_on']}" if "calibrated_on" in row else "-")
            lines.append(f"| {cfg} | {row['concurrency']} | {row['baseline_tokens_per_s']:.0f} | {row['spec_tokens_per_s']:.0f} | "
                         f"{row['speedup']:.2f}x | {per} | {pred} | {grow} | {same} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    run, out = (Path(a) for a in (argv or sys.argv[1:])[:2])
    r = build(run)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(r, indent=1) + "\n")
    plots(r, out)
    print(tables(r))


if __name__ == "__main__":
    main()
