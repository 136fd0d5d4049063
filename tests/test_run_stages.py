"""`draftlab run-stages`: dvc.yaml's stages in dependency order where DVC is not installed, with a
profile merged in, skipping what is unchanged as `dvc repro` would (draftlab/experiments/run_stages.py)."""
import json
import os
import subprocess
import sys

import pytest
import yaml

from draftlab.errors import UserError
from draftlab.experiments.run_stages import stage_order
from tests.support.project import ROOT, reduced_project


def run(root, *args):
    env = {**os.environ, "PYTHONPATH": str(root), "DRAFTLAB_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "draftlab", "run-stages", *args], cwd=root, env=env, capture_output=True, text=True)
    return r.returncode, r.stdout + r.stderr


def ran(out: str) -> list[str]:
    return [line.split(":")[1].strip() for line in out.splitlines() if line.startswith("run-stages:") and line.endswith(" s")]


def test_the_order_puts_every_stage_after_what_it_reads():
    dvc = yaml.safe_load((ROOT / "dvc.yaml").read_text())
    order = stage_order(dvc)
    assert sorted(order) == sorted(dvc["stages"])
    assert order.index("target") < order.index("prompts") < order.index("synthesize")  # prompts reads the pin
    assert order.index("export") < order.index("bench") < order.index("check")


def test_a_profile_runs_the_stages_then_only_what_changed(tmp_path):
    root = reduced_project(tmp_path / "p")
    (root / "configs").mkdir()
    (root / "configs" / "small.yaml").write_text("prompts:\n  num_prompts: 16\nstandardize:\n  draft_vocab_size: 48\n")
    rc, out = run(root, "small", "--until", "standardize")
    assert rc == 0, out
    assert ran(out) == ["target", "prompts", "synthesize", "extract", "standardize"]
    params = yaml.safe_load((root / "params.yaml").read_text())
    assert params["prompts"]["num_prompts"] == 16 and params["standardize"]["draft_vocab_size"] == 48
    assert json.loads((root / "data/features/manifest.json").read_text())["params"]["standardize"]["draft_vocab_size"] == 48
    state = json.loads((root / ".run-stages.json").read_text())
    assert set(state) == {"target", "prompts", "synthesize", "extract", "standardize"} and all(s["seconds"] >= 0 for s in state.values())

    rc, out = run(root, "--until", "standardize")  # nothing changed: nothing runs
    assert rc == 0 and ran(out) == [] and out.count("unchanged, skipped") == 5
    rc, out = run(root, "-S", "standardize.draft_vocab_size=40", "--until", "standardize")  # one param: its stage only
    assert rc == 0 and ran(out) == ["standardize"], out

    rc, out = run(root, "-S", "standardize.draft_vocab_sise=40")
    assert rc == 2 and "did you mean standardize.draft_vocab_size?" in out and "Traceback" not in out
    rc, out = run(root, "--until", "nope")
    assert rc == 2 and "no stage 'nope'" in out

    # A damaged run record is set aside, named, and the stages run again (their outputs are remade).
    for damaged in ('{"target": 5', "[1, 2]", '{"target": 5}'):
        (root / ".run-stages.json").write_text(damaged)
        rc, out = run(root, "--until", "target")
        assert rc == 0 and ".run-stages.json" in out and "ignoring it" in out and "Traceback" not in out, out
        assert ran(out) == ["target"] and json.loads((root / ".run-stages.json").read_text())["target"]["seconds"] >= 0


def test_a_stage_that_fails_stops_the_run_naming_it(tmp_path, monkeypatch):
    root = reduced_project(tmp_path / "p")
    monkeypatch.chdir(root)
    p = yaml.safe_load((root / "params.yaml").read_text())
    p["target"]["model"] = "models/absent"
    (root / "params.yaml").write_text(yaml.safe_dump(p))
    from draftlab.experiments.run_stages import run_stages

    monkeypatch.setenv("PYTHONPATH", str(root))
    with pytest.raises(UserError, match=r"stage target failed \(exit 2\)"):
        run_stages([], until="prompts")
    assert not (root / ".run-stages.json").exists()
