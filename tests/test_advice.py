"""The speedup model of draftlab.bench.advice on synthetic costs: the fitted terms, chains, trees,
"don't speculate", per-concurrency advice and its crossover, predicted against measured."""
import math
import random

import pytest

from draftlab.bench import advice, offline, fits
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
    # timings per configuration are fitted, not read one by one: an outlier at 5 steps moves the
    # line a little, not the 5-step draft to the outlier
    draft_s = {f"{s}-1": (0.1 + (s - 1) * 0.35) * MS for s in range(1, 9)}
    noisy = {**draft_s, "5-1": 3 * draft_s["5-1"]}
    assert advice.round_cost({**costs, "draft_s": draft_s}, 5, 1, 6, tau)["draft"] == pytest.approx(draft_s["5-1"])
    assert advice.round_cost({**costs, "draft_s": noisy}, 5, 1, 6, tau)["draft"] < 1.5 * draft_s["5-1"]


def test_advice_recommends_the_best_chain_and_extrapolates_past_measured_depths():
    out = advice.advise([0.8, 0.7, 0.6], cpu_costs())
    rows = {r["num_steps"]: r for r in out["candidates"]}
    assert set(rows) == set(range(1, 9)) and out["speculate"]
    assert out["recommended"] == max((r for r in out["candidates"] if r["num_steps"] <= 3), key=lambda r: r["predicted_speedup"])
    assert rows[5]["extrapolated"] and not rows[3]["extrapolated"]
    assert rows[5]["predicted_tau"] == pytest.approx(chain_tau([0.8, 0.7, 0.6, 0.6, 0.6]))
    assert out["advice"].startswith(f"num_steps={out['recommended']['num_steps']} topk=1")


def test_a_depth_past_the_acceptance_measured_is_named_worth_measuring_never_recommended():
    """The H200 case: the 8-step chain, predicted from a 5-step acceptance, was the model's best and
    served less than the 7-step one. Only measured depths are recommended; a deeper one predicted
    higher is named, to be served once and measured."""
    costs = cpu_costs(verify_s={w: 3.0 * MS for w in range(2, 10)}, baseline_step_s=4.0 * MS)  # a free verify width
    out = advice.advise([0.95] * 5, costs, [(s, 1, s + 1) for s in range(1, 9)])
    assert out["recommended"]["num_steps"] == 5 and not out["recommended"]["extrapolated"]
    assert out["worth_measuring"]["num_steps"] == 8 and out["worth_measuring"]["extrapolated"]
    assert "num_steps=8" in out["advice"] and "serve it once to measure" in out["advice"]
    # where the measured depths already give the best, nothing is named
    flat = advice.advise([0.95] * 8, costs, [(s, 1, s + 1) for s in range(1, 9)])
    assert flat["recommended"]["num_steps"] == 8 and flat["worth_measuring"] is None


def test_served_chains_make_their_depths_measured_and_interpolate_the_ones_between():
    cands = [{"num_steps": s, "topk": 1, "num_draft_tokens": s + 1, "predicted_tau": 1.0 + 0.9 * s, "extrapolated": s > 5}
             for s in range(1, 9)] + [{"num_steps": 6, "topk": 8, "num_draft_tokens": 32, "predicted_tau": 6.0}]
    got = {(c["num_steps"], c["topk"]): c for c in fits.known_taus(cands, {(7, 1, 8): 6.2, (3, 1, 4): 3.6})}
    assert got[(7, 1)]["predicted_tau"] == 6.2 and not got[(7, 1)]["extrapolated"]  # served: its own tau
    assert got[(3, 1)]["predicted_tau"] == 3.6
    assert got[(6, 1)]["predicted_tau"] == pytest.approx((5.5 + 6.2) / 2) and not got[(6, 1)]["extrapolated"]
    assert got[(8, 1)]["extrapolated"] and got[(8, 1)]["predicted_tau"] == pytest.approx(8.2)  # past the deepest served
    assert got[(6, 8)]["predicted_tau"] == 6.0  # a tree not served: as the acceptance predicts it


def test_dont_speculate_when_no_candidate_is_predicted_above_one():
    """A random-weight target: the draft is never right, so every round costs more than it yields."""
    out = advice.advise([0.01, 0.0], cpu_costs())
    assert not out["speculate"] and out["recommended"] is None
    assert all(r["predicted_speedup"] < 1.0 for r in out["candidates"])
    assert out["advice"].startswith("don't speculate") and out["recommendation"] == advice.DONT_SPECULATE == "don't speculate"
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


