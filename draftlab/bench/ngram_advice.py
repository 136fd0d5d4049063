"""The advice for n-gram lookup (NGRAM): its round, fitted from its measured pairing, and whether it
beats the trained draft, by how much.

    ngram = ngram_advice.advise(backend, ngram_pairings, costs, draft_candidates)
    ngram["report"]            # bench.json advice.ngram (None without an NGRAM configuration)
    ngram["by_key"]            # {("NGRAM", N, B): candidate row}, bs=1, for draftlab.bench.sweep.rows
    text = ngram_advice.advice_text(advised, ngram)    # the draft's advice, and n-gram lookup against it

A round of n-gram lookup with N tokens verified (root included) and a tree at most B wide:

    round(N, B) = V(N) + lookup        one verify of the N-token block (SGLang pads it to N, a fixed
                                        shape, so it costs N tokens whatever matched) and the host-side
                                        lookup; no draft forward and no draft extend

timed whole in-process, the lookup being the reference drafter's (draftlab.bench.offline.measure_ngram_costs,
costs["ngram_round_s"]). The speedup follows the draft's model (draftlab.bench.advice):

    in-process  I(c) = (P + T e) / (P + (T / tau_c) round(c))    e, P: decode step and prefill timed in
                                                                 the same interleaved loop; T tokens/request
    reference   speedup(c) = sigma * I(c),   sigma = measured speedup / I of the calibrating pairing
    SGLang      speedup(c) = (P_s + T b_s) / (P_s + (T / tau_c) kappa round(c)),
                kappa solved so that the calibrating pairing's measured speedup is predicted; P_s, b_s
                that pairing's baseline (draftlab.bench.fits.probed_requests). kappa_from_rounds, its
                served round (draftlab.bench.fits.served_round; where the requests are too alike in
                length for its line, their seconds less the prefill probe's per-request cost, per
                round) / its in-process round, is reported beside it

The calibrating pairing is the first NGRAM configuration of bench.sweep, as spec.*'s calibrates the
draft's model: it is predicted exactly by construction, and every other NGRAM configuration measured
is a prediction with its error (`held_out` also predicts each measured one from each other one).
tau of a candidate: a measured configuration's served tau; a chain (B = 1) shorter than a chain
measured, 1 + sum_i prod_{j<=i} a_j of that chain's measured per-depth acceptance. With requests in
flight the calibrating pairing's batches give each concurrency's step and round scale
(advice.costs_by_concurrency), as they do for the draft.
"""
from __future__ import annotations

import math

from draftlab.bench import advice, sweep, fits
from draftlab.metrics import chain_tau

NGRAM = sweep.NGRAM


def timed_configs(keys) -> list[tuple[int, int]]:
    """(draft tokens, breadth) to time in-process for the NGRAM configuration keys: each one, and
    every shorter chain of a chain (the candidates `advise` predicts)."""
    out = set()
    for _, tokens, breadth in keys:
        out.add((tokens, breadth))
        if breadth == 1:
            out |= {(n, 1) for n in range(2, tokens)}
    return sorted(out)


def name_of(key) -> str:
    return "ngram" if key[1:] == (12, 10) else sweep.name_of(key)


def _measured(p) -> dict:
    """One NGRAM pairing's figures for the model."""
    base, spec = p.baseline, p.spec
    base_reqs, spec_reqs = sweep.served_requests(p)
    probed = fits.probed_requests([t for t, _ in base_reqs], [s for _, s in base_reqs], base.get("prompt_only_seconds") or [])
    return {"key": p.configuration.key, "name": p.configuration.name, "tau": spec["spec"]["tau"],
            "acceptance": spec["spec"]["acceptance"] or [], "speedup": spec["speed"]["median"] / base["speed"]["median"],
            "served": fits.served_round(base_reqs, spec_reqs), "probed": probed, "pairing": p}


def candidates(measured: list[dict]) -> list[dict]:
    """The NGRAM configurations predicted: those measured (their served tau) and the shorter chains of a
    measured chain (tau from its per-depth acceptance)."""
    rows = {m["key"]: {"key": m["key"], "configuration": m["name"], "predicted_tau": m["tau"], "tau_from": "served"} for m in measured}
    for m in measured:
        _, tokens, breadth = m["key"]
        if breadth != 1 or not m["acceptance"]:
            continue
        for n in range(2, tokens):
            key = (NGRAM, n, 1)
            if key not in rows:
                a = [m["acceptance"][min(i, len(m["acceptance"]) - 1)] for i in range(n - 1)]
                rows[key] = {"key": key, "configuration": name_of(key), "predicted_tau": chain_tau(a), "tau_from": f"acceptance of {m['name']}"}
    return list(rows.values())


