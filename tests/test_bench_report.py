""""Does training pay?": the verdict, the best of each kind per concurrency, where the reports put
the table; and the NGRAM advice's algebra on noiseless synthetic pairings."""
import json
import re
import statistics
import sys
import types
from pathlib import Path

import pytest

from draftlab.bench import report, ngram_advice
from draftlab.check.diagnose import Paths, Run
from draftlab.check.report import summary_markdown

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import real_workload_report as rwr  # noqa: E402


def best(name, speedup, tau=2.0):
    return {"configuration": name, "speedup": speedup, "tau": tau, "tokens_per_s": 100.0 * speedup}


@pytest.mark.parametrize("draft,gram,pays,words", [
    (1.30, 1.10, True, r"yes: the draft 7-1-8 1\.30x, 18% above n-gram lookup ngram \(1\.10x\)"),
    (0.72, 0.84, False, r"no: n-gram lookup ngram \(0\.84x, no training\) beats the draft's best 7-1-8 \(0\.72x\) by 17%; "
                        r"neither beats the baseline$"),
    (0.90, 0.80, False, r"no: neither beats the baseline"),
    (1.20, 1.50, False, r"no: n-gram lookup ngram \(1\.50x, no training\) beats the draft's best 7-1-8 \(1\.20x\) by 25%$"),
])
def test_training_pays_when_the_draft_beats_the_baseline_and_ngram_lookup(draft, gram, pays, words):
    got, text = report.verdict(best("ngram", gram), best("7-1-8", draft))
    assert got is pays
    assert re.match(words, text)


def test_without_ngram_measured_the_table_says_how_to_measure_it():
    got, text = report.verdict(None, best("5-1-6", 1.75))
    assert got is None and "add ngram to bench.sweep" in text and "1.75x" in text


def config(name, algorithm, bs1, points):
    pooled = {"speedup": bs1, "tau": 2.0, "tokens_per_s": 100 * bs1, "baseline_tokens_per_s": 100.0, "requests": 4, "acceptance": [0.5]}
    return {"configuration": name, "algorithm": algorithm, "pooled": pooled, "by_category": {}, "by_turn": {"1": pooled},
            "concurrency": [{"concurrency": n, "speedup": s, "tau": 2.0, "tokens_per_s": 300.0 * s, "baseline_tokens_per_s": 300.0 + n}
                            for n, s in points.items()]}


def test_the_best_of_each_kind_is_picked_at_each_concurrency_on_its_own():
    configs = [config("3-1-4", "EAGLE3", 0.66, {8: 0.80}), config("7-1-8", "EAGLE3", 0.72, {8: 0.70}),
               config("ngram", "NGRAM", 0.84, {8: 0.75}), config("ngram-4-1", "NGRAM", 0.74, {8: 0.90})]
    rows = report.training_pays(configs)
    assert [r["concurrency"] for r in rows] == [1, 8]
    assert [(r["best_draft"]["configuration"], r["best_ngram"]["configuration"]) for r in rows] == [("7-1-8", "ngram"), ("3-1-4", "ngram-4-1")]
    assert [r["baseline_tokens_per_s"] for r in rows] == [100.0, 308.0]  # spec.*'s pairing's baseline
    assert [r["training_pays"] for r in rows] == [False, False]
    md = report.headline_markdown(rows)
    assert "| 1 | 100.0 | ngram: tau 2.00, 0.84x | 7-1-8: tau 2.00, 0.72x | no: n-gram lookup ngram (0.84x" in md
    assert report.verdict_line(rows) == "bs=1: no (draft 0.72x, n-gram 0.84x), 8 in flight: no (draft 0.80x, n-gram 0.90x)"