# ---------------------------------------------------------------------------------------------
# The fitted terms and the formula, by hand


def medians_of_noisy_timings(true: dict, repeats: int = 15, seed: int = 0, spread: float = 0.1) -> dict:
    """{key: median of `repeats` timings}: each timing the true cost times 1 + |N(0, spread)|, one in
    five hit by a spike of up to +150% (another process on the shared CPU). (A drift of the load
    across the keys is what measure_costs' interleaving takes away: not simulated here.)"""
    rng = random.Random(seed)
    out = {}
    for key, t in true.items():
        times = [t * (1 + abs(rng.gauss(0, spread))) * (1 + rng.uniform(0, 1.5) * (rng.random() < 0.2)) for _ in range(repeats)]
        out[key] = sorted(times)[repeats // 2]
    return out


def test_the_draft_fit_recovers_known_fixed_and_per_step_costs_from_noisy_medians():
    d0, per_step = 0.4 * MS, {1: 1.7 * MS, 2: 2.9 * MS}
    configs = [(s, 1) for s in range(1, 9)] + [(3, 2), (4, 2), (6, 2)]
    true = {f"{s}-{k}": d0 + (s - 1) * per_step[k] for s, k in configs}
    for seed in range(5):
        got_d0, got = advice.fit_draft(medians_of_noisy_timings(true, seed=seed))
        # the noise only adds time (the median of |N| and spikes: about +10%): the fit is the
        # noisy line, close to the true one
        assert got[1] == pytest.approx(1.7 * MS, rel=0.15) and got[2] == pytest.approx(2.9 * MS, rel=0.15)
        assert 0 <= got_d0 < 1.5 * MS
    # exact timings give the exact terms
    got_d0, got = advice.fit_draft(true)
    assert got_d0 == pytest.approx(d0) and got == pytest.approx(per_step)
    # a topk timed at one depth only still gets its per-step cost, the fixed part shared
    got_d0, got = advice.fit_draft({**{f"{s}-1": d0 + (s - 1) * per_step[1] for s in range(1, 6)}, "5-4": d0 + 4 * 3.5 * MS})
    assert got_d0 == pytest.approx(d0) and got[4] == pytest.approx(3.5 * MS)


def test_fitted_lines_are_monotone_and_never_negative():
    # verify by width: 8 ms + 0.5 ms/token measured with noise that makes the raw table non-monotone
    true = {w: 8 * MS + 0.5 * MS * w for w in range(2, 10)}
    noisy = next(n for seed in range(99) if any((n := medians_of_noisy_timings(true, seed=seed))[w + 1] < n[w] for w in range(2, 9)))
    v0, v1 = advice.fit_line(noisy)  # the raw lookup would go down somewhere: the line does not
    assert v1 == pytest.approx(0.5 * MS, rel=0.5) and v0 == pytest.approx(8 * MS, rel=0.2)
    assert advice.fit_line({2: 3.0, 4: 2.0, 8: 1.0}) == (pytest.approx(2.0), 0.0)  # falling: flat at the mean
    assert advice.fit_line({1: 0.5, 8: 4.0, 9: 6.0})[0] == 0.0  # a negative intercept is pinned at 0
    assert advice.fit_line({6: 2.0}) == (2.0, 0.0)
    fit = advice.fit_costs({"verify_s": noisy, "tree_verify_s": {8: 14 * MS}, "draft_s": {"1-1": 0.1 * MS, "3-1": 0.9 * MS},
                            "extend_s": {1: 0.3 * MS, 9: 0.5 * MS}})
    # a tree timed at one width takes the chains' slope through that point
    assert fit["tree_verify_per_token"] == v1 and fit["tree_verify_fixed"] + 8 * v1 == pytest.approx(14 * MS)
    assert fit["extend_fixed"] == pytest.approx(0.275 * MS) and fit["extend_per_row"] == pytest.approx(0.025 * MS)
    assert fit["draft_fixed"] == pytest.approx(0.1 * MS) and fit["draft_per_step"] == {1: pytest.approx(0.4 * MS)}


HAND = {"baseline_step_s": 10.0, "draft_head_s": 1.0, "draft_step_s": {1: 2.0, 2: 3.0},  # ms: one unit throughout
        "verify_s": {2: 10.0, 9: 17.0},              # chains: 8 + 1 * w
        "tree_verify_s": {3: 12.0, 8: 14.0},         # trees: 10.8 + 0.4 * w
        "extend_s": {1: 1.0, 9: 1.8}, "loop_s": 0.5}  # 0.9 + 0.1 * rows


def test_the_prediction_by_hand_for_a_chain():
    # a = [0.8, 0.5]: tau = 1 + 0.8 + 0.8 * 0.5 = 2.2
    # round = draft 1 + 1 * 2 + verify 8 + 3 + extend 0.9 + 0.22 + loop 0.5 = 15.62
    out = advice.advise([0.8, 0.5], HAND, [(2, 1, 3)])
    row = out["candidates"][0]
    assert row["predicted_tau"] == pytest.approx(2.2)
    assert advice.round_cost(HAND, 2, 1, 3, 2.2) == pytest.approx(
        {"draft": 3.0, "verify": 11.0, "draft_verify": 14.0, "extend": 1.12, "loop": 0.5, "round": 15.62})
    assert row["predicted_speedup"] == pytest.approx(2.2 * 10 / 15.62)  # 1.4085
    # per request of T = 100 tokens, prefill 20, the draft's prefill 4: (20 + 1000) / (24 + 100 / 2.2 * 15.62)
    per_request = {**HAND, "tokens_per_request": 100, "prefill_s": 20.0, "draft_prefill_s": 4.0}
    assert advice.predict(per_request, 2.2, 2, 1, 3) == pytest.approx(1020 / 734.0)
    assert out["recommendation"] == "num_steps=2 topk=1 num_draft_tokens=3" and out["speculate"]


def test_a_configuration_timed_whole_is_predicted_from_that_timing_not_the_sum_of_its_parts():
    """The draft and verify of a round timed one after the other (draft_verify_s) replace the lines
    through the parts for that configuration; an untimed one still gets the lines."""
    timed = {**HAND, "draft_verify_s": {"2-1-3": 12.5, "5-1-6": 30.0}}
    # 2-1-3: 12.5 + extend 0.9 + 0.1 * 2.2 + loop 0.5 (the parts' lines said 3 + 11 = 14)
    assert advice.round_cost(timed, 2, 1, 3, 2.2)["round"] == pytest.approx(14.12)
    assert advice.predict(timed, 2.2, 2, 1, 3) == pytest.approx(2.2 * 10 / 14.12)
    # a round that costs more for its depth than the lines say ranks below a shallower one
    deep = advice.advise([0.95] * 5, timed, [(2, 1, 3), (5, 1, 6)])
    assert deep["recommendation"] == "num_steps=2 topk=1 num_draft_tokens=3"
    lines = advice.advise([0.95] * 5, HAND, [(2, 1, 3), (5, 1, 6)])
    assert lines["recommendation"] == "num_steps=5 topk=1 num_draft_tokens=6"
    # not timed whole: the parts' lines
    assert advice.round_cost(timed, 3, 1, 4, 2.5) == advice.round_cost(HAND, 3, 1, 4, 2.5)


def test_the_prediction_by_hand_for_a_tree():
    # a = [0.6], depth-1 rank shares [0.6, 0.2]: ranks 0 and 1 accepted with 0.6 and 0.2 at every depth.
    # 2 steps, topk 2: depth 1 reaches 0.6 and 0.2, depth 2 0.36, 0.12 (under rank 0) and 0.12, 0.04;
    # 4 verified tokens = the root + the best 3 nodes: 0.6, 0.36, 0.2 -> tau = 2.16
    out = advice.advise([0.6], HAND, [(2, 2, 4)], depth1_ranks=[0.6, 0.2])
    row = out["candidates"][0]
    assert row["predicted_tau"] == pytest.approx(2.16)
    # round = draft 1 + 1 * 3 + tree verify 10.8 + 0.4 * 4 + extend 0.9 + 0.216 + loop 0.5 = 18.016
    assert advice.round_cost(HAND, 2, 2, 4, 2.16)["round"] == pytest.approx(18.016)
    assert row["predicted_speedup"] == pytest.approx(2.16 * 10 / 18.016)  # 1.1989


def test_dont_speculate_is_the_explicit_recommendation_when_every_candidate_is_below_one():
    """A draft that costs as much as the target: nothing pays, whatever the tree or chain."""
    costs = {**HAND, "baseline_step_s": 8.0, "draft_step_s": {1: 12.0, 2: 15.0}}
    out = advice.advise([0.5, 0.4], costs, depth1_ranks=[0.5, 0.1, 0.05])
    assert all(r["predicted_speedup"] < 1.0 for r in out["candidates"]) and any(r["topk"] > 1 for r in out["candidates"])
    assert out == {**out, "speculate": False, "recommended": None, "recommendation": "don't speculate"}
    best = max(r["predicted_speedup"] for r in out["candidates"])
    assert out["advice"].startswith("don't speculate: no candidate is predicted above 1.0x") and f"{best:.2f}x" in out["advice"]


def test_a_costlier_draft_or_verify_never_predicts_a_higher_speedup():
    rng = random.Random(7)
    configs = advice.CHAINS + advice.TREES
    ranks = [0.6, 0.15, 0.07, 0.04, 0.03, 0.02, 0.02, 0.01]
    for _ in range(20):
        base = {"baseline_step_s": rng.uniform(5, 20), "verify_s": medians_of_noisy_timings({w: 8 + rng.uniform(0.1, 1) * w for w in range(2, 10)}, seed=rng.randrange(99)),
                "tree_verify_s": {6: 14.0, 8: 15.0, 32: 25.0}, "extend_s": {1: 1.0, 9: 2.0}, "loop_s": rng.uniform(0, 2),
                "draft_s": medians_of_noisy_timings({f"{s}-{k}": 0.3 + (s - 1) * k ** 0.3 * rng.uniform(0.5, 3) for s, k, _ in configs},
                                                    seed=rng.randrange(99)),
                "tokens_per_request": rng.choice([None, 64, 256]), "prefill_s": 20.0, "draft_prefill_s": 3.0}
        a = [rng.uniform(0.3, 0.9) for _ in range(5)]
        before = advice.advise(a, base, configs, depth1_ranks=ranks)["candidates"]
        # costlier: every drafting timing slower by one factor, or by more per step, or every verify
        # slower per token (one timing alone moving can tilt a least-squares line either way)
        c = rng.uniform(1.01, 2)
        for costlier in ({**base, "draft_s": {key: t * c for key, t in base["draft_s"].items()}},
                         {**base, "draft_s": {key: t + 0.5 * (int(key.split("-")[0]) - 1) for key, t in base["draft_s"].items()}},
                         {**base, "verify_s": {w: t + (c - 1) * w for w, t in base["verify_s"].items()}}):
            after = advice.advise(a, costlier, configs, depth1_ranks=ranks)["candidates"]
            assert all(y["predicted_speedup"] <= x["predicted_speedup"] + 1e-12 for x, y in zip(before, after))
        # and within one costs dict, more verified tokens at the same tau never pays more
        assert advice.predict(base, 3.0, 4, 1, 9) <= advice.predict(base, 3.0, 4, 1, 5)


def test_the_bench_summary_says_dont_speculate_and_the_prediction_for_the_configuration_that_ran():
    from draftlab.bench.run import summary

    out = advice.advise([0.01], cpu_costs(), [(1, 1, 2)])
    ran = advice.predicted_vs_measured(out["candidates"], [{"num_steps": 1, "topk": 1, "num_draft_tokens": 2,
                                                             "measured_tau": 1.0, "measured_speedup": 0.8}])[0]
    report = {"speedup": 0.8, "baseline": {"tokens_per_s": {"median": 100.0}}, "spec": {"tau": 1.0, "tokens_per_s": {"median": 80.0}},
              "offline": {"tau": 1.0}, "advice": {**out, "ran": ran}}
    line = summary(report)
    assert "advice: don't speculate" in line and f"predicted {ran['predicted_speedup']:.2f}x" in line
    assert f"{100 * ran['speedup_error']:+.0f}% against measured" in line


def test_the_served_baselines_requests_give_its_step_and_fixed_cost():
    rng = random.Random(0)
    tokens = [rng.randrange(20, 129) for _ in range(32)]
    seconds = [0.040 + n * 0.012 * rng.uniform(0.98, 1.02) for n in tokens]  # 40 ms per request, 12 ms per token
    fit = fits.fit_requests(tokens, seconds)
    assert fit["server_step_s"] == pytest.approx(0.012, rel=0.03)
    assert fit["server_request_s"] == pytest.approx(0.040, abs=0.02)
    assert fits.fit_requests([64] * 10, [0.8] * 10) is None  # one length: step and fixed cost are not separable


def test_a_servers_own_work_per_step_is_paid_once_per_round():
    base = {**HAND, "tokens_per_request": math.inf}
    plain = advice.predict(base, 3.0, 2, 1, 3)
    # The served baseline needs 4 ms per step more than the engine's decode step measured here:
    served = {**base, "server_step_s": base["baseline_step_s"] + 4.0, "baseline_run_step_s": base["baseline_step_s"]}
    r = advice.round_cost(base, 2, 1, 3, 3.0)["round"]
    assert advice.server_costs(served) == (14.0, HAND.get("prefill_s", 0.0), 4.0)
    assert advice.predict(served, 3.0, 2, 1, 3) == pytest.approx(3.0 * 14.0 / (r + 4.0))
    assert advice.predict(served, 3.0, 2, 1, 3) > plain  # the baseline pays it per token, speculation per round
    # A server no slower than the engine adds nothing
    same = {**base, "server_step_s": base["baseline_step_s"], "baseline_run_step_s": base["baseline_step_s"] + 1.0}
    assert advice.predict(same, 3.0, 2, 1, 3) == pytest.approx(plain)


# --- a server's own rounds -------------------------------------------------------------------


def served_requests(round_s, tau, step_s=0.0044, request_s=0.03, lengths=(40, 64, 90, 128, 17, 75)):
    """Paired requests a server whose costs are exactly these would give (rounds yield tau tokens)."""
    base = [(n, request_s + n * step_s) for n in lengths]
    spec = [(n, round(n / tau), request_s + round(n / tau) * round_s) for n in lengths]
    return base, spec


def test_a_served_round_is_recovered_from_paired_requests():
    base, spec = served_requests(round_s=0.007, tau=4.0)
    got = fits.served_round(base, spec)
    assert got["step_s"] == pytest.approx(0.0044) and got["request_s"] == pytest.approx(0.03)
    assert got["round_s"] == pytest.approx(0.007)
    assert got["served_tau"] == pytest.approx(sum(n for n, _, _ in spec) / sum(r for _, r, _ in spec))
    assert fits.served_round([(50, 0.3)] * 4, spec) is None  # equal lengths: step and fixed cost inseparable


def test_served_advice_fits_the_rounds_predicts_held_out_configs_and_picks_the_best():
    r0, d, v = 0.005, 0.0004, 0.00005  # seconds: per round, per draft step, per verified token
    taus = {(3, 1, 4): 3.2, (5, 1, 6): 4.1, (7, 1, 8): 4.6, (5, 4, 8): 4.5, (6, 8, 32): 5.6, (8, 1, 9): 4.8}
    measured = {}
    for (s, k, w), tau in taus.items():
        if (s, k, w) != (8, 1, 9):
            measured[(s, k, w)] = fits.served_round(*served_requests(r0 + d * s + v * w, tau))
    candidates = [{"num_steps": s, "topk": k, "num_draft_tokens": w, "predicted_tau": tau} for (s, k, w), tau in taus.items()]
    out = fits.advise_served(candidates, measured)
    assert out["fit_ms"]["round_fixed"] == pytest.approx(5.0, rel=1e-6)
    assert out["fit_ms"]["per_draft_step"] == pytest.approx(0.4, rel=1e-6)
    assert out["fit_ms"]["per_verify_token"] == pytest.approx(0.05, rel=1e-6)
    rows = {(c["num_steps"], c["topk"], c["num_draft_tokens"]): c for c in out["candidates"]}
    T = sum((40, 64, 90, 128, 17, 75)) / 6
    for key, tau in taus.items():  # a config never served (8-1-9) is predicted from the fitted line
        s, _, w = key
        tau = measured[key]["served_tau"] if key in measured else tau  # a served config: the tau it served
        expect = (0.03 + T * 0.0044) / (0.03 + (T / tau) * (r0 + d * s + v * w))
        assert rows[key]["predicted_speedup"] == pytest.approx(expect, rel=1e-6)
    best = max(rows.values(), key=lambda r: r["predicted_speedup"])
    assert out["recommended"] == best and out["speculate"]
    assert len(out["held_out"]) == len(measured)  # each measured config predicted by a fit without it
    for h in out["held_out"]:
        assert h["predicted_round_ms"] == pytest.approx(h["measured_round_ms"], rel=1e-6)


def test_served_advice_says_dont_speculate_when_rounds_cost_more_than_they_yield():
    measured = {cfg: fits.served_round(*served_requests(0.02 + 0.001 * cfg[0], 1.5)) for cfg in ((3, 1, 4), (5, 1, 6), (7, 1, 8))}
    out = fits.advise_served([{"num_steps": 3, "topk": 1, "num_draft_tokens": 4, "predicted_tau": 1.5}], measured)
    assert not out["speculate"] and out["recommendation"] == advice.DONT_SPECULATE


def test_a_server_of_another_engine_scales_the_in_process_round_to_its_own():
    """SGLang's round is not the in-process one plus an overhead: the model keeps the in-process
    shape and takes its scale from the served round of the configuration that ran."""
    costs = {**HAND, "baseline_step_s": 25.0, "server_step_s": 4.5, "server_request_s": 20.0, "tokens_per_request": 68.0,
             "draft_prefill_s": 2.0}
    ran = advice.round_cost(costs, 5, 1, 6, 4.0)["round"]
    costs["offline_round_s"] = ran
    without = advice.predict(costs, 4.0, 5, 1, 6)
    assert without < 1.0  # the slow in-process round against the fast served step: "don't speculate"
    costs["round_scale"] = fits.round_scale(costs, 7.0)
    assert costs["round_scale"] == pytest.approx(7.0 / ran)
    assert advice.predict(costs, 4.0, 5, 1, 6) == pytest.approx((20 + 68 * 4.5) / (20 + 68 / 4.0 * 7.0))
    other = advice.round_cost(costs, 7, 1, 8, 4.5)["round"]  # another configuration: its in-process shape, scaled
    assert advice.predict(costs, 4.5, 7, 1, 8) == pytest.approx((20 + 68 * 4.5) / (20 + 68 / 4.5 * 7.0 * other / ran))


def test_the_advice_per_concurrency_scales_each_batch_and_names_the_crossover():
    costs = {**HAND, "baseline_step_s": 10.0, "server_step_s": 10.0, "server_request_s": 0.0}
    costs["offline_round_s"] = advice.round_cost(costs, 2, 1, 3, 2.5)["round"]
    costs["round_scale"] = 1.0
    base = [{"concurrency": 4, "throughput": 4 / 12.0}, {"concurrency": 16, "throughput": 16 / 20.0}]
    spec = [{"concurrency": 4, "throughput": 4 * 2.5 / 20.0}, {"concurrency": 16, "throughput": 16 * 2.5 / 80.0}]
    per = advice.costs_by_concurrency(costs, base, spec, tau=2.5)
    assert set(per) == {1, 4, 16} and per[1] is costs
    assert per[4]["server_step_s"] == pytest.approx(12.0)
    assert per[16]["round_scale"] == pytest.approx(80.0 / costs["offline_round_s"])
    # the configuration that ran, predicted at its own tau, gets back each batch's measured ratio
    assert advice.predict(per[4], 2.5, 2, 1, 3) == pytest.approx(12.0 * 2.5 / 20.0)
    assert advice.predict(per[16], 2.5, 2, 1, 3) == pytest.approx(20.0 * 2.5 / 80.0)
    out = advice.advise_by_concurrency([0.6, 0.5], per, [(2, 1, 3)])
    assert out["by_concurrency"][4]["speculate"] and not out["by_concurrency"][16]["speculate"]
    assert out["crossover_concurrency"] == 16


def test_prefills_measured_per_request_come_out_of_the_round_so_a_higher_tau_pays_them_over_fewer_rounds():
    """Batches made by the model itself: n in flight, T tokens a request, p_n seconds of prefill per
    admitted request, step b_n, rounds R_n with the same in-process shape for both chains. From the
    2-step chain's batches the 5-step chain comes out exact with the prefills measured, and too low
    when they are amortized into the 2-step chain's rounds (it has more rounds to charge them to)."""
    costs = {**HAND, "baseline_step_s": 10.0, "server_step_s": 10.0, "server_request_s": 0.0}
    costs["offline_round_s"] = advice.round_cost(costs, 2, 1, 3, 2.5)["round"]
    costs["round_scale"] = 1.0
    T, p, b, kappa = 80.0, {8: 30.0}, 12.0, 1.6  # prefill 30 ms per request at 8 in flight

    def tokens_per_s(n, step_or_round, tau):  # n * T tokens per slot life of n * p_n + (T / tau) * round
        return n * T / (n * p[n] + T / tau * step_or_round)

    r2 = kappa * costs["offline_round_s"]
    r5 = kappa * advice.round_cost(costs, 5, 1, 6, 3.5)["round"]
    base = [{"concurrency": 8, "throughput": tokens_per_s(8, b, 1.0)}]
    spec2 = [{"concurrency": 8, "throughput": tokens_per_s(8, r2, 2.5)}]
    measured5 = tokens_per_s(8, r5, 3.5) / base[0]["throughput"]
    per = advice.costs_by_concurrency(costs, base, spec2, tau=2.5, request_s=p, tokens_per_request=T)
    assert per[8]["server_step_s"] == pytest.approx(b) and per[8]["round_scale"] == pytest.approx(kappa)
    assert advice.predict(per[8], 3.5, 5, 1, 6) == pytest.approx(measured5)
    amortized = advice.costs_by_concurrency(costs, base, spec2, tau=2.5)
    assert advice.predict(amortized[8], 3.5, 5, 1, 6) < 0.98 * measured5
    # prefills larger than the batches allow (a bad probe): the amortized form, not a negative step
    odd = advice.costs_by_concurrency(costs, base, spec2, tau=2.5, request_s={8: 500.0}, tokens_per_request=T)
    assert odd[8]["server_step_s"] == pytest.approx(amortized[8]["server_step_s"])


def test_a_wide_verify_grows_with_requests_in_flight_where_the_matmuls_turn_compute_bound():
    """An 8B-like matmul curve: flat (weights read once) up to 128 tokens, then linear. At 16 in
    flight a 32-wide tree verifies 512 tokens where the 6-wide chain that ran verifies 96."""
    gemm = {1: 3.3, 32: 3.3, 128: 3.3, 512: 11.0}  # ms

    def f(t):
        return 3.3 if t <= 128 else 3.3 + (t - 128) * (11.0 - 3.3) / 384

    costs = {**HAND, "baseline_step_s": 10.0, "server_step_s": 10.0, "server_request_s": 0.0, "gemm_s": gemm}
    costs["offline_round_s"] = advice.round_cost(costs, 2, 1, 6, 2.5)["round"]
    costs["round_scale"] = 1.0
    base = [{"concurrency": n, "throughput": n / 12.0} for n in (4, 16)]
    spec = [{"concurrency": n, "throughput": n * 2.5 / 20.0} for n in (4, 16)]
    per = advice.costs_by_concurrency(costs, base, spec, tau=2.5, ran_width=6)
    assert advice.batch_growth(per[1], 32) == 0.0  # bs=1: the scale already holds it
    assert advice.batch_growth(per[16], 6) == 0.0  # the width that ran: measured as it is
    assert advice.batch_growth(per[4], 32) == pytest.approx(0.0)  # 128 tokens: still memory-bound
    grown = f(16 * 32) - f(16 * 6) - (f(32) - f(6))
    assert advice.batch_growth(per[16], 32) == pytest.approx(grown) and grown > 7.0
    # the tree's round at 16 in flight is the scaled one plus that growth
    scaled = advice.round_cost(per[16], 6, 8, 32, 3.0)["round"] * per[16]["round_scale"]
    assert advice.predict(per[16], 3.0, 6, 8, 32) == pytest.approx(3.0 * 12.0 / (scaled + grown))  # b_16 = 12
    # without a matmul table (or the width that ran), the advice is the scaled one, as before
    plain = advice.costs_by_concurrency({k: v for k, v in costs.items() if k != "gemm_s"}, base, spec, tau=2.5, ran_width=6)
    assert advice.predict(plain[16], 3.0, 6, 8, 32) > advice.predict(per[16], 3.0, 6, 8, 32)
    assert advice.batch_growth(advice.costs_by_concurrency(costs, base, spec, tau=2.5)[16], 32) == 0.0


def test_a_json_matmul_table_interpolates_between_and_past_its_points():
    table = {"2": 1.0, "10": 2.0, "100": 20.0}  # as bench.json holds it: string keys
    assert advice.interpolate(table, 6) == pytest.approx(1.5)
    assert advice.interpolate(table, 55) == pytest.approx(11.0)
    assert advice.interpolate(table, 190) == pytest.approx(38.0)  # past the end: the last segment's line
    assert advice.interpolate({"8": 4.0}, 100) == 4.0


def test_the_targets_matmuls_are_timed_per_token_count():
    import torch

    target = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(256, 64), torch.nn.Linear(64, 512, bias=False))
    out = offline.measure_gemm_s(target, [1, 64, 2048], repeats=3)
    assert set(out) == {1, 64, 2048} and all(t > 0 for t in out.values())
    assert out[2048] > out[1]  # 2048 rows of three matmuls cost more than one row on any device


