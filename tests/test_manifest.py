"""The configuration hash: stable when nothing changes, different when anything hashed changes."""
import json

from draftlab.manifest import build_manifest, dir_hash, read_manifest, with_lineage, write_manifest

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