def _round(costs: dict, key) -> float | None:
    return (costs.get("ngram_round_s") or {}).get(f"{key[1]}-{key[2]}")


def in_process_speedup(costs: dict, tau: float, key) -> float:
    """I(c) of the module docstring."""
    r, step, prefill = _round(costs, key), costs["ngram_decode_step_s"], costs.get("ngram_prefill_s", 0.0)
    T = costs.get("tokens_per_request") or math.inf
    return tau * step / r if math.isinf(T) else (prefill + T * step) / (prefill + (T / tau) * r)


def _scale(backend: str, m: dict, costs: dict) -> dict | None:
    """The calibration on one measured pairing: {"sigma": ...} (reference) or {"kappa", "step_s",
    "request_s", "tokens_per_request"} (another engine: SGLang); None when it cannot be made."""
    r = _round(costs, m["key"])
    if not r:
        return None
    if backend == "reference":
        return {"sigma": m["speedup"] / in_process_speedup(costs, m["tau"], m["key"])}
    served, probed = m["served"], m["probed"]
    if not served and probed:  # requests too alike in length to fit a line through: the prefill probe gives the fixed cost
        _, spec_reqs = sweep.served_requests(m["pairing"])
        base_tokens = [t for t, _ in sweep.served_requests(m["pairing"])[0]]
        rounds = sum(v for _, v, _ in spec_reqs)
        served = {"round_s": (sum(s for *_, s in spec_reqs) - len(spec_reqs) * probed["server_request_s"]) / rounds,
                  "tokens_per_request": sum(base_tokens) / len(base_tokens)} if rounds and base_tokens else None
    if not served:
        return None
    probed = probed or {"server_step_s": served["step_s"], "server_request_s": served["request_s"]}
    scale = {"kappa_from_rounds": served["round_s"] / r, "step_s": probed["server_step_s"],
             "request_s": probed["server_request_s"], "tokens_per_request": served["tokens_per_request"]}
    # kappa solved so that the calibrating pairing's prediction is its measured speedup, as spec.*'s
    # is: the served round alone (kappa_from_rounds) mixes a line fitted through the baseline's
    # requests with the prefill probe's medians, and NGRAM's requests differ widely in tau (a looping
    # answer is looked up whole), so that round predicted its own pairing 12% high on an H100.
    T, b, P, s = scale["tokens_per_request"] or math.inf, scale["step_s"], scale["request_s"], m["speedup"]
    kappa = m["tau"] * b / (s * r) if math.isinf(T) else ((P + T * b) / s - P) * m["tau"] / (T * r)
    return {"kappa": kappa if kappa > 0 else scale["kappa_from_rounds"], **scale}


def predict(costs: dict, scale: dict, tau: float, key) -> float | None:
    """Predicted bs=1 speedup of the NGRAM configuration `key` whose rounds yield `tau` tokens."""
    r = _round(costs, key)
    if r is None or scale is None:
        return None
    if "sigma" in scale:
        return scale["sigma"] * in_process_speedup(costs, tau, key)
    T, b, P = scale["tokens_per_request"] or math.inf, scale["step_s"], scale["request_s"]
    rnd = scale["kappa"] * r
    return tau * b / rnd if math.isinf(T) else (P + T * b) / (P + (T / tau) * rnd)


def _at_concurrency(costs: dict, m: dict, rows: list[dict]) -> dict:
    """{n: {key: {"predicted_tau", "predicted_speedup"}}} from the calibrating pairing's batches at n."""
    base, spec = m["pairing"].baseline, m["pairing"].spec
    if not base or not spec["sweep"]:
        return {}
    request_s = {r["concurrency"]: r["prompt_only_s_per_request"] for r in base["sweep"] if r.get("prompt_only_s_per_request")}
    tokens = sum(r["completion_tokens"] for r in base["sweep"]) / max(1, sum(r["requests"] for r in base["sweep"]))
    own = {**costs, "offline_round_s": _round(costs, m["key"])}
    per = advice.costs_by_concurrency(own, base["sweep"], spec["sweep"], m["tau"], None, request_s or None, tokens)
    out = {}
    for n, c in per.items():
        if n == 1:
            continue
        scale = {"kappa": c["round_scale"], "step_s": c["server_step_s"], "request_s": c["server_request_s"],
                 "tokens_per_request": c["tokens_per_request"]}
        out[n] = {row["key"]: {"predicted_tau": row["predicted_tau"], "predicted_speedup": predict(costs, scale, row["predicted_tau"], row["key"])}
                  for row in rows}
    return out


