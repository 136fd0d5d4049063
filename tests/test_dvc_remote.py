"""Sharing runs through a DVC remote, as docs/sharing-runs.md tells users to.

In temporary directories: a local-path DVC remote, a bare git repository as `origin`, and clones
of a reduced project (micro target, few prompts and tokens, 1 epoch). Alice runs the pipeline
and pushes; Bob clones, pulls and finds everything up to date with the same metrics; an
experiment Alice pushes is pulled and applied by Bob with its outputs and metrics; Carol pulls
only the exported draft. Nothing leaves the machine (DVC analytics off in .dvc/config).
"""
import configparser
import json
import os
import re
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from draftlab.check.hardware import check_hardware
from draftlab.manifest import dir_hash
from tests.support.project import copy_run

ROOT = Path(__file__).resolve().parents[1]
CACHED = ["data/prompts", "data/synth", "data/hidden", "data/features", "models/draft-ckpt", "models/draft"]  # DVC-cached outs
MANIFESTS = {"prompts": "data/prompts", "synthesize": "data/synth", "extract": "data/hidden", "standardize": "data/features",
             "train": "models/draft-ckpt", "export": "models/draft", "bench": "reports/bench"}
TIMES: dict[str, float] = {}


def sh(cmd, cwd, check=True):
    t = time.perf_counter()
    env = {**os.environ, "PYTHONPATH": str(cwd), "DVC_NO_ANALYTICS": "1", "GIT_TERMINAL_PROMPT": "0"}
    r = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, env=env, check=False)
    TIMES[" ".join(map(str, cmd[:3]))] = TIMES.get(" ".join(map(str, cmd[:3])), 0.0) + time.perf_counter() - t
    if check and r.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, cmd))} in {cwd} failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")
    return r


def ran(output: str) -> set[str]:
    return set(re.findall(r"Running stage '([^']+)'", output))


def identity(repo: Path):
    """A committer inside the temp repo only (dvc exp run commits too); no global config needed."""
    sh(["git", "config", "user.name", "draftlab test"], repo)
    sh(["git", "config", "user.email", "test@draftlab.invalid"], repo)


def clone(origin: Path, dest: Path) -> Path:
    sh(["git", "clone", "-q", str(origin), str(dest)], dest.parent)
    identity(dest)
    return dest


@pytest.fixture(scope="module")
def shared(dvc_run, tmp_path_factory):
    """Alice has run the pipeline (a copy of the reduced project after its `dvc repro`, the run
    tests/test_pipeline_dvc.py starts from), commits, pushes git to origin and the data to the
    DVC remote; Bob clones origin and pulls."""
    base = tmp_path_factory.mktemp("sharing")
    storage, origin, alice = base / "dvc-storage", base / "origin.git", base / "alice"
    sh(["git", "init", "-q", "--bare", "-b", "main", str(origin)], base)
    copy_run(dvc_run[0], alice)
    sh(["git", "init", "-q", "-b", "main"], alice)
    identity(alice)
    sh(["dvc", "remote", "add", "-d", "storage", str(storage)], alice)
    sh(["dvc", "remote", "modify", "storage", "jobs", "4"], alice)
    sh(["git", "add", "-A"], alice)
    sh(["git", "commit", "-q", "-m", "pipeline run"], alice)
    sh(["git", "remote", "add", "origin", str(origin)], alice)
    sh(["git", "push", "-q", "origin", "main"], alice)
    push = sh(["dvc", "push", "-j", "2"], alice)
    sha = sh(["git", "rev-parse", "HEAD"], alice).stdout.strip()
    bob = clone(origin, base / "bob")
    pull = sh(["dvc", "pull"], bob)
    return {"base": base, "storage": storage, "origin": origin, "alice": alice, "bob": bob, "sha": sha,
            "repro": dvc_run[1], "push": push.stdout, "pull": pull.stdout}


def test_the_remote_is_committed_with_its_jobs_and_in_sync_after_push(shared):
    config = configparser.ConfigParser()
    config.read(shared["bob"] / ".dvc/config")  # as committed by Alice, cloned by Bob
    assert config["core"]["remote"] == "storage"  # -d: the default remote
    remote = config["'remote \"storage\"'"]
    assert remote["url"] == str(shared["storage"]) and remote["jobs"] == "4"
    assert "in sync" in sh(["dvc", "status", "--cloud"], shared["alice"]).stdout
    assert any(shared["storage"].rglob("*")) and "files pushed" in shared["push"]


def test_a_fresh_clone_pulls_everything_up_to_date_with_the_same_metrics(shared):
    alice, bob = shared["alice"], shared["bob"]
    for out in CACHED:  # byte for byte Alice's outputs
        assert (bob / out).is_dir() and dir_hash(bob / out, exclude=()) == dir_hash(alice / out, exclude=()), out
    status = sh(["dvc", "status"], bob).stdout
    assert "Data and pipelines are up to date." in status, status
    out = sh(["dvc", "repro"], bob).stdout
    assert ran(out) == set(), out
    assert "Stage 'check' didn't change, skipping" in out
    diff = sh(["dvc", "metrics", "diff", shared["sha"], "--json"], bob).stdout
    assert json.loads(diff) == {}, diff


