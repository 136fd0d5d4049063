"""tools/peers_h200.py and tools/peers_report.py on a CPU: the plan, SpecForge's argv against its
CLI, resume and deadline, the log parsers on lines in SpecForge's and our formats, the report."""
import argparse
import json
from pathlib import Path

import pytest
from tests.support.tools import load_tool

ROOT = Path(__file__).resolve().parents[1]


peers = load_tool("peers_h200")
report = load_tool("peers_report")


def specforge_parser():
    """SpecForge 0.2.0's own CLI (specforge/cli.py main), its train and export subcommands."""
    p = argparse.ArgumentParser(prog="specforge")
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train")
    t.add_argument("-c", "--config", required=True)
    t.add_argument("--role", choices=("auto", "all", "producer", "consumer", "both"), default="auto")
    t.add_argument("--node-rank", type=int, default=None)
    t.add_argument("--plan", action="store_true")
    t.add_argument("overrides", nargs="*")
    e = sub.add_parser("export")
    e.add_argument("--to", choices=("hf", "sglang"), required=True)
    e.add_argument("--checkpoint", required=True)
    e.add_argument("--draft-config", required=True)
    e.add_argument("--output-dir", required=True)
    e.add_argument("--vocab-mapping", default=None)
    e.add_argument("--embedding-key", default="model.embed_tokens.weight")
    return p


def setup(tmp_path, *extra):
    args = peers.parse_args(["--work", str(tmp_path / "w"), "--results", str(tmp_path / "r"), *extra])
    paths = peers.Paths(tmp_path / "w", tmp_path / "r")
    return args, paths, peers.budget(paths, size=args.size)


def test_small_mode_shrinks_only_the_data_and_drops_the_bench_stage_and_ours_train(tmp_path):
    args, paths, b = setup(tmp_path, "--size", "small")
    full, small = peers.peers_params("full"), peers.peers_params("small")
    assert small["prompts"]["num_prompts"] == 1200 and full["prompts"]["num_prompts"] == 4800
    assert small["bench"]["num_prompts"] == 34  # the offline run: 32 prompts + 2 warm-up
    for key in ("train", "capture", "synth", "extract", "spec", "target"):  # the same rows' recipe and budget
        assert small[key] == full[key], key
    assert b == peers.budget(paths, size="full") and b["features"] == "offline"
    ours = peers.step_argv("ours", paths, args, b)
    assert ours[ours.index("--phases") + 1] == "pipeline"  # no bench stage in the pipeline
    order = peers.SIZES["small"]["order"]
    assert order[-1] == "ours_train" and order.index("serve") < order.index("offline")
    training = ["ours", "convert", "sf_train", "sf_export", "check"]
    assert order[:5] == training  # both trainings before any serving
    assert peers.SIZES["small"]["configs"].split(",") == ["3-1-4", "5-1-6", "6-8-32"]
    e = peers.EXPECT_S["small"]
    core = sum(e[s] for s in training) + e["serve_start"] + 2 * 2 * e["serve_config"]
    assert 1380 <= core <= 1560, core  # ~25 minutes: the docstring's estimate
    assert f"{core}  = 25 minutes" in peers.__doc__
    z = peers.sizes(paths, "small", args)
    assert (z["mode"], z["num_prompts"], z["offline_prompts"], z["served_prompts"], z["bench_stage"]) == ("small", 1200, 32, 32, False)


def test_the_gpu_8b_subcommand_runs_the_phases_asked(monkeypatch):
    import gpu_8b

    seen = []
    monkeypatch.setattr(gpu_8b.Run, "call", lambda self, step, argv: seen.append(argv) or 0)
    monkeypatch.setattr(gpu_8b, "main", lambda argv: gpu_8b.Run.call(None, "pipeline", ["x", "--phases", "pipeline,bench"]))
    monkeypatch.setattr(gpu_8b, "CONFIG", gpu_8b.CONFIG)
    assert peers.main(["gpu-8b", "p.yaml", "--phases", "pipeline", "--", "--work", "w"]) == 0
    assert seen[-1] == ["x", "--phases", "pipeline"] and str(gpu_8b.CONFIG) == "p.yaml"
    monkeypatch.setattr(gpu_8b.Run, "call", lambda self, step, argv: seen.append(argv) or 0)
    peers.main(["gpu-8b", "p.yaml", "--", "--work", "w"])  # the full mode: unchanged
    assert seen[-1] == ["x", "--phases", "pipeline,bench"]


