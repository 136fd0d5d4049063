"""The speedup model of draftlab.advice on synthetic costs: chains, trees, "don't speculate",
per-concurrency advice and its crossover, predicted against measured."""
import math

import pytest

from draftlab import advice
from draftlab.metrics import chain_tau

MS = 1e-3


def cpu_costs(**over) -> dict:
    """Round terms shaped like the embedded default on a CPU (seconds)."""
    costs = {"baseline_step_s": 2.9 * MS, "draft_head_s": 0.1 * MS, "draft_step_s": 0.35 * MS,
             "verify_s": {2: 3.2 * MS, 6: 3.6 * MS, 9: 3.9 * MS}, "tree_verify_s": {8: 4.5 * MS, 32: 7.0 * MS},
             "extend_s": {1: 0.3 * MS, 9: 0.5 * MS}, "loop_s": 0.2 * MS}
    costs.update(over)
    return costs


def test_a_chain_round_counts_every_part_and_the_speedup_follows():
    costs = cpu_costs()
    a = [0.8, 0.7, 0.6, 0.5, 0.4]
    tau = chain_tau(a)
    parts = advice.round_cost(costs, 5, 1, 6, tau)
    extend = (0.3 + 0.2 * (tau - 1) / 8) * MS
    assert parts["draft"] == pytest.approx((0.1 + 4 * 0.35) * MS)
    assert parts["verify"] == pytest.approx(3.6 * MS) and parts["extend"] == pytest.approx(extend)
    assert parts["round"] == pytest.approx(parts["draft"] + parts["verify"] + extend + 0.2 * MS)
    assert advice.predict(costs, tau, 5, 1, 6) == pytest.approx(tau * 2.9 * MS / parts["round"])
    # per request: the prefill is paid by both, the draft's prefill by speculation only
    T, pre, dpre = 128, 3 * MS, 1 * MS
    per_request = advice.predict({**costs, "tokens_per_request": T, "prefill_s": pre, "draft_prefill_s": dpre}, tau, 5, 1, 6)
    assert per_request == pytest.approx((pre + T * 2.9 * MS) / (pre + dpre + T / tau * parts["round"]))
    # a draft timed for the very configuration replaces the per-step estimate
    assert advice.round_cost({**costs, "draft_s": {"5-1": 9 * MS}}, 5, 1, 6, tau)["draft"] == 9 * MS


def test_advice_recommends_the_best_chain_and_extrapolates_past_measured_depths():
    out = advice.advise([0.8, 0.7, 0.6], cpu_costs())
    rows = {r["num_steps"]: r for r in out["candidates"]}
    assert set(rows) == set(range(1, 9)) and out["speculate"]
    assert out["recommended"] == max(out["candidates"], key=lambda r: r["predicted_speedup"])
    assert rows[5]["extrapolated"] and not rows[3]["extrapolated"]
    assert rows[5]["predicted_tau"] == pytest.approx(chain_tau([0.8, 0.7, 0.6, 0.6, 0.6]))
    assert out["advice"].startswith(f"num_steps={out['recommended']['num_steps']} topk=1")


def test_dont_speculate_when_no_candidate_is_predicted_above_one():
    """A random-weight target: the draft is never right, so every round costs more than it yields."""
    out = advice.advise([0.01, 0.0], cpu_costs())
    assert not out["speculate"] and out["recommended"] is None
    assert all(r["predicted_speedup"] < 1.0 for r in out["candidates"])
    assert out["advice"].startswith("don't speculate")
    assert advice.advise([], cpu_costs())["recommended"] is None  # nothing measured: nothing accepted


def test_tree_tau_of_a_chain_is_chain_tau_and_more_branches_accept_more():
    a = [0.7, 0.6, 0.5, 0.5]
    assert advice.tree_tau([[x] for x in a], 4, 1, 5) == pytest.approx(chain_tau(a))
    ranks = [0.7, 0.12, 0.05, 0.03]
    q = advice.rank_acceptance_of(a, ranks, 4)
    assert q[0] == pytest.approx([0.7, 0.12, 0.05, 0.03]) and q[1][1] == pytest.approx(0.6 * 0.12 / 0.7)
    wide = advice.tree_tau(q, 4, 4, 16)
    assert wide > advice.tree_tau(q, 4, 4, 8) > advice.tree_tau(q, 4, 1, 5) == pytest.approx(chain_tau(a))
    # a node is reached through its parent: the two-node tree of rank 0 then rank 1 below the root
    assert advice.tree_tau([[0.5, 0.3]], 1, 2, 3) == pytest.approx(1 + 0.5 + 0.3)
    # a capped row never sums above 1
    assert sum(advice.rank_acceptance_of([0.95], [0.6, 0.3, 0.2], 3)[0]) == pytest.approx(1.0)


