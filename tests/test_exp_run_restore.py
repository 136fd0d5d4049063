"""A failed `draftlab exp run` leaves the workspace as it found it (draftlab/experiments/workspace.py): params.yaml,
dvc.lock and the target pin put back, outputs the run made removed, outputs it changed checked out
from DVC's cache, the failed stage's resumable output kept and named, and anything else listed."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

from draftlab.experiments.workspace import Snapshot
from tests.support.micro import save_micro_model
from tests.support.project import reduced_project


def git(root: Path, *argv) -> str:
    return subprocess.run(["git", *argv], cwd=root, check=True, capture_output=True, text=True).stdout


def snapshot_files(root: Path, names) -> dict:
    return {n: (root / n).read_bytes() for n in names}


def test_a_run_that_fails_at_a_stage_puts_the_workspace_back(tmp_path):
    """The new user's case: a profile that changes the target, whose run gets past the target and the
    prompts and then fails (here: synthesis against a server that is not there)."""
    root = reduced_project(tmp_path / "project")
    save_micro_model(root / "models" / "micro2", arch="llama", num_layers=4)
    env = {**os.environ, "PYTHONPATH": str(root), "DVC_NO_ANALYTICS": "1"}
    git(root, "init", "-q")
    git(root, "config", "user.name", "draftlab test")
    git(root, "config", "user.email", "test@draftlab.invalid")
    r = subprocess.run([sys.executable, "-m", "dvc", "repro", "prompts"], cwd=root, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    shutil.rmtree(root / "models" / "target-dequantized")  # as a fresh clone has it before dvc pull: absent
    profile = {"target": {"model": "models/micro2"}, "prompts": {"num_prompts": 16},
               "synth": {"backend": "openai", "base_url": "http://127.0.0.1:9/v1", "model_name": "m", "max_retries": 0,
                         "timeout_s": 5.0}}
    (root / "configs").mkdir()
    (root / "configs" / "broken.yaml").write_text(yaml.safe_dump(profile))
    git(root, "add", "-A")
    git(root, "commit", "-qm", "baseline")
    names = ["params.yaml", "dvc.lock", "models/target-pin.json", "reports/prompts.json", "data/.gitignore",
             "models/.gitignore", *sorted(p.relative_to(root).as_posix() for p in (root / "data/prompts").iterdir())]
    before = snapshot_files(root, names)

    r = subprocess.run([sys.executable, "-m", "draftlab", "exp", "run", "broken"], cwd=root, env=env, capture_output=True,
                       text=True)
    assert r.returncode != 0
    # the run did change what it is now asked to put back: a new pin, new prompts, then synthesis failed
    assert "Running stage 'target'" in r.stdout and "Running stage 'synthesize'" in r.stdout, r.stdout + r.stderr
    assert snapshot_files(root, names) == before
    assert not (root / "models" / "target-dequantized").exists()  # made by the run, removed
    assert git(root, "status", "--porcelain") == "?? data/synth/\n"  # the failed stage's answers so far, kept for a resume
    tail = r.stderr[r.stderr.index("draftlab exp run: dvc exp run failed"):].splitlines()
    assert "params.yaml" in tail[1] and "models/target-pin.json" in tail[1] and "dvc.lock" in tail[1]
    assert tail[2] == "  removed (the run made it): models/target-dequantized"
    assert tail[3] == "  checked out from DVC's cache: data/self-prompts, data/prompts"
    assert tail[4].startswith("  kept: data/synth: stage synthesize stopped in it") and "rm -r data/synth" in tail[4]
    assert len(tail) == 5


def project(root: Path) -> Path:
    """A folder with a dvc.yaml of one stage: a cached output, a non-cached metric, a persistent output."""
    root.mkdir()
    (root / "dvc.yaml").write_text(yaml.safe_dump({"stages": {"make": {
        "cmd": "true", "outs": ["out/cached", {"out/resume": {"persist": True}}],
        "metrics": [{"reports/m.json": {"cache": False}}]}}}))
    (root / "params.yaml").write_text("a:\n  b: 1\n")
    (root / "reports").mkdir()
    (root / "reports/m.json").write_text(json.dumps({"tau": 2.0}))
    return root


def test_what_the_run_made_goes_what_it_changed_comes_back_and_the_rest_is_listed(tmp_path, monkeypatch):
    root = project(tmp_path / "p")
    git(root, "init", "-q")
    monkeypatch.chdir(root)
    snap = Snapshot.take(Path("params.yaml"))
    (root / "params.yaml").write_text("a:\n  b: 2\n")  # what dvc exp run -S does
    (root / "reports/m.json").unlink()  # DVC removes a stage's outputs before running it
    (root / "out/cached").mkdir(parents=True)
    (root / "out/cached/x.bin").write_bytes(b"half")
    (root / "dvc.lock").write_text("schema: '2.0'\n")
    (root / "notes.txt").write_text("written while the run ran")
    outcome = snap.restore()
    assert (root / "params.yaml").read_text() == "a:\n  b: 1\n" and json.loads((root / "reports/m.json").read_text()) == {"tau": 2.0}
    assert not (root / "out/cached").exists() and not (root / "dvc.lock").exists()
    assert (root / "notes.txt").exists()  # not dvc.yaml's: never removed, only named
    assert sorted(outcome.restored) == ["params.yaml", "reports/m.json"] and sorted(outcome.removed) == ["dvc.lock", "out/cached"]
    left = dict(outcome.left)
    assert "not an output dvc.yaml names" in left["notes.txt"]
    text = outcome.text(1)
    assert "left: notes.txt" in text and "removed (the run made it): " in text
    assert text.splitlines()[-1].endswith(str(snap.backup)) and snap.backup.is_dir()  # something is left: the copies stay
    snap.discard()


def test_keep_failed_changes_nothing_and_says_how_to_undo(tmp_path, monkeypatch):
    root = project(tmp_path / "p")
    monkeypatch.chdir(root)
    snap = Snapshot.take(Path("params.yaml"))
    (root / "params.yaml").write_text("a:\n  b: 2\n")
    (root / "out/cached").mkdir(parents=True)
    outcome = snap.restore(act=False)
    assert (root / "params.yaml").read_text() == "a:\n  b: 2\n" and (root / "out/cached").is_dir()
    text = outcome.text(1, acted=False)
    assert "--keep-failed" in text and "(undo: rm -r out/cached)" in text
    assert f"changed: params.yaml (as they were before the run: copies in {snap.backup})" in text
    assert any(p.read_text() == "a:\n  b: 1\n" for p in snap.backup.iterdir())
    snap.discard()


def test_a_run_that_changes_nothing_says_so(tmp_path, monkeypatch):
    root = project(tmp_path / "p")
    monkeypatch.chdir(root)
    snap = Snapshot.take(Path("params.yaml"))
    outcome = snap.restore()
    assert outcome.text(2) == "draftlab exp run: dvc exp run failed (exit 2); the workspace is as the run found it"
    assert not snap.backup.exists()