def test_measure_costs_times_every_configuration_whole_over_a_mid_answer_cache():
    """On a micro target and an untrained draft: one whole timing of drafting + verify per
    configuration asked for, and the advice's round for it is that timing plus extend and loop."""
    from draftlab.engine import speculative
    from tests.support.drafts import random_draft
    from tests.support.micro import make_micro_model

    target = make_micro_model("llama", num_layers=4, seed=11)
    draft = random_draft(target, 3)
    prompt = [5, 9, 200, 3, 77, 12]
    context = prompt + speculative.baseline_generate(target, prompt, 10, ignore_eos=True).output_ids
    configs = [(1, 1, 2), (3, 1, 4), (2, 2, 4)]
    costs = offline.measure_costs(target, draft, context, [1, 2, 3], configs, repeats=2, prompt_len=len(prompt))
    assert set(costs["draft_verify_s"]) == {"1-1-2", "3-1-4", "2-2-4"}
    assert all(t > 0 for t in costs["draft_verify_s"].values())
    costs["loop_s"] = 0.0
    parts = advice.round_cost(costs, 3, 1, 4, 2.0)
    assert parts["round"] == pytest.approx(costs["draft_verify_s"]["3-1-4"] + parts["extend"])


def test_a_burst_of_load_on_a_few_requests_does_not_move_the_servers_per_request_cost():
    """Requests of P + T * b with P = 12 ms, b = 10 ms; five of 32 hit by a burst (3x slower). The
    prompt-only requests give P back, the medians give b back; a line through every request does not."""
    rng = random.Random(0)
    P, b = 0.012, 0.010
    tokens = [rng.randint(33, 128) for _ in range(32)]
    seconds = [P + t * b for t in tokens]
    for i in (3, 9, 14, 20, 27):
        seconds[i] *= 3.0
    prompt_only = [P + b] * 30 + [0.2, 0.3]  # the first token comes with the prefill; two probes hit too
    got = fits.probed_requests(tokens, seconds, prompt_only)
    assert got["server_step_s"] == pytest.approx(b) and got["server_request_s"] == pytest.approx(P)
    line = fits.fit_requests(tokens, seconds)
    assert abs(line["server_request_s"] - P) > 0.05 or abs(line["server_step_s"] - b) > 0.002
    assert fits.probed_requests(tokens, seconds, []) is None  # no probe: the caller falls back to the line


