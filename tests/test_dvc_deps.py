"""dvc.yaml's code deps of each stage are exactly the files its script can import.

DVC re-runs a stage when one of its deps changes, and the stage's config_hash covers the same
files (draftlab.manifest.code_files). A module missing from deps means an edit that changes
a stage's output does not re-run it; so the two lists must not drift.
"""

import pytest
import yaml

from draftlab.manifest import ROOT, code_files


def names(script) -> list[str]:
    return [f.relative_to(ROOT).as_posix() for f in code_files(script) if f.is_relative_to(ROOT)]

STAGES = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]


def _script(cmd: str) -> str:
    module = cmd.split(" -m ", 1)[1].split()[0]  # python -m stages.train ... -> stages/train.py
    return module.replace(".", "/") + ".py"


def _code_deps(stage: dict) -> list[str]:
    deps = [d if isinstance(d, str) else next(iter(d)) for d in stage["deps"]]
    return sorted(d for d in deps if d.endswith(".py"))


@pytest.mark.parametrize("name", sorted(STAGES))
def test_stage_deps_are_the_modules_its_script_imports(name):
    stage = STAGES[name]
    want = names(ROOT / _script(stage["cmd"]))
    got = _code_deps(stage)
    missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
    assert not missing and not extra, (
        f"dvc.yaml stage {name}: deps missing {missing}, listing {extra} that its script never imports; "
        f"its code deps are: {want}")


def test_a_lazy_import_inside_a_function_is_followed(tmp_path):
    # a stage that imports a module only inside a function still depends on it
    script = tmp_path / "stage.py"
    script.write_text("def main():\n    from draftlab.sglang import layers\n    return layers\n")
    files = names(script)
    assert "draftlab/sglang/layers.py" in files and "draftlab/sglang/__init__.py" in files
    assert "draftlab/errors.py" in files  # layers.py imports it: followed transitively
    assert "draftlab/bench/servers.py" not in files


def test_code_hash_changes_with_an_imported_module(tmp_path, monkeypatch):
    from draftlab import manifest

    pkg = tmp_path / "draftlab"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "helper.py").write_text("X = 1\n")
    script = tmp_path / "stage.py"
    script.write_text("from draftlab.helper import X\n")
    monkeypatch.setattr(manifest, "ROOT", tmp_path)
    before = manifest.code_hash(script)
    (pkg / "helper.py").write_text("X = 2\n")
    after = manifest.code_hash(script)
    assert before["files"] == after["files"] == ["draftlab/__init__.py", "draftlab/helper.py", "stage.py"]
    assert before["sha256"] != after["sha256"]
