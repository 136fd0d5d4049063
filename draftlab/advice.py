"""The offline isolation run, the measured costs of a speculative round, and the advice drawn from them.

The bench stage's second opinion on a served draft: the same exported draft decoded in-process
(draftlab.spec_engine, no server); what each part of a speculative round costs on this machine,
timed by running the engine's own step functions; and from those and the measured acceptance the
predicted tau and speedup of chains and trees, with "don't speculate" when none pays.

The cost model counts the round as the engine runs it (spec_engine.generate). For a configuration
of s = num_steps, k = topk, w = num_draft_tokens, with rounds that yield tau tokens (seconds):

    round(s, k, w, tau) = DV(s, k, w)              drafting and verify, timed whole per configuration
                                                   (draft_verify_s); where a configuration was not timed:
                          D0 + (s - 1) * d_k       drafting (draft_chain / draft_tree): the head on the
                                                   root, then s - 1 draft forwards of the k-wide frontier
                        + V0 + V1 * w              verify: one target forward over the w draft tokens,
                                                   the acceptance walk, the KV rollback
                        + E0 + E1 * tau            extend: the draft over the accepted rows + bonus
                                                   (aux concatenation and fc included)
                        + L                        the rest of the round loop (emitting, counting, cache
                                                   bookkeeping): what the offline run's rounds took beyond
                                                   the fitted parts above, at the configuration that ran
                                                   (negative where the fitted lines overshoot that round)
    speedup = (P + T * b) / (P + P_d + (T / tau) * (round + o))

b: the baseline decode step (s/token); P, P_d: the target's and the draft's prefill (s/request);
o: the server's own work per engine step: with the served baseline's requests fitted as
P + T * b_server (`probed_requests`: P from prompt-only requests, b_server the median of the
rest per token; `fit_requests` without them), b = b_server, P = its fixed part (prefill, HTTP) and
o = b_server - the in-process decode step over the same prompts, paid once per round by a
speculative server (`server_costs`); without a served baseline, b is the in-process step, P the
prefill and o = 0;
The bench's reference server runs this very engine, and there the prediction is the in-process
speedup at the served pair's scale (`speedup_scale`, `in_process_speedup`):
    speedup(c) = sigma * (P + T * e) / (P + P_d + (T / tau_c) * (round(c) - L)),
    sigma = the served speedup of the configuration that ran / that formula for it at its served tau,
with e, P, P_d the decode step and prefills timed in `measure_costs`' loop. Every timing in the
formula comes from one interleaved loop, so a change in the machine's speed hits them alike: on a
shared 2-core CPU the served pair, the offline run and that loop, taken a minute apart, differed by
up to 2x in absolute speed, which the additive form (o, L from other minutes) turned into errors of
up to 20%. The configuration that ran is then predicted exactly; the test of the model is how it
predicts the others (`tools/advice_sweep.py`).
With a server that runs another engine (SGLang), o is replaced by a scale: every round costs
kappa * round, kappa = the served round of the configuration that ran (measured from its paired
requests, `served_round`) / the offline run's round of it (`round_scale`).
T: tokens per request (T -> infinity: the steady-state tau * b / round). tau: the chain's
1 + sum_i prod_{j<=i} a_j from the measured acceptance, or for a tree the same walk over the
draft's depth-1 rank shares (`tree_tau`).

DV is timed as a round runs it, the draft's forwards and the target's verify one after the other
over a cache of a prompt plus half an answer (`measure_costs`): the sum of the parts timed apart
missed how a round's cost grows with depth (the verify's cost is a step function of its width on a
CPU, 3.4 ms at 2-3 tokens, 4.0 at 4-6, 4.7 at 7-9 for the default target, which a line through noisy
timings flattened). The parts below stay: they show where a round's time goes, and they predict a
configuration that was not timed.

The terms are fitted, not read off one timing each (`fit_costs`): a timing of one configuration on
a shared CPU moves by more than the difference between neighbouring configurations, so
D0 (s, shared by every k) and d_k (s/step, one per topk) are the non-negative least-squares line
through the median drafting times of every (num_steps, topk) measured; V0, V1 (s, s/token) the line
through the verify times by width (chains and trees each their own line, a tree timed at one width
takes the chains' slope); E0, E1 (s, s/row) the line through the extend times by rows. Every slope
is >= 0: a costlier draft or a wider verify never predicts a higher speedup. L (s) is the only
term calibrated on a whole run. A costs dict holds these terms measured at one batch size (a plain
number where a term is one constant; {size: seconds} where it was timed per size);
`advise_by_concurrency` takes one such dict per concurrency (e.g. an SGLang server's decode step and
verify times per batch size) and names the concurrency from which no candidate is predicted to pay.

With n requests in flight a verify runs the target over n * w tokens. Where that is compute-bound
(an 8B target at 16 x 32 = 512 tokens), a wide tree's round grows faster with n than a chain's, and a
round scaled from bs=1 does not know it. The batch growth (`batch_growth`) adds, to a round scaled
from the configuration that ran (width w0), what the target's dense matmuls cost over n * w tokens
beyond n * w0, less the same difference at bs=1 (which the scale already holds): G(n) * [T] timed on
this device by `measure_gemm_s`, unscaled, because a matmul of that size costs the same under a
server's CUDA graphs as in-process.
"""
from __future__ import annotations

