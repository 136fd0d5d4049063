"""The cost model of a speculative round, and the advice drawn from it: numbers in, numbers out.

From what each part of a round costs (timed by draftlab.bench.offline, or fitted on a server's own
rounds by draftlab.bench.fits) and the measured acceptance: the predicted tau and speedup of
chains and trees, and the recommendation, "don't speculate" when none pays. Nothing here runs a
model.

The cost model counts the round as the engine runs it (draftlab.engine.speculative.generate). For a configuration
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
P + T * b_server (`draftlab.bench.fits.probed_requests`: P from prompt-only requests, b_server the median of the
rest per token; `draftlab.bench.fits.fit_requests` without them), b = b_server, P = its fixed part (prefill, HTTP) and
o = b_server - the in-process decode step over the same prompts, paid once per round by a
speculative server (`server_costs`); without a served baseline, b is the in-process step, P the
prefill and o = 0;
The bench's reference server runs this very engine, and there the prediction is the in-process
speedup at the served pair's scale (`draftlab.bench.fits.speedup_scale`, `in_process_speedup`):
    speedup(c) = sigma * (P + T * e) / (P + P_d + (T / tau_c) * (round(c) - L)),
    sigma = the served speedup of the configuration that ran / that formula for it at its served tau,
with e, P, P_d the decode step and prefills timed in `draftlab.bench.offline.measure_costs`' loop. Every timing in the
formula comes from one interleaved loop, so a change in the machine's speed hits them alike: on a
shared 2-core CPU the served pair, the offline run and that loop, taken a minute apart, differed by
up to 2x in absolute speed, which the additive form (o, L from other minutes) turned into errors of
up to 20%. The configuration that ran is then predicted exactly; the test of the model is how it
predicts the others (`tools/advice_sweep.py`).
With a server that runs another engine (SGLang), o is replaced by a scale: every round costs
kappa * round, kappa = the served round of the configuration that ran (measured from its paired
requests, `draftlab.bench.fits.served_round`) / the offline run's round of it (`draftlab.bench.fits.round_scale`).
T: tokens per request (T -> infinity: the steady-state tau * b / round). tau: the chain's
1 + sum_i prod_{j<=i} a_j from the measured acceptance, or for a tree the same walk over the
draft's depth-1 rank shares (`tree_tau`).

DV is timed as a round runs it, the draft's forwards and the target's verify one after the other
over a cache of a prompt plus half an answer (`draftlab.bench.offline.measure_costs`): the sum of the parts timed apart
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
this device by `draftlab.bench.offline.measure_gemm_s`, unscaled, because a matmul of that size costs the same under a
server's CUDA graphs as in-process.
"""
from __future__ import annotations

import math
import statistics

import numpy as np

from draftlab.engine import speculative
from draftlab.metrics import chain_tau

CHAINS = [(n, 1, n + 1) for n in range(1, 9)]  # (num_steps, topk, num_draft_tokens)
TREES = [(3, 2, 6), (4, 2, 8), (5, 4, 8), (6, 8, 32)]


def tree_tau(rank_acceptance: list[list[float]], num_steps: int, topk: int, num_draft_tokens: int) -> float:
    """Expected tau of the tree draftlab.engine.speculative.draft_tree builds, if its scores were the acceptance.

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
    keep = speculative.best_subtree(reach, parents, num_draft_tokens)
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


def nonnegative_lstsq(columns: list[list[float]], y: list[float]) -> list[float]:
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
    a, b = nonnegative_lstsq([[1.0] * len(xs), xs], ys)
    return a, b


def fit_draft(draft_s: dict) -> tuple[float, dict]:
    """(D0, {topk: d_k}) from {"num_steps-topk": seconds}: draft(s, k) = D0 + (s - 1) * d_k, non-negative
    least squares over every configuration timed (D0 is the head on the root, shared by all widths).
    A topk timed at num_steps 1 only has no d_k (the lookup takes it from the neighbouring widths)."""
    pts = [(int(key.split("-")[0]) - 1, int(key.split("-")[1]), float(t)) for key, t in draft_s.items()]
    widths = sorted({k for x, k, _ in pts if x > 0})
    coef = nonnegative_lstsq([[1.0] * len(pts)] + [[x if kk == k else 0.0 for x, kk, _ in pts] for k in widths],
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


def in_process_speedup(costs: dict, tau: float, num_steps: int, topk: int, num_draft_tokens: int) -> float:
    """The in-process engine's speedup by the timings of `draftlab.bench.offline.measure_costs` alone, all taken in one
    interleaved loop: (P + T * e) / (P + P_d + (T / tau) * round), e the decode step and P, P_d the
    prefills timed there, round = `round_cost` less its loop term (calibrated on another run)."""
    parts = round_cost(costs, num_steps, topk, num_draft_tokens, tau)
    r, step = parts["round"] - parts["loop"], costs["baseline_step_s"]
    T = costs.get("tokens_per_request") or math.inf
    if math.isinf(T):
        return tau * step / r
    prefill, draft_prefill = costs.get("prefill_s", 0.0), costs.get("draft_prefill_s", 0.0)
    return (prefill + T * step) / (prefill + draft_prefill + (T / tau) * r)


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


def interpolate(table: dict, x: float) -> float:
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
    f = lambda t: interpolate(table, t)  # noqa: E731
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
