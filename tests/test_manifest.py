"""The configuration hash: stable when nothing changes, different when anything hashed changes."""
import json
from types import SimpleNamespace

from draftlab.check.findings import INFO
from draftlab.check.hardware import (
    check_hardware,
    hardware_differences,
    stage_manifests,
)
from draftlab.manifest import (
    build_manifest,
    describe_hardware,
    dir_hash,
    read_manifest,
    with_lineage,
    write_manifest,
)

PARAMS = {"train": {"lr": 0.003, "epochs": 10}}


def test_hash_is_stable_and_ignores_info():
    a = build_manifest("train", PARAMS, {"features": "abc"}, info={"seconds": 1.0})
    b = build_manifest("train", json.loads(json.dumps(PARAMS)), {"features": "abc"}, info={"seconds": 9.0})
    assert a["config_hash"] == b["config_hash"]


def test_hash_changes_with_params_inputs_and_stage():
    base = build_manifest("train", PARAMS, {"features": "abc"})["config_hash"]
    assert build_manifest("train", {"train": {"lr": 0.001, "epochs": 10}}, {"features": "abc"})["config_hash"] != base
    assert build_manifest("train", PARAMS, {"features": "abd"})["config_hash"] != base
    assert build_manifest("export", PARAMS, {"features": "abc"})["config_hash"] != base


def test_hash_changes_with_the_stage_script(tmp_path):
    script = tmp_path / "stage.py"
    script.write_text("from draftlab.fsutil import canonical_json\nx = 1\n")
    a = build_manifest("s", PARAMS, {}, script)
    script.write_text("from draftlab.fsutil import canonical_json\nx = 2\n")
    b = build_manifest("s", PARAMS, {}, script)
    assert a["config_hash"] != b["config_hash"]
    assert "draftlab/fsutil.py" in a["code_files"]  # what the script imports is hashed too


def test_manifest_round_trip_and_lineage(tmp_path):
    m = build_manifest("prompts", PARAMS, {})
    write_manifest(tmp_path, m)
    assert read_manifest(tmp_path) == m
    metrics = with_lineage({"tau": 3.1}, m, {"num_steps": 5})
    assert metrics["config_hash"] == m["config_hash"] and metrics["settings"] == {"num_steps": 5}


def test_dir_hash_follows_content_not_manifest(tmp_path):
    (tmp_path / "a.txt").write_text("one")
    h1 = dir_hash(tmp_path)
    (tmp_path / "manifest.json").write_text("{}")
    assert dir_hash(tmp_path) == h1
    (tmp_path / "a.txt").write_text("two")
    assert dir_hash(tmp_path) != h1


# The hardware record: in every manifest, never in the config hash; draftlab.check.hardware reads it.

HERE = {"machine": "x86_64", "cpu_model": "AMD EPYC 7B13", "cpu_simd": ["avx", "avx2", "fma"], "cpu_flags_sha256": "a" * 64,
        "cpu_count": 2, "gpu": None, "torch": {"threads": 1, "cpu_capability": "AVX2", "cuda": None}}
OTHER_CPU = {**HERE, "cpu_model": "Intel Xeon Platinum 8481C", "cpu_simd": ["amx_bf16", "avx", "avx2", "avx512f", "fma"],
             "torch": {"threads": 1, "cpu_capability": "AVX512", "cuda": None}}


def test_every_manifest_records_the_hardware():
    import torch

    hw = build_manifest("train", PARAMS, {})["hardware"]
    assert hw == describe_hardware()
    assert set(hw) == {"machine", "cpu_model", "cpu_simd", "cpu_flags_sha256", "cpu_count", "gpu", "torch"}
    assert hw["cpu_count"] >= 1 and isinstance(hw["cpu_simd"], list)
    assert hw["torch"]["threads"] == torch.get_num_threads()  # torch is imported here: recorded
    assert hw["torch"]["cuda"] == torch.version.cuda
    assert hw["gpu"] is None or hw["gpu"]["count"] >= 1
    json.dumps(hw)  # plain JSON


def test_hardware_is_not_hashed(monkeypatch):
    from draftlab import manifest

    a = build_manifest("train", PARAMS, {"features": "abc"})
    monkeypatch.setattr(manifest, "describe_hardware", lambda: OTHER_CPU)
    b = build_manifest("train", PARAMS, {"features": "abc"})
    assert b["hardware"] == OTHER_CPU and a["hardware"] != b["hardware"]
    assert a["config_hash"] == b["config_hash"]
    assert {k: v for k, v in a.items() if k != "hardware"} == {k: v for k, v in b.items() if k != "hardware"}


def test_torch_fields_only_when_torch_is_imported(monkeypatch):
    import sys

    monkeypatch.delitem(sys.modules, "torch")
    without = describe_hardware()
    monkeypatch.undo()
    assert without["torch"] is None  # a stage that never imports torch (prompts) records none
    assert {k: v for k, v in without.items() if k != "torch"} == {k: v for k, v in describe_hardware().items() if k != "torch"}


