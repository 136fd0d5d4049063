"""`draftlab run-stages`: dvc.yaml's stages in dependency order where DVC is not installed, with a
profile merged in, skipping what is unchanged as `dvc repro` would (draftlab/experiments/run_stages.py)."""
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pandas as pd
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
    assert ran(out) == ["target", "self_prompts", "prompts", "synthesize", "extract", "standardize"]
    params = yaml.safe_load((root / "params.yaml").read_text())
    assert params["prompts"]["num_prompts"] == 16 and params["standardize"]["draft_vocab_size"] == 48
    assert json.loads((root / "data/features/manifest.json").read_text())["params"]["standardize"]["draft_vocab_size"] == 48
    state = json.loads((root / ".run-stages.json").read_text())
    assert set(state) == {"target", "self_prompts", "prompts", "synthesize", "extract", "standardize"} and all(s["seconds"] >= 0 for s in state.values())

    rc, out = run(root, "--until", "standardize")  # nothing changed: nothing runs
    assert rc == 0 and ran(out) == [] and out.count("unchanged, skipped") == 6
    rc, out = run(root, "-S", "standardize.draft_vocab_size=40", "--until", "standardize")  # one param: its stage only
    assert rc == 0 and ran(out) == ["standardize"], out

    # An output written over after its stage completed (a checkout laid over the run's tree): the stage runs
    # again, as dvc repro would, and not the ones whose outputs are as they were left.
    manifest = root / "data/prompts/manifest.json"
    manifest.write_text(manifest.read_text())
    rc, out = run(root, "--until", "standardize")
    assert rc == 0 and "prompts: its outputs changed since it completed" in out and ran(out)[0] == "prompts", out
    assert "target: unchanged, skipped" in out and "self_prompts: unchanged, skipped" in out
    rc, out = run(root, "--until", "standardize")
    assert rc == 0 and ran(out) == [], out

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


def test_a_node_without_dvc_runs_profiles_and_plain_minus_s_and_names_what_a_sweep_needs(tmp_path):
    """A GPU node with no git/DVC (tools/offline_gpu_run.sh) has no hydra-core either: a profile
    still runs, and so does -S with one plain value; a sweep, read in Hydra's grammar as DVC reads
    it, needs hydra-core, and says so."""
    root = reduced_project(tmp_path / "p")
    blocked = tmp_path / "blocked" / "hydra"
    blocked.mkdir(parents=True)
    (blocked / "__init__.py").write_text("raise ImportError('hydra-core is not installed on this node')\n")
    env = {**os.environ, "PYTHONPATH": f"{blocked.parent}{os.pathsep}{root}", "DRAFTLAB_THREADS": "1"}
    go = lambda *a: subprocess.run([sys.executable, "-m", "draftlab", "run-stages", *a], cwd=root, env=env,  # noqa: E731
                                   capture_output=True, text=True)
    r = go("--until", "target")
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stdout + r.stderr
    r = go("-S", "prompts.num_prompts=16", "-S", "target.dtype=float32", "--until", "target")
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stdout + r.stderr
    params = yaml.safe_load((root / "params.yaml").read_text())
    assert params["prompts"]["num_prompts"] == 16 and params["target"]["dtype"] == "float32"
    r = go("-S", "prompts.num_prompts=16,32", "--until", "target")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "-S prompts.num_prompts=16,32: " in r.stderr + r.stdout and "pip install hydra-core" in r.stderr + r.stdout


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