def test_pulled_manifests_keep_their_hash_and_the_hardware_they_ran_on(shared):
    alice, bob = shared["alice"], shared["bob"]
    manifests = {stage: json.loads((bob / d / "manifest.json").read_text()) for stage, d in MANIFESTS.items()}
    for stage, m in manifests.items():
        a = json.loads((alice / MANIFESTS[stage] / "manifest.json").read_text())
        assert m["config_hash"] == a["config_hash"] and m["hardware"] == a["hardware"], stage
        assert m["hardware"]["cpu_count"] >= 1
    assert manifests["prompts"]["hardware"]["torch"] is None  # the prompts stage never imports torch
    assert manifests["train"]["hardware"]["torch"]["threads"] >= 1
    recorded = manifests["train"]["hardware"]
    assert check_hardware(manifests, recorded) == []  # re-checked on the machine that made them: nothing to say
    other = {**recorded, "cpu_model": "another CPU", "cpu_simd": [*recorded["cpu_simd"], "avx512f"]}
    [f] = check_hardware(manifests, other)  # Bob's machine, had it been another CPU type
    assert f.name == "hardware_differs" and set(f.evidence["stages"]) == set(MANIFESTS)


@pytest.fixture(scope="module")
def experiment(shared):
    """Alice runs an experiment and pushes it; Bob pulls and applies it."""
    alice, bob = shared["alice"], shared["bob"]
    run = sh(["dvc", "exp", "run", "-n", "steps3", "-S", "spec.num_steps=3"], alice)
    alice_bench = json.loads((alice / "reports/bench.json").read_text())
    alice_check = json.loads((alice / "reports/check.json").read_text())
    sh(["dvc", "exp", "push", "origin", "steps3"], alice)
    listed = sh(["dvc", "exp", "list", "origin"], bob).stdout
    pull = sh(["dvc", "exp", "pull", "origin", "steps3"], bob)
    apply = sh(["dvc", "exp", "apply", "steps3"], bob)
    return {"run": run.stdout, "alice_bench": alice_bench, "alice_check": alice_check, "listed": listed,
            "pull": pull.stdout, "apply": apply.stdout}


def test_an_experiment_reruns_only_bench_and_check(experiment):
    assert ran(experiment["run"]) == {"bench", "check"}, experiment["run"]
    assert experiment["alice_bench"]["settings"]["num_steps"] == 3


def test_a_pushed_experiment_is_pulled_and_applied_with_its_outputs_and_metrics(shared, experiment):
    bob = shared["bob"]
    assert "steps3" in experiment["listed"]  # visible on origin before the pull
    bench = json.loads((bob / "reports/bench.json").read_text())
    assert bench == experiment["alice_bench"]  # the experiment's metrics, as Alice measured them
    assert bench["settings"]["num_steps"] == 3 and bench["config_hash"] == experiment["alice_bench"]["config_hash"]
    assert json.loads((bob / "reports/check.json").read_text()) == experiment["alice_check"]
    bench_manifest = json.loads((bob / "reports/bench/manifest.json").read_text())
    assert bench_manifest["config_hash"] == bench["config_hash"] and bench_manifest["params"]["spec"]["num_steps"] == 3
    assert yaml.safe_load((bob / "params.yaml").read_text())["spec"]["num_steps"] == 3
    status = sh(["dvc", "status"], bob).stdout
    assert "Data and pipelines are up to date." in status, status  # outputs, lock and params agree
    diff = json.loads(sh(["dvc", "metrics", "diff", shared["sha"], "--json"], bob).stdout)
    assert diff["reports/bench.json"]["settings.num_steps"] == {"old": 5, "new": 3, "diff": -2}


def test_pull_only_what_a_stage_needs(shared):
    carol = clone(shared["origin"], shared["base"] / "carol")
    sh(["dvc", "pull", "export"], carol)  # the exported draft: no hidden states, no features
    assert (carol / "models/draft/manifest.json").is_file()
    assert dir_hash(carol / "models/draft", exclude=()) == dir_hash(shared["alice"] / "models/draft", exclude=())
    for absent in ("data/hidden", "data/features", "models/draft-ckpt", "data/synth"):
        assert not (carol / absent).exists(), absent
    sh(["dvc", "pull", "models/draft-ckpt", "data/prompts"], carol)  # by path, the same way
    assert (carol / "models/draft-ckpt/manifest.json").is_file() and (carol / "data/prompts/eval.jsonl").is_file()
    assert not (carol / "data/hidden").exists()


def test_report_timings(shared):
    print("\n" + "\n".join(f"{k}: {v:.1f}s" for k, v in sorted(TIMES.items(), key=lambda kv: -kv[1])))
