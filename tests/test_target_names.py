"""A target.model that is neither a folder, a file nor a valid hub id is one named error in every
stage that reads it (the target stage first: it runs first in `dvc repro`), never the hub client's
HFValidationError traceback, and never a request to the hub."""
import os
import subprocess
import sys

import pytest
import yaml

from draftlab.errors import QUOTE_CHARS, UserError
from draftlab.params import TargetParams
from draftlab.target.load import load_config, load_target, load_tokenizer
from draftlab.target.pin import pin_target
from tests.test_target_pin import ROOT

NAMES = {
    "a space": ("my model", "neither an existing folder or file nor a valid hub id"),
    "a space in the name": ("org/na me", "neither an existing folder or file nor a valid hub id"),
    "spaces around a folder": ("models/tiny-target ", "has spaces around it and names nothing"),
    "empty": ("", "target.model is empty"),
    "blank": ("   ", "target.model is empty"),
    "too long": ("org/" + "n" * 5000, "neither an existing folder or file nor a valid hub id"),
    "a package not installed": ("pkg:no_such_package/m.gguf", "Python package no_such_package is not installed"),
    "double dots": ("org/..name", "neither an existing folder or file nor a valid hub id"),
    "a package file that is no GGUF": ("pkg:draftlab/params.py", "a file inside a package is a target only as a GGUF model file"),
    "an upper-case .GGUF": ("absent.GGUF", "GGUF file absent.GGUF not found"),
}


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    """Nothing here may reach a hub: a refused name is refused before it is asked."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.mark.parametrize("case", sorted(NAMES))
def test_every_load_names_the_value(case, monkeypatch):
    model, words = NAMES[case]
    monkeypatch.chdir(ROOT)  # models/tiny-target exists: "models/tiny-target " must not be taken for it
    params = TargetParams(model=model, revision=None, dtype="float32", device="cpu")
    for load in (lambda: pin_target(model, None), lambda: load_config(params), lambda: load_tokenizer(model),
                 lambda: load_target(params, "cpu")):
        with pytest.raises(UserError, match=words) as e:
            load()
        assert len(str(e.value)) < 3 * QUOTE_CHARS


@pytest.mark.parametrize("case", ["a space", "empty", "too long"])
def test_the_target_stage_exits_2_without_a_traceback(case, tmp_path):
    model, words = NAMES[case]
    p = yaml.safe_load((ROOT / "params.yaml").read_text())
    p["target"]["model"] = model
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(p))
    run = subprocess.run([sys.executable, "-m", "stages.target", "--out", str(tmp_path / "pin.json")], cwd=tmp_path,
                         capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"})
    assert run.returncode == 2, run.stderr
    assert words in run.stderr and "Traceback" not in run.stderr and not (tmp_path / "pin.json").exists()


def test_an_unreadable_gguf_file_is_named(tmp_path, monkeypatch):
    import builtins

    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    real_open = builtins.open

    def denied(file, *args, **kwargs):
        if str(file) == str(gguf):
            raise PermissionError(13, "Permission denied")
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", denied)
    with pytest.raises(UserError, match=r"target.model .*m.gguf.*: cannot read .*m.gguf \(Permission denied\)"):
        pin_target(str(gguf), None)