import math
import statistics
import time

import numpy as np
import torch

from draftlab import spec_engine
from draftlab.draft import KVCache
from draftlab.extract import AuxCapture
from draftlab.metrics import chain_tau, conditional_acceptance, pooled_tau

CHAINS = [(n, 1, n + 1) for n in range(1, 9)]  # (num_steps, topk, num_draft_tokens)
TREES = [(3, 2, 6), (4, 2, 8), (5, 4, 8), (6, 8, 32)]


# ---------------------------------------------------------------------------------------------
# The model (pure: numbers in, numbers out)


def tree_tau(rank_acceptance: list[list[float]], num_steps: int, topk: int, num_draft_tokens: int) -> float:
    """Expected tau of the tree spec_engine.draft_tree builds, if its scores were the acceptance.

    rank_acceptance[d][r]: P(the target's token at depth d + 1 is the draft's rank-r proposal |
    the path above it was accepted); depths past the last reuse it. Siblings are exclusive (one
    target token), so tau = 1 + the summed probability of reaching each verified node.
    """
    def q(d, r):
        row = rank_acceptance[min(d, len(rank_acceptance) - 1)] if rank_acceptance else []
        return row[r] if r < len(row) else 0.0

    reach, parents, depth = [1.0], [-1], [0]
    frontier = [0]
    for step in range(num_steps):
        made = []
        for node in frontier:
            for r in range(topk):
                reach.append(reach[node] * q(step, r))
                parents.append(node)
                depth.append(step + 1)
                made.append(len(reach) - 1)
        frontier = sorted(made, key=lambda c: -reach[c])[:topk]
    keep = spec_engine.best_subtree(reach, parents, num_draft_tokens)
    return 1.0 + sum(reach[c] for c in keep if c)


def rank_acceptance_of(acceptance: list[float], depth1_ranks: list[float] | None, topk: int) -> list[list[float]]:
    """Per-depth, per-rank acceptance from the chain's a_i and the depth-1 rank shares of the target's token.

    depth1_ranks[r]: share of positions where the target's token is the draft's rank-r choice
    (measured by `measure_rank_shares`). Rank r at depth d is taken as a_d * depth1_ranks[r] /
    depth1_ranks[0] (the ranks keep their depth-1 proportions), capped to a total of 1.
    """
    rows = []
    for a in acceptance or [0.0]:
        if topk == 1 or not depth1_ranks or depth1_ranks[0] <= 0:
            rows.append([a])
            continue
        row = [a * s / depth1_ranks[0] for s in depth1_ranks[:topk]]
        total = sum(row)
        rows.append([x / total for x in row] if total > 1.0 else row)
    return rows


def _lookup(table, key: float) -> float:
    """table: a number, or {size: value} interpolated linearly (extrapolated past the largest size)."""
    if not isinstance(table, dict):
        return float(table)
    pts = sorted((float(k), float(v)) for k, v in table.items())
    if key <= pts[0][0] or len(pts) == 1:
        return pts[0][1]
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if key <= x1 or x1 == pts[-1][0]:
            return y0 + (y1 - y0) * (key - x0) / (x1 - x0)


def _nonnegative_lstsq(columns: list[list[float]], y: list[float]) -> list[float]:
    """Least squares y ~ sum_j c_j * columns[j] with every c_j >= 0 (a cost term is never negative):
    solved unconstrained, then the most negative coefficient is pinned at 0 and the rest solved
    again, until none is negative. Columns that are all zero get 0."""
    A = np.asarray(columns, dtype=float).T.reshape(len(y), len(columns))
    free = [j for j in range(A.shape[1]) if np.any(A[:, j])]
    coef = np.zeros(A.shape[1])
    while free:
        sol = np.linalg.lstsq(A[:, free], np.asarray(y, dtype=float), rcond=None)[0]
        if sol.min() >= 0:
            coef[free] = sol
            break
        free.pop(int(sol.argmin()))
    return coef.tolist()


def fit_line(points: dict) -> tuple[float, float]:
    """(intercept, slope), both >= 0, of the least-squares line through {x: y}; one x: (y, 0)."""
    xs, ys = [float(x) for x in points], [float(v) for v in points.values()]
    if len(set(xs)) < 2:
        return (statistics.fmean(ys), 0.0) if ys else (0.0, 0.0)
    a, b = _nonnegative_lstsq([[1.0] * len(xs), xs], ys)
    return a, b


def fit_draft(draft_s: dict) -> tuple[float, dict]:
    """(D0, {topk: d_k}) from {"num_steps-topk": seconds}: draft(s, k) = D0 + (s - 1) * d_k, non-negative
    least squares over every configuration timed (D0 is the head on the root, shared by all widths).
    A topk timed at num_steps 1 only has no d_k (the lookup takes it from the neighbouring widths)."""
    pts = [(int(key.split("-")[0]) - 1, int(key.split("-")[1]), float(t)) for key, t in draft_s.items()]
    widths = sorted({k for x, k, _ in pts if x > 0})
    coef = _nonnegative_lstsq([[1.0] * len(pts)] + [[x if kk == k else 0.0 for x, kk, _ in pts] for k in widths],
                              [t for *_, t in pts])
    return coef[0], dict(zip(widths, coef[1:]))


