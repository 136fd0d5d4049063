"""draftlab exp report: a recipe study's runs side by side (draftlab/experiments/study.py)."""
import json
from pathlib import Path

import pandas as pd
import pytest
import yaml

from draftlab.errors import UserError
from draftlab.experiments import study
from draftlab.main import main


def write_run(folder: Path, epochs: int, turns=None, answer_tokens=1000, curve=(1.5, 1.8, 2.0), bench=None, lr=0.001, seed=0,
              answers="ab12cd34ef", losses=None, eval_rows=48):
    """A run's kept files (grid.KEPT): params, train metrics and manifest history, extract counts, the bench."""
    folder.mkdir(parents=True)
    params = {"spec": {"num_steps": 3, "topk": 1}, "train": {"epochs": epochs, "lr": lr, "ttt_steps": 3, "seed": seed},
              "extract": {"train_turns": turns, "loop_tokens": "learn"}, "standardize": {"draft_vocab_size": 16384},
              "synth": {"max_new_tokens": 256}, "prompts": {"leading_assistant": "skip"}}
    (folder / "params.yaml").write_text(yaml.safe_dump(params))
    history = [{"epoch": e + 1, "eval_tau_decoded_first_turns_by_steps": [t - 0.4, t - 0.2, t]} for e, t in enumerate(curve)]
    (folder / "models/draft-ckpt").mkdir(parents=True)
    (folder / "models/draft-ckpt/manifest.json").write_text(json.dumps({"config_hash": "t", "info": {"history": history}}))
    (folder / "reports/train").mkdir(parents=True)
    (folder / "reports/train/metrics.json").write_text(json.dumps({
        "tau_pred": curve[-1] + 0.5, "accept": {"step_1": 0.7}, "seconds": 100.0, "tokens_per_s": 1e5,
        "tau_decoded_first_turns_by_steps": {"steps_3": curve[-1]},
        "step1_by_kind": {"loop": {"tokens": 10, "a_1": 0.8}, "other": {"tokens": 20, "a_1": 0.5}},
        "step1_by_position": {"0-63": {"tokens": 30, "a_1": 0.6}},
        **({"train_loss": losses[0], "eval_loss": losses[1], "optimizer_steps": answer_tokens // 10} if losses else {})}))
    (folder / "data/hidden").mkdir(parents=True)
    (folder / "data/hidden/manifest.json").write_text(json.dumps(
        {"config_hash": "x", "info": {"counts": {"train": {"rows": answer_tokens // 100, "answer_tokens": answer_tokens},
                                                 "eval": {"rows": eval_rows, "answer_tokens": 40 * eval_rows}}}}))
    (folder / "data/synth").mkdir(parents=True)  # which synthesis made the answers: train.jsonl's hash
    (folder / "data/synth/manifest.json").write_text(json.dumps(
        {"config_hash": "s", "info": {"files": {"train.jsonl": {"rows": 9, "sha256": answers}}}}))
    if bench:
        (folder / "reports/bench.json").write_text(json.dumps(bench))


def bench(draft_tau, ngram_taus=(2.1, 1.8)):
    def conf(name, algorithm, tau, speedup):
        return {"configuration": name, "algorithm": algorithm,
                "pooled": {"tau": tau, "speedup": speedup, "acceptance": [0.6, 0.5, 0.4]},
                "concurrency": [{"concurrency": 8, "tau": tau - 0.05, "speedup": speedup - 0.1}]}
    return {"config_hash": "h", "settings": {"num_steps": 3, "topk": 1, "num_draft_tokens": 4}, "offline_tau": draft_tau - 0.03,
            "offline": {"step1_by_kind": {"loop": {"rounds": 5, "a_1": 0.7}}},
            "prompt_sets": [{"name": "heldout", "configurations": [conf("3-1-4", "EAGLE3", draft_tau, 0.8),
                                                                    conf("7-1-8", "EAGLE3", draft_tau + 0.3, 0.7),
                                                                    conf("ngram-4-1", "NGRAM", ngram_taus[1], 0.7),
                                                                    conf("ngram", "NGRAM", ngram_taus[0], 0.81)]}]}


def test_runs_are_set_side_by_side_with_a_table_per_treatment_and_the_curves(tmp_path):
    write_run(tmp_path / "base", 3, bench=bench(2.0))
    write_run(tmp_path / "runs/01-epochs=8", 8, curve=(1.5, 1.8, 2.0, 2.1, 2.2, 2.3, 2.35, 2.4), bench=bench(2.4))
    write_run(tmp_path / "runs/02-train_turns=1", 3, turns=1, answer_tokens=250, curve=(1.4, 1.6, 1.7))
    write_run(tmp_path / "runs/03-lr=0.003-epochs=8", 8, lr=0.003)  # two keys from the base, one from 01-epochs=8
    write_run(tmp_path / "runs/04-lr=0.01.tmp", 3, lr=0.01)  # a point cut short while it was being kept: not a run
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as done:
        main(["exp", "report", str(tmp_path / "base"), str(tmp_path / "runs"), "--out", str(out)])
    assert done.value.code == 0

    rows = pd.read_csv(out / "points.csv")
    assert list(rows["run"]) == ["base", "01-epochs=8", "02-train_turns=1", "03-lr=0.003-epochs=8"]  # a grid's folder: its points
    first = rows.iloc[0]
    assert first["decoded tau first turns"] == 2.0 and first["heldout draft tau"] == 2.0
    assert first["heldout ngram tau"] == 2.1 and first["heldout ngram speedup"] == 0.81  # the best n-gram by tau, not the first
    assert first["heldout ngram speedup at 8"] == pytest.approx(0.71)  # its own figures in flight
    assert first["heldout draft tau at 8"] == pytest.approx(1.95)  # the draft at spec.* (3-1-4), not the sweep's 7-1-8
    assert pd.isna(rows.iloc[2]["heldout draft tau"])  # trained only (--until train): nothing served
    md = (out / "results.md").read_text()
    epochs_table = md.split("## Treatment: epochs")[1].split("## ")[0]
    assert "| base | 3 |" in epochs_table and "| 01-epochs=8 | 8 |" in epochs_table and "03-lr" not in epochs_table
    turns_table = md.split("## Treatment: train_turns")[1].split("## ")[0]
    assert "02-train_turns=1" in turns_table and "01-epochs" not in turns_table
    # the lr run also changed epochs: its treatment is against the run one key away, and says so
    lr_table = md.split("## Treatment: lr, against `01-epochs=8`")[1].split("## ")[0]
    assert "| 01-epochs=8 | 0.001 |" in lr_table and "| 03-lr=0.003-epochs=8 | 0.003 |" in lr_table and "| base |" not in lr_table
    assert md.index("## Treatment: epochs") < md.index("## Treatment: lr")  # the base's own treatments first
    # the data's treatment by the answer tokens each run trained on: 1.7 at 250 tokens, 2.0 at 1000 (null: every turn)
    assert f"per doubling of train answer tokens (least squares over these runs, which span 2.00 doublings): {0.3 / 2:+.3f}." \
        in turns_table
    # decoded tau 2.0 at 3 epochs, 2.4 at 8: per doubling of epochs, 0.4 / log2(8/3)
    assert f"per doubling of epochs (least squares over these runs, which span 1.42 doublings): {0.4 / 1.415:+.3f}." in md
    assert "not told apart from none" not in md  # no seeds' spread measured: nothing to tell it apart from
    assert "| epoch | 1 | 2 | 3 | 4 | 5 | 6 | 7 | 8 |" in md  # the epoch curve of the 8-epoch run
    assert "| loop tokens | 10 | 0.800 | 5 | 0.700 |" in md  # the base's step-1 split beside its offline rounds
    assert (out / "epochs.png").stat().st_size > 0 and (out / "data.png").stat().st_size > 0


def test_bad_runs_and_bases_are_named(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="empty: neither a run"):
        study.report([tmp_path / "empty"], tmp_path / "out")
    write_run(tmp_path / "a", 3)
    with pytest.raises(UserError, match="--base b: no run of that name; the runs are a"):
        study.report([tmp_path / "a"], tmp_path / "out", base="b")


def test_slope_needs_two_sizes():
    assert study.slope_per_doubling([4, 4], [2.0, 2.1]) is None
    assert study.slope_per_doubling([1, 2, 4], [1.0, 1.5, 2.0]) == pytest.approx(0.5)


def test_a_committed_real_workload_report_folder_is_read_as_a_run(tmp_path):
    """tools/real_workload_report.py's folder: metrics.json, bench.json, decoded.tsv and stage-counts.json at its top."""
    write_run(tmp_path / "run", 3, bench=bench(2.0))
    folder = tmp_path / "committed"
    folder.mkdir()
    (folder / "params.yaml").write_text((tmp_path / "run/params.yaml").read_text())
    (folder / "metrics.json").write_text((tmp_path / "run/reports/train/metrics.json").read_text())
    (folder / "bench.json").write_text((tmp_path / "run/reports/bench.json").read_text())
    (folder / "decoded.tsv").write_text("epoch\tfirst_turns_1\tfirst_turns_2\tfirst_turns_3\n1\t1.1\t1.3\t1.5\n2\t1.2\t1.5\t1.9\n")
    (folder / "stage-counts.json").write_text(json.dumps({"extract": {"counts": {"train": {"rows": 7, "answer_tokens": 700}}}}))
    row = study.point(folder)
    assert row["heldout draft tau"] == 2.0 and row["train answer tokens"] == 700 and row["train conversations"] == 7
    assert study.markdown(pd.DataFrame([row]).astype({"train answer tokens": "Int64"}), ["train answer tokens"]).endswith("| 700 |")
    assert study.decoded_curve(folder, 3) == [(1, 1.5), (2, 1.9)]
    older = tmp_path / "older"  # a report from before decoded.tsv: its last epoch's figure alone
    older.mkdir()
    for name in ("params.yaml", "metrics.json", "bench.json"):
        (older / name).write_text((folder / name).read_text())
    params = yaml.safe_load((older / "params.yaml").read_text())
    del params["prompts"]["leading_assistant"]  # from before the key: it did what the key's default does
    (older / "params.yaml").write_text(yaml.safe_dump(params))
    assert study.point(older)["leading_assistant"] == "skip"
    study.report([older, folder], tmp_path / "out")
    assert not (tmp_path / "out/data.png").exists()  # one data size: no data curve
    assert "## After each epoch: older\n\n| epoch | 3 |" in (tmp_path / "out/results.md").read_text()


def test_a_damaged_file_of_a_run_is_named_not_read_as_missing(tmp_path):
    write_run(tmp_path / "a", 3)
    (tmp_path / "a/reports/train/metrics.json").write_text("{not json")
    with pytest.raises(UserError, match=r"a/reports/train/metrics.json: not valid JSON"):
        study.report([tmp_path / "a"], tmp_path / "out")


def test_a_run_stopped_before_the_bench_is_not_credited_with_an_earlier_runs_serving(tmp_path):
    # --until train in a checkout: the bench files there served another export
    write_run(tmp_path / "trained-only", 8, bench=bench(3.5))
    (tmp_path / "trained-only/reports/bench").mkdir()
    (tmp_path / "trained-only/reports/bench/manifest.json").write_text(json.dumps(
        {"stage": "bench", "config_hash": "h", "inputs": {"export": "an-earlier-export"}}))
    row = study.point(tmp_path / "trained-only")
    assert row["decoded tau first turns"] == 2.0 and "heldout draft tau" not in row and "offline tau" not in row
    # the same run once its own export was served: credited
    (tmp_path / "trained-only/models/draft").mkdir()
    (tmp_path / "trained-only/models/draft/manifest.json").write_text(json.dumps(
        {"config_hash": "an-earlier-export", "inputs": {"train": "t"}}))
    assert study.point(tmp_path / "trained-only")["heldout draft tau"] == 3.5


def test_the_data_curve_sets_only_runs_that_differ_in_their_data(tmp_path):
    # the same data made again on another GPU (a few tokens more) and an lr point: no data treatment
    write_run(tmp_path / "a", 8, answer_tokens=1000)
    write_run(tmp_path / "b", 8, answer_tokens=1003, lr=0.002)
    write_run(tmp_path / "c", 8, answer_tokens=1004)
    study.report([tmp_path / "a", tmp_path / "b", tmp_path / "c"], tmp_path / "out")
    assert not (tmp_path / "out/data.png").exists()
    write_run(tmp_path / "d", 8, turns=1, answer_tokens=250)  # the first turns of the same conversations: a data point
    study.report([tmp_path / "a", tmp_path / "b", tmp_path / "c", tmp_path / "d"], tmp_path / "out")
    assert (tmp_path / "out/data.png").stat().st_size > 0


def lineage(root, chain):
    """Manifests under root: chain is [(path, config_hash, {input: hash})]."""
    for rel, h, inputs in chain:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(json.dumps({"config_hash": h, "inputs": inputs}))


FULL = [("models/draft-ckpt/manifest.json", "c1", {}), ("models/draft/manifest.json", "e1", {"train": "c1"}),
        ("reports/bench/manifest.json", "b1", {"export": "e1"}), ("reports/check.json", "k1", {"bench": "b1"})]


def test_a_run_that_made_every_stage_owns_its_export_bench_and_check(tmp_path):
    lineage(tmp_path, FULL)
    assert study.earlier_runs(tmp_path) == {}
    assert study.earlier_runs(tmp_path / "nothing-here") == {}


def test_a_run_stopped_after_training_names_the_earlier_runs_bench_and_check(tmp_path):
    # run-stages --until train in a checkout: a new checkpoint, the committed bench and check of another export
    lineage(tmp_path, [("models/draft-ckpt/manifest.json", "c2", {})] + FULL[2:])
    why = study.earlier_runs(tmp_path)
    assert set(why) == {"bench", "check"} and "reports/bench/" in why["bench"] and "stopped before it" in why["bench"]
    # the same with the earlier export still there: all three are the earlier run's
    lineage(tmp_path, [("models/draft-ckpt/manifest.json", "c2", {})] + FULL[1:])
    assert set(study.earlier_runs(tmp_path)) == {"export", "bench", "check"}
    # a bench re-run on this run's export, its check not yet: only the check
    lineage(tmp_path, FULL[:3])
    (tmp_path / "reports/check.json").write_text(json.dumps({"config_hash": "k0", "inputs": {"bench": "b0"}}))
    assert set(study.earlier_runs(tmp_path)) == {"check"}


def test_outputs_that_name_no_upstream_are_taken_as_the_runs_own(tmp_path):
    # a bench manifest without inputs (hand-made, or a report folder's copies): nothing to tell it by
    lineage(tmp_path, [("models/draft-ckpt/manifest.json", "c1", {})])
    (tmp_path / "reports/bench").mkdir(parents=True)
    (tmp_path / "reports/bench/manifest.json").write_text(json.dumps({"stage": "bench", "config_hash": "x"}))
    (tmp_path / "reports/bench.json").write_text("{}")
    assert study.earlier_runs(tmp_path) == {}


def test_the_spread_between_seeds_is_measured_and_names_the_treatments_inside_it(tmp_path):
    write_run(tmp_path / "base", 8, curve=(2.0, 2.5))
    write_run(tmp_path / "lr-hi", 8, curve=(2.0, 2.53), lr=0.002)  # +0.03: inside a 0.05 spread
    write_run(tmp_path / "lr-lo", 8, curve=(2.0, 2.3), lr=0.0005)  # -0.20: outside it
    study.report([tmp_path / n for n in ("base", "lr-hi", "lr-lo")], tmp_path / "out")
    md = (tmp_path / "out/results.md").read_text()
    assert "## Spread between seeds\n\nNot measured" in md and "the spread between seeds is not measured" in md
    write_run(tmp_path / "seed-1", 8, curve=(2.0, 2.45), seed=1)  # the base's recipe, another seed: 0.05 apart
    study.report([tmp_path / n for n in ("base", "lr-hi", "lr-lo", "seed-1")], tmp_path / "out")
    md = (tmp_path / "out/results.md").read_text()
    spread = md.split("## Spread between seeds")[1].split("## Treatment")[0]
    assert "| base | 0 | 2.500 |" in spread and "| seed-1 | 1 | 2.450 |" in spread and "seeds of one recipe: 0.050" in spread
    lr = md.split("## Treatment: lr")[1].split("## ")[0]
    assert "not told apart from it: lr-hi (+0.030)." in lr and "lr-lo" not in lr.split("Within")[1]


def test_runs_on_answers_of_another_synthesis_are_told_apart(tmp_path):
    write_run(tmp_path / "base", 8, curve=(2.0, 2.5))
    write_run(tmp_path / "lr-same-answers", 8, curve=(2.0, 2.6), lr=0.002)
    study.report([tmp_path / "base", tmp_path / "lr-same-answers"], tmp_path / "out")
    md = (tmp_path / "out/results.md").read_text()
    assert "| ab12cd34 |" in md and "different synthesis runs" not in md
    assert pd.read_csv(tmp_path / "out/points.csv")["answers"].tolist() == ["ab12cd34", "ab12cd34"]
    write_run(tmp_path / "lr-new-answers", 8, curve=(2.0, 2.6), lr=0.004, answers="99ff00aa11")  # synthesized again
    study.report([tmp_path / "base", tmp_path / "lr-new-answers"], tmp_path / "out")
    lr = (tmp_path / "out/results.md").read_text().split("## Treatment: lr")[1]
    assert "| 99ff00aa |" in lr and "answers of different synthesis runs" in lr


def test_self_prompts_are_a_data_treatment_whose_new_answers_are_the_point(tmp_path):
    """self_prompts.count adds prompts, so its runs' train.jsonl differ by design: no note about mixed syntheses,
    a slope per doubling of the training tokens, and data.png."""
    write_run(tmp_path / "base", 8, curve=(2.0, 2.5), answer_tokens=1000)
    write_run(tmp_path / "more", 8, curve=(2.0, 2.6), answer_tokens=2000, answers="77aa00bb11")
    params = yaml.safe_load((tmp_path / "more/params.yaml").read_text())
    (tmp_path / "more/params.yaml").write_text(yaml.safe_dump({**params, "self_prompts": {"count": 20000}}))
    study.report([tmp_path / "base", tmp_path / "more"], tmp_path / "out")
    md = (tmp_path / "out/results.md").read_text()
    count = md.split("## Treatment: self_prompts")[1]
    assert "| base | 0 |" in count and "| more | 20000 |" in count and "different synthesis runs" not in count
    assert "per doubling" in count and (tmp_path / "out/data.png").exists()


def test_a_treatment_whose_runs_hold_out_other_conversations_says_so(tmp_path):
    """prompts.leading_assistant drop adds conversations to the eval share too: the decoded tau of its runs is over
    other conversations, and the report says so where they are compared (and not where the eval splits agree)."""
    write_run(tmp_path / "base", 8, curve=(2.0, 2.5), answer_tokens=1000, bench=bench(2.4))
    write_run(tmp_path / "drop", 8, curve=(2.0, 2.6), answer_tokens=1500, answers="77aa00bb11", eval_rows=73,
              bench=bench(2.45))
    params = yaml.safe_load((tmp_path / "drop/params.yaml").read_text())
    (tmp_path / "drop/params.yaml").write_text(yaml.safe_dump({**params, "prompts": {"leading_assistant": "drop"}}))
    write_run(tmp_path / "lr", 8, curve=(2.0, 2.55), lr=0.002)
    study.report([tmp_path / "base", tmp_path / "drop", tmp_path / "lr"], tmp_path / "out")
    md = (tmp_path / "out/results.md").read_text()
    drop = md.split("## Treatment: leading_assistant")[1].split("## ")[0]
    assert "| drop | drop | 77aa00bb | 1500 | 73 |" in drop and "eval splits differ" in drop
    assert "eval splits differ" not in md.split("## Treatment: lr")[1].split("## ")[0]
    assert pd.read_csv(tmp_path / "out/points.csv")["eval conversations"].tolist() == [48, 73, 48]


def test_a_size_slope_says_how_many_doublings_it_spans_and_when_every_run_is_within_the_seeds_spread(tmp_path):
    """A slope over a quarter of a doubling magnifies noise: the line says the span, and that the slope is not told
    apart from none when each run's difference from the base is within the seeds' spread."""
    write_run(tmp_path / "base", 8, curve=(2.0, 2.50), answer_tokens=1000)
    write_run(tmp_path / "base-seed1", 8, curve=(2.0, 2.40), answer_tokens=1000, seed=1)  # spread 0.10
    write_run(tmp_path / "more", 8, curve=(2.0, 2.45), answer_tokens=1200, answers="77aa00bb11")
    params = yaml.safe_load((tmp_path / "more/params.yaml").read_text())
    (tmp_path / "more/params.yaml").write_text(yaml.safe_dump({**params, "self_prompts": {"count": 480}}))
    study.report([tmp_path / "base", tmp_path / "base-seed1", tmp_path / "more"], tmp_path / "out")
    table = (tmp_path / "out/results.md").read_text().split("## Treatment: self_prompts")[1].split("## ")[0]
    assert "which span 0.26 doublings): -0.190." in table
    assert "Every run lies within the seeds' spread of the base, so the slope is not told apart from none." in table

    write_run(tmp_path / "much-more", 8, curve=(2.0, 2.80), answer_tokens=4000, answers="88aa00bb11")
    params = yaml.safe_load((tmp_path / "much-more/params.yaml").read_text())
    (tmp_path / "much-more/params.yaml").write_text(yaml.safe_dump({**params, "self_prompts": {"count": 9000}}))
    study.report([tmp_path / "base", tmp_path / "base-seed1", tmp_path / "more", tmp_path / "much-more"], tmp_path / "out")
    table = (tmp_path / "out/results.md").read_text().split("## Treatment: self_prompts")[1].split("## ")[0]
    assert "which span 2.00 doublings)" in table and "not told apart from none" not in table  # +0.30 stands out


def test_a_data_curve_at_another_setting_is_measured_against_its_own_point_and_says_if_it_still_rises(tmp_path):
    """A data curve run at a higher lr than the base's (each run two keys from the base) is still a treatment: its
    differences are taken from its full-data run, and the gain between its two largest sizes is set beside the
    seeds' spread, the question of whether more prompts would pay."""
    write_run(tmp_path / "base", 8, curve=(2.0, 2.5), answer_tokens=8000)
    write_run(tmp_path / "lr-hi", 8, curve=(2.0, 2.6), answer_tokens=8000, lr=0.002)
    for name, turns, tokens, tau, seed in (("quarter", 2000, 2000, 1.8, 0), ("quarter-seed-1", 2000, 2000, 1.85, 1),
                                           ("half", 4000, 4000, 2.3, 0)):
        write_run(tmp_path / name, 8, curve=(1.5, tau), turns=turns, answer_tokens=tokens, lr=0.002, seed=seed,
                  losses=(5.0, 8.5 if turns == 2000 else 7.0))
    study.report([tmp_path / n for n in ("base", "lr-hi", "quarter", "quarter-seed-1", "half")], tmp_path / "out", base="base")
    md = (tmp_path / "out/results.md").read_text()
    data = md.split("## Treatment: train_turns, against `lr-hi`")[1].split("## ")[0]
    assert "| quarter | 2000 |" in data and "| half | 4000 |" in data and "| lr-hi | null |" in data
    assert "quarter-seed-1" not in data  # another seed: the spread's, not the curve's
    # 1.8 at 2000 tokens, 2.3 at 4000, 2.6 at 8000: the top doubling gained 0.3, more than the seeds' 0.05
    assert "Between the two largest train answer tokens (4,000 and 8,000): +0.300 per doubling. Still rising at the top" in data
    assert "seeds of one recipe: 0.050" in md
    assert (tmp_path / "out/data.png").stat().st_size > 0
    # each run's steps and loss gap beside it: the quarter trained fewer steps, and its eval loss sits further above
    rows = pd.read_csv(tmp_path / "out/points.csv").set_index("run")
    assert rows.loc["quarter", "optimizer steps"] == 200 and rows.loc["half", "optimizer steps"] == 400
    assert rows.loc["quarter", "eval/train loss"] == pytest.approx(1.7) and rows.loc["half", "eval/train loss"] == pytest.approx(1.4)
    assert pd.isna(rows.loc["base", "eval/train loss"])  # a run whose metrics hold no losses: blank, not an error
    assert "| 200 | 1.700 |" in data
    # the same curve flat at the top: within the spread
    write_run(tmp_path / "half-flat", 8, curve=(1.5, 2.58), turns=4000, answer_tokens=4000, lr=0.002)
    study.report([tmp_path / n for n in ("base", "lr-hi", "quarter", "quarter-seed-1", "half-flat")], tmp_path / "out")
    data = (tmp_path / "out/results.md").read_text().split("## Treatment: train_turns")[1].split("## ")[0]
    assert "(4,000 and 8,000): +0.020 per doubling. Flat at the top: within the seeds' spread." in data


def test_the_steps_axis_puts_each_epoch_at_its_share_of_the_runs_optimizer_steps():
    """epochs.png's second panel: a run of 3 epochs and 1,977 steps ends epoch 1 at step 659, one of 8 epochs and
    2,304 steps at 288: more data per epoch shows as more steps per epoch. A run without its steps is left out."""
    rows = pd.DataFrame([{"run": "more-prompts", "epochs": "3", "optimizer steps": 1977},
                         {"run": "all-sharegpt", "epochs": 8, "optimizer steps": 2304},
                         {"run": "old", "epochs": 3, "optimizer steps": None}])
    rows["optimizer steps"] = rows["optimizer steps"].astype("Int64")
    assert study.steps_per_epoch(rows) == {"more-prompts": 659.0, "all-sharegpt": 288.0}