def simulate(tmp_path, monkeypatch, size, deadline):
    """main() with every step replaced by one that takes its expected seconds (a fake clock):
    which steps ran and which configurations were served."""
    args, paths, _ = setup(tmp_path / f"{size}-{deadline}-{len(list(tmp_path.iterdir()))}", "--size", size, "--deadline-s", str(deadline))
    for d in ("ours", "specforge"):
        paths.draft[d].mkdir(parents=True)
        (paths.draft[d] / "config.json").write_text("{}")
    ran, served = [], []
    clock = [0.0]
    monkeypatch.setattr(peers.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(peers, "versions", lambda: {})

    def fake(step):
        def do(run, args, configs):
            if run.todo(step):
                ran.append(step)
                if step == "serve":
                    clock[0] += peers.EXPECT_S[size]["serve_start"]
                    for config, d in peers.serve_todo(run, configs):
                        if d:
                            served.append((config, d))
                            clock[0] += peers.EXPECT_S[size]["serve_config"]
                else:
                    clock[0] += peers.EXPECT_S[size][step]
            return 0
        return do

    monkeypatch.setattr(peers, "STEP_RUNNERS", {s: fake(s) for s in peers.STEPS})
    assert peers.main(["--work", str(paths.work), "--results", str(paths.results), "--size", size, "--deadline-s", str(deadline)]) == 0
    return ran, served


def test_the_deadline_cuts_serving_before_training(tmp_path, monkeypatch):
    training = {"ours", "convert", "sf_train", "sf_export", "check"}
    ran, served = simulate(tmp_path, monkeypatch, "small", 1500)
    assert set(ran) == training | {"serve"}  # offline and ours_train: no time left
    assert served == [("3-1-4", "ours"), ("3-1-4", "specforge"), ("5-1-6", "specforge"), ("5-1-6", "ours")]
    ran, served = simulate(tmp_path, monkeypatch, "small", 1680)
    assert {c for c, _ in served} == {"3-1-4", "5-1-6", "6-8-32"} and "offline" not in ran
    ran, served = simulate(tmp_path, monkeypatch, "small", 1200)  # short: training whole, serving cut
    assert training <= set(ran) and "serve" not in ran and not served  # (offline fills the 150 s left)
    ran, _ = simulate(tmp_path, monkeypatch, "small", 10_000)
    assert ran == peers.SIZES["small"]["order"]
    for deadline in range(400, 2400, 190):  # never a configuration served while a training step was cut
        ran, served = simulate(tmp_path, monkeypatch, "small", deadline)
        assert not served or training <= set(ran), deadline
        assert len([1 for c, _ in served]) % 2 == 0  # a configuration for both drafts or neither


def test_our_figures_from_the_pipeline_train_stage(tmp_path):
    args, paths, b = setup(tmp_path, "--size", "small")
    logs = paths.pipeline_results / "logs"
    logs.mkdir(parents=True)
    (logs / "train.log").write_text("\r".join(line for _, line in OUR_LINES) + "\n")
    (paths.pipeline_results / "timings.json").write_text(json.dumps({"stage-train": 300.0}))
    fig = peers.pipeline_train_figures(paths, b)
    assert [e["t_s"] for e in fig["evals"]] == [100.0, 200.0]  # 300 s x epoch / 3 epochs
    assert fig["tokens_per_s"] == 8390.7 and fig["wall_s"] == 300.0 and fig["peak_memory_mib"] is None
    assert fig["tokens_per_s_wall"] == round(1234092 // 3 * 3 / 300.0, 1) and "pipeline's train stage" in fig["source"]


def test_budget_is_gpu_8b_with_stored_states_and_both_trainers_get_it(tmp_path):
    args, paths, b = setup(tmp_path)
    assert b == {"epochs": 3, "batch_size": 16, "max_length": 512, "ttt_steps": 5, "our_lr": 0.0005, "features": "offline"}
    conv = peers.step_argv("convert", paths, args, b)
    flag = {conv[i]: conv[i + 1] for i in range(2, len(conv) - 1, 2)}
    assert flag == {"--features": str(paths.features), "--draft": str(paths.draft["ours"]), "--target": str(paths.twin),
                    "--out": str(paths.sf), "--epochs": "3", "--batch-size": "16", "--lr": "0.0001",
                    "--max-length": "512", "--ttt-length": "5"}
    ours = peers.step_argv("ours", paths, args, b)
    assert ours[2:7] == ["gpu-8b", str(paths.results / "params-peers.yaml"), "--phases", "pipeline,bench", "--"]
    assert "sweep,parity" in ours and args.size == "full"
    assert peers.peers_params()["prompts"]["num_prompts"] == 4800  # the full mode's data, unchanged


def test_specforge_commands_parse_with_its_cli(tmp_path):
    args, paths, b = setup(tmp_path)
    p = specforge_parser()
    train = peers.step_argv("sf_train", paths, args, b)
    assert train[0] == "specforge"
    got = p.parse_args(train[1:])
    assert got.command == "train" and got.config == str(paths.sf / "run.yaml") and not got.plan
    assert got.overrides == ["training.log_interval=10"]
    assert p.parse_args(peers.step_argv("sf_plan", paths, args, b)[1:]).plan
    exp = p.parse_args(peers.step_argv("sf_export", paths, args, b)[1:])
    assert (exp.to, exp.checkpoint, exp.draft_config, exp.vocab_mapping, exp.output_dir) == (
        "sglang", str(paths.sf / "output"), str(paths.sf / "draft_config.json"), str(paths.sf / "vocab_mapping.pt"),
        str(paths.draft["specforge"]))


def test_both_drafts_get_the_same_check_offline_and_serve_flags(tmp_path):
    args, paths, b = setup(tmp_path)
    for step in ("check", "offline"):
        a, s = (peers.step_argv(step, paths, args, b, d) for d in ("ours", "specforge"))
        diff = [(x, y) for x, y in zip(a, s) if x != y]
        assert len(a) == len(s) and all("ours" in x or "draft" in x for x, _ in diff)
    a = peers.serve_argv(paths, args, "ours", "6-8-32", "http://127.0.0.1:1", paths.results / "b.log", 2, 100)
    s = peers.serve_argv(paths, args, "specforge", "6-8-32", "http://127.0.0.1:1", paths.results / "b.log", 2, 100)
    same = lambda v: [x for i, x in enumerate(v) if v[i - 1] not in ("--work-dir", "--draft", "--out", "--mirror")]
    assert same(a) == same(s) and "--baseline-url" in a and a[a.index("--configs") + 1] == "6-8-32"


def test_resume_skips_done_steps_and_the_deadline_skips_what_would_not_fit(tmp_path):
    args, paths, _ = setup(tmp_path, "--deadline-s", "500")
    run = peers.Run(args)
    (paths.sf).mkdir(parents=True)
    (paths.sf / "run.yaml").write_text("x: 1\n")
    assert not run.todo("convert")  # done: run.yaml is written last by the converter
    assert not run.todo("sf_train")  # 1200 s expected, 500 left
    assert "skipped" in json.loads(paths.peers.read_text())["steps"]["sf_train"]
    assert run.todo("sf_export")
    run.record["steps"]["sf_train"] = {"rc": 1}
    assert not peers.is_done("sf_train", paths, run.record)  # a failed run is not done
    run.record["steps"]["sf_train"] = {"rc": 0}
    assert peers.is_done("sf_train", paths, run.record)
    run.record["flags"] = {"configs": ["3-1-4"]}
    for d in ("ours", "specforge"):
        (paths.results / f"serve-{d}.json").write_text(json.dumps({"configs": {"3-1-4": {"speedup": 2.0}}}))
    assert peers.is_done("serve", paths, run.record)
    (paths.results / "serve-specforge.json").write_text(json.dumps({"configs": {"3-1-4": {"skipped": "time"}}}))
    assert not peers.is_done("serve", paths, run.record)
    assert peers.Run(args).record["steps"]["sf_train"]["skipped"]  # the record survives a restart


# SpecForge 0.2.0 training/assembly.py _logger: print(f"step {step}: {printable}"), floats and lists
SF_LINES = [
    (30.0, ("step 10: {'acc_0': 0.41, 'ploss_0': 2.1, 'acc': 0.35, 'loss': 5.2, 'lr': 2.5e-05, "
           "'perf/optimizer_steps_per_hour': 3600.0, 'perf/optimizer_step_time_s': 1.0, 'perf/data_wait_time_s': 0.01, "
           "'perf/train_compute_time_s': 0.9, 'perf/durable_ack_time_s': 0.0, 'perf/global_samples_per_second': 8.0}")),
    (40.0, "step 20: {'acc_0': 0.52, 'loss': 4.0, 'perf/global_samples_per_second': 16.0, 'perf/optimizer_step_time_s': 1.0}"),
    (50.0, "step 30: {'acc_0': nan, 'loss': 3.9, 'perf/global_samples_per_second': 20.0}"),
    (90.0, ("step 270: {'eval/avg_loss': 1.2, 'eval/avg_acc': 0.9, 'eval/per_position_acc': [0.9, 0.8], "
           "'eval/simulated_acc_len': 1.62, 'eval/acceptance_rate_0': 0.9}")),
    (91.0, "Using flex attention on draft model training!"),
]
OUR_LINES = [
    (100.0, "epoch 1: eval loss 1.1330, accept [0.908, 0.91, 0.903, 0.894, 0.88], tau_pred 4.736"),
    (200.0, "epoch 2: eval loss 0.6519, accept [0.942, 0.948, 0.946, 0.945, 0.942], tau_pred 5.231"),
    (210.0, "train: features offline: 1234092 training tokens at 8390.7 tokens/s (optimizer steps only)"),
]


def test_specforge_log_lines_give_rate_accuracy_and_tau():
    got = peers.parse_specforge(SF_LINES)
    assert [w["samples_per_s"] for w in got["train"]] == [8.0, 16.0, 20.0] and got["train"][2]["acc_1"] is None
    (e,) = got["evals"]
    assert e == {"t_s": 90.0, "step": 270, "acc_1": 0.9, "loss": 1.2, "per_position_acc": [0.9, 0.8], "tau_pred": pytest.approx(2.62)}
    run = {"wall_s": 100.0, "rc": 0, "lines": SF_LINES, "peak_process_mib": None, "peak_gpu_delta_mib": 2048.0}
    fig = peers.train_figures(run, got, "specforge", tokens_per_epoch=3000, sequences=10, epochs=3)
    assert fig["tokens_per_s"] == 18.0 * 300  # median of the windows after the first, x 300 tokens a sequence
    assert fig["tokens_per_s_wall"] == 90.0 and fig["peak_memory_mib"] == 2048.0 and fig["final_acc_1"] == 0.9


def test_our_log_lines_and_time_to_accuracy():
    got = peers.parse_ours(OUR_LINES)
    assert [e["acc_1"] for e in got["evals"]] == [0.908, 0.942] and got["tokens_per_s"] == 8390.7
    assert got["train_tokens"] == 1234092 and got["features"] == "offline"
    assert peers.time_to_acc(got["evals"], 0.93) == 200.0 and peers.time_to_acc(got["evals"], 0.99) is None


def test_gpu_memory_of_the_process_tree():
    text = "1234, 40960\n77, [N/A]\n555, 1024\n"
    assert peers.parse_compute_apps(text) == {1234: 40960.0, 555: 1024.0}
    import os
    assert os.getpid() in peers.descendants(os.getppid())


def test_draft_flops_count_fc_once_and_the_layer_and_head_per_step():
    cfg = {"hidden_size": 4, "intermediate_size": 8, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 2,
           "vocab_size": 100, "draft_vocab_size": 10, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 3]}}
    fc, layer, head = 3 * 4 * 4, 2 * 4 * (2 + 2) * 2 + 2 * 2 * 4 + 3 * 4 * 8, 10 * 4
    assert peers.draft_flops_per_token(cfg, 5) == 6 * (fc + 5 * (layer + head))


