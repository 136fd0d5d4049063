"""The offline isolation run, the measured costs of a speculative round, and the advice drawn from them.

The bench stage's second opinion on a served draft: the same exported draft decoded in-process
(draftlab.spec_engine, no server); what each part of a speculative round costs on this machine,
timed by running the engine's own step functions; and from those and the measured acceptance the
predicted tau and speedup of chains and trees, with "don't speculate" when none pays.

The cost model counts the round as the engine runs it (spec_engine.generate):

    round  = draft(config)          draft_chain / draft_tree: the head on the root, num_steps - 1 draft forwards
           + verify(config)         one target forward over the num_draft_tokens, the acceptance walk, the KV rollback
           + extend(tau)            the draft over the accepted rows + bonus (aux concatenation and fc included)
           + loop                   the rest of the round loop (emitting, counting); measured as what the
                                    offline run's rounds took beyond the parts above
    speedup = (prefill + T * baseline_step) / (prefill + draft_prefill + (T / tau) * round)

with T the tokens per request (T -> infinity: the steady-state tau * baseline_step / round). A
costs dict holds these terms measured at one batch size; `advise_by_concurrency` takes one such
dict per concurrency (e.g. an SGLang server's decode step and verify times per batch size) and
names the concurrency from which no candidate is predicted to pay.
"""
from __future__ import annotations

import math
import statistics
import time

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
    """table: a number, or {size: seconds} interpolated linearly (extrapolated past the largest size)."""
    if not isinstance(table, dict):
        return float(table)
    pts = sorted((float(k), float(v)) for k, v in table.items())
    if key <= pts[0][0] or len(pts) == 1:
        return pts[0][1]
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if key <= x1 or x1 == pts[-1][0]:
            return y0 + (y1 - y0) * (key - x0) / (x1 - x0)


def round_cost(costs: dict, num_steps: int, topk: int, num_draft_tokens: int, tau: float) -> dict:
    """Seconds of each part of one round of this configuration, and their sum."""
    chain = topk == 1
    drafting = costs.get("draft_s", {}).get(f"{num_steps}-{topk}")  # measured for this very configuration
    if drafting is None:
        drafting = costs.get("draft_head_s", 0.0) + (num_steps - 1) * _lookup(costs["draft_step_s"], topk)
    verify = _lookup(costs["verify_s"] if chain else costs.get("tree_verify_s", costs["verify_s"]), num_draft_tokens)
    extend = _lookup(costs.get("extend_s", costs["draft_step_s"]), tau)
    parts = {"draft": drafting, "verify": verify, "extend": extend, "loop": costs.get("loop_s", 0.0)}
    parts["round"] = sum(parts.values())
    return parts


def predict(costs: dict, tau: float, num_steps: int, topk: int, num_draft_tokens: int) -> float:
    """Predicted speedup of one configuration whose rounds yield `tau` tokens."""
    r = round_cost(costs, num_steps, topk, num_draft_tokens, tau)["round"]
    T = costs.get("tokens_per_request") or math.inf
    base, prefill = costs["baseline_step_s"], costs.get("prefill_s", 0.0)
    if math.isinf(T):
        return tau * base / r
    return (prefill + T * base) / (prefill + costs.get("draft_prefill_s", 0.0) + (T / tau) * r)


def advise(acceptance: list[float], costs: dict, configs=None, depth1_ranks: list[float] | None = None) -> dict:
    """Predicted tau and speedup of each configuration, the recommended one, or "don't speculate".

    acceptance: the measured a_i (depths past those measured reuse the last one: extrapolated);
    configs: (num_steps, topk, num_draft_tokens) triples (chains of 1..8 and a few trees by default);
    trees need depth1_ranks (else they are skipped).
    """
    configs = configs if configs is not None else CHAINS + (TREES if depth1_ranks else [])
    rows = []
    for steps, topk, ndt in configs:
        a = [acceptance[min(i, len(acceptance) - 1)] for i in range(steps)] if acceptance else [0.0] * steps
        tau = chain_tau(a) if topk == 1 else tree_tau(rank_acceptance_of(a, depth1_ranks, topk), steps, topk, ndt)
        parts = round_cost(costs, steps, topk, ndt, tau)
        rows.append({"num_steps": steps, "topk": topk, "num_draft_tokens": ndt, "predicted_tau": tau,
                     "predicted_speedup": predict(costs, tau, steps, topk, ndt), "round_ms": 1e3 * parts["round"],
                     "extrapolated": steps > len(acceptance)})
    best = max(rows, key=lambda r: r["predicted_speedup"]) if rows else None
    speculate = best is not None and best["predicted_speedup"] > 1.0
    return {"candidates": rows, "recommended": best if speculate else None, "speculate": speculate,
            "advice": (f"num_steps={best['num_steps']} topk={best['topk']} num_draft_tokens={best['num_draft_tokens']} "
                       f"(predicted {best['predicted_speedup']:.2f}x)") if speculate else
                      "don't speculate: no candidate is predicted above 1.0x"
                      + (f" (best {best['predicted_speedup']:.2f}x)" if best else "")}


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
# Measuring: the offline run and the costs, with the engine's own functions


