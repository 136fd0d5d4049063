"""The check names stages that ran under different releases of torch, transformers or sglang
(draftlab/check/packages.py), and stays quiet when they match."""
from draftlab.check.findings import WARNING
from draftlab.check.packages import check_package_drift
from draftlab.manifest import package_versions

STACK = {"python": "3.11.7", "torch": "2.13.0", "transformers": "5.25.0", "tokenizers": "0.23.3", "safetensors": "0.8.0",
         "numpy": "2.3.5", "sglang": None}


def manifest(stage: str, **versions) -> dict:
    return {"stage": stage, "config_hash": "a" * 64, "packages": {**STACK, **versions}}


def test_matching_manifests_give_no_finding():
    stages = ("synthesize", "extract", "standardize", "train", "export", "bench")
    assert check_package_drift({s: manifest(s) for s in stages}) == []
    assert check_package_drift({"extract": manifest("extract"), "train": None, "bench": {"stage": "bench"}}) == []


def test_features_extracted_under_one_transformers_and_served_under_another_is_a_warning():
    manifests = {"extract": manifest("extract", transformers="5.24.0"), "standardize": manifest("standardize", transformers="5.24.0"),
                 "train": manifest("train"), "bench": manifest("bench")}
    [f] = check_package_drift(manifests)
    assert f.name == "package_versions_differ" and f.severity == WARNING
    assert f.evidence == {"package": "transformers", "versions": {"5.24.0": ["extract", "standardize"], "5.25.0": ["train", "bench"]}}
    assert "transformers 5.24.0 (extract, standardize) against transformers 5.25.0 (train, bench)" in f.cause
    assert "dvc repro --force" in f.fix and "constraints/cpu.txt" in f.fix


def test_each_numerics_package_is_its_own_warning_and_other_packages_are_not_compared():
    manifests = {"extract": manifest("extract", torch="2.12.0", numpy="1.26.4", tokenizers="0.22.2"),
                 "bench": manifest("bench", sglang="0.5.14"), "train": manifest("train", sglang="0.5.13")}
    found = check_package_drift(manifests)
    assert [f.evidence["package"] for f in found] == ["torch", "sglang"]
    assert found[0].evidence["versions"] == {"2.12.0": ["extract"], "2.13.0": ["bench", "train"]}
    assert found[1].evidence["versions"] == {"0.5.14": ["bench"], "0.5.13": ["train"]}


def test_a_stage_without_sglang_beside_one_with_it_is_no_drift():
    """A CPU machine extracts without SGLang, a GPU machine serves with it: the normal split."""
    assert check_package_drift({"extract": manifest("extract"), "bench": manifest("bench", sglang="0.5.14")}) == []


def test_manifests_record_the_numerics_packages():
    recorded = package_versions()
    assert {"torch", "transformers", "sglang"} <= set(recorded)
    assert recorded["torch"] and recorded["transformers"]  # installed wherever the stages run
