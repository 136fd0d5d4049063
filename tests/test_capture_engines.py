"""extract.engine and extract.tp_size: the rank layout, the params rule, the engines' refusals,
and the extract stage under torchrun refusing tensor parallelism without SGLang."""
import json
import subprocess
import sys
import types

import pytest
import torch

from draftlab.errors import UserError
from draftlab.features import extract
from draftlab.features.engines import open_engine
from draftlab.features.engines.transformers_engine import TransformersEngine
from draftlab.parallel import rank_layout
from tests.support.micro import save_micro_model
from tests.test_extract_stage import extract as run_extract, extracted, extracted_project, set_params  # noqa: F401


@pytest.mark.parametrize("world,tp,rank,want", [
    (1, 1, 0, (0, 1, 0, (0,))), (4, 1, 3, (3, 4, 0, (3,))), (4, 2, 1, (0, 2, 1, (0, 1))),
    (4, 2, 2, (1, 2, 0, (2, 3))), (8, 4, 6, (1, 2, 2, (4, 5, 6, 7))), (2, 2, 0, (0, 1, 0, (0, 1)))])
def test_consecutive_ranks_form_one_tp_group(world, tp, rank, want):
    got = rank_layout(world, tp, rank)
    assert (got.dp_rank, got.dp_size, got.tp_rank, got.tp_ranks) == want and got.writes == (want[2] == 0)


def test_a_world_tp_size_does_not_divide_is_refused():
    with pytest.raises(UserError, match="extract.tp_size 2 does not divide the 3 processes"):
        rank_layout(3, 2, 0)


def test_tp_size_above_one_needs_the_sglang_engine(tmp_path):
    import yaml
    from pathlib import Path
    from draftlab.params import ParamsError, load_params

    p = yaml.safe_load((Path(__file__).resolve().parents[1] / "params.yaml").read_text())
    p["extract"]["tp_size"] = 2
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(p))
    with pytest.raises(ParamsError, match="extract.tp_size 2 needs extract.engine sglang"):
        load_params(["extract"], tmp_path / "params.yaml")
    p["extract"]["engine"] = "sglang"
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(p))
    assert load_params(["extract"], tmp_path / "params.yaml").extract.tp_size == 2


def test_sglang_engine_without_sglang_or_cuda_is_a_user_error_naming_the_key(monkeypatch):
    import importlib.util

    params = types.SimpleNamespace(engine="sglang", tp_size=1)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "sglang" else real(name, *a))
    with pytest.raises(UserError, match="extract.engine sglang: SGLang is not installed"):
        open_engine(None, params, "cpu")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "sglang" else real(name, *a))
    with pytest.raises(UserError, match="extract.engine sglang needs a CUDA device"):
        open_engine(None, params, "cpu")


def test_the_transformers_engine_captures_exactly_what_capture_does(tmp_path):
    model = save_micro_model(tmp_path / "micro", arch="llama", num_layers=4).eval()
    rows = [([3, 4, 5, 6, 7], [False, True, True, True, True]), ([8, 9, 10], [False, True, True])]
    engine = TransformersEngine(model)
    a = extract.extract_shard(model, rows, [1, 3], batch_size=2, dtype=torch.float32, device="cpu")
    b = extract.extract_shard(engine, rows, [1, 3], batch_size=2, dtype=torch.float32, device="cpu")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_the_manifest_records_engine_tp_size_and_dtype(extracted):
    info = json.loads((extracted[0] / "hidden" / "manifest.json").read_text())["info"]
    assert (info["engine"], info["tp_size"], info["dtype"]) == ("transformers", 1, "bfloat16")


def test_torchrun_with_tp_size_two_and_the_transformers_engine_is_refused(extracted_project):
    set_params(extracted_project, "extract", tp_size=2)
    r = run_extract(extracted_project, "two", nproc=2)
    assert r.returncode != 0 and "extract.tp_size 2 needs extract.engine sglang" in r.stderr
    assert not (extracted_project / "two").exists()