def test_the_reference_servers_advice_is_the_in_process_shape_at_the_served_pairs_scale():
    """Timings from one loop give every configuration's in-process speedup; the served pair of the
    configuration that ran gives one ratio. Halving every timing (a faster minute for the loop)
    changes nothing, and the per-concurrency costs keep their own scale."""
    costs = {**cpu_costs(), "draft_verify_s": {"2-1-3": 5.0 * MS, "5-1-6": 6.5 * MS}, "prefill_s": 8 * MS,
             "draft_prefill_s": 1 * MS, "tokens_per_request": 68.0, "loop_s": 3.0 * MS}
    inproc5 = advice.in_process_speedup(costs, 3.6, 5, 1, 6)
    # the loop term (calibrated on another run) is left out: 6.5 + extend, not + 3 ms
    extend = advice.round_cost(costs, 5, 1, 6, 3.6)["extend"]
    assert inproc5 == pytest.approx((8 + 68 * 2.9) / (8 + 1 + 68 / 3.6 * (6.5 + extend / MS)))
    sigma = fits.speedup_scale(costs, 1.5, 3.6, 5, 1, 6)
    scaled = {**costs, "speedup_scale": sigma}
    assert advice.predict(scaled, 3.6, 5, 1, 6) == pytest.approx(1.5)  # the configuration that ran: its measurement
    assert advice.predict(scaled, 2.4, 2, 1, 3) == pytest.approx(1.5 * advice.in_process_speedup(costs, 2.4, 2, 1, 3) / inproc5)
    def halved(v):
        return {kk: vv / 2 for kk, vv in v.items()} if isinstance(v, dict) else v / 2

    half = {k: halved(v) if k.endswith("_s") else v for k, v in costs.items()}
    half = {**half, "speedup_scale": fits.speedup_scale(half, 1.5, 3.6, 5, 1, 6)}
    assert advice.predict(half, 2.4, 2, 1, 3) == pytest.approx(advice.predict(scaled, 2.4, 2, 1, 3))
    per = advice.costs_by_concurrency({**scaled, "offline_round_s": 9 * MS}, [{"concurrency": 4, "throughput": 1000.0}],
                                      [{"concurrency": 4, "throughput": 1500.0}], 3.6, 6)
    assert "speedup_scale" not in per[4] and per[4]["round_scale"]
