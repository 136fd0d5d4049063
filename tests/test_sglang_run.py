"""tools/sglang_run.py, the driver that serves the pipeline's draft with SGLang, end to end on a CPU.

The same code launches SGLang on a GPU box (reports/sglang-h200/); here every server is the
project's reference server, which applies SGLang's flag rules and prints SGLang's log lines, or
(the bench phase) a stand-in for `python -m sglang.launch_server` that starts it.
"""
import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STANDIN = ROOT / "tests" / "fixtures" / "sglang_standin"  # `python -m sglang.launch_server` -> the reference server


# Merged over --quick's sizes (--params, as a user would): fewer prompts and shorter answers, still
# 10 eval prompts (the fault bench's 8, the sweep's 3 + 1 warm-up). None of the figures asserted
# below depends on the sizes; the pipeline's stages then train on half the tokens.
SMALLER = "prompts: {num_prompts: 32, eval_fraction: 0.3}\nsynth: {max_new_tokens: 64}\n"


def drive(results: Path, *extra: str, env: dict | None = None) -> subprocess.CompletedProcess:
    params = results.parent / "smaller.yaml"
    params.write_text(SMALLER)
    argv = [sys.executable, str(ROOT / "tools" / "sglang_run.py"), "--backend", "reference", "--quick", "--params", str(params),
            "--results", str(results), "--pack", str(results.parent / "packed" / "pack.tar.gz"), *extra]
    return subprocess.run(argv, capture_output=True, text=True, timeout=1500, env=env)


@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory):
    results = tmp_path_factory.mktemp("sglang_run") / "results"
    r = drive(results, "--phases", "pipeline,parity,faults", "--faults", "chain_draft_tokens_forced")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return results, r


def test_a_forced_flag_fault_is_served_recorded_and_named(rehearsal):
    results, _ = rehearsal
    s = json.loads((results / "faults/chain_draft_tokens_forced/summary.json").read_text())
    assert s["started"] and s["named"] and s["launched_flags"]["num_draft_tokens"] == 16
    assert s["server_flags"]["num_draft_tokens"] == 2  # what the server ran, from /server_info
    assert "chain_draft_tokens" in [a["rule"] for a in s["log_adjustments"]]  # the server's own line
    bench = json.loads((results / "faults/chain_draft_tokens_forced/work/reports/bench.json").read_text())
    assert bench["backend"] == "url" and bench["flags"]["served"]["num_draft_tokens"] == 2
    assert bench["server_log"].endswith("server.log") and bench["spec"]["tau"] >= 1.0
    assert not os.path.isabs(bench["server_log"])  # a results folder that moves elsewhere still reads


def test_stage_logs_show_the_command_as_typed(rehearsal):
    results, _ = rehearsal
    head = (results / "logs" / "prompts.log").read_text().splitlines()[:2]
    assert head[0].startswith("$ python -m stages.prompts ") and head[1].startswith("# cwd work ")