def fit_costs(costs: dict) -> dict:
    """The fitted terms of the round model (seconds, or whatever unit `costs` holds):
    draft_fixed (D0), draft_per_step ({topk: d_k}), verify_fixed/verify_per_token (V0, V1 of a
    chain), tree_verify_fixed/tree_verify_per_token, extend_fixed/extend_per_row (E0, E1).

    From the raw timings where they are: draft_s {"s-k": t} (else draft_head_s + draft_step_s, a
    number or {topk: t}), verify_s and tree_verify_s {width: t}, extend_s {rows: t} (else one draft
    step). costs["fit_s"], when present, is returned as it is (the fit a report already holds).
    """
    if "fit_s" in costs:
        return costs["fit_s"]
    if costs.get("draft_s"):
        d0, per_step = fit_draft(costs["draft_s"])
        per_step = per_step or {1: 0.0}  # num_steps 1 only: no draft forward was timed
    else:
        d0, step = float(costs.get("draft_head_s", 0.0)), costs["draft_step_s"]
        per_step = {int(float(k)): float(v) for k, v in step.items()} if isinstance(step, dict) else {1: float(step)}

    def line(table):
        return fit_line(table) if isinstance(table, dict) else (float(table), 0.0)

    v0, v1 = line(costs["verify_s"])
    tree = costs.get("tree_verify_s") or {}
    if isinstance(tree, dict) and len(tree) == 1:  # one width: the chains' slope through it
        (w, t), = tree.items()
        t0, t1 = max(0.0, float(t) - v1 * float(w)), v1
    else:
        t0, t1 = line(tree) if tree else (v0, v1)
    extend = costs.get("extend_s")
    e0, e1 = line(extend) if extend is not None else (_lookup(per_step, 1), 0.0)
    return {"draft_fixed": d0, "draft_per_step": per_step, "verify_fixed": v0, "verify_per_token": v1,
            "tree_verify_fixed": t0, "tree_verify_per_token": t1, "extend_fixed": e0, "extend_per_row": e1}


def round_cost(costs: dict, num_steps: int, topk: int, num_draft_tokens: int, tau: float) -> dict:
    """Each part of one round of this configuration and their sum, by the fitted model (module
    docstring; the unit of `costs`, seconds as measured)."""
    fit = fit_costs(costs)
    drafting = fit["draft_fixed"] + (num_steps - 1) * _lookup(fit["draft_per_step"], topk)
    kind = "verify" if topk == 1 else "tree_verify"
    verify = fit[f"{kind}_fixed"] + fit[f"{kind}_per_token"] * num_draft_tokens
    extend = fit["extend_fixed"] + fit["extend_per_row"] * tau
    parts = {"draft": drafting, "verify": verify, "extend": extend, "loop": costs.get("loop_s", 0.0)}
    whole = (costs.get("draft_verify_s") or {}).get(f"{num_steps}-{topk}-{num_draft_tokens}")
    parts["draft_verify"] = float(whole) if whole is not None else drafting + verify
    parts["round"] = parts["draft_verify"] + extend + parts["loop"]
    return parts


def server_costs(costs: dict) -> tuple[float, float, float]:
    """(baseline step, per-request fixed cost, the server's own work per engine step), in the unit
    of `costs`.

    With the served baseline fitted (server_step_s, server_request_s: `fit_requests`), a server's
    step is the engine's decode step plus its own work per step (scheduling, output, stop checks):
    o = server_step_s - the in-process decode step over the same prompts (baseline_run_step_s, from
    the offline run; else the timed step). A speculative server pays o once per round, not once per
    token. Without a served baseline: the in-process step, the prefill, and o = 0."""
    if costs.get("server_step_s") is None:
        return costs["baseline_step_s"], costs.get("prefill_s", 0.0), 0.0
    step, here = costs["server_step_s"], costs.get("baseline_run_step_s") or costs["baseline_step_s"]
    return step, costs.get("server_request_s", costs.get("prefill_s", 0.0)), max(0.0, step - here)


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
    fixed, step = _nonnegative_lstsq([[1.0] * len(tokens), [float(t) for t in tokens]], list(seconds))
    return {"server_request_s": fixed, "server_step_s": step}


def in_process_speedup(costs: dict, tau: float, num_steps: int, topk: int, num_draft_tokens: int) -> float:
    """The in-process engine's speedup by the timings of `measure_costs` alone, all taken in one
    interleaved loop: (P + T * e) / (P + P_d + (T / tau) * round), e the decode step and P, P_d the
    prefills timed there, round = `round_cost` less its loop term (calibrated on another run)."""
    parts = round_cost(costs, num_steps, topk, num_draft_tokens, tau)
    r, step = parts["round"] - parts["loop"], costs["baseline_step_s"]
    T = costs.get("tokens_per_request") or math.inf
    if math.isinf(T):
        return tau * step / r
    prefill, draft_prefill = costs.get("prefill_s", 0.0), costs.get("draft_prefill_s", 0.0)
    return (prefill + T * step) / (prefill + draft_prefill + (T / tau) * r)


