"""What a server measured, fitted for the cost model (draftlab.bench.advice): its per-request cost and
decode step, the scale of its rounds against the in-process engine's, and a round model fitted on
its own rounds alone.

    costs.update(draftlab.bench.fits.probed_requests(tokens, seconds, prompt_only_s) or draftlab.bench.fits.fit_requests(tokens, seconds) or {})
    costs["round_scale"] = draftlab.bench.fits.round_scale(costs, draftlab.bench.fits.served_round(base, spec)["round_s"])
    costs["speedup_scale"] = draftlab.bench.fits.speedup_scale(costs, measured_speedup, tau, num_steps, topk, num_draft_tokens)
    advice = draftlab.bench.fits.advise_served(candidates, {(s, k, w): draftlab.bench.fits.served_round(base, spec), ...})

Pure arithmetic over request timings: nothing here runs a model.

A serving engine's own rounds (SGLang): an in-process round is not a served one. SGLang replays CUDA
graphs of the draft and the verify and overlaps its scheduling with them, where the in-process engine
launches eager kernels from Python. A served round is measured without any server instrumentation:
the speculative server's requests over the same prompts as the baseline's take P + rounds * R seconds
(rounds = spec_verify_ct), with P the per-request cost fitted on the baseline's requests (prefill,
HTTP; `fit_requests`). Over the configurations served, R is fitted as

    round(s, k, w) = R0 + d * s + v * w      (seconds; non-negative least squares)

R0: what every round pays (the target's weights read once by the verify, the draft's extend, the
server's own work), d: one draft step (a graph replay of the draft layer and its head), v: one more
token in the verify forward. Memory-bound at bs=1, so topk enters only through w.
"""
from __future__ import annotations

import statistics

from draftlab.bench.advice import in_process_speedup, interpolate, nonnegative_lstsq, predict, recommend, round_cost


def probed_requests(tokens: list[int], seconds: list[float], prompt_only_s: list[float]) -> dict | None:
    """A server's per-request cost and decode step from its requests and from prompt-only requests
    (max_new_tokens 1) to it: P1 = the median prompt-only request (prefill, HTTP, the first token),
    step = the median over requests of (seconds - P1) / (tokens - 1); returned in the P + T * step
    form of `fit_requests` (server_request_s = P1 - step). Medians, not a line fitted through every
    request: on a shared 2-core CPU a burst of load on a few requests moved the fitted fixed part
    from 0.1 ms to 475 ms between two runs of one configuration, and with it the prediction by 20%."""
    p1 = statistics.median(prompt_only_s) if prompt_only_s else None
    steps = [(sec - p1) / (t - 1) for t, sec in zip(tokens, seconds) if p1 is not None and t > 1]
    if not steps:
        return None
    step = max(0.0, statistics.median(steps))
    return {"server_request_s": max(0.0, p1 - step), "server_step_s": step}


def fit_requests(tokens: list[int], seconds: list[float]) -> dict | None:
    """Per-request seconds = fixed + tokens * step, fitted over a server's measured requests (both
    >= 0): its decode step (s/token) and what a request costs besides (prefill, HTTP). None when the
    requests are too few or too alike in length to separate the two."""
    if len(tokens) < 3 or max(tokens) - min(tokens) < 8:
        return None
    fixed, step = nonnegative_lstsq([[1.0] * len(tokens), [float(t) for t in tokens]], list(seconds))
    return {"server_request_s": fixed, "server_step_s": step}


def speedup_scale(costs: dict, measured_speedup: float, tau: float, num_steps: int, topk: int, num_draft_tokens: int) -> float:
    """sigma = the served speedup of the configuration that ran / its in-process speedup at its served
    tau (`in_process_speedup`). With costs["speedup_scale"] = sigma, `predict` gives every candidate
    sigma * its in-process speedup: the shape across configurations from one interleaved loop, the
    server's share (HTTP, scheduling, its own step) as one ratio measured on the served pair."""
    return measured_speedup / in_process_speedup(costs, tau, num_steps, topk, num_draft_tokens)


def round_scale(costs: dict, served_round_s: float) -> float:
    """kappa = a served round of the configuration that ran / the offline run's round of it
    (costs["offline_round_s"], which the fitted model plus loop_s reproduces at that configuration).

    For a server that is not the in-process engine (SGLang: CUDA graphs, its own kernels and
    scheduler), o = server step - in-process step says nothing: on an H200 an 8B target's eager
    in-process step took 25 ms where SGLang's took 4.5 ms. There the model keeps the shape of the
    in-process round (how drafting, verify and extend grow with steps, topk and width) and takes
    its scale from the one served round measured: round_served(cfg) = kappa * round(cfg)."""
    return served_round_s / costs["offline_round_s"]



def served_round(base: list[tuple[int, float]], spec: list[tuple[int, int, float]]) -> dict | None:
    """One configuration's measured round from paired requests over the same prompts.

    base: (completion tokens, seconds) per baseline request; spec: (completion tokens, verify
    rounds, seconds) per speculative request. Returns step_s (the baseline's decode step), request_s
    (its fixed cost per request), round_s (R), served_tau and tokens_per_request, or None when the
    baseline's requests cannot separate the step from the fixed cost (`fit_requests`)."""
    fit = fit_requests([t for t, _ in base], [s for _, s in base])
    rounds = sum(r for _, r, _ in spec)
    if fit is None or not rounds:
        return None
    request_s = fit["server_request_s"]
    return {"step_s": fit["server_step_s"], "request_s": request_s,
            "round_s": (sum(s for *_, s in spec) - len(spec) * request_s) / rounds,
            "served_tau": sum(t for t, _, _ in spec) / rounds,
            "tokens_per_request": statistics.fmean(t for t, _ in base)}