def synthetic_peers(path: Path, sf_tau=5.0):
    served = lambda tau: {c: {"served_tau": tau + i * 0.5, "speedup": 2.0 + i * 0.3} for i, c in enumerate(["3-1-4", "5-1-6"])}
    data = {"versions": {"specforge": "0.2.0", "sglang": "0.5.14"},
            "flags": {"configs": ["3-1-4", "5-1-6"], "budget": {"epochs": 3, "batch_size": 16}, "num_prompts": 32,
                      "specforge_learning_rate": 1e-4, "specforge_overrides": ["training.log_interval=10"]},
            "served": {"ours": served(5.2), "specforge": served(sf_tau)},
            "offline": {"ours": {"tau": 5.1}, "specforge": {"tau": 4.9}},
            "train": {"ours": {"tokens_per_s": 8000.0, "mfu": 0.12, "peak_memory_mib": 20480.0, "final_acc_1": 0.96,
                               "evals": [{"t_s": 100.0, "acc_1": 0.9}, {"t_s": 200.0, "acc_1": 0.96}]},
                      "specforge": {"tokens_per_s": 6000.0, "peak_memory_mib": 30720.0, "final_acc_1": 0.95,
                                    "evals": [{"t_s": 150.0, "acc_1": 0.93}, {"t_s": 300.0, "acc_1": 0.95}]}}}
    path.mkdir(parents=True, exist_ok=True)
    (path / "peers.json").write_text(json.dumps(data))