@pytest.fixture(scope="module")
def tool():
    """tools/sglang_run.py as a module, for what needs no process of its own."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("sglang_run", ROOT / "tools" / "sglang_run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_target_that_is_not_a_model_directory_is_refused(tool, tmp_path, monkeypatch, capsys):
    """The driver's own main() with drive()'s argv: it refuses before it starts anything."""
    argv = ["sglang_run.py", "--backend", "reference", "--quick", "--results", str(tmp_path / "results"),
            "--pack", str(tmp_path / "packed" / "pack.tar.gz"), "--target", str(tmp_path)]
    monkeypatch.setattr(sys, "argv", argv)
    assert tool.main() == 2 and "no config.json" in capsys.readouterr().err
    assert not (tmp_path / "results").exists() and not (tmp_path / "packed").exists()


def test_work_dir_target_and_params_come_from_the_arguments(tool, tmp_path, monkeypatch):
    import types

    import yaml

    (tmp_path / "over.yaml").write_text("bench:\n  num_prompts: 7\n")
    args = types.SimpleNamespace(results=str(tmp_path / "results"), work=str(tmp_path / "elsewhere"),
                                 target=str(ROOT / "models" / "tiny-target"), params=str(tmp_path / "over.yaml"),
                                 backend="reference", time_limit_s=float("inf"), quick=True, steps="", faults="", pack="")
    for name in ("PYTHONPATH", "PYTHONUNBUFFERED", "NCCL_NVLS_ENABLE"):  # the driver sets them for what it starts
        monkeypatch.setenv(name, os.environ.get(name, ""))
    driver = tool.Driver(args)
    driver.write_params(driver.work)
    driver.link_target(driver.work)
    p = yaml.safe_load((tmp_path / "elsewhere" / "params.yaml").read_text())
    assert p["target"]["model"] == "models/tiny-target" and p["bench"]["num_prompts"] == 7
    assert (tmp_path / "elsewhere" / p["target"]["model"] / "config.json").exists()


def test_live_parity_ran_against_a_server_and_passed(rehearsal):
    results, _ = rehearsal
    wiring = json.loads((results / "work/reports/check.json").read_text())
    ok = [f for f in wiring["findings"] if f["name"] == "live_parity_ok"]
    assert ok and ok[0]["evidence"]["source"].startswith("http://127.0.0.1:")


def test_results_pack_without_data_or_weights_and_a_rerun_resumes(rehearsal):
    results, _ = rehearsal
    with tarfile.open(results.parent / "packed" / "pack.tar.gz") as tar:
        names = tar.getnames()
    assert any(n.endswith("faults/chain_draft_tokens_forced/summary.json") for n in names)
    assert not any(n.endswith(".safetensors") or "/data/" in n for n in names)
    again = drive(results, "--phases", "pipeline,parity,faults", "--faults", "chain_draft_tokens_forced")
    assert again.returncode == 0 and "rc 0" not in again.stdout  # everything was done: nothing ran
    short = drive(results, "--phases", "sweep", "--time-limit-s", "1")
    assert short.returncode == 0 and "run the same command again" in short.stdout and not (results / "done" / "sweep").exists()


def test_a_sweep_point_is_a_paired_ratio_against_a_baseline_served_alongside(rehearsal):
    results, _ = rehearsal
    r = drive(results, "--phases", "sweep", "--steps", "1,2")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    for steps in (1, 2):
        point = json.loads((results / "sweep" / f"{steps}.json").read_text())
        assert point["flags"]["num_steps"] == steps and point["flags"]["num_draft_tokens"] == steps + 1
        assert point["speedup"] == pytest.approx(point["tokens_per_s"] / point["baseline_tokens_per_s"])
        assert point["spec"]["tau"] >= 1.0 and point["baseline_speed"]["requests"] == point["speed"]["requests"]
    rows = (results / "sweep" / "sweep.csv").read_text().splitlines()
    assert rows[0] == "num_steps,tau,tokens_per_s,speedup" and [x.split(",")[0] for x in rows[1:]] == ["1", "2"]
    assert (results / "sweep" / "sweep.png").stat().st_size > 0


def test_the_sglang_bench_runs_its_real_launches_side_by_side_on_two_ports(rehearsal):
    """The bench phase with --backend sglang, SGLang's argv and all, with a stand-in for SGLang: the
    baseline and the speculative server are up together, so they must listen on two ports."""
    results, _ = rehearsal
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(STANDIN), str(ROOT)])}
    r = drive(results, "--backend", "sglang", "--phases", "bench", env=env)
    assert r.returncode == 0 and "bench: rc 0" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]
    bench = json.loads((results / "work/reports/bench.json").read_text())
    assert bench["backend"] == "sglang" and bench["flags"]["served"]["num_steps"] == bench["flags"]["effective"]["num_steps"]
    assert bench["baseline"]["tokens_per_s"]["requests"] == bench["spec"]["tokens_per_s"]["requests"] and bench["speedup"] > 0
    logs = results / "work/reports/bench"
    ports = [re.search(r"sglang stand-in: --port (\d+)", (logs / f"server-{m}.log").read_text()).group(1) for m in ("baseline", "spec")]
    assert ports[0] != ports[1]