def test_the_run_summary_leads_with_the_table():
    rows = report.training_pays([config("5-1-6", "EAGLE3", 1.75, {}), config("ngram", "NGRAM", 1.10, {})])
    bench = {"prompt_sets": [{"name": "heldout", "requests": 32, "training_pays": rows}]}
    run = Run(Paths())
    run.bench = bench
    md = summary_markdown(run, [], "c0ffee", Path("reports"))
    assert md.index("## Does training pay? (heldout: 32 requests)") < md.index("## What ran")
    assert "yes: the draft 5-1-6 1.75x, 59% above n-gram lookup ngram (1.10x)" in md


def test_the_real_workload_report_sets_the_held_out_set_against_the_earlier_measurement():
    rows = report.training_pays([config("3-1-4", "EAGLE3", 0.70, {}), config("ngram", "NGRAM", 0.90, {})])
    bench = {"prompt_sets": [{"name": "heldout", "conversations": 32, "requests": 32, "turns": 1, "training_pays": rows,
                              "configurations": [config("3-1-4", "EAGLE3", 0.70, {}), config("ngram", "NGRAM", 0.90, {})]}]}
    md = "\n".join(rwr.training_pays_md(bench))
    assert md.startswith("## Does training pay?")
    assert "| 3-1-4 | 2.000 | 1.830 | 0.700 | 0.660 |" in md and "| ngram | 2.000 | 2.060 | 0.900 | 0.840 |" in md


def test_the_real_workload_report_shows_the_learning_curve_epoch_by_epoch(tmp_path):
    plots = tmp_path / "reports/train/plots"
    plots.mkdir(parents=True)
    (plots / "loss.tsv").write_text("epoch\ttrain_loss\teval_loss\n1\t9.5\t4.25\n2\t3.5\t3.125\n")
    (plots / "accept.tsv").write_text("epoch\taccept_1\taccept_2\ttau_pred\n1\t0.6\t0.5\t1.9\n2\t0.7\t0.6\t2.12\n")
    md = "\n".join(rwr.learning_curve_md(tmp_path))
    assert "| 1 | 9.500 | 4.250 | 0.600 | 1.900 |" in md and "| 2 | 3.500 | 3.125 | 0.700 | 2.120 |" in md
    assert rwr.learning_curve_md(tmp_path / "elsewhere") == []  # a run without the plot files: no section


def test_the_real_workload_report_says_when_a_resumed_runs_rates_count_only_its_last_steps():
    assert "from step 2800 on" in rwr.counted_from({"from_step": 2800, "tokens_per_s": 1.0}, 3954)
    # a manifest from before from_step: the meter counted 1154 of the run's 3954 steps
    assert "from step 2800 on" in rwr.counted_from({"steps": 1154, "tokens_per_s": 1.0}, 3954)
    assert rwr.counted_from({"from_step": 0, "steps": 3954}, 3954) == rwr.counted_from({}, 3954) == ""  # a whole run


def test_the_real_workload_report_gives_the_rate_of_the_steps_its_meter_counted(tmp_path):
    """A run resumed from a checkpoint without counters, by a train stage that counted the refill's
    tokens in its metrics' rate: the report takes the meter's rate of the steps it ran, and says none
    for a kind of step it did not run."""
    (tmp_path / "params.yaml").write_text("spec: {num_steps: 3}\n")
    (tmp_path / "reports/train").mkdir(parents=True)
    (tmp_path / "reports/train/metrics.json").write_text(json.dumps(
        {"epochs": 6, "optimizer_steps": 3954, "tokens_per_s": 198836.3, "mfu": 0.07}))
    (tmp_path / "models/draft-ckpt").mkdir(parents=True)
    (tmp_path / "models/draft-ckpt/manifest.json").write_text(json.dumps({"info": {"throughput": {
        "steps": 1154, "tokens": 37414490, "tokens_per_s": 126559.8,
        "by_states": {"cached": {"steps": 1154, "tokens_per_s": 126559.8}, "computed": {"steps": 0, "tokens_per_s": None}}}}}))
    md = rwr.results_md(tmp_path, {}, tmp_path / "out", {})
    assert ("6 epochs, 3954 steps at 126559.8 tok/s (the steps from step 2800 on: a resumed run whose checkpoint held "
            "no counters)") in md
    assert "steps with the target none, from the cache 126559.8 tok/s" in md and "198836" not in md


