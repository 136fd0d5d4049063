"""tools/real_workload_report.py on the committed GPU run: the tables it writes are the run's own
figures, and the by-kind split of served tau accounts for every measured request."""
import json
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
REPORT = ROOT / "reports/real-workload/real-gpu"
sys.path.insert(0, str(ROOT / "tools"))

import real_workload_report as rwr  # noqa: E402


def test_the_kind_rule_tells_code_from_prose():
    ask = lambda text: {"messages": [{"role": "user", "content": text}]}  # noqa: E731
    assert rwr.kind(ask("Fix this:\n```\nx = 1\n```")) == "code"
    assert rwr.kind(ask("Write a Python script that renames files")) == "code"
    assert rwr.kind(ask("What is a good name for a bakery?")) == "prose"
    assert rwr.kind(ask("Describe the coastline of Java island")) == "code"  # the rule is lexical, documented as such


def run_from_report(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    for src, dst in (("bench.json", "reports/bench.json"), ("requests.jsonl", "reports/bench/requests.jsonl"),
                     ("metrics.json", "reports/train/metrics.json"), ("params.yaml", "params.yaml")):
        (run / dst).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(REPORT / src, run / dst)
    return run


def test_the_report_tables_are_the_runs_figures(tmp_path):
    run, out = run_from_report(tmp_path), tmp_path / "out"
    rwr.main([str(run), str(out), "--prompts", str(REPORT / "bench-prompts.jsonl")])
    bench = json.loads((REPORT / "bench.json").read_text())
    md = (out / "results.md").read_text()
    assert f"| served (SGLang, the same prompts) | {bench['tau']:.3f} |" in md
    for c in bench["configurations"]:
        assert f"| {c['configuration']} | {c['tau']:.3f} | {c['predicted_tau']:.3f} | 1 | {c['speedup']:.3f} |" in md
    assert (out / "acceptance-by-position.png").stat().st_size > 0
    assert (out / "bench-prompts.jsonl").read_text() == (REPORT / "bench-prompts.jsonl").read_text()


def test_tau_by_kind_accounts_for_every_measured_request(tmp_path):
    run = run_from_report(tmp_path)
    params = {"warmup": 2, "num_prompts": 32}
    by_kind = rwr.tau_by_kind(run, rwr.read_prompts(REPORT / "bench-prompts.jsonl"), params)
    reqs = [json.loads(line) for line in (REPORT / "requests.jsonl").read_text().splitlines()]
    for name, kinds in by_kind.items():
        metas = [r["meta"] for r in reqs if r["mode"] == "speculative" and r["configuration"] == name]
        assert sum(k["prompts"] for k in kinds.values()) == len(metas) == params["num_prompts"]
        tokens, rounds = sum(m["completion_tokens"] for m in metas), sum(m["spec_verify_ct"] for m in metas)
        # tokens pooled back from the kinds: tau_k * rounds_k summed equals all tokens
        rounds_by_kind = {}
        prompts = [json.loads(line) for line in (REPORT / "bench-prompts.jsonl").read_text().splitlines()][2:34]
        for row, m in zip(prompts, metas):
            rounds_by_kind[rwr.kind(row)] = rounds_by_kind.get(rwr.kind(row), 0) + m["spec_verify_ct"]
        assert abs(sum(kinds[k]["tau"] * rounds_by_kind[k] for k in kinds) - tokens) < 1e-6 * tokens
        assert sum(rounds_by_kind.values()) == rounds
    bench = json.loads((REPORT / "bench.json").read_text())
    assert abs(bench["spec"]["verify_ct"] - sum(m["meta"]["spec_verify_ct"] for m in reqs
                                                if m["mode"] == "speculative" and m["configuration"] == "3-1-4")) == 0


def test_the_report_goes_to_a_new_folder_and_never_over_a_report_unless_forced(tmp_path, monkeypatch, capsys):
    run = run_from_report(tmp_path)
    prompts = ["--prompts", str(REPORT / "bench-prompts.jsonl")]
    monkeypatch.chdir(tmp_path)
    rwr.main([str(run), *prompts])  # no OUT: a new folder
    first, = (tmp_path / "reports/real-workload").iterdir()
    assert first.name.startswith("run-") and (first / "results.md").is_file()
    rwr.main([str(run), *prompts])  # again: another new folder, the first one untouched
    assert len(list((tmp_path / "reports/real-workload").iterdir())) == 2

    committed = tmp_path / "committed"
    shutil.copytree(REPORT, committed)
    before = {p.name: p.read_bytes() for p in committed.iterdir() if p.is_file()}
    with pytest.raises(SystemExit) as e:
        rwr.main([str(run), str(committed), *prompts])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith(f"error: {committed} already holds") and "--force" in err
    assert {p.name: p.read_bytes() for p in committed.iterdir() if p.is_file()} == before  # nothing written
    rwr.main([str(run), str(committed), "--force", *prompts])
    assert (committed / "results.md").read_text() == (first / "results.md").read_text()  # written over, as asked


def test_stage_times_come_from_the_stage_manifests(tmp_path):
    run = run_from_report(tmp_path)
    for rel, stage, wall in (("data/prompts", "prompts", 12.5), ("data/synth", "synthesize", 180.0),
                             ("models/draft-ckpt", "train", 301.2), ("reports/bench", "bench", 390.0)):
        (run / rel).mkdir(parents=True, exist_ok=True)
        info = {"wall_s": wall, **({"state_cache": {"kept": True, "bytes": 3 * 2**30},
                                    "throughput": {"by_states": {"computed": {"steps": 10, "tokens_per_s": 72000.0},
                                                                 "cached": {"steps": 20, "tokens_per_s": 187000.0}}}}
                                   if stage == "train" else {}),
                **({"server_startup": [{"total_s": 170.0, "phases_s": {"imports": 60.0, "cuda_graphs": 100.0, "health": 10.0}},
                                       {"total_s": 90.0, "phases_s": {"health": 90.0}}]} if stage == "synthesize" else {})}
        (run / rel / "manifest.json").write_text(json.dumps({"stage": stage, "config_hash": "x", "info": info}))
    (run / ".run-stages.json").write_text(json.dumps({"check": {"seconds": 9.0}, "train": {"seconds": 305.0}}))
    (run / "data/hidden").mkdir(parents=True)  # extract's counts, without a wall time: kept for a recipe study
    (run / "data/hidden/manifest.json").write_text(json.dumps({"info": {"counts": {"train": {"rows": 9, "answer_tokens": 900}}}}))
    assert rwr.stage_times(run) == {"prompts": 12.5, "synthesize": 180.0, "train": 301.2, "bench": 390.0, "check": 9.0}
    assert list(rwr.stage_times(run)) == ["prompts", "synthesize", "train", "bench", "check"]  # the DAG's order
    out = tmp_path / "out"
    rwr.main([str(run), str(out), "--prompts", str(REPORT / "bench-prompts.jsonl")])
    md = (out / "results.md").read_text()
    assert "| synthesize | 180.000 |" in md and "| train | 301.200 |" in md and "Not recorded: target, extract" in md
    assert "In all 892.7 s (`stage-times.png`)." in md and (out / "stage-times.png").stat().st_size > 0
    assert ("states kept after the first epoch (3.0 GiB): steps with the target 72000.0 tok/s, from the cache 187000.0 tok/s."
            in md)  # train.state_cache, from the train manifest
    # the synthesize manifest's server start-ups: the slowest one's phases
    assert "synthesize: 2 servers up in 90-170 s; the slowest: imports 60 s, cuda graphs 100 s, health 10 s" in md
    kept = json.loads((out / "stage-counts.json").read_text())
    assert kept["seconds"]["bench"] == 390.0 and kept["extract"]["counts"]["train"]["answer_tokens"] == 900


def test_the_data_line_counts_the_targets_own_prompts_and_says_when_the_state_cache_was_off(tmp_path):
    run = run_from_report(tmp_path)
    for rel, manifest in (("data/prompts", {"stage": "prompts", "config_hash": "x", "info": {"train": 40, "eval": 2, "usable": 15,
                                                                         "self_prompts_used": 27}}),
                          ("models/draft-ckpt", {"stage": "train", "config_hash": "x", "info": {"state_cache": {"kept": False,
                                                                                            "bytes": 95 * 2**30}}})):
        (run / rel).mkdir(parents=True, exist_ok=True)
        (run / rel / "manifest.json").write_text(json.dumps(manifest))
    out = tmp_path / "out"
    rwr.main([str(run), str(out), "--prompts", str(REPORT / "bench-prompts.jsonl")])
    data = next(line for line in (out / "results.md").read_text().splitlines() if line.startswith("Data: "))
    assert data.startswith("Data: 40 train and 2 eval prompts of 15 usable and 27 the target wrote itself (self_prompts); ")
    assert "; state cache off (95.0 GiB of states: the target ran in every epoch)" in data
    assert "states kept" not in data
    # the states that fit kept (train.state_cache auto on a GPU too small for all of them)
    partial = {"kept": True, "bytes": 95 * 2**30, "kept_bytes": 47 * 2**30, "kept_sequences": {"train": 14203, "eval": 728},
               "sequences": {"train": 40022, "eval": 728}}
    (run / "models/draft-ckpt/manifest.json").write_text(json.dumps({"stage": "train", "config_hash": "x",
                                                                    "info": {"state_cache": partial}}))
    rwr.main([str(run), str(out), "--force", "--prompts", str(REPORT / "bench-prompts.jsonl")])
    data = next(line for line in (out / "results.md").read_text().splitlines() if line.startswith("Data: "))
    assert ("; states of 14,203 of 40,022 train, 728 of 728 eval sequences kept after the first epoch (47.0 of 95.0 GiB): "
            "the target ran on the rest in every epoch") in data and "state cache off" not in data
    # and the rest in host memory (a second tier where the GPU's budget ends)
    both = {**partial, "kept_bytes": 95 * 2**30, "host_bytes": 48 * 2**30, "kept_sequences": {"train": 40022, "eval": 728}}
    (run / "models/draft-ckpt/manifest.json").write_text(json.dumps({"stage": "train", "config_hash": "x",
                                                                    "info": {"state_cache": both}}))
    rwr.main([str(run), str(out), "--force", "--prompts", str(REPORT / "bench-prompts.jsonl")])
    data = next(line for line in (out / "results.md").read_text().splitlines() if line.startswith("Data: "))
    assert "; states kept after the first epoch (95.0 GiB, 48.0 GiB of them in host memory)" in data


def test_the_step1_table_sets_the_offline_rounds_beside_training_in_the_same_groups():
    cell = {"tokens": 10, "a_1": 0.5}
    # as metrics.json holds them: sorted as text, 128-255 before 64-127
    train = {"step1_by_kind": {"loop": cell, "other": cell}, "step1_by_position": {"0-63": cell, "128-255": cell, "64-127": cell},
             "step1_by_turn": {"1": cell}}
    bench = {"offline": {"step1_by_kind": {"loop": {"rounds": 7, "a_1": 0.9}, "other": {"rounds": 30, "a_1": 0.4}},
                         "step1_by_position": {"0-63": {"rounds": 20, "a_1": 0.45}, "64-127": {"rounds": 17, "a_1": 0.5}}}}
    md = "\n".join(rwr.step1_md(train, bench))
    assert "| group | eval tokens | a_1 teacher-forced | offline rounds | a_1 offline |" in md
    assert "| loop tokens | 10 | 0.500 | 7 | 0.900 |" in md and "| positions 64-127 | 10 | 0.500 | 17 | 0.500 |" in md
    assert "| turn 1 | 10 | 0.500 |  |  |" in md  # the bench sends no turn groups
    assert md.index("positions 0-63") < md.index("positions 64-127") < md.index("positions 128-255")  # from the answer's start
    assert "offline" not in "\n".join(rwr.step1_md(train, {"offline": {"tau": 2.0}}))  # an older bench: training's alone


def test_the_first_steps_seconds_and_each_evals_come_from_the_train_manifests_throughput(tmp_path):
    run = tmp_path / "run"
    plots = run / "reports/train/plots"
    plots.mkdir(parents=True)
    (plots / "loss.tsv").write_text("epoch\ttrain_loss\teval_loss\n1\t20.0\t15.0\n2\t12.0\t10.0\n")
    (plots / "accept.tsv").write_text("epoch\taccept_1\ttau_pred\n1\t0.47\t1.98\n2\t0.65\t3.03\n")
    md = "\n".join(rwr.learning_curve_md(run, {"1": 21.1, "2": 2.2}))
    assert "| epoch | train loss | eval loss | a_1 | predicted tau | eval (s) |" in md
    assert "| 1 | 20.000 | 15.000 | 0.470 | 1.980 | 21.100 |" in md and "| 2 | 12.000 | 10.000 | 0.650 | 3.030 | 2.200 |" in md
    assert "eval (s)" not in "\n".join(rwr.learning_curve_md(run, None))  # an older run's manifest: no column
    (plots / "decoded.tsv").write_text("epoch\tfirst_turns_1\tfirst_turns_2\tevery_turn_1\tevery_turn_2\n1\t1.4\t1.6\t1.5\t1.7\n2\t1.5\t1.8\t1.6\t1.9\n")
    md = "\n".join(rwr.learning_curve_md(run, None, depth=2))  # the bench's chain: first turns at its depth
    assert "| epoch | train loss | eval loss | a_1 | predicted tau | decoded tau, first turns, chain of 2 |" in md
    assert "| 2 | 12.000 | 10.000 | 0.650 | 3.030 | 1.800 |" in md
    assert "decoded" not in "\n".join(rwr.learning_curve_md(run, None, depth=5))  # deeper than trained: no column
    assert rwr.first_step({"first_step_s": 47.61}) == "; the first step 47.61 s (compiling and first uses included)"
    assert rwr.first_step({}) == ""


def test_a_run_stopped_before_the_bench_reports_its_training_and_none_of_the_earlier_bench(tmp_path, capsys):
    # run-stages --until train in a checkout: reports/ still holds the committed bench of another export
    run = run_from_report(tmp_path)
    for rel, stage, inputs in (("models/draft-ckpt", "train", {}), ("reports/bench", "bench", {"export": "an-earlier-export"})):
        (run / rel).mkdir(parents=True, exist_ok=True)
        (run / rel / "manifest.json").write_text(json.dumps({"stage": stage, "config_hash": stage + "-hash", "inputs": inputs,
                                                            "info": {"wall_s": 100.0}}))
    (run / "reports/check.md").write_text("# an earlier run's check\n")
    out = tmp_path / "out"
    rwr.main([str(run), str(out)])  # no --prompts: nothing served needs them
    assert "left out: reports/bench/ served another export" in capsys.readouterr().out
    md = (out / "results.md").read_text()
    assert "Nothing served by this run: reports/bench/ served another export than this run's" in md
    assert "tau triangle" not in md and "Does training pay" not in md and "Every configuration" not in md
    assert "| train | 100.000 |" in md and "| bench |" not in md  # the earlier bench's time is not this run's
    assert {p.name for p in out.iterdir()}.isdisjoint({"bench.json", "requests.jsonl", "configurations.csv", "check.md",
                                                        "bench-prompts.jsonl"})
    assert (out / "metrics.json").exists()  # the run's own training figures are kept
