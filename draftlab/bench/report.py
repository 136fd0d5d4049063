"""The bench's report: per prompt set (bench.prompts), each configuration by category and by turn,
and the table that answers "does training pay?": the baseline, the best n-gram lookup (NGRAM, no
training) and the best trained-draft configuration side by side, at every concurrency measured.

    sets = draftlab.bench.report.prompt_sets(plan.sets, pairings)   # bench.json "prompt_sets" (draftlab.bench.run)
    text = draftlab.bench.report.markdown(report)                    # reports/bench/report.md, headline table first

Figures of a group of requests (a category, a turn, or all: "pooled"), from the bs=1 pairing:
    tau         completion tokens / verify rounds, pooled over the group's requests
    acceptance  a_i by draft position, pooled (per-depth counts where the server gives them, else its histogram)
    speedup     median speculative tokens/s per request / the baseline's median, over the group's requests
At n > 1 in flight (whole batches of the set): speedup = batch tokens/s against the baseline's.
The best of each kind at a concurrency is the one with the highest speedup there.
"""
from __future__ import annotations

import statistics

from draftlab.bench import servers
from draftlab.sglang import startup
from draftlab.sglang.client import parse_meta

NGRAM = "NGRAM"


def group_figures(base: dict | None, spec: dict, idx: list[int]) -> dict:
    """tau, acceptance and speedup of the requests at positions `idx` (bench.measure's order)."""
    metas = [parse_meta(spec["metas"][i]) for i in idx]
    fig = servers.spec_figures(metas) or {}
    rate = lambda src, i: (src["metas"][i].get("completion_tokens") or 0) / src["request_seconds"][i]  # noqa: E731
    spec_rate = statistics.median(rate(spec, i) for i in idx) if idx else None
    base_rate = statistics.median(rate(base, i) for i in idx) if base and idx else None
    return {"requests": len(idx), "tau": fig.get("tau"), "acceptance": fig.get("acceptance"),
            "tokens_per_s": spec_rate, "baseline_tokens_per_s": base_rate,
            "speedup": spec_rate / base_rate if spec_rate and base_rate else None}


def configuration_figures(name: str, algorithm: str, base: dict | None, spec: dict, labels: list[dict]) -> dict:
    """One configuration on one prompt set: pooled, by category (where the set has them), by turn, and per concurrency."""
    n = len(spec["metas"])
    groups_cat, groups_turn = {}, {}
    for i, label in enumerate(labels[:n]):
        if label["category"] is not None:
            groups_cat.setdefault(label["category"], []).append(i)
        groups_turn.setdefault(str(label["turn"]), []).append(i)
    at = {r["concurrency"]: r for r in (base or {}).get("sweep", [])}
    points = [{"concurrency": r["concurrency"], "tau": r.get("tau"), "tokens_per_s": r["throughput"],
               "baseline_tokens_per_s": at[r["concurrency"]]["throughput"],
               "speedup": r["throughput"] / at[r["concurrency"]]["throughput"]} for r in spec["sweep"] if r["concurrency"] in at]
    return {"configuration": name, "algorithm": algorithm, "pooled": group_figures(base, spec, list(range(n))),
            "by_category": {c: group_figures(base, spec, idx) for c, idx in groups_cat.items()},
            "by_turn": {t: group_figures(base, spec, idx) for t, idx in groups_turn.items()}, "concurrency": points}


def prompt_sets(sets: list, pairings: list) -> list[dict]:
    """bench.json "prompt_sets": per set its description, every configuration measured on it and its headline table."""
    out = []
    for bset in sets:
        configs = []
        for p in pairings:
            if not p.spec:
                continue
            base, spec = (p.sets or {}).get(bset.name) or ((p.baseline, p.spec) if bset is sets[0] else (None, None))
            if spec:
                configs.append(configuration_figures(p.configuration.name, p.configuration.resolution.effective.algorithm,
                                                     base, spec, bset.labels))
        out.append({**bset.info(), "configurations": configs, "training_pays": training_pays(configs)})
    return out


def _pick(configs: list[dict], n: int, ngram: bool) -> dict | None:
    """The configuration of one kind with the highest speedup at concurrency n, and its figures there."""
    best = None
    for c in configs:
        if (c["algorithm"] == NGRAM) != ngram:
            continue
        fig = c["pooled"] if n == 1 else next((p for p in c["concurrency"] if p["concurrency"] == n), None)
        if fig and fig.get("speedup") is not None and (best is None or fig["speedup"] > best["speedup"]):
            best = {"configuration": c["configuration"], "tau": fig["tau"], "speedup": fig["speedup"], "tokens_per_s": fig["tokens_per_s"]}
    return best


def training_pays(configs: list[dict]) -> list[dict]:
    """One row per concurrency measured: the baseline's tokens/s (of the first pairing, spec.*'s; bs=1:
    per request), the best n-gram lookup and the best draft configuration, and the verdict."""
    if not configs:
        return []
    first = configs[0]
    levels = [1] + [p["concurrency"] for p in first["concurrency"]]
    rows = []
    for n in levels:
        base = first["pooled"]["baseline_tokens_per_s"] if n == 1 else next(p["baseline_tokens_per_s"] for p in first["concurrency"]
                                                                             if p["concurrency"] == n)
        g, d = _pick(configs, n, True), _pick(configs, n, False)
        pays, text = verdict(g, d)
        rows.append({"concurrency": n, "baseline_tokens_per_s": base, "best_ngram": g, "best_draft": d, "training_pays": pays,
                     "verdict": text})
    return rows


