"""benchmarks/ngram_cache.py, its CPU form: the measurement a GPU user runs against SGLang works end
to end on the reference server, and reads a repeat that kept its cache apart from a flushed one."""
import json

from benchmarks.ngram_cache import main


def test_the_quick_form_tells_a_flushed_repeat_from_a_remembered_one(tmp_path, capsys):
    out = tmp_path / "ngram.json"
    main(["--quick", "--logs", str(tmp_path / "logs"), "--json", str(out)])
    got = json.loads(out.read_text())
    taus = [p["spec"]["tau"] for p in got["passes"].values()]
    assert got["flush_empties_cache"] and abs(taus[2] - taus[0]) <= 0.05 * taus[0]
    assert taus[1] > 1.5 * taus[0]  # the kept cache holds the first pass's answers
    assert got["passes"]["A first pass"]["baseline"]["requests"] == got["conversations"]
    assert "flush empties the cache: yes" in capsys.readouterr().out