def test_a_sweep_runs_every_point_upstream_keys_slowest_keeps_each_and_resumes(tmp_path):
    """-S values in dvc exp run's sweep grammar make a grid: 2 x 2 points, the prompts key (read by an
    earlier stage) varying slowest, so prompts runs twice and standardize four times; each point's
    reports are kept apart, grid.csv has a row each, and a second run skips the points done."""
    root = reduced_project(tmp_path / "p")
    sweep = ["-S", "standardize.draft_vocab_size=choice(40,48)", "-S", "prompts.num_prompts=12,16", "--until", "standardize"]
    (root / "reports").mkdir(exist_ok=True)
    (root / "reports" / "bench.json").write_text(json.dumps({"tau": 9.9, "speedup": 9.9}))  # an older run's
    rc, out = run(root, *sweep)
    assert rc == 0, out
    assert "a grid of 4 points over prompts.num_prompts, standardize.draft_vocab_size" in out
    assert ran(out).count("prompts") == 2 and ran(out).count("standardize") == 4 and ran(out).count("target") == 1
    names = ["01-num_prompts=12-draft_vocab_size=40", "02-num_prompts=12-draft_vocab_size=48",
             "03-num_prompts=16-draft_vocab_size=40", "04-num_prompts=16-draft_vocab_size=48"]
    assert sorted(p.name for p in (root / "runs").iterdir() if p.is_dir()) == names
    for name in names:  # each point's own reports and params, as that point made them
        n, v = (int(x.split("=")[1]) for x in name.split("-")[1:])
        kept = root / "runs" / name
        assert yaml.safe_load((kept / "params.yaml").read_text())["standardize"]["draft_vocab_size"] == v
        assert json.loads((kept / "data/features/manifest.json").read_text())["params"]["standardize"]["draft_vocab_size"] == v
        assert json.loads((kept / "data/prompts/manifest.json").read_text())["params"]["prompts"]["num_prompts"] == n
        assert json.loads((kept / "point.json").read_text())["finished"] is True
    grid = (root / "runs" / "grid.csv").read_text().splitlines()
    assert grid[0].startswith("point,prompts.num_prompts,standardize.draft_vocab_size,tau_pred,decoded_tau_first_turns,served_tau")
    assert len(grid) == 5
    assert all("9.9" not in row for row in grid[1:])  # the bench did not run for these points: no served figure

    rc, out = run(root, *sweep)  # every point done: nothing runs
    assert rc == 0 and ran(out) == [] and out.count("done before, skipped") == 4, out
    rc, out = run(root, "-S", "prompts.num_prompts=interval(1,2)")
    assert rc == 2 and "interval() needs a sampler" in out and "Traceback" not in out


def test_a_gpu_node_packs_reports_manifests_and_a_grids_points_but_no_data(tmp_path):
    """tools/offline_gpu_run.sh packs with draftlab.experiments.grid.pack: what a grid keeps per point,
    and the grid's runs/ folder itself, so a sweep run on a node comes back whole; never the data."""
    import tarfile

    from draftlab.experiments.grid import pack

    files = {"reports/train/metrics.json": "{}", "params.yaml": "a: 1\n", ".run-stages.json": "{}",
             "data/synth/manifest.json": "{}", "data/synth/train.jsonl": "big\n", "models/draft/config.json": "{}",
             "models/draft/model.safetensors": "weights", "runs/01-epochs=3/point.json": "{}", "runs/grid.csv": "point\n",
             "data/prompts/eval.jsonl": "{}\n"}
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    out = tmp_path / "results.tar.gz"
    pack(out, tmp_path)
    with tarfile.open(out) as tar:
        names = {m.name for m in tar.getmembers() if m.isfile()}
    assert names == set(files) - {"data/synth/train.jsonl", "models/draft/model.safetensors"}
    assert not (tmp_path / "results.tar.gz.tmp").exists()
    (tmp_path / "data/synth/.answers.json").write_text("{}")  # the answers' resume key, beside them
    own = {"data/self-prompts/prompts.jsonl", "data/self-prompts/.written.json"}  # the target's own prompts and their key
    for name in own:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("{}\n")
    pack(out, tmp_path)
    with tarfile.open(out) as tar:
        assert not own & {m.name for m in tar.getmembers()}
    pack(out, tmp_path, answers=True)  # DRAFTLAB_PACK_ANSWERS=1: the answers too, for the next node to reuse
    with tarfile.open(out) as tar:
        names = {m.name for m in tar.getmembers() if m.isfile()}
    assert names == set(files) - {"models/draft/model.safetensors"} | {"data/synth/.answers.json"} | own
    pack(out, tmp_path, draft=True)  # DRAFTLAB_PACK_DRAFT=1: the exported checkpoint too, each file once
    with tarfile.open(out) as tar:
        members = [m.name for m in tar.getmembers() if m.isfile()]
    assert set(members) == set(files) - {"data/synth/train.jsonl"} and len(members) == len(set(members))
    (tmp_path / "models/.train-resume").mkdir(parents=True)
    (tmp_path / "models/.train-resume/last.pt").write_text("step 2800")  # a training the node's time limit stopped
    pack(out, tmp_path, draft=True)
    with tarfile.open(out) as tar:
        assert "models/.train-resume/last.pt" not in tar.getnames()
    pack(out, tmp_path, answers=True, resume=True)  # DRAFTLAB_PACK_RESUME=1: the next node's train goes on from it
    with tarfile.open(out) as tar:
        names = {m.name for m in tar.getmembers() if m.isfile()}
    assert "models/.train-resume/last.pt" in names and "data/synth/train.jsonl" in names