def speedup_scale(costs: dict, measured_speedup: float, tau: float, num_steps: int, topk: int, num_draft_tokens: int) -> float:
    """sigma = the served speedup of the configuration that ran / its in-process speedup at its served
    tau (`in_process_speedup`). With costs["speedup_scale"] = sigma, `predict` gives every candidate
    sigma * its in-process speedup: the shape across configurations from one interleaved loop, the
    server's share (HTTP, scheduling, its own step) as one ratio measured on the served pair."""
    return measured_speedup / in_process_speedup(costs, tau, num_steps, topk, num_draft_tokens)


def predict(costs: dict, tau: float, num_steps: int, topk: int, num_draft_tokens: int) -> float:
    """Predicted speedup of one configuration whose rounds yield `tau` tokens (module docstring)."""
    if costs.get("speedup_scale"):  # the reference server: the in-process shape at the served pair's scale
        return costs["speedup_scale"] * in_process_speedup(costs, tau, num_steps, topk, num_draft_tokens)
    base, prefill, overhead = server_costs(costs)
    r = round_cost(costs, num_steps, topk, num_draft_tokens, tau)["round"]
    draft_prefill = costs.get("draft_prefill_s", 0.0)
    if costs.get("round_scale"):  # another engine serves: the in-process round's shape at its scale
        r, draft_prefill = r * costs["round_scale"], 0.0  # (its served rounds hold the draft's prefill)
        r += batch_growth(costs, num_draft_tokens)
    else:
        r += overhead
    T = costs.get("tokens_per_request") or math.inf
    if math.isinf(T):
        return tau * base / r
    return (prefill + T * base) / (prefill + draft_prefill + (T / tau) * r)


def round_scale(costs: dict, served_round_s: float) -> float:
    """kappa = a served round of the configuration that ran / the offline run's round of it
    (costs["offline_round_s"], which the fitted model plus loop_s reproduces at that configuration).

    For a server that is not the in-process engine (SGLang: CUDA graphs, its own kernels and
    scheduler), o = server step - in-process step says nothing: on an H200 an 8B target's eager
    in-process step took 25 ms where SGLang's took 4.5 ms. There the model keeps the shape of the
    in-process round (how drafting, verify and extend grow with steps, topk and width) and takes
    its scale from the one served round measured: round_served(cfg) = kappa * round(cfg)."""
    return served_round_s / costs["offline_round_s"]