def advise(backend: str, pairings: list, costs: dict, draft_candidates: list[dict]) -> dict:
    """The NGRAM advice from the NGRAM pairings measured (each with a speculative server's figures):
    see the module docstring. Returns {"report", "by_key", "by_concurrency_key"}."""
    measured = [_measured(p) for p in pairings]
    if not measured or not costs.get("ngram_round_s"):
        return {"report": None, "by_key": {}, "by_concurrency_key": {}}
    calib = measured[0]
    scale = _scale(backend, calib, costs)
    rows = []
    for c in candidates(measured):
        rows.append({**c, "num_draft_tokens": c["key"][1], "max_bfs_breadth": c["key"][2],
                     "predicted_speedup": predict(costs, scale, c["predicted_tau"], c["key"]),
                     "round_ms": 1e3 * _round(costs, c["key"]) if _round(costs, c["key"]) else None})
    by_key = {r["key"]: r for r in rows}
    compared = [{"configuration": m["name"], "measured_tau": m["tau"], "measured_speedup": m["speedup"],
                 "predicted_speedup": by_key[m["key"]]["predicted_speedup"],
                 "speedup_error": _error(by_key[m["key"]]["predicted_speedup"], m["speedup"])} for m in measured]
    held_out = []
    for m in measured:
        for other in measured:
            if other is m:
                continue
            got = predict(costs, _scale(backend, other, costs), m["tau"], m["key"])
            held_out.append({"configuration": m["name"], "calibrated_on": other["name"], "predicted_speedup": got,
                             "measured_speedup": m["speedup"], "speedup_error": _error(got, m["speedup"])})
    report = {"calibrated_on": calib["name"], "scale": scale, "candidates": [{k: v for k, v in r.items() if k != "key"} for r in rows],
              "predicted_vs_measured": compared, "held_out": held_out, "versus_draft": versus(rows, draft_candidates)}
    return {"report": report, "by_key": by_key, "by_concurrency_key": _at_concurrency(costs, calib, rows)}


def _error(predicted, measured):
    return predicted / measured - 1.0 if predicted is not None and measured else None


def versus(ngram_rows: list[dict], draft_candidates: list[dict]) -> dict | None:
    """The best n-gram lookup against the best trained-draft configuration, both as predicted at bs=1
    (the draft's candidates whose tau was measured, not extrapolated): which is faster, by how much."""
    grams = [r for r in ngram_rows if r.get("predicted_speedup") is not None]
    drafts = [r for r in draft_candidates if not r.get("extrapolated")]
    if not grams or not drafts:
        return None
    g = max(grams, key=lambda r: r["predicted_speedup"])
    d = max(drafts, key=lambda r: r["predicted_speedup"])
    gs, ds = g["predicted_speedup"], d["predicted_speedup"]
    dname = sweep.name_of((d["num_steps"], d["topk"], d["num_draft_tokens"]))
    if gs > ds:
        text = (f"n-gram lookup {g['configuration']} (predicted {gs:.2f}x, no training) beats the trained draft's best, "
                f"{dname} ({ds:.2f}x), by {100 * (gs / ds - 1):.0f}%")
    else:
        text = (f"the trained draft {dname} (predicted {ds:.2f}x) beats n-gram lookup's best, {g['configuration']} "
                f"({gs:.2f}x), by {100 * (ds / gs - 1):.0f}%")
    if max(gs, ds) <= 1.0:
        text += "; neither is predicted above 1.0x"
    return {"best_ngram": g["configuration"], "best_ngram_predicted_speedup": gs, "best_draft": dname,
            "best_draft_predicted_speedup": ds, "ngram_over_draft": gs / ds, "winner": "ngram" if gs > ds else "draft", "text": text}


def advice_text(advised: dict, ngram: dict) -> str:
    """The draft's advice in words, and n-gram lookup against it where an NGRAM configuration ran."""
    vs = (ngram.get("report") or {}).get("versus_draft")
    return advised["advice"] + (f"; {vs['text']}" if vs else "")
