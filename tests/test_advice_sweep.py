"""tools/advice_sweep.py on synthetic bench reports: the table's rows and markdown, the experiments
walked out of `dvc exp show --json`, the files mode end to end."""
import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("advice_sweep", ROOT / "tools" / "advice_sweep.py")
tool = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tool)


def report(steps: int, tau: float, speedup: float, predicted: float, ref_curve: dict | None = None, topk: int = 1) -> dict:
    """A bench.json with what the tool reads: the served config, tau, speedup, the advice."""
    ndt = steps + 1 if topk == 1 else 8
    ran = {"num_steps": steps, "topk": topk, "num_draft_tokens": ndt, "predicted_tau": tau + 0.05, "predicted_speedup": predicted,
           "measured_tau": tau, "measured_speedup": speedup, "speedup_error": predicted / speedup - 1, "where": "served"}
    candidates = [{"num_steps": s, "topk": 1, "num_draft_tokens": s + 1, "predicted_tau": 1 + 0.5 * s, "predicted_speedup": p}
                  for s, p in (ref_curve or {}).items()]
    return {"settings": {"num_steps": steps, "topk": topk, "num_draft_tokens": ndt}, "tau": tau, "speedup": speedup,
            "config_hash": f"h{steps}-{topk}", "advice": {"candidates": candidates, "predicted_vs_measured": [ran], "ran": ran}}


CURVE = {1: 1.10, 2: 1.30, 3: 1.40, 5: 1.50, 7: 1.40}


def test_rows_and_markdown_from_synthetic_runs():
    runs = [("steps-5", report(5, 3.4, 1.50, 1.45, CURVE)), ("steps-1", report(1, 1.8, 1.00, 1.10)),
            ("steps-3", report(3, 2.9, 1.60, 1.50)), ("tree", report(5, 3.5, 1.2, 1.3, topk=4))]
    rows = tool.table_rows(runs, reference=runs[0][1])
    assert [(r["run"], r["num_steps"], r["topk"]) for r in rows] == [("steps-1", 1, 1), ("steps-3", 3, 1), ("steps-5", 5, 1), ("tree", 5, 4)]
    one, three = rows[0], rows[1]
    assert one["error"] == pytest.approx(0.10) and one["reference_speedup"] == 1.10 and one["reference_error"] == pytest.approx(0.10)
    assert three["error"] == pytest.approx(1.5 / 1.6 - 1) and three["reference_error"] == pytest.approx(1.4 / 1.6 - 1)
    assert rows[3]["reference_speedup"] is None and rows[3]["reference_error"] is None  # the reference never predicted that tree
    md = tool.markdown(rows, "steps-5")
    lines = md.splitlines()
    assert lines[0].startswith("| run | num_steps | topk | draft tokens | measured tau | predicted tau | measured speedup")
    assert "predicted speedup (from steps-5)" in lines[0] and lines[1] == "|" + "---|" * 11
    assert lines[2] == "| steps-1 | 1 | 1 | 2 | 1.80 | 1.85 | 1.000 | 1.100 | +10.0% | 1.100 | +10.0% |"
    assert lines[5].endswith("| n/a | n/a |")
    assert "largest error, own run: 10.0%" in md and "from steps-5: 12.5%" in md
    assert "from" not in tool.markdown(rows).splitlines()[0]  # no reference: no reference columns


def test_own_prediction_falls_back_to_the_list_or_the_candidates():
    r = report(3, 2.9, 1.6, 1.5, {3: 1.45})
    del r["advice"]["ran"]
    assert tool.own_prediction(r) == (pytest.approx(2.95), 1.5)  # a report from before "ran": the list
    r["advice"]["predicted_vs_measured"] = []
    assert tool.own_prediction(r) == (2.5, 1.45)  # the candidates
    r2 = {**r, "settings": {}, "flags": {"effective": {"num_steps": 3, "topk": 1, "num_draft_tokens": 4}}}
    assert tool.config_of(r2) == (3, 1, 4)


def test_experiments_are_walked_out_of_dvc_exp_show_json():
    def entry(rev, name, data=True):
        return {"rev": rev, "name": name, "data": {"metrics": {tool.BENCH: {"data": {"speedup": 1.2}}}} if data else {}}
    show = [{"rev": "workspace", "name": None, "data": {}},
            {**entry("a" * 40, "main"), "experiments": [{"revs": [entry("b" * 40, "steps-1")]}, {"revs": [entry("c" * 40, None, False)]}]}]
    got = tool.experiments(show)
    assert [(n, r[:1], d) for n, r, d in got] == [("main", "a", {"speedup": 1.2}), ("steps-1", "b", {"speedup": 1.2}), ("ccccccc", "c", {})]


def test_files_mode_writes_the_table_and_the_plot(tmp_path, capsys):
    files = []
    for name, r in (("five", report(5, 3.4, 1.5, 1.45, CURVE)), ("two", report(2, 2.4, 1.25, 1.35))):
        files.append(tmp_path / f"{name}.json")
        files[-1].write_text(json.dumps(r))
    tool.main(["--files", *map(str, files), "--out", str(tmp_path / "out"), "--reference", str(files[0])])
    md = (tmp_path / "out" / "sweep.md").read_text()
    assert md.count("\n| ") == 2 and "+8.0%" in md and "+4.0%" in md  # 1.35/1.25 own, 1.30/1.25 from the reference
    assert (tmp_path / "out" / "sweep.png").stat().st_size > 1000
    assert "sweep.md" in capsys.readouterr().out
