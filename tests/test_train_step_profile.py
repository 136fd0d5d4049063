"""DRAFTLAB_TRAIN_PROFILE: the train stage traces its own steps and says where their time went."""
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from draftlab.errors import UserError
from draftlab.tracing import gpu_busy_share
from draftlab.train.profile import ENV, requested
from test_train import write_params
from tiny_features import training_kit

ROOT = Path(__file__).resolve().parents[1]


def test_the_variable_names_the_first_step_and_optionally_how_many():
    assert requested("") is None and requested("  ") is None
    assert requested("100") == (100, 3)
    assert requested("7:5") == (7, 5)
    for bad in ("x", "0", "5:0", "3:y", "-2"):
        with pytest.raises(UserError, match=f"{ENV}=.*N or N:COUNT"):
            requested(bad)


def test_the_gpu_busy_share_is_the_union_of_kernels_over_the_traced_window():
    def event(kind, a, b):
        return types.SimpleNamespace(device_type=types.SimpleNamespace(name=kind), time_range=types.SimpleNamespace(start=a, end=b))

    # host events span 0-100 us; kernels 10-30 and 20-40 overlap (30 us), 60-70 adds 10: 40% busy
    events = [event("CPU", 0, 100), event("CUDA", 10, 30), event("CUDA", 20, 40), event("CUDA", 60, 70)]
    assert abs(gpu_busy_share(events) - 0.4) < 1e-9
    assert gpu_busy_share([event("CPU", 0, 5)]) is None


def run_stage(root: Path, out: str, profile: str):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", ENV: profile}
    cmd = [sys.executable, "-m", "stages.train", "--features", "features", "--out", out, "--reports", f"reports/{out}",
           "--resume-dir", f"resume-{out}"]
    return subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=240)


def test_the_stage_traces_the_steps_asked_for_and_names_where_the_host_spent_them(tmp_path):
    kit = training_kit(tmp_path / "kit")
    root = kit["root"]
    write_params(root, root / "target")
    r = run_stage(root, "traced", "2:2")
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads((root / "reports/traced/step-profile.json").read_text())
    assert got["steps"] == [2, 3]
    assert got["gpu_busy_share"] is None and got["gpu_kernel_time"] == []  # a CPU run: no kernels
    assert got["wall_s_per_step"] > 0
    names = [e["name"] for e in got["host_self_time"]]
    assert names and all(e["ms_per_step"] > 0 for e in got["host_self_time"])
    assert any(n.startswith("aten::") for n in names)  # the step's own operators
    assert f"steps 2-3 traced ({ENV})" in r.stdout

    late = run_stage(root, "late", "100000")
    assert late.returncode == 0, late.stderr[-3000:]
    assert "nothing traced: step 100000 is not among the steps this process ran" in late.stdout and not (root / "reports/late/step-profile.json").exists()

    bad = run_stage(root, "bad", "soon")
    assert bad.returncode != 0 and f"{ENV}='soon'" in bad.stderr
