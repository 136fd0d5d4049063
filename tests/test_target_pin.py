"""The target pin (stage target, draftlab/target/pin.py): another target is one params edit.

A local folder's pin follows the bytes of its model files and nothing beside them; a hub id's
pin is the commit its revision resolves to, offline from the Hugging Face cache; every stage that
loads the target depends on the pin, none on a target folder; and DVC re-runs exactly the stages
the pin's bytes say must.
"""
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from draftlab.errors import UserError
from draftlab.manifest import ROOT, code_files
from draftlab.target.pin import pin_target
from tests.support.micro import save_micro_model

PIN = "models/target-pin.json"
COMMIT_A, COMMIT_B = "a" * 40, "0123456789abcdef0123456789abcdef01234567"


def model_folder(root: Path) -> Path:
    m = root / "model"
    m.mkdir(parents=True)
    (m / "config.json").write_text('{"model_type": "llama"}')
    (m / "model.safetensors").write_bytes(bytes(range(256)) * 4)
    (m / "tokenizer.json").write_text('{"vocab": {}}')
    (m / "README.md").write_text("a model card\n")
    return m


def test_a_local_pin_follows_the_model_files_only(tmp_path):
    m = model_folder(tmp_path)
    pin, how = pin_target(str(m), None)
    assert how == "hashed" and pin["kind"] == "local" and pin["model"] == str(m)
    assert sorted(pin["files"]) == ["config.json", "model.safetensors", "tokenizer.json"]  # README is not the model
    assert pin["files"]["model.safetensors"]["size"] == 1024
    (m / "README.md").write_text("another card\n")  # beside the model: no change
    (m / "eval.json").write_text("{}")
    (m / ".cache").mkdir()
    (m / ".cache" / "model.safetensors").write_bytes(b"junk")
    (m / "runs").mkdir()
    (m / "runs" / "model.safetensors").write_bytes(b"junk")  # below the top level: transformers never reads it
    assert pin_target(str(m), None)[0] == pin
    blob = bytearray((m / "model.safetensors").read_bytes())
    blob[500] ^= 1  # one weight byte
    (m / "model.safetensors").write_bytes(bytes(blob))
    changed = pin_target(str(m), None)[0]
    assert changed["content_sha256"] != pin["content_sha256"]
    assert changed["files"]["config.json"] == pin["files"]["config.json"]
    (m / "chat_template.jinja").write_text("{{ messages }}")  # a chat template defines the model too
    assert "chat_template.jinja" in pin_target(str(m), None)[0]["files"]


