"""tools/same_batches_report.py: the committed same-batches report is what its run files give, and
each figure in it is the reading it names."""
import json
from pathlib import Path

import pytest

from tests.support.tools import load_tool
from tests.support.json_same import same

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "reports" / "gpu-8b" / "same-batches"
tool = load_tool("same_batches_report")


def test_the_report_is_remade_from_the_run_files(tmp_path, capsys):
    tool.main([str(OUT / "run"), str(ROOT / "reports" / "gpu-8b" / "run" / "bench.json"), str(tmp_path)])
    same(json.loads((tmp_path / "results.json").read_text()), json.loads((OUT / "results.json").read_text()))
    assert (tmp_path / "same-batches.png").stat().st_size > 10_000
    assert "| 5-1-6 | 6-8-32 | 16 |" in capsys.readouterr().out


def test_the_repeats_predictions_and_log_rounds_are_what_they_say():
    r = tool.build(OUT / "run", ROOT / "reports" / "gpu-8b" / "run" / "bench.json")
    sweep = json.loads((OUT / "run" / "sweep.json").read_text())
    entry = sweep["configs"]["8-1-9"]["concurrency"][1]  # 8 in flight
    pairs = [s["tokens_per_s"] / b["tokens_per_s"] for b, s in zip(entry["baseline"]["batches"], entry["spec"]["batches"])]
    row = next(x for x in r["configs"]["8-1-9"] if x["concurrency"] == 8)
    assert row["repeat_speedups"] == pytest.approx(pairs)
    assert row["repeat_spread"] == pytest.approx(max(pairs) / min(pairs) - 1)
    for p in r["predictions"]:
        assert p["calibrated_on"] != p["config"]
        assert p["error_same_batches"] == pytest.approx(p["predicted_same_batches"] / p["measured"] - 1)
    assert r["summary"]["predictions"] == len(r["predictions"]) == 3 * 2 * 3  # 3 configs, each from 2 others, at 4/8/16
    # the baseline's step at n running: n / throughput of its Decode lines at exactly n
    assert set(r["sglang_rounds_ms"]) == {"baseline", "spec-5-1-6", "spec-6-8-32", "spec-8-1-9"}
    assert 4 < r["sglang_rounds_ms"]["baseline"]["4"]["median_ms"] < r["sglang_rounds_ms"]["baseline"]["16"]["median_ms"]


def test_log_rounds_take_accept_len_times_requests_over_throughput(tmp_path):
    log = tmp_path / "decode-spec.log"
    line = ("[2026-12-02 13:38:26] Decode batch, #running-req: {n}, #token: 148, token usage: 0.00, accept len: {a}, "
            "accept rate: 0.48, cuda graph: True, gen throughput (token/s): {t}, #queue-req: 0\n")
    log.write_text(line.format(n=8, a=4.0, t=1600.0) + line.format(n=8, a=2.0, t=1600.0) + line.format(n=3, a=2.0, t=100.0))
    rounds = tool.log_rounds(log)
    assert rounds == {"8": {"median_ms": pytest.approx(15.0), "lines": 2}}  # 8 * 4 / 1600 = 20 ms, 8 * 2 / 1600 = 10 ms
