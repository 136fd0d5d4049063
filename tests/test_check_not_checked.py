"""A wiring check that lacks what it needs says "not checked: ...": it never returns nothing, which
the report would read as a pass. One test per check that used to return early in silence."""
from draftlab.check.diagnose import check_served_target
from draftlab.check.findings import INFO, WARNING
from draftlab.check.hardware import hardware_unrecorded
from draftlab.check.serving import check_flags, check_tau

BENCH = {"flags": {"effective": {"num_steps": 3, "topk": 1}}, "offline": {"tau": 2.0}, "spec": {"tau": 2.0}}


def test_tau_links_without_a_value_are_named():
    (f,) = check_tau({}, BENCH, 0.1)  # no train-predicted tau: neither link from training can be checked
    assert f.name == "tau_not_checked" and f.severity == INFO  # offline -> served was checked
    assert f.evidence["links"] == ["train -> offline (train unknown, offline 2.0)"] and f.cause.startswith("not checked")
    (g,) = check_tau({"tau_pred": 2.0}, {"flags": BENCH["flags"]}, 0.1)  # a bench report without any tau
    assert g.name == "tau_not_checked" and g.severity == WARNING
    assert "tau_consistent" not in [x.name for x in check_tau({}, BENCH, 0.1)]  # agreement is not claimed for what was not compared


def test_a_bench_report_without_a_served_target_is_named():
    (f,) = check_served_target({"model": "m", "num_layers": 8}, None)
    assert f.name == "served_target_unchecked" and f.severity == WARNING and "names no served target" in f.cause


def test_a_bench_report_without_flags_is_named():
    (f,) = check_flags({"spec": {"tau": 2.0}})
    assert f.name == "flags_not_checked" and f.severity == WARNING


def test_manifests_without_a_hardware_record_are_named():
    (f,) = hardware_unrecorded({"train": {"stage": "train"}, "bench": {"stage": "bench", "hardware": {"cpu_model": "x"}}, "extract": None})
    assert f.name == "hardware_not_checked" and f.evidence["stages"] == ["train"]
    assert hardware_unrecorded({"extract": None}) == []


def test_lineage_links_without_a_hash_are_named():
    from draftlab.check.serving import check_lineage

    hashes = {"synth": "a" * 64, "extract": None}
    (f,) = check_lineage(hashes, [("extract", "a" * 64, "synth"), ("standardize", "b" * 64, "extract"), ("export", None, "train")])
    assert f.name == "lineage_not_checked" and f.evidence["links"] == ["standardize <- extract", "export <- train"]
    assert check_lineage(hashes, [("extract", "a" * 64, "synth")]) == []