def test_a_missing_local_path_names_the_key_and_the_fix(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").mkdir()
    for model in ("models/my-target", "./nowhere", str(tmp_path / "a/b/c")):
        with pytest.raises(UserError, match=r"target\.model .*does not exist; set target\.model to an existing model folder or to a hub id"):
            pin_target(model, None, offline=True)
    (tmp_path / "models" / "empty").mkdir()
    with pytest.raises(UserError, match=r"target\.model 'models/empty': .*config\.json not found"):
        pin_target("models/empty", None)


def fake_hub_cache(root: Path, repo: str, refs: dict[str, str]) -> Path:
    """The layout huggingface_hub writes: models--org--name/{refs/<rev>, snapshots/<commit>/...}."""
    base = root / ("models--" + repo.replace("/", "--"))
    for ref, commit in refs.items():
        (base / "refs").mkdir(parents=True, exist_ok=True)
        (base / "refs" / ref).write_text(commit)
        (base / "snapshots" / commit).mkdir(parents=True, exist_ok=True)
        (base / "snapshots" / commit / "config.json").write_text("{}")
    return root


def test_a_hub_id_is_pinned_offline_from_the_cache(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no local folder named org/
    cache = fake_hub_cache(tmp_path / "hub", "org/chat-model", {"main": COMMIT_A, "v2": COMMIT_B})
    pin, how = pin_target("org/chat-model", None, cache_dir=cache, offline=True)
    assert (pin, how) == ({"model": "org/chat-model", "revision": None, "kind": "hub", "commit": COMMIT_A}, "cache")
    assert pin_target("org/chat-model", "v2", cache_dir=cache, offline=True)[0]["commit"] == COMMIT_B
    assert pin_target("org/chat-model", COMMIT_B, cache_dir=cache, offline=True)[0]["commit"] == COMMIT_B  # a snapshot by commit
    with pytest.raises(UserError, match=r"HF_HUB_OFFLINE is set and revision 'v3' is not in the local Hugging Face cache.*"
                                        r"set target\.revision to the 40-hex commit"):
        pin_target("org/chat-model", "v3", cache_dir=cache, offline=True)
    with pytest.raises(UserError, match=r"'org/other'.*revision 'main' is not in the local Hugging Face cache"):
        pin_target("org/other", None, cache_dir=cache, offline=True)


def test_a_40_hex_revision_is_the_commit_without_any_lookup(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    pin, how = pin_target("org/not-cached", COMMIT_B, cache_dir=tmp_path / "empty", offline=False)  # no network touched
    assert how == "given" and pin == {"model": "org/not-cached", "revision": COMMIT_B, "kind": "hub", "commit": COMMIT_B}


def test_an_unreachable_hub_falls_back_to_the_cache(tmp_path, monkeypatch):
    from draftlab.target import pin as target_pin

    monkeypatch.chdir(tmp_path)
    def no_network(model, revision):
        raise ConnectionError("no route to host")
    monkeypatch.setattr(target_pin, "commit_from_hub", no_network)
    cache = fake_hub_cache(tmp_path / "hub", "org/chat-model", {"main": COMMIT_A})
    assert pin_target("org/chat-model", None, cache_dir=cache, offline=False) == (
        {"model": "org/chat-model", "revision": None, "kind": "hub", "commit": COMMIT_A}, "cache")
    with pytest.raises(UserError, match=r"the hub could not be reached \(ConnectionError\)"):
        pin_target("org/other", None, cache_dir=cache, offline=False)


# --- dvc.yaml --------------------------------------------------------------------------------

STAGES = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]


def _deps(stage) -> list[str]:
    return [d if isinstance(d, str) else next(iter(d)) for d in stage.get("deps", [])]


def _params(stage) -> list[str]:
    return [p if isinstance(p, str) else next(iter(p)) for p in stage.get("params", [])]


def _loads_target(stage) -> bool:
    script = ROOT / (stage["cmd"].split(" -m ", 1)[1].split()[0].replace(".", "/") + ".py")
    code = {f.relative_to(ROOT).as_posix() for f in code_files(script) if f.is_relative_to(ROOT)}
    return "draftlab/target/load.py" in code or any(p == "target" or p.startswith("target.") for p in _params(stage))


def test_every_stage_that_loads_the_target_depends_on_the_pin_and_none_on_a_folder():
    pinned = {name for name, s in STAGES.items() if PIN in _deps(s)}
    loads = {name for name, s in STAGES.items() if _loads_target(s) and name != "target"}
    assert loads == pinned and {"synthesize", "extract", "train", "bench", "check"} <= loads
    target = STAGES["target"]
    # the pin, and the folder a GGUF target is dequantized into (stages load it through the pin)
    assert [next(iter(o)) if isinstance(o, dict) else o for o in target["outs"]] == [PIN, "models/target-dequantized"]
    assert _params(target) == ["target.model", "target.revision"] and "always_changed" not in target
    for name, s in STAGES.items():
        assert not [d for d in _deps(s) if d.startswith("models/") and d != PIN and not d.startswith("models/draft")], name
    assert "tiny-target" not in (ROOT / "dvc.yaml").read_text()


# --- DVC: the pin re-runs exactly what it must -------------------------------------------------

def _sh(cmd, cwd):
    r = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(cwd), "DVC_NO_ANALYTICS": "1"})
    assert r.returncode == 0, f"{cmd} failed:\n{r.stdout}\n{r.stderr}"
    return r.stdout


def _ran(out: str) -> set[str]:
    return set(re.findall(r"Running stage '([^']+)'", out))


@pytest.mark.skipif(shutil.which("dvc") is None, reason="dvc not installed")
def test_dvc_reruns_what_loads_the_target_exactly_when_the_pin_changes(tmp_path):
    root = tmp_path / "p"
    for name in ("draftlab", "stages"):
        shutil.copytree(ROOT / name, root / name, ignore=shutil.ignore_patterns("__pycache__"))
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["target"]["model"] = "models/a"
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    a = root / "models" / "a"  # a folder transformers loads: the stage refuses one it cannot (tests/test_hostile_targets.py)
    save_micro_model(a, num_layers=1)
    (root / "dvc.yaml").write_text(yaml.safe_dump({"stages": {
        "target": STAGES["target"],
        "loads": {"cmd": f"{sys.executable} -c \"import shutil; shutil.copy('{PIN}', 'seen.json')\"",
                  "deps": [PIN], "params": ["target"], "outs": [{"seen.json": {"cache": False}}]}}}))
    _sh(["git", "init", "-q"], root)
    _sh(["dvc", "init", "-q"], root)
    assert _ran(_sh(["dvc", "repro"], root)) == {"target", "loads"}
    assert _ran(_sh(["dvc", "repro"], root)) == set()  # nothing changed: nothing runs, status clean
    assert "up to date" in _sh(["dvc", "status"], root)
    weights = (a / "model.safetensors").read_bytes()
    (a / "model.safetensors").write_bytes(weights[:-1] + bytes([weights[-1] ^ 1]))  # one weight byte
    assert _ran(_sh(["dvc", "repro"], root)) == set()  # an in-place edit is not seen (not always_changed) ...
    assert _ran(_sh(["dvc", "repro", "--force", "target"], root)) == {"target"}  # ... until the target is re-pinned
    assert _ran(_sh(["dvc", "repro"], root)) == {"loads"}  # and then only what the new pin changes re-runs
    shutil.copytree(a, root / "models" / "b")
    params["target"]["model"] = "models/b"  # another target: one params edit, no dvc.yaml edit
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    assert _ran(_sh(["dvc", "repro"], root)) == {"target", "loads"}
    assert json.loads((root / "seen.json").read_text())["model"] == "models/b"