def test_report_on_synthetic_results(tmp_path):
    synthetic_peers(tmp_path / "res")
    out = tmp_path / "rep"
    got = report.report(tmp_path / "res", out)
    text = (out / "README.md").read_text()
    assert (out / "served.png").stat().st_size > 1000 and (out / "accuracy.png").exists()
    assert "| draftlab draft | draftlab | 5.20 | 5.70 | 2.00x | 2.30x | 8,000 | 12.0% | 20.0 GiB | 200 s | 5.10 |" in text
    assert "| SpecForge draft | SpecForge | 5.00 | 5.50 | 2.00x | 2.30x | 6,000 | - | 30.0 GiB | 300 s | 4.90 |" in text
    assert got["threshold_acc_1"] == 0.95 and "to be explained" not in text
    assert json.loads((out / "results.json").read_text())["figures"]["specforge"]["time_to_acc_s"] == 300.0
    assert "**Mode: full**" in text
    synthetic_peers(tmp_path / "res2", sf_tau=5.4)
    assert "ours is lower" in (report.report(tmp_path / "res2", tmp_path / "rep2", 0.9) and (tmp_path / "rep2" / "README.md").read_text())


def test_report_states_the_small_mode_and_its_sizes(tmp_path):
    synthetic_peers(tmp_path / "res")
    p = tmp_path / "res" / "peers.json"
    data = json.loads(p.read_text())
    data["sizes"] = {"mode": "small", "num_prompts": 1200, "train_sequences": 1080, "train_tokens_per_epoch": 103000,
                     "capture_layers": [7, 15, 23], "offline_prompts": 32, "served_prompts": 32, "bench_stage": False}
    data["steps"] = {"offline": {"skipped": "120 s expected, 30 s left"}, "serve": {"skipped_configs": ["6-8-32"]}}
    data["train"]["ours"]["source"] = "the pipeline's train stage (ours step)"
    p.write_text(json.dumps(data))
    report.report(tmp_path / "res", tmp_path / "rep")
    text = (tmp_path / "rep" / "README.md").read_text()
    assert "**Mode: small**" in text and "| prompts (train + eval) | 1,200 |" in text
    assert "| train sequences, both trainers | 1,080 |" in text and "not run" in text
    assert "offline (120 s expected, 30 s left)" in text and "served configuration 6-8-32" in text
    assert "Our trainer's figures: the pipeline's train stage" in text
