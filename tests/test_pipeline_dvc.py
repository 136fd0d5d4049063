"""The DAG as DVC runs it, in a scratch copy of the project with a micro target.

Asserts the invariants users rely on: nothing changed -> nothing runs; a param re-runs exactly
the stages that read it and those downstream; a typo stops the stage that reads the section;
config hashes are stable across runs and follow the params.
"""
import json
import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from draftlab.features.dataset import physical_layers_of
from tests.support.project import copy_run

ROOT = Path(__file__).resolve().parents[1]


def sh(cmd, cwd, check=True):
    r = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(cwd)})
    if check and r.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")
    return r


def ran(output: str) -> set[str]:
    return set(re.findall(r"Running stage '([^']+)'", output))


def set_params(root: Path, **changes):
    p = yaml.safe_load((root / "params.yaml").read_text())
    for key, value in changes.items():
        section, name = key.split("__")
        p[section][name] = value
    (root / "params.yaml").write_text(yaml.safe_dump(p, sort_keys=False))


@pytest.fixture(scope="module")
def project(dvc_run, tmp_path_factory):
    """A copy of the reduced project (micro target, few prompts and tokens, 1 epoch: REDUCED in
    tests/support/project.py) after its first `dvc repro`, and that run's output."""
    first_root, first_out = dvc_run
    root = copy_run(first_root, tmp_path_factory.mktemp("project") / "project")
    sh(["git", "init", "-q"], root)
    return root, first_out


def stages_in_dag(root) -> set[str]:
    return set(yaml.safe_load((root / "dvc.yaml").read_text())["stages"])


def config_hashes(root) -> dict:
    out = {}
    for m in (root / "data").glob("*/manifest.json"):
        out[m.parent.name] = json.loads(m.read_text())["config_hash"]
    return out


def test_first_run_runs_every_stage(project):
    root, out = project
    assert ran(out) == stages_in_dag(root)


def test_every_stage_records_its_wall_time_for_the_report(project):
    """dvc repro keeps no stage times; each stage's manifest does (info.wall_s), and the real-workload
    report reads them from there (the micro target is a folder: stage target writes no manifest)."""
    from tests.support.tools import load_tool

    root, _ = project
    times = load_tool("real_workload_report").stage_times(root)
    assert list(times) == ["self_prompts", "prompts", "synthesize", "extract", "standardize", "train", "export", "bench"]
    assert all(isinstance(t, float) and t > 0 for t in times.values()), times


def test_the_advice_says_what_pays_at_each_concurrency_measured(project):
    root, out = project
    bench = json.loads((root / "reports/bench.json").read_text())
    per = bench["advice"]["by_concurrency"]
    assert set(per["recommendation"]) == {"1", "2"} and set(per["predicted_speedup"]) == {"1", "2"}
    # how a verify grows with 2 requests in flight: the target's matmuls timed at w and 2 * w tokens
    assert {"2", "4", "64"} <= set(bench["costs"]["gemm_s"])
    assert per["crossover_concurrency"] in (None, 1, 2)
    line = next(x for x in out.splitlines() if x.startswith("bench: tau"))
    assert "concurrency" in line  # the stage's one-line summary names the crossover, or that there is none


def test_the_bench_records_its_two_servers_start_ups(project):
    """Without bench.sweep too, the baseline's and the draft's server each have their start-up in bench.json."""
    root, out = project
    bench = json.loads((root / "reports/bench.json").read_text())
    s = bench["settings"]
    assert set(bench["server_startup"]) == {"baseline", f"{s['num_steps']}-{s['topk']}-{s['num_draft_tokens']}"}
    assert all(0 < got["total_s"] < 600 for got in bench["server_startup"].values())
    assert any(x.startswith("bench: 2 servers up in") for x in out.splitlines())  # printed once both are up