def fit_served_rounds(rounds: dict) -> dict:
    """{(num_steps, topk, num_draft_tokens): round seconds} -> the round model's terms in fit_costs'
    form (round_cost, predict and advise take it): R0 + d * s + v * w (see above)."""
    cfgs = list(rounds)
    r0, d, v = nonnegative_lstsq([[1.0] * len(cfgs), [float(c[0]) for c in cfgs], [float(c[2]) for c in cfgs]],
                                  [float(rounds[c]) for c in cfgs])
    return {"draft_fixed": r0 + d, "draft_per_step": {1: d}, "verify_fixed": 0.0, "verify_per_token": v,
            "tree_verify_fixed": 0.0, "tree_verify_per_token": v, "extend_fixed": 0.0, "extend_per_row": 0.0}


def served_costs(rounds: dict, step_s: float, request_s: float, tokens_per_request: float) -> dict:
    """A costs dict for predict/advise from served rounds and the served baseline (no in-process terms)."""
    return {"fit_s": fit_served_rounds(rounds), "baseline_step_s": step_s, "prefill_s": request_s,
            "tokens_per_request": tokens_per_request}


def known_taus(candidates: list[dict], served: dict) -> list[dict]:
    """candidates with the tau the served configurations show: a served configuration's own served
    tau; an unserved chain no deeper than the deepest chain measured (by acceptance or served), the
    chain taus measured interpolated by depth; both no longer extrapolated. Every other row as it is.
    served: {(s, k, w): served tau}."""
    chains = {c["num_steps"]: c["predicted_tau"] for c in candidates if c["topk"] == 1 and not c.get("extrapolated")}
    chains.update({k[0]: t for k, t in served.items() if k[1] == 1})
    out = []
    for c in candidates:
        key = (c["num_steps"], c["topk"], c["num_draft_tokens"])
        if key in served:
            c = {**c, "predicted_tau": served[key], "extrapolated": False, "tau_from": "served"}
        elif c["topk"] == 1 and chains and c["num_steps"] <= max(chains):
            c = {**c, "predicted_tau": chains.get(c["num_steps"]) or interpolate(chains, c["num_steps"]), "extrapolated": False}
        out.append(c)
    return out


def advise_served(candidates: list[dict], measured: dict) -> dict:
    """The advice from a server's own rounds.

    candidates: rows with num_steps, topk, num_draft_tokens and predicted_tau (the bench stage's
    advice: tau from the measured acceptance); measured: {(s, k, w): served_round(...)} for the
    configurations served. Returns `recommend` over the candidates with the speedups predicted by
    the round model fitted on every measured configuration and the taus served (`known_taus`), the
    fitted terms (ms), and per measured configuration the prediction made without it (leave one
    out, its round and its served tau both unseen: the model's error on a configuration it has not
    seen)."""
    measured = {tuple(k): v for k, v in measured.items() if v}
    served = {k: m["served_tau"] for k, m in measured.items() if m.get("served_tau")}
    if not measured:
        return {**recommend([]), "fit_ms": None, "held_out": []}
    step_s = statistics.median(m["step_s"] for m in measured.values())
    request_s = statistics.median(m["request_s"] for m in measured.values())
    tokens = statistics.fmean(m["tokens_per_request"] for m in measured.values())

    def predicted(costs, row):
        key = (row["num_steps"], row["topk"], row["num_draft_tokens"])
        return predict(costs, row["predicted_tau"], *key), round_cost(costs, *key, row["predicted_tau"])["round"]

    rounds = {k: m["round_s"] for k, m in measured.items()}
    costs = served_costs(rounds, step_s, request_s, tokens)  # fitted once for every candidate
    rows = []
    for c in known_taus(candidates, served):
        speedup, round_s = predicted(costs, c)
        rows.append({**{k: c[k] for k in ("num_steps", "topk", "num_draft_tokens", "predicted_tau")},
                     "predicted_speedup": speedup, "round_ms": 1e3 * round_s, "extrapolated": c.get("extrapolated", False)})
    held_out = []
    for key in measured:
        unseen = known_taus(candidates, {k: t for k, t in served.items() if k != key})
        row = next((c for c in unseen if (c["num_steps"], c["topk"], c["num_draft_tokens"]) == key), None)
        rest = {k: r for k, r in rounds.items() if k != key}
        if row is None or len(rest) < 3:
            continue
        speedup, round_s = predicted(served_costs(rest, step_s, request_s, tokens), row)
        held_out.append({"num_steps": key[0], "topk": key[1], "num_draft_tokens": key[2], "predicted_speedup": speedup,
                         "predicted_tau": row["predicted_tau"], "extrapolated": row.get("extrapolated", False),
                         "predicted_round_ms": 1e3 * round_s, "measured_round_ms": 1e3 * rounds[key]})
    fit = costs["fit_s"]
    d = fit["draft_per_step"][1]
    return {**recommend(rows), "held_out": held_out,
            "fit_ms": {"round_fixed": 1e3 * (fit["draft_fixed"] - d), "per_draft_step": 1e3 * d,
                       "per_verify_token": 1e3 * fit["verify_per_token"], "baseline_step": 1e3 * step_s,
                       "request_fixed": 1e3 * request_s, "tokens_per_request": tokens}}