def test_trees_are_advised_from_top_k_acceptance_and_win_where_wide_verifies_are_cheap():
    a, ranks = [0.6, 0.5, 0.45, 0.4, 0.4, 0.4], [0.6, 0.15, 0.07, 0.04, 0.03, 0.02, 0.02, 0.01]
    gpu = {"baseline_step_s": 10 * MS, "draft_head_s": 0.3 * MS, "draft_step_s": {1: 0.4 * MS, 8: 0.5 * MS},
           "verify_s": {2: 10.5 * MS, 9: 11 * MS}, "tree_verify_s": {8: 11 * MS, 32: 12 * MS}, "extend_s": 0.5 * MS}
    out = advice.advise(a, gpu, depth1_ranks=ranks)
    trees = [r for r in out["candidates"] if r["topk"] > 1]
    assert {(r["num_steps"], r["topk"], r["num_draft_tokens"]) for r in trees} >= {(5, 4, 8), (6, 8, 32)}
    assert out["recommended"]["topk"] > 1  # verify width is nearly free: the widest tree's tau wins
    cpu = advice.advise(a, cpu_costs(tree_verify_s={8: 8 * MS, 32: 30 * MS}), depth1_ranks=ranks)
    assert cpu["recommended"]["topk"] == 1  # on a CPU every verified token costs: a chain wins
    assert not [r for r in advice.advise(a, gpu)["candidates"] if r["topk"] > 1]  # no rank shares, no trees


def test_per_concurrency_advice_names_the_crossover():
    """Verify cost grows with batch x width (compute-bound sooner than a decode step): speculation
    pays at low concurrency and stops paying from some batch size on, which must be named."""
    def at(b):
        step = 10 * MS + 0.05 * MS * b  # memory-bound decode: nearly flat in b
        return {"baseline_step_s": step, "draft_head_s": 0.3 * MS, "draft_step_s": 0.5 * MS * (1 + b / 16),
                "verify_s": {w: max(step, 0.2 * MS * b * w) for w in range(2, 10)}, "extend_s": 0.5 * MS}
    a = [0.8, 0.7, 0.6, 0.5, 0.5]
    out = advice.advise_by_concurrency(a, {b: at(b) for b in (1, 4, 16, 32, 64, 128)})
    per = out["by_concurrency"]
    assert per[1]["speculate"] and per[1]["recommended"]["predicted_speedup"] > 2
    assert out["crossover_concurrency"] is not None
    c = out["crossover_concurrency"]
    assert all(not per[b]["speculate"] for b in per if b >= c) and all(per[b]["speculate"] for b in per if b < c)
    # fewer drafts pay longer: the recommended chain shortens as the batch grows
    steps = [per[b]["recommended"]["num_steps"] for b in sorted(per) if per[b]["speculate"]]
    assert steps == sorted(steps, reverse=True)
    # where it pays at every concurrency measured, there is no crossover
    assert advice.advise_by_concurrency(a, {1: at(1), 4: at(4)})["crossover_concurrency"] is None


def test_predicted_vs_measured_for_every_configuration_run():
    out = advice.advise([0.8, 0.7, 0.6], cpu_costs())
    ran = [{"num_steps": 3, "topk": 1, "num_draft_tokens": 4, "measured_tau": 2.9, "measured_speedup": 1.5},
           {"num_steps": 9, "topk": 1, "num_draft_tokens": 10, "measured_speedup": 1.0}]  # not a candidate: left out
    rows = advice.predicted_vs_measured(out["candidates"], ran)
    assert len(rows) == 1 and rows[0]["where"] == "served"
    pred = next(r for r in out["candidates"] if r["num_steps"] == 3)["predicted_speedup"]
    assert rows[0]["speedup_error"] == pytest.approx(pred / 1.5 - 1)


def test_lookup_interpolates_and_extrapolates():
    table = {2: 1.0, 4: 2.0, 8: 3.0}
    assert advice._lookup(table, 3) == 1.5 and advice._lookup(table, 1) == 1.0
    assert advice._lookup(table, 10) == pytest.approx(3.5) and advice._lookup(2.5, 7) == 2.5
    assert math.isclose(advice._lookup({1: 1.0}, 5), 1.0)