def offline_run(target, draft, prompts: list[list[int]], flags, physical: list[int], max_new_tokens: int,
                eos: set[int], ignore_eos: bool) -> dict:
    """Every prompt decoded in-process by spec_engine with the served flags: pooled tau, a_i, speed,
    seconds per round (prefills excluded) and the outputs (for the rank shares)."""
    results = [
        spec_engine.generate(target, draft, p, num_steps=flags.num_steps, topk=flags.topk, num_draft_tokens=flags.num_draft_tokens,
                             max_new_tokens=max_new_tokens, eos_token_id=eos, ignore_eos=ignore_eos, physical_layers=physical)
        for p in prompts
    ]
    proposed = [sum(x) for x in zip(*(r.proposed for r in results))]
    accepted = [sum(x) for x in zip(*(r.accepted for r in results))]
    tokens = sum(len(r.output_ids) for r in results)
    verify_ct = sum(r.spec_verify_ct for r in results)
    return {
        "tau": pooled_tau([len(r.output_ids) for r in results], [r.spec_verify_ct for r in results]),
        "acceptance": conditional_acceptance(accepted, proposed),
        "tokens_per_s": tokens / sum(r.total_s for r in results),
        "tokens_per_request": tokens / len(results),
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


def _median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        spec_engine._sync("cuda" if torch.cuda.is_available() else "cpu")
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


@torch.inference_mode()
def measure_costs(target, draft, prompt: list[int], physical: list[int], configs=None, repeats: int = 9) -> dict:
    """Seconds of each term of the round model, timed on `prompt` by the engine's own functions.

    Each timing is a median of `repeats`; a term is timed from the state the engine would be in
    (the prompt prefilled in the target's and the draft's caches), and every cache is rolled back
    after it, so that the next timing starts from the same state.
    """
    configs = configs or CHAINS + TREES
    device = target.device
    ids = torch.tensor([prompt], device=device)
    n = len(prompt)
    spec_engine.baseline_generate(target, prompt, 2, ignore_eos=True)  # warm-up
    steps = 16
    base_runs = [spec_engine.baseline_generate(target, prompt, steps + 1, ignore_eos=True) for _ in range(3)]
    baseline_step = statistics.median((b.total_s - b.prefill_s) / steps for b in base_runs)
    with AuxCapture(target, physical) as aux, spec_engine.attention_kernels(device):
        cache = spec_engine.new_cache(target)
        t0 = time.perf_counter()
        x = int(spec_engine.target_forward(target, ids, cache, logits_to_keep=1)[0, -1].argmax())
        prefill = time.perf_counter() - t0
        dcache = KVCache()
        t0 = time.perf_counter()
        root = draft.step(torch.cat([ids[:, 1:], torch.tensor([[x]], device=device)], 1), draft.project(aux.take()),
                          torch.arange(n, device=device)[None], dcache)[:, -1:]
        draft_prefill = time.perf_counter() - t0
        d0 = len(dcache)

        drafting, trees = {}, {}
        for s, k, ndt in configs:
            if k == 1:
                fn = lambda s=s: spec_engine.draft_chain(draft, dcache, root, x, n, s)  # noqa: E731
            else:
                fn = lambda s=s, k=k, ndt=ndt: spec_engine.draft_tree(draft, dcache, root, x, n, s, k, ndt)  # noqa: E731
            drafting[f"{s}-{k}"] = _median_time(fn, repeats)
            if k > 1:
                trees[ndt] = fn()

        def verify(tree):
            logits = spec_engine.verify_tree(target, cache, tree, n)
            spec_engine.accept_path(tree, logits, True, 0.0, -1, 1.0, None)
            _rollback(cache, n)

        chain_widths = sorted({ndt for s, k, ndt in configs if k == 1} | {2})
        chain = lambda w: spec_engine.Tree([x] + prompt[:w - 1], list(range(-1, w - 1)), list(range(w)))  # noqa: E731
        verify_s = {w: _median_time(lambda w=w: verify(chain(w)), repeats) for w in chain_widths}
        tree_verify_s = {w: _median_time(lambda t=t: verify(t), repeats) for w, t in trees.items()}

        def extend(r):  # the draft over r accepted rows, fed by the verify forward's aux states
            spec_engine.verify_tree(target, cache, chain(max(r, 2)), n)
            t0 = time.perf_counter()
            draft.step(torch.tensor([prompt[:r]], device=device), draft.project(aux.take()[:, :r]),
                       torch.arange(n, n + r, device=device)[None], dcache)
            spec_engine._sync(device)
            took = time.perf_counter() - t0
            dcache.crop(d0)
            _rollback(cache, n)
            return took

        extend_s = {r: statistics.median(extend(r) for _ in range(repeats)) for r in range(1, max(chain_widths) + 1)}
    return {"baseline_step_s": baseline_step, "prefill_s": prefill, "draft_prefill_s": draft_prefill,
            "draft_s": drafting, "draft_step_s": (drafting.get("2-1", 0.0) - drafting.get("1-1", 0.0)) or 1e-4,
            "draft_head_s": drafting.get("1-1", 0.0), "verify_s": verify_s, "tree_verify_s": tree_verify_s, "extend_s": extend_s}


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