def test_a_grid_row_carries_the_decoded_tau_at_the_points_served_depth_so_a_train_only_grid_ranks_its_points(tmp_path):
    """grid.csv's decoded_tau_first_turns: the train metrics' greedy chains over the eval split's first
    answers at the point's own spec.num_steps; none where train did not run for the point."""
    from draftlab.experiments.grid import summary_row

    def point(name, steps, stages):
        folder = tmp_path / name
        (folder / "reports/train").mkdir(parents=True)
        (folder / "point.json").write_text(json.dumps({"swept": [f"spec.num_steps={steps}"], "stages": [{"stage": s} for s in stages],
                                                       "seconds": 12.5}))
        (folder / "params.yaml").write_text(yaml.safe_dump({"spec": {"num_steps": steps}}))
        (folder / "reports/train/metrics.json").write_text(json.dumps(
            {"tau_pred": 2.6, "tau_decoded_first_turns_by_steps": {f"steps_{n}": 1.0 + 0.25 * n for n in range(1, 8)}}))
        return folder

    row = summary_row(point("01-num_steps=3", 3, ["train"]), ["spec.num_steps"])
    assert row["decoded_tau_first_turns"] == 1.75 and row["tau_pred"] == 2.6 and row["spec.num_steps"] == "3"
    assert summary_row(point("02-num_steps=5", 5, ["train"]), ["spec.num_steps"])["decoded_tau_first_turns"] == 2.25
    assert summary_row(point("03-num_steps=5", 5, ["extract"]), ["spec.num_steps"])["decoded_tau_first_turns"] is None