def test_same_hardware_gives_no_finding():
    assert check_hardware({"train": {"stage": "train", "hardware": HERE}, "bench": {"stage": "bench", "hardware": dict(HERE)}}, HERE) == []
    # not compared: the full flag hash, torch's thread count (each stage sets its own)
    other_threads = {**HERE, "cpu_flags_sha256": "b" * 64, "torch": {**HERE["torch"], "threads": 2}}
    assert check_hardware({"train": {"hardware": other_threads}}, HERE) == []


def test_other_cpu_is_named_with_stages_and_both_machines():
    two_threads = {**OTHER_CPU, "torch": {**OTHER_CPU["torch"], "threads": 2}}  # the same machine, a stage with torch's default threads
    manifests = {"synthesize": {"stage": "synthesize", "hardware": OTHER_CPU}, "train": {"stage": "train", "hardware": OTHER_CPU},
                 "export": {"stage": "export", "hardware": two_threads}, "bench": {"stage": "bench", "hardware": HERE},
                 "prompts": {"stage": "prompts", "hardware": {**OTHER_CPU, "torch": None}},  # a stage without torch
                 "extract": None, "old": {"stage": "old"}}
    [f] = check_hardware(manifests, HERE)  # one finding per kind of machine
    assert f.name == "hardware_differs" and f.severity == INFO
    assert f.evidence["stages"] == ["synthesize", "train", "export", "prompts"]
    assert f.evidence["recorded"] == OTHER_CPU and f.evidence["here"] == HERE
    assert set(f.evidence["differs"]) == {"cpu_model", "cpu_simd", "torch_cpu_capability"}
    assert f.evidence["differs"]["torch_cpu_capability"] == {"recorded": "AVX512", "here": "AVX2"}
    assert "Intel Xeon Platinum 8481C" in f.cause and "AMD EPYC 7B13" in f.cause and "0.19%" in f.cause


def test_each_other_machine_is_one_finding_and_gpus_and_cores_count():
    gpu_box = {**HERE, "cpu_count": 16, "gpu": {"name": "NVIDIA H200", "count": 8},
               "torch": {"threads": 8, "cpu_capability": "AVX2", "cuda": "12.8"}}
    found = check_hardware({"train": {"stage": "train", "hardware": gpu_box}, "bench": {"stage": "bench", "hardware": OTHER_CPU}}, HERE)
    assert [f.evidence["stages"] for f in found] == [["train"], ["bench"]]
    assert found[0].evidence["differs"] == {"cpu_count": {"recorded": 16, "here": 2}, "gpu": {"recorded": "NVIDIA H200", "here": "none"}}
    assert "8x NVIDIA H200" in found[0].cause


def test_unknown_sides_are_not_differences():
    no_torch = {**HERE, "torch": None}  # a stage that never imported torch (prompts)
    assert hardware_differences(no_torch, HERE) == {}
    unnamed = {**HERE, "gpu": {"name": None, "count": 1}}
    assert hardware_differences(unnamed, {**HERE, "gpu": {"name": "NVIDIA H200", "count": 1}}) == {}


def test_stage_manifests_reads_train_and_bench_beside_the_paths(tmp_path):
    (tmp_path / "models/draft-ckpt").mkdir(parents=True)
    (tmp_path / "models/draft-ckpt/manifest.json").write_text(json.dumps({"stage": "train", "hardware": OTHER_CPU}))
    (tmp_path / "reports/bench").mkdir(parents=True)
    (tmp_path / "reports/bench/manifest.json").write_text(json.dumps({"stage": "bench", "hardware": HERE}))
    paths = SimpleNamespace(draft=tmp_path / "models/draft", bench=tmp_path / "reports/bench.json")
    run = SimpleNamespace(paths=paths, synth={"stage": "synthesize"}, hidden=None, features=None, export_manifest=None)
    got = stage_manifests(run)
    assert list(got) == ["synthesize", "extract", "standardize", "train", "export", "bench"]
    assert got["train"]["hardware"] == OTHER_CPU and got["bench"]["hardware"] == HERE and got["extract"] is None
    assert [f.evidence["stages"] for f in check_hardware(got, HERE)] == [["train"]]


def test_write_manifest_records_the_stage_wall_time_from_its_process_start(tmp_path):
    """A stage process that ran 1.5 s before it wrote its manifest records at least that (Python's start
    and imports included): the time a `dvc exp run` of it took, which DVC itself does not record."""
    import subprocess
    import sys

    from draftlab.manifest import ROOT

    code = ("import time; time.sleep(1.5)\n"
            "from draftlab.manifest import build_manifest, write_manifest\n"
            f"write_manifest({str(tmp_path)!r}, build_manifest('prompts', {{}}, {{}}, info={{'rows': 3}}))\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=tmp_path, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    manifest = read_manifest(tmp_path)
    assert 1.5 <= manifest["info"]["wall_s"] < 60 and manifest["info"]["rows"] == 3
    again = build_manifest("prompts", {}, {}, info={"rows": 3})
    assert manifest["config_hash"] == again["config_hash"]  # the time is not hashed
