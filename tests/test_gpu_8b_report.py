"""tools/gpu_8b_report.py: the committed GPU report is what the committed run's files give."""
import importlib.util
import json
import sys
from pathlib import Path

import pytest

from tests.support.json_same import same

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("gpu_8b_report", ROOT / "tools" / "gpu_8b_report.py")
tool = importlib.util.module_from_spec(spec)
sys.modules["gpu_8b_report"] = tool
spec.loader.exec_module(tool)
RUN = ROOT / "reports" / "gpu-8b" / "run"



def test_the_report_is_remade_from_the_run_files(tmp_path, capsys):
    tool.main([str(RUN), str(tmp_path)])
    made = json.loads((tmp_path / "results.json").read_text())
    same(made, json.loads((ROOT / "reports" / "gpu-8b" / "results.json").read_text()))
    for png in ("speedup.png", "concurrency.png", "tau.png"):
        assert (tmp_path / png).stat().st_size > 10_000
    table = capsys.readouterr().out
    for p in made["bs1"]:
        assert f"| {p['config']} |" in table


def test_every_point_is_paired_pooled_and_compared_with_each_advice():
    r = tool.build(RUN)
    assert {p["config"] for p in r["bs1"]} >= {"3-1-4", "5-1-6", "7-1-8", "5-4-8", "6-8-32"}
    for p in r["bs1"]:
        assert p["speedup"] == pytest.approx(p["spec_tokens_per_s"] / p["baseline_tokens_per_s"])
        for k, v in p["advice"].items():
            assert p["advice_error"][k] == pytest.approx(v / p["speedup"] - 1.0)
    bench = next(p for p in r["bs1"] if p["source"] == "bench stage")
    # the scaled model is calibrated on the bench stage's served round: at its tau it gives back the measurement
    assert bench["advice"]["scaled"] == pytest.approx(bench["speedup"], rel=0.01)
    assert r["tau"]["served"] == pytest.approx(r["tau"]["offline"], rel=0.02)


def test_each_configuration_in_flight_is_predicted_from_the_others_batches_with_and_without_batch_growth():
    r = tool.build(RUN)
    in_flight = [cfg for cfg, rows in r["concurrency"].items() if any("calibrated_on" in row for row in rows)]
    assert len(in_flight) >= 2  # the sweep's tree and chain, each calibrated on the other
    for cfg in in_flight:
        for row in r["concurrency"][cfg]:
            if row["concurrency"] > 1:
                assert row["calibrated_on"] != cfg and row["calibrated_on"] in in_flight
                assert row["error_same_batches"] == pytest.approx(row["predicted_same_batches"] / row["speedup"] - 1.0)
    # a 32-wide tree at 16 in flight verifies 512 tokens: its round grows more than a chain's
    growth = {cfg: rows[-1]["batch_growth_ms"] for cfg, rows in r["concurrency"].items() if "batch_growth_ms" in rows[-1]}
    assert growth["6-8-32"] > 4 * max(v for k, v in growth.items() if k.split("-")[1] == "1")
