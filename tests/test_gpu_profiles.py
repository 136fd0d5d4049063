"""The GPU runs as params profiles (configs/*.yaml): each loads over params.yaml, and the 8B profile
runs end to end on a CPU in its reduced form (the reference server for SGLang, a micro target): its
configuration sweep paired against one baseline, in flight, and the check's live parity against a
server the check stage starts itself (check.serve_parity)."""
import json
import os
import shutil
import subprocess
import sys

import pytest
import yaml

from draftlab.experiments.profiles import apply_profiles
from tests.support.project import REDUCED, ROOT, reduced_project

PROFILES = sorted((ROOT / "configs").glob("*.yaml"))


@pytest.mark.parametrize("profile", PROFILES, ids=[p.stem for p in PROFILES])
def test_every_profile_loads_over_params_yaml(profile):
    applied = apply_profiles([str(profile)], params_file=ROOT / "params.yaml")
    assert applied.keys and all(applied.origin[k] == str(profile) for k in applied.keys)


def test_the_8b_profile_sweeps_every_configuration_in_flight_beside_one_baseline():
    new = apply_profiles([str(ROOT / "configs/gpu-8b.yaml")], params_file=ROOT / "params.yaml").new
    assert new["bench.backend"] == "sglang" and new["bench.side_by_side"] and new["synth.backend"] == "sglang"
    assert new["bench.sweep"][-1] == "advised" and new["bench.concurrency"] == [1, 4, 8, 16] and new["check.serve_parity"]


@pytest.mark.parametrize("name", ["real-cpu", "real-gpu"])
def test_the_real_workload_profiles_measure_the_advices_pick(name):
    """The advice's recommendation is served and measured beside the listed configurations, so it never
    stands unmeasured (the new user's run recommended 1-1-2 and swept only 5-1-6)."""
    sweep = apply_profiles([str(ROOT / f"configs/{name}.yaml")], params_file=ROOT / "params.yaml").new["bench.sweep"]
    assert sweep[-1] == "advised" and sweep.count("advised") == 1 and len(sweep) >= 2


# The CPU form: the reduced project's sizes and the reference server, over the GPU profile.
CPU = {**REDUCED, "target": {**REDUCED["target"], "dtype": "float32"}, "synth": {**REDUCED["synth"], "backend": "hf"},
       "train": {**REDUCED["train"], "lr": 0.003}, "bench": {**REDUCED["bench"], "backend": "reference", "sweep": ["2-1-3", "advised"]},
       "check": {**REDUCED["check"], "serve_parity": True}}


def test_the_8b_profile_runs_on_a_cpu_against_the_reference_server(tmp_path):
    root = reduced_project(tmp_path / "p")
    (root / "configs").mkdir()
    shutil.copy(ROOT / "configs/gpu-8b.yaml", root / "configs/gpu-8b.yaml")
    (root / "configs/cpu.yaml").write_text(yaml.safe_dump(CPU))
    env = {**os.environ, "PYTHONPATH": str(root), "DRAFTLAB_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "draftlab", "run-stages", "gpu-8b", "cpu"], cwd=root, env=env,
                       capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    bench = json.loads((root / "reports/bench.json").read_text())
    names = [c["configuration"] for c in bench["configurations"]]
    assert names[:2] == ["5-1-6", "2-1-3"] and len(names) in (2, 3)  # spec.*'s first; advised unless already measured
    for c in bench["configurations"]:
        assert c["speedup"] > 0 and [p["concurrency"] for p in c["concurrency"]] == [2]
    assert list((root / "reports/bench").glob("*.png"))
    check = json.loads((root / "reports/check.json").read_text())
    ok = [f for f in check["findings"] if f["name"] == "live_parity_ok"]
    assert ok and ok[0]["evidence"]["source"].startswith("http://127.0.0.1:")  # a server the check started
