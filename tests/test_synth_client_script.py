"""benchmarks/synth_client.py drives the stage's openai client against its stand-in servers and says how fast."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_client_answers_every_turn_over_both_servers_near_the_ideal_rate(tmp_path):
    out = tmp_path / "r.json"
    r = subprocess.run([sys.executable, "benchmarks/synth_client.py", "--quick", "--out", str(out)], cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(out.read_text())
    assert (got["turns"], got["errors"]) == (300 * 3, 0)  # every turn of every conversation
    # 64 conversations in flight, each sticking to one of two servers: both take a fair share
    assert sum(got["requests_per_server"]) == 900 and min(got["requests_per_server"]) > 300
    # Each turn waits 0.2 s on its server, so 64 in flight bound the rate at 320 turns/s: a client that
    # waited on its requests one after another would reach 1/64 of it. The floor is loose (a loaded
    # 2-core machine reaches ~70%); the benchmark itself prints the figure.
    assert got["turns_per_s"] > 0.25 * got["ideal_turns_per_s"]
    assert "turns/s" in r.stdout