def test_the_real_workload_report_splits_step1_acceptance_by_kind_and_position():
    train = {"step1_by_kind": {"loop": {"tokens": 40, "a_1": 0.95}, "other": {"tokens": 160, "a_1": 0.6}},
             "step1_by_position": {"0-63": {"tokens": 120, "a_1": 0.62}, "512+": {"tokens": 0, "a_1": None}}}
    md = "\n".join(rwr.step1_md(train))
    assert "| loop tokens | 40 | 0.950 |" in md and "| other tokens | 160 | 0.600 |" in md
    assert "| positions 0-63 | 120 | 0.620 |" in md and "| positions 512+ | 0 |" in md
    assert rwr.step1_md({"tau_pred": 2.0}) == []  # metrics of a run before the split: no section
    # A run with the split by turn and the first turns' decoded tau: both shown
    train |= {"step1_by_turn": {"1": {"tokens": 80, "a_1": 0.5}, "2": {"tokens": 70, "a_1": 0.7}, "3+": {"tokens": 50, "a_1": 0.8}},
              "tau_decoded_by_steps": {"steps_1": 1.7, "steps_2": 2.1}, "tau_decoded_first_turns_by_steps": {"steps_1": 1.5, "steps_2": 1.8}}
    md = "\n".join(rwr.step1_md(train))
    assert "| turn 1 | 80 | 0.500 |" in md and "| turn 3+ | 50 | 0.800 |" in md
    assert "| every turn | 1.700 | 2.100 |" in md and "| first turns | 1.500 | 1.800 |" in md and "depth 2" in md


# --- the NGRAM advice ----------------------------------------------------------------------------

LENGTHS = [56, 60, 64, 68, 72]  # completion tokens of the 5 requests (the median request: 64, the mean 64)


def pairing(name, key, tau, P, b, R):
    """A noiseless pairing: a baseline request costs P + T * b, a speculative one P + (T / tau) * R."""
    base_s = [P + t * b for t in LENGTHS]
    spec_s = [P + (t / tau) * R for t in LENGTHS]
    base = {"metas": [{"completion_tokens": t} for t in LENGTHS], "request_seconds": base_s, "prompt_only_seconds": [P + b] * 5,
            "speed": {"median": statistics.median(t / s for t, s in zip(LENGTHS, base_s))}, "sweep": []}
    spec = {"metas": [{"completion_tokens": t, "spec_verify_ct": t / tau} for t in LENGTHS], "request_seconds": spec_s,
            "spec": {"tau": tau, "acceptance": [0.6, 0.5, 0.4]}, "speed": {"median": statistics.median(t / s for t, s in zip(LENGTHS, spec_s))},
            "sweep": []}
    return types.SimpleNamespace(configuration=types.SimpleNamespace(key=key, name=name, ngram=True), baseline=base, spec=spec)


COSTS = {"ngram_round_s": {"4-1": 0.010, "3-1": 0.009, "2-1": 0.008, "12-10": 0.014}, "ngram_decode_step_s": 0.006,
         "ngram_prefill_s": 0.02, "tokens_per_request": 64}
DRAFT = [{"num_steps": 3, "topk": 1, "num_draft_tokens": 4, "predicted_speedup": 0.70, "extrapolated": False},
         {"num_steps": 8, "topk": 1, "num_draft_tokens": 9, "predicted_speedup": 5.0, "extrapolated": True}]