def verdict(g: dict | None, d: dict | None) -> tuple[bool | None, str]:
    """(does the trained draft pay: beat the baseline and n-gram lookup, the words)."""
    if d is None:
        return None, "no draft configuration measured"
    ds = d["speedup"]
    if g is None:
        return None, f"n-gram lookup not measured (add ngram to bench.sweep); the draft {d['configuration']}: {ds:.2f}x"
    gs = g["speedup"]
    if ds > max(1.0, gs):
        return True, f"yes: the draft {d['configuration']} {ds:.2f}x, {100 * (ds / gs - 1):.0f}% above n-gram lookup {g['configuration']} ({gs:.2f}x)"
    if gs > ds:
        return False, (f"no: n-gram lookup {g['configuration']} ({gs:.2f}x, no training) beats the draft's best "
                       f"{d['configuration']} ({ds:.2f}x) by {100 * (gs / ds - 1):.0f}%"
                       + ("; neither beats the baseline" if gs <= 1.0 else ""))
    return False, f"no: neither beats the baseline (the draft {d['configuration']} {ds:.2f}x, n-gram lookup {g['configuration']} {gs:.2f}x)"


def verdict_line(rows: list[dict]) -> str:
    """The headline table in one line: per concurrency, yes/no and the two best speedups."""
    parts = []
    for r in rows:
        if r["training_pays"] is None:
            continue
        word = "yes" if r["training_pays"] else "no"
        parts.append(f"{'bs=1' if r['concurrency'] == 1 else str(r['concurrency']) + ' in flight'}: {word} "
                     f"(draft {r['best_draft']['speedup']:.2f}x, n-gram {r['best_ngram']['speedup']:.2f}x)")
    return ", ".join(parts)


# ---------------------------------------------------------------------------------------------
# Markdown


def _f(x, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _best(b: dict | None) -> str:
    return "-" if b is None else f"{b['configuration']}: tau {_f(b['tau'])}, {_f(b['speedup'])}x"


def headline_markdown(rows: list[dict]) -> str:
    """The "does training pay?" table."""
    lines = ["| requests in flight | baseline tok/s | best n-gram lookup (no training) | best trained draft | does training pay? |",
             "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['concurrency']} | {_f(r['baseline_tokens_per_s'], 1)} | {_best(r['best_ngram'])} | {_best(r['best_draft'])} "
                     f"| {r['verdict']} |")
    return "\n".join(lines)


def groups_markdown(s: dict) -> str:
    """Per configuration of one set: pooled, by turn (when several) and by category: tau, a_i, speedup."""
    depth = max((len(g["acceptance"] or []) for c in s["configurations"] for g in [c["pooled"]]), default=0)
    shown = min(depth, 8)
    lines = ["| configuration | group | requests | tau | " + " | ".join(f"a_{i}" for i in range(1, shown + 1)) + " | speedup (bs=1) |",
             "|---|---|---|---|" + "---|" * shown + "---|"]
    for c in s["configurations"]:
        groups = [("pooled", c["pooled"])]
        if len(c["by_turn"]) > 1:
            groups += [(f"turn {t}", g) for t, g in c["by_turn"].items()]
        groups += [(cat, g) for cat, g in c["by_category"].items()]
        for name, g in groups:
            acc = (g["acceptance"] or []) + [None] * shown
            lines.append(f"| {c['configuration']} | {name} | {g['requests']} | {_f(g['tau'])} | "
                         + " | ".join(_f(a) for a in acc[:shown]) + f" | {_f(g['speedup'])} |")
    return "\n".join(lines)


def markdown(report: dict) -> str:
    """reports/bench/report.md: "does training pay?" first (every prompt set), then every set by group."""
    sets = report.get("prompt_sets") or []
    out = ["# Bench report", "", "## Does training pay?", "",
           "Baseline (no speculation), the best n-gram lookup (SGLang's NGRAM: drafts looked up in a cache of earlier text, "
           "no training) and the best trained-draft configuration, each paired against the same baseline server, at every "
           "concurrency measured (bs=1: median tokens/s per request; more in flight: whole batches).", ""]
    for s in sets:
        out += [f"### {s['name']} ({s['conversations']} conversations, {s['requests']} requests, {s['turns']} turn(s))", "",
                headline_markdown(s["training_pays"]), ""]
    adv = report.get("advice") or {}
    out += ["## The advice", "", adv.get("advice", "-"), ""]
    for s in sets:
        out += [f"## {s['name']}: every configuration by turn and category", "",
                f"Source: `{s['source']}`. tau and a_i pooled over the group's requests; speedup: medians of tokens/s per request.", "",
                groups_markdown(s), ""]
    out += offline_step1_markdown(report.get("offline") or {})
    if report.get("phases_s"):
        out += ["## Where the bench's time went", "", ", ".join(f"{k}: {v:.0f} s" for k, v in report["phases_s"].items()) + ".", ""]
        if line := startup.summary(list((report.get("server_startup") or {}).values())):
            out += [f"Server start-up (launch to a healthy /health, from each server's log): {line}.", ""]
    return "\n".join(out)


def offline_step1_markdown(offline: dict) -> list[str]:
    """The offline run's step-1 acceptance by kind of token and position in the answer (draftlab.bench.offline.step1_by_group)."""
    kinds, bands = offline.get("step1_by_kind"), offline.get("step1_by_position")
    if not kinds or not bands:
        return []
    rows = [(f"{k} tokens", c) for k, c in kinds.items()] + [(f"positions {k}", c) for k, c in bands.items()]
    return ["## Where the offline run's acceptance goes", "",
            "The first draft of every verify round of the offline run (the project's engine over the first prompt set), by "
            "the token it predicts: a loop token closes an 8-gram already in the answer (draftlab/data/loops.py).", "",
            "| group | rounds | a_1 |", "|---|---|---|"] + \
        [f"| {g} | {c['rounds']} | {'-' if c['a_1'] is None else format(c['a_1'], '.3f')} |" for g, c in rows] + [""]