def test_second_repro_runs_nothing_and_hashes_are_stable(project):
    root, _ = project
    before = config_hashes(root)
    out = sh(["dvc", "repro"], root).stdout
    assert ran(out) == set()
    assert config_hashes(root) == before


def test_capture_layers_rerun_extract_and_downstream_only(project):
    root, _ = project
    before = config_hashes(root)
    set_params(root, capture__layers=[1, 2, 4])
    out = sh(["dvc", "repro"], root).stdout
    downstream = {"extract", "standardize", "train", "export", "bench", "check"} & stages_in_dag(root)
    assert ran(out) == downstream
    after = config_hashes(root)
    assert after["prompts"] == before["prompts"] and after["synth"] == before["synth"]
    assert after["hidden"] != before["hidden"] and after["features"] != before["features"]
    assert physical_layers_of(root / "data/features") == [2, 3, 5]  # what the shards say they hold


def test_spec_change_reruns_only_bench_and_check(project):
    root, _ = project
    set_params(root, spec__num_steps=3, spec__num_draft_tokens=4)
    out = sh(["dvc", "repro"], root).stdout
    assert ran(out) == {"bench", "check"} & stages_in_dag(root)


def test_typo_in_a_read_section_stops_the_stage(project):
    root, _ = project
    p = yaml.safe_load((root / "params.yaml").read_text())
    p["capture"]["layer"] = [1]
    (root / "params.yaml").write_text(yaml.safe_dump(p, sort_keys=False))
    try:
        r = sh(["dvc", "repro"], root, check=False)
        assert r.returncode != 0
        assert "unknown key capture.layer, did you mean capture.layers?" in r.stdout + r.stderr
    finally:
        del p["capture"]["layer"]
        (root / "params.yaml").write_text(yaml.safe_dump(p, sort_keys=False))


def test_spec_typo_stops_bench_with_a_hint(project):
    root, _ = project
    p = yaml.safe_load((root / "params.yaml").read_text())
    p["spec"]["num_step"] = 5  # what `dvc exp run -S '+spec.num_step=5'` writes
    (root / "params.yaml").write_text(yaml.safe_dump(p, sort_keys=False))
    try:
        r = sh(["dvc", "repro"], root, check=False)
        assert r.returncode != 0
        assert "unknown key spec.num_step, did you mean spec.num_steps?" in r.stdout + r.stderr
        assert ran(r.stdout) == {"bench"}  # only the stage that reads spec ran, and it stopped
    finally:
        del p["spec"]["num_step"]
        (root / "params.yaml").write_text(yaml.safe_dump(p, sort_keys=False))


def test_unservable_layer_is_refused_before_compute(project):
    root, _ = project
    set_params(root, capture__layers=[2, 5])  # 5 = output of the last of 6 layers
    try:
        r = sh(["dvc", "repro", "extract"], root, check=False)
        assert r.returncode != 0
        assert "layer 5 is out of range" in r.stdout + r.stderr and "cannot be captured by SGLang" in r.stdout + r.stderr
    finally:
        set_params(root, capture__layers=[1, 2, 4])


def test_flags_sglang_would_change_stop_bench_before_launch(project):
    root, _ = project
    last_report = (root / "reports/bench.json").read_text()
    set_params(root, spec__topk=1, spec__num_steps=1, spec__num_draft_tokens=16, bench__backend="sglang")
    try:
        r = sh(["dvc", "repro", "bench"], root, check=False)
        assert r.returncode != 0
        assert (root / "reports/bench.json").read_text() == last_report  # the failed run lost no report
        assert (root / "reports/bench").is_dir()
        err = r.stdout + r.stderr
        assert "rule chain_draft_tokens: SGLang would run 2 draft tokens" in err
        assert "set spec.num_draft_tokens: 2" in err
        assert "sglang.launch_server" not in err  # refused before anything was started
    finally:
        set_params(root, spec__num_steps=3, spec__num_draft_tokens=4, bench__backend="reference")