def test_the_sglang_round_is_a_verify_and_a_lookup_scaled_on_the_measured_pairing():
    kappa = 0.25  # the served round / the in-process round of the calibrating pairing
    chain = pairing("ngram-4-1", ("NGRAM", 4, 1), 2.0, P=0.01, b=0.004, R=kappa * 0.010)
    tree = pairing("ngram", ("NGRAM", 12, 10), 2.5, P=0.01, b=0.004, R=kappa * 0.014)
    got = ngram_advice.advise("sglang", [chain, tree], COSTS, DRAFT)
    rep = got["report"]
    assert rep["calibrated_on"] == "ngram-4-1" and rep["scale"]["kappa"] == pytest.approx(kappa)
    for row in rep["predicted_vs_measured"]:  # its own exactly, and the other from it: the same round model
        assert row["speedup_error"] == pytest.approx(0.0, abs=1e-9)
    assert all(h["speedup_error"] == pytest.approx(0.0, abs=1e-9) for h in rep["held_out"])
    taus = {c["configuration"]: c["predicted_tau"] for c in rep["candidates"]}
    assert taus["ngram-3-1"] == pytest.approx(1 + 0.6 + 0.3) and taus["ngram-2-1"] == pytest.approx(1.6)  # from the chain's a_i
    by = {c["configuration"]: c for c in rep["candidates"]}
    assert by["ngram-3-1"]["tau_from"] == "acceptance of ngram-4-1"
    vs = rep["versus_draft"]  # the draft's extrapolated 8-step chain is not the draft's best
    top = max(c["predicted_speedup"] for c in rep["candidates"])
    assert vs["best_draft"] == "3-1-4" and vs["best_ngram_predicted_speedup"] == pytest.approx(top)
    assert vs["winner"] == "ngram" and f"by {100 * (top / 0.70 - 1):.0f}%" in vs["text"]
    adv = ngram_advice.advice_text({"advice": "don't speculate"}, got)
    assert adv == "don't speculate; " + vs["text"]


def test_the_reference_server_scales_the_in_process_speedup_by_the_measured_pairing():
    chain = pairing("ngram-4-1", ("NGRAM", 4, 1), 2.0, P=0.01, b=0.004, R=0.003)
    got = ngram_advice.advise("reference", [chain], COSTS, DRAFT)["report"]
    (row,) = got["predicted_vs_measured"]
    assert row["speedup_error"] == pytest.approx(0.0, abs=1e-9)
    inproc = ngram_advice.in_process_speedup(COSTS, 2.0, ("NGRAM", 4, 1))
    assert got["scale"]["sigma"] == pytest.approx(row["measured_speedup"] / inproc)
    assert inproc == pytest.approx((0.02 + 64 * 0.006) / (0.02 + 32 * 0.010))  # (P + T e) / (P + (T / tau) round)


def test_without_an_ngram_pairing_there_is_no_ngram_advice():
    got = ngram_advice.advise("sglang", [], COSTS, DRAFT)
    assert got == {"report": None, "by_key": {}, "by_concurrency_key": {}}
    assert ngram_advice.advice_text({"advice": "num_steps=5 (predicted 1.8x)"}, got) == "num_steps=5 (predicted 1.8x)"


def test_the_real_workload_report_names_where_the_traced_training_steps_spent_their_time(tmp_path):
    (tmp_path / "reports/train").mkdir(parents=True)
    assert rwr.step_profile_md(tmp_path) == []  # a run that traced no steps: no line
    (tmp_path / "reports/train/step-profile.json").write_text(json.dumps({
        "steps": [150, 152], "wall_s_per_step": 0.4114, "gpu_busy_share": 0.6461,
        "host_self_time": [{"name": "aten::_cudnn_attention_forward", "ms_per_step": 109.11, "calls_per_step": 80.0}],
        "gpu_kernel_time": [{"name": "aten::mm", "ms_per_step": 46.37, "calls_per_step": 738.0}]}))
    md = "\n".join(rwr.step_profile_md(tmp_path))
    assert "steps 150-152 traced" in md and "411 ms a step, the GPU busy 64.6% of it" in md
    assert "`aten::_cudnn_attention_forward` 109.11 ms (80.0 calls)" in md and "`aten::mm` 46.37 ms" in md
