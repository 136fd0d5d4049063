"""benchmarks/train_throughput.py runs end to end on a CPU (its tiny shape) and reports what it says."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_benchmark_times_both_batchings_and_packed_batches_pad_less(tmp_path):
    out = tmp_path / "r.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("DRAFTLAB_PEAK_FLOPS", None)
    r = subprocess.run([sys.executable, "benchmarks/train_throughput.py", "--warmup", "1", "--steps", "3", "--out", str(out)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    padded, tokens = json.loads(out.read_text())["results"]
    assert padded["mode"].startswith("padded") and tokens["mode"].startswith("packed")
    assert padded["steps"] == tokens["steps"] == 3 and padded["tokens_per_s"] > 0 and tokens["tokens_per_s"] > 0
    assert tokens["padding_share"] < padded["padding_share"] / 2
    assert padded["mfu"] is None and 0 < padded["target_flop_share"] < 1  # no peak on a CPU; both parts counted
    assert "tok/s" in r.stdout and "FLOPs per real token" in r.stdout
