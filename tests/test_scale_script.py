"""benchmarks/data_parallel.py (DDP training and data-parallel extraction) end to end on a CPU: 2 processes over gloo."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_quick_run_compares_one_and_two_processes(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks/data_parallel.py"), "--quick", "--out", str(tmp_path)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads((tmp_path / "results.json").read_text())
    tr, ex = res["training"], res["extraction"]
    assert "error" not in tr and "error" not in ex, (tr.get("error"), ex.get("error"))
    # The same global batch in 1 and 2 processes: the same loss at every step, up to float rounding.
    assert len(tr["loss_1proc"]) == len(tr["loss_2proc"]) == res["meta"]["plan"]["steps"]
    assert tr["loss_max_rel_diff"] < 1e-5 and all(math.isfinite(x) for x in tr["loss_1proc"])
    assert tr["tokens_per_s_1proc"] > 0 and tr["scaling_efficiency"] > 0
    # Two writers produce the single writer's shards, byte for byte.
    assert ex["shards"] >= 4 and ex["shards_identical"] is True and ex["device_2proc"] == "cpu x 2 processes"
    assert not (tmp_path / "work").exists()  # the synthetic data and weights are not kept
    assert (tmp_path / "logs" / "extract-2.log").read_text().startswith("$ ")