def write_wheel(folder, name: str, version: str):
    """A pure-Python wheel of one module `name` whose VERSION is `version` (no build tool needed)."""
    import zipfile

    folder.mkdir(parents=True, exist_ok=True)
    dist = f"{name}-{version}.dist-info"
    files = {f"{name}/__init__.py": f"VERSION = {version!r}\n",
             f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
             f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    files[f"{dist}/RECORD"] = "".join(f"{p},,\n" for p in files) + f"{dist}/RECORD,,\n"
    with zipfile.ZipFile(folder / f"{name}-{version}-py3-none-any.whl", "w") as z:
        for path, text in files.items():
            z.writestr(path, text)


def test_a_gpu_node_installs_the_wheels_once_and_again_only_when_they_change(tmp_path):
    """tools/offline_gpu_run.sh on a resume: the same wheels are not installed again (minutes on a
    GPU node); other wheels are, replacing the old versions."""
    root = reduced_project(tmp_path / "p")
    wheels, results = tmp_path / "wheels", tmp_path / "results"
    write_wheel(wheels, "nodepkg", "0.1")
    env = {**os.environ, "PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}"}

    def node_run(**more_env):
        r = subprocess.run(["bash", str(ROOT / "tools/offline_gpu_run.sh"), str(wheels), str(results), "--help"], cwd=root,
                           env={**env, **more_env}, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stdout + r.stderr
        return r.stdout + r.stderr

    (root / "data/synth").mkdir(parents=True, exist_ok=True)
    (root / "data/synth/train.jsonl").write_text("{}\n")
    said = node_run()
    assert "already installed" not in said and f"packed {results}/results.tar.gz" in said  # packed on the way out
    with tarfile.open(results / "results.tar.gz") as tar:
        assert "data/synth/train.jsonl" not in tar.getnames()
    node_run(DRAFTLAB_PACK_ANSWERS="1")  # the answers too, for the next node
    with tarfile.open(results / "results.tar.gz") as tar:
        assert "data/synth/train.jsonl" in tar.getnames()
    (root / "models/draft").mkdir(parents=True, exist_ok=True)
    (root / "models/draft/model.safetensors").write_text("weights")
    node_run(DRAFTLAB_PACK_DRAFT="1")  # the exported draft too
    with tarfile.open(results / "results.tar.gz") as tar:
        assert "models/draft/model.safetensors" in tar.getnames() and "data/synth/train.jsonl" not in tar.getnames()
    (root / "models/.train-resume").mkdir(parents=True, exist_ok=True)
    (root / "models/.train-resume/last.pt").write_text("checkpoint")
    node_run(DRAFTLAB_PACK_RESUME="1")  # a training stopped midway: its checkpoint, for the next node to go on from
    with tarfile.open(results / "results.tar.gz") as tar:
        assert "models/.train-resume/last.pt" in tar.getnames() and "models/draft/model.safetensors" not in tar.getnames()
    assert "VERSION = '0.1'" in (results / "site/nodepkg/__init__.py").read_text()
    assert "the same 1 already installed" in node_run()
    (wheels / "nodepkg-0.1-py3-none-any.whl").unlink()
    write_wheel(wheels, "nodepkg", "0.2")
    assert "already installed" not in node_run()
    assert "VERSION = '0.2'" in (results / "site/nodepkg/__init__.py").read_text()


def test_a_points_folder_names_each_swept_key_as_the_study_does():
    """runs/<point>/ names a key by its last part, unless that says nothing on its own: self_prompts.count is
    'self_prompts' (the study's column), so a grid over it is not a folder of 'count=...'."""
    from draftlab.experiments.grid import point_name

    assert point_name(1, ["self_prompts.count=20000", "train.epochs=6"]) == "02-self_prompts=20000-epochs=6"
    assert point_name(0, ['train.lr="0.002"']) == "01-lr=0.002"


def fake_stages(calls):
    """run_stages as a grid calls it, without running anything: records each point's overrides and
    leaves a train report whose tau is the point's ttt_steps (or 1), as a finished train stage would."""
    def run_stages(profiles, overrides, until, force, params_file, dvc_file=None):
        calls.append(list(overrides))
        values = dict(o.split("=", 1) for o in overrides)
        report = Path("reports/train/metrics.json")
        report.parent.mkdir(parents=True, exist_ok=True)
        report.write_text(json.dumps({"tau_pred": float(values.get("train.ttt_steps", 1))}))
        return [{"stage": "train", "seconds": 1.0}]
    return run_stages


def test_one_at_a_time_runs_each_swept_key_alone_and_grids_into_one_folder_add_up(tmp_path, monkeypatch):
    """--one-at-a-time: the base, then each key's values alone against it, the earliest stage's key first (1 + 2
    + 2 points, not 4), a single -S value in every point; a second grid into the same runs/ keeps the first's
    points, and grid.csv lists all of them, a key a point did not sweep left empty."""
    from draftlab.experiments import grid, run_stages as module

    calls = []
    monkeypatch.setattr(module, "run_stages", fake_stages(calls))
    monkeypatch.chdir(tmp_path)
    sets = ["train.ttt_steps=5,9", "standardize.draft_vocab_size=choice(8192,32768)", "train.lr=0.002"]
    grid.run_grid([], sets, "train", [], "params.yaml", ROOT / "dvc.yaml", "runs", one_at_a_time=True)
    assert calls == [["train.lr=0.002"], ["train.lr=0.002", "standardize.draft_vocab_size=8192"],
                     ["train.lr=0.002", "standardize.draft_vocab_size=32768"], ["train.lr=0.002", "train.ttt_steps=5"],
                     ["train.lr=0.002", "train.ttt_steps=9"]]
    names = ["01-base", "02-draft_vocab_size=8192", "03-draft_vocab_size=32768", "04-ttt_steps=5", "05-ttt_steps=9"]
    assert sorted(p.name for p in (tmp_path / "runs").iterdir() if p.is_dir()) == names

    grid.run_grid([], ["train.epochs=3,6"], "train", [], "params.yaml", ROOT / "dvc.yaml", "runs")
    assert len(calls) == 7
    table = pd.read_csv(tmp_path / "runs/grid.csv")
    assert list(table.columns[:4]) == ["point", "train.epochs", "standardize.draft_vocab_size", "train.ttt_steps"]
    assert table["point"].tolist() == ["01-epochs=3", "02-epochs=6", *names]
    assert table["tau_pred"].tolist() == [1.0, 1.0, 1.0, 1.0, 1.0, 5.0, 9.0]
    assert table["train.ttt_steps"].isna().tolist() == [True] * 5 + [False] * 2  # the profiles' value: not swept there

    grid.run_grid([], sets, "train", [], "params.yaml", ROOT / "dvc.yaml", "runs", one_at_a_time=True)
    assert len(calls) == 7  # every point done before: skipped


def test_one_at_a_time_without_a_sweep_is_refused(tmp_path):
    root = tmp_path / "p"
    root.mkdir()
    rc, out = run(root, "-S", "train.epochs=3", "--one-at-a-time")
    assert rc == 2 and "--one-at-a-time" in out and "several values" in out and "Traceback" not in out, out