def _interpolate(table: dict, x: float) -> float:
    """table {x: y} (keys may be strings, as read back from JSON) at x, piecewise linear; past the ends,
    the end segment's line (a single point: that value)."""
    pts = sorted((float(k), float(v)) for k, v in table.items())
    if len(pts) == 1:
        return pts[0][1]
    i = max(1, min(len(pts) - 1, int(np.searchsorted([p for p, _ in pts], x))))
    (x0, y0), (x1, y1) = pts[i - 1], pts[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def batch_growth(costs: dict, num_draft_tokens: int) -> float:
    """What a round of width w costs with costs["batch"] = n requests in flight beyond the round scaled
    from the configuration that ran (width costs["ref_width"] = w0), by the target's dense matmuls
    (costs["gemm_s"], {tokens: s}): F(n w) - F(n w0) - (F(w) - F(w0)). Zero at n = 1, at w = w0, and
    without a matmul table (module docstring)."""
    n, w0, table = costs.get("batch") or 1, costs.get("ref_width"), costs.get("gemm_s")
    if n <= 1 or not w0 or not table:
        return 0.0
    f = lambda t: _interpolate(table, t)  # noqa: E731
    return f(n * num_draft_tokens) - f(n * w0) - (f(num_draft_tokens) - f(w0))


DONT_SPECULATE = "don't speculate"


def config_name(row: dict) -> str:
    return f"num_steps={row['num_steps']} topk={row['topk']} num_draft_tokens={row['num_draft_tokens']}"


def advise(acceptance: list[float], costs: dict, configs=None, depth1_ranks: list[float] | None = None) -> dict:
    """Predicted tau and speedup of each configuration, and the recommendation: the best one, or
    "don't speculate" when no candidate is predicted above 1.0x.

    acceptance: the measured a_i (depths past those measured reuse the last one: extrapolated);
    configs: (num_steps, topk, num_draft_tokens) triples (chains of 1..8 and a few trees by default);
    trees need depth1_ranks (else they are skipped). Returns candidates (one row each), recommended
    (the best row, or None), speculate (bool), recommendation ("num_steps=.. topk=.. num_draft_tokens=.."
    or "don't speculate") and advice (the recommendation with its predicted speedup, in words).
    """
    configs = configs if configs is not None else CHAINS + (TREES if depth1_ranks else [])
    costs = {**costs, "fit_s": fit_costs(costs)}  # fitted once for every candidate
    rows = []
    for steps, topk, ndt in configs:
        a = [acceptance[min(i, len(acceptance) - 1)] for i in range(steps)] if acceptance else [0.0] * steps
        tau = chain_tau(a) if topk == 1 else tree_tau(rank_acceptance_of(a, depth1_ranks, topk), steps, topk, ndt)
        parts = round_cost(costs, steps, topk, ndt, tau)
        rows.append({"num_steps": steps, "topk": topk, "num_draft_tokens": ndt, "predicted_tau": tau,
                     "predicted_speedup": predict(costs, tau, steps, topk, ndt), "round_ms": 1e3 * parts["round"],
                     "extrapolated": steps > len(acceptance)})
    return recommend(rows)


def recommend(rows: list[dict]) -> dict:
    """The best of `rows` (each with a predicted_speedup) whose tau comes from measured acceptance, or
    "don't speculate" when none is above 1.0x.

    A row marked extrapolated (deeper than the acceptance measured: its a_i reuse the deepest one) is
    never recommended. A draft accepts less past the depth it was trained to: on an H200 a draft
    trained 5 steps deep was predicted tau 7.07 at 8 steps from its 5-step acceptance and served
    6.39, and the 8-step chain the model recommended ran at 2.89x against 3.19x for 7 steps. Where
    such a row is predicted above the recommendation it is named (worth_measuring): serve it once
    to measure its acceptance."""
    measured = [r for r in rows if not r.get("extrapolated")]
    best = max(measured, key=lambda r: r["predicted_speedup"]) if measured else None
    speculate = best is not None and best["predicted_speedup"] > 1.0
    deeper = max((r for r in rows if r.get("extrapolated")), key=lambda r: r["predicted_speedup"], default=None)
    worth = deeper if deeper is not None and deeper["predicted_speedup"] > max(1.0, best["predicted_speedup"] if best else 0.0) else None
    text = (f"{config_name(best)} (predicted {best['predicted_speedup']:.2f}x)" if speculate else
            f"{DONT_SPECULATE}: no candidate is predicted above 1.0x"
            + (f" (best {best['predicted_speedup']:.2f}x, {config_name(best)})" if best else ""))
    if worth is not None:
        text += (f"; {config_name(worth)} is predicted {worth['predicted_speedup']:.2f}x from acceptance extrapolated "
                 "past the depth measured: serve it once to measure")
    return {"candidates": rows, "recommended": best if speculate else None, "speculate": speculate,
            "recommendation": config_name(best) if speculate else DONT_SPECULATE, "worth_measuring": worth, "advice": text}


def advise_by_concurrency(acceptance: list[float], costs_by_batch: dict, configs=None, depth1_ranks=None) -> dict:
    """`advise` at each concurrency from that concurrency's costs dict (per-round costs of a batch
    of that many requests: baseline decode step, verify by width, ...), and the crossover: the
    lowest concurrency from which no candidate is predicted above 1.0x (None if speculation pays
    at every concurrency measured)."""
    per = {int(b): advise(acceptance, c, configs, depth1_ranks) for b, c in sorted(costs_by_batch.items(), key=lambda kv: int(kv[0]))}
    crossover = None
    for b in sorted(per, reverse=True):
        if per[b]["speculate"]:
            break
        crossover = b
    return {"by_concurrency": per, "crossover_concurrency": crossover}


def costs_by_concurrency(costs: dict, baseline_sweep: list[dict], spec_sweep: list[dict], tau: float,
                         ran_width: int | None = None, request_s: dict | None = None,
                         tokens_per_request: float | None = None) -> dict:
    """{concurrency: costs dict} for advise_by_concurrency, from the configuration that ran served
    with n requests in flight (the bench stage's paired batches: tokens/s of whole batches).

    At n in flight a baseline step serves n sequences: b_n = n / baseline tokens/s; a round of the
    configuration that ran takes R_n = n * tau / speculative tokens/s (prefill amortized into both).
    Every configuration's round is scaled as at bs=1 (`round_scale`), kappa_n = R_n / the offline
    round of the configuration that ran: the in-process round's shape, the served batch's scale.
    With costs["gemm_s"] and ran_width (the num_draft_tokens that ran), each other width's round also
    gets the batch growth of its verify (`batch_growth`). Concurrency 1 is `costs` itself.

    With request_s ({n: seconds}, the server's time per admitted request at n in flight: prompt-only
    requests, the prefill probe) and tokens_per_request (T), the prefills come out of the step and
    the round instead of being amortized into both. A request in flight waits through about n
    prefills in its life (every request around it is replaced once), so at n in flight it costs
    n * p_n + T * b_n, and tokens/s = n * T / that:
        b_n = n / baseline tokens/s - n * p_n / T,  R_n = tau * (n / speculative tokens/s - n * p_n / T).
    A configuration with a higher tau then pays the same prefills over fewer rounds, which the
    amortized form charges it per round."""
    out = {1: costs}
    spec = {r["concurrency"]: r for r in spec_sweep}
    request_s = {int(k): float(v) for k, v in (request_s or {}).items()} if tokens_per_request else {}  # keys may be JSON strings
    for base in baseline_sweep:
        n, s = base["concurrency"], spec.get(base["concurrency"])
        if n <= 1 or not s or not base.get("throughput") or not s.get("throughput") or not costs.get("offline_round_s"):
            continue
        p_n = request_s.get(n, 0.0)
        per_token = n * p_n / tokens_per_request if p_n else 0.0  # s of prefill per generated token, per slot
        step, rnd = n / base["throughput"] - per_token, tau * (n / s["throughput"] - per_token)
        if step <= 0 or rnd <= 0:  # prefills larger than what was measured: fall back to amortizing them
            step, rnd, p_n = n / base["throughput"], n * tau / s["throughput"], 0.0
        out[n] = {**{k: v for k, v in costs.items() if k != "speedup_scale"}, "server_step_s": step, "server_request_s": n * p_n,
                  "tokens_per_request": tokens_per_request if p_n else None,
                  "round_scale": rnd / costs["offline_round_s"], "batch": n, "ref_width": ran_width}
    return out


def predicted_vs_measured(candidates: list[dict], measured: list[dict]) -> list[dict]:
    """For every configuration run: predicted and measured tau and speedup, and the speedup's error."""
    out = []
    for m in measured:
        row = next((c for c in candidates if (c["num_steps"], c["topk"], c["num_draft_tokens"]) ==
                    (m["num_steps"], m["topk"], m["num_draft_tokens"])), None)
        if row is None:
            continue
        err = row["predicted_speedup"] / m["measured_speedup"] - 1.0 if m.get("measured_speedup") else None
        out.append({**{k: m[k] for k in ("num_steps", "topk", "num_draft_tokens")}, "where": m.get("where", "served"),
                    "predicted_tau": row["predicted_tau"], "measured_tau": m.get("measured_tau"),
                    "predicted_speedup": row["predicted_speedup"], "measured_speedup": m.get("measured_speedup"),
                    "speedup_error": err})
    return out


# ---------------------------------------------------------------------------------------------
# A serving engine's own rounds (SGLang): the model fitted on what the server measured
#
# An in-process round is not a served one: SGLang replays CUDA graphs of the draft and the verify
# and overlaps its scheduling with them, where the engine above launches eager kernels from Python.
# A served round is measured without any server instrumentation: the speculative server's requests
# over the same prompts as the baseline's take P + rounds * R seconds (rounds = spec_verify_ct), with
# P the per-request cost fitted on the baseline's requests (prefill, HTTP; `fit_requests`). Over the
# configurations served, R is fitted as
#
#     round(s, k, w) = R0 + d * s + v * w      (seconds; non-negative least squares)
#
# R0: what every round pays (the target's weights read once by the verify, the draft's extend, the
# server's own work), d: one draft step (a graph replay of the draft layer and its head), v: one more
# token in the verify forward. Memory-bound at bs=1, so topk enters only through w.


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
    r0, d, v = _nonnegative_lstsq([[1.0] * len(cfgs), [float(c[0]) for c in cfgs], [float(c[2]) for c in cfgs]],
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
            c = {**c, "predicted_tau": chains.get(c["num_steps"]) or _interpolate(chains, c["num_steps"]), "extrapolated": False}
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


# ---------------------------------------------------------------------------------------------
# Measuring: the offline run and the costs, with the engine's own functions


def offline_run(target, draft, prompts: list[list[int]], flags, physical: list[int], max_new_tokens: int,
                eos: set[int], ignore_eos: bool, with_baseline: bool = True) -> dict:
    """Every prompt decoded in-process by spec_engine with the served flags: pooled tau, a_i, speed,
    seconds per round (prefills excluded) and the outputs (for the rank shares). with_baseline: also
    decode each prompt without speculation, for the in-process decode step (baseline_step_s, None
    without); a server of another engine is scaled on its own rounds instead (`round_scale`), and an
    eager 8B baseline costs a minute."""
    results, baselines = [], []
    for p in prompts:  # each prompt decoded both ways, one after the other: a drift in load hits both
        results.append(spec_engine.generate(target, draft, p, num_steps=flags.num_steps, topk=flags.topk,
                                            num_draft_tokens=flags.num_draft_tokens, max_new_tokens=max_new_tokens,
                                            eos_token_id=eos, ignore_eos=ignore_eos, physical_layers=physical))
        if with_baseline:
            baselines.append(spec_engine.baseline_generate(target, p, max_new_tokens, eos_token_id=eos, ignore_eos=ignore_eos))
    base_steps = sum(len(b.output_ids) - 1 for b in baselines)
    proposed = [sum(x) for x in zip(*(r.proposed for r in results))]
    accepted = [sum(x) for x in zip(*(r.accepted for r in results))]
    tokens = sum(len(r.output_ids) for r in results)
    verify_ct = sum(r.spec_verify_ct for r in results)
    return {
        "tau": pooled_tau([len(r.output_ids) for r in results], [r.spec_verify_ct for r in results]),
        "acceptance": conditional_acceptance(accepted, proposed),
        "tokens_per_s": tokens / sum(r.total_s for r in results),
        "tokens_per_request": tokens / len(results),
        # the in-process decode step over the same prompts (prefill excluded), s/token
        "baseline_step_s": sum(b.total_s - b.prefill_s for b in baselines) / base_steps if base_steps else None,
        "draft_s": sum(r.draft_s for r in results),
        "verify_s": sum(r.verify_s for r in results),
        "verify_ct": verify_ct,
        "decode_s": sum(r.total_s - r.prefill_s for r in results),  # the draft prefill included (subtracted by the caller)
        "requests": len(results),
        "outputs": [p + r.output_ids for p, r in zip(prompts, results)],
    }


def _rollback(cache, n: int) -> None:
    """The target's cache back to its first n positions (the prompt)."""
    drop = cache.get_seq_length() - n
    if drop > 0:
        cache.crop(-drop)


def _interleaved_medians(timers: dict, repeats: int) -> dict:
    """{name: median seconds} of `timers` ({name: fn() -> seconds it took}), run round-robin: one
    pass over every timer per repeat, after one warm-up pass. A drift in the machine's load then
    shifts every term alike, rather than all the timings of one configuration (timed one after the
    other, a slow minute made the longer chains look slower per step than the short ones)."""
    for fn in timers.values():
        fn()
    times = {name: [] for name in timers}
    for _ in range(repeats):
        for name, fn in timers.items():
            times[name].append(fn())
    return {name: statistics.median(t) for name, t in times.items()}


def _timed(fn, device):
    """fn as a timer: the seconds one call takes, the device synchronized."""
    def run():
        t0 = time.perf_counter()
        fn()
        spec_engine._sync(device)
        return time.perf_counter() - t0
    return run


@torch.inference_mode()
def measure_costs(target, draft, prompt: list[int], physical: list[int], configs=None, repeats: int = 15,
                  prompt_len: int | None = None) -> dict:
    """The raw timings of the round model's terms (seconds), on `prompt`, by the engine's own functions:
    baseline_step_s, prefill_s, draft_prefill_s, draft_s {"num_steps-topk": s}, verify_s and
    tree_verify_s {width: s}, extend_s {rows: s}, and draft_verify_s {"num_steps-topk-num_draft_tokens": s}:
    the drafting, verify, acceptance and KV keep of one round of each configuration, timed whole.
    `fit_costs` turns the parts into the model's lines; `round_cost` takes a configuration's whole
    timing where there is one.

    `prompt` is the state the rounds are timed in: give a prompt plus about half an answer (the
    bench passes its offline run's first output cut there), and prompt_len, the prompt's own length
    (the prefills are timed over it). Rounds run over a cache that grows
    from the prompt to the prompt plus the answer, and every draft step and verify attends over
    it: timed over the prompt alone, the deeper chains' rounds came out short of the offline run's by
    about 4% of a baseline decode step per draft step (2-core CPU, the default target and draft).

    Each timing is the median of `repeats`, the terms interleaved (`_interleaved_medians`); a term is
    timed from the state the engine would be in (the prompt prefilled in the target's and the
    draft's caches), and every cache is rolled back after it, so that the next timing starts from
    the same state. The baseline step is one decode step of the target (baseline_generate's body),
    timed among the rest.
    """
    configs = configs or CHAINS + TREES
    device = target.device
    prompt_len = prompt_len or len(prompt)
    n = len(prompt)
    spec_engine.baseline_generate(target, prompt, 2, ignore_eos=True)  # warm-up

    with AuxCapture(target, physical) as aux, spec_engine.attention_kernels(device):
        def prefilled(tokens):  # (ids, target cache, first token, draft cache, root state, seconds, draft seconds)
            ids = torch.tensor([tokens], device=device)
            cache = spec_engine.new_cache(target)
            t0 = time.perf_counter()
            x = int(spec_engine.target_forward(target, ids, cache, logits_to_keep=1)[0, -1].argmax())
            prefill = time.perf_counter() - t0
            dcache = KVCache()
            t0 = time.perf_counter()
            root = draft.step(torch.cat([ids[:, 1:], torch.tensor([[x]], device=device)], 1), draft.project(aux.take()),
                              torch.arange(len(tokens), device=device)[None], dcache)[:, -1:]
            spec_engine._sync(device)
            return ids, cache, x, dcache, root, prefill, time.perf_counter() - t0

        first = prefilled(prompt[:prompt_len])  # a request's prefills: the prompt alone
        prefill, draft_prefill = first[-2:]
        ids, cache, x, dcache, root, *_ = first if prompt_len == n else prefilled(prompt)  # the state rounds are timed in
        d0 = len(dcache)

        def decode_step():  # the baseline's step (baseline_generate's body), timed among the rest
            logits = spec_engine.target_forward(target, torch.tensor([[x]], device=device), cache, logits_to_keep=1)
            spec_engine.pick(logits[0, -1], True, 0.0, -1, 1.0, None)
            _rollback(cache, n)

        timers, trees = {("decode", 1): _timed(decode_step, device)}, {}
        for s, k, ndt in configs:
            if k == 1:
                fn = lambda s=s: spec_engine.draft_chain(draft, dcache, root, x, n, s)  # noqa: E731
            else:
                fn = lambda s=s, k=k, ndt=ndt: spec_engine.draft_tree(draft, dcache, root, x, n, s, k, ndt)  # noqa: E731
                trees[ndt] = fn()
            timers[("draft", f"{s}-{k}")] = _timed(fn, device)

        def verify(tree):
            logits = spec_engine.verify_tree(target, cache, tree, n)
            spec_engine.accept_path(tree, logits, True, 0.0, -1, 1.0, None)
            _rollback(cache, n)

        chain_widths = sorted({ndt for s, k, ndt in configs if k == 1} | {2})
        chain = lambda w: spec_engine.Tree([x] + prompt[:w - 1], list(range(-1, w - 1)), list(range(w)))  # noqa: E731
        for w in chain_widths:
            timers[("verify", w)] = _timed(lambda w=w: verify(chain(w)), device)
        for w, t in trees.items():
            timers[("tree_verify", w)] = _timed(lambda t=t: verify(t), device)

        def extend(r):  # the draft over r accepted rows, fed by the verify forward's aux states (not timed)
            def run():
                spec_engine.verify_tree(target, cache, chain(max(r, 2)), n)
                spec_engine._sync(device)
                t0 = time.perf_counter()
                draft.step(torch.tensor([prompt[:r]], device=device), draft.project(aux.take()[:, :r]),
                           torch.arange(n, n + r, device=device)[None], dcache)
                spec_engine._sync(device)
                took = time.perf_counter() - t0
                dcache.crop(d0)
                _rollback(cache, n)
                return took
            return run

        for r in range(1, max(chain_widths) + 1):
            timers[("extend", r)] = extend(r)

        def whole(s, k, ndt):  # drafting, verify, acceptance and the KV keep of one round, as generate runs them
            def run():
                t0 = time.perf_counter()
                if k == 1:
                    tree = spec_engine.draft_chain(draft, dcache, root, x, n, s)
                else:
                    tree = spec_engine.draft_tree(draft, dcache, root, x, n, s, k, ndt)
                logits = spec_engine.verify_tree(target, cache, tree, n)
                path, _ = spec_engine.accept_path(tree, logits, True, 0.0, -1, 1.0, None)
                spec_engine.keep_kv(cache, n, path)
                spec_engine._sync(device)
                took = time.perf_counter() - t0
                _rollback(cache, n)
                return took
            return run

        for s, k, ndt in configs:
            timers[("draft_verify", f"{s}-{k}-{ndt}")] = whole(s, k, ndt)
        med = _interleaved_medians(timers, repeats)
    baseline_step = med.pop(("decode", 1))

    def by(term):
        return {key: t for (name, key), t in med.items() if name == term}

    return {"baseline_step_s": baseline_step, "prefill_s": prefill, "draft_prefill_s": draft_prefill,
            "draft_s": by("draft"), "verify_s": by("verify"), "tree_verify_s": by("tree_verify"), "extend_s": by("extend"),
            "draft_verify_s": by("draft_verify")}


@torch.inference_mode()
def measure_gemm_s(target, token_counts, repeats: int = 5) -> dict[int, float]:
    """{T: seconds} of every dense matmul of the target (each nn.Linear, lm_head included) over T token
    rows, timed as plain matmuls on the target's device and dtype, the counts interleaved, the median
    of `repeats`: what the target's forward costs in its linear layers at T tokens, memory-bound for a
    small T (the weights are read once) and compute-bound for a large one (`batch_growth`). A
    mixture-of-experts layer is counted as if every expert ran: an upper bound."""
    weights = [m.weight for m in target.modules() if isinstance(m, torch.nn.Linear)]
    device, dtype = weights[0].device, weights[0].dtype
    rows = {int(t): {w.shape[1]: torch.randn(int(t), w.shape[1], device=device, dtype=dtype) for w in weights}
            for t in token_counts}

    def timer(t):
        def run():
            xs = rows[t]
            for w in weights:
                torch.matmul(xs[w.shape[1]], w.t())
        return _timed(run, device)

    return _interleaved_medians({t: timer(t) for t in rows}, repeats)


@torch.inference_mode()
def measure_rank_shares(target, draft, sequences: list[list[int]], prompt_lens: list[int], physical: list[int], k: int = 8) -> list[float]:
    """Share of answer positions where the target's next token is the draft's rank-r proposal, r < k
    (the draft at depth 1, fed the target's own states, as after a draft extend)."""
    device = target.device
    counts, total = [0] * k, 0
    for seq, p in zip(sequences, prompt_lens):
        ids = torch.tensor([seq], device=device)
        with AuxCapture(target, physical) as aux:
            target(input_ids=ids, use_cache=False)
            state = draft.step(ids[:, 1:], draft.project(aux.take()[:, :-1]), torch.arange(len(seq) - 1, device=device)[None], KVCache())
        top = draft.to_target(draft.logits(state[0]).topk(k, -1).indices)  # row t predicts token t + 2
        truth = ids[0, 2:]
        rows = top[p - 1:len(seq) - 2]  # the answer tokens a draft proposes (the first comes from the target's prefill)
        hits = rows == truth[p - 1:, None]
        total += rows.shape[0]
        for r, c in enumerate(hits.sum(0).tolist()):
            counts[r] += c
    return [c / total for c in counts] if total else []
