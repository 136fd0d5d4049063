"""The target stage's weight check (draftlab.target.layout through target_check.check_weight_layout):
transformers' own name conversions applied (per-expert MoE tensors fused on load), no tensor read,
a tensor missing or of another shape refused, whatever accelerate and kernels are installed."""
import importlib.util
import shutil
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

from draftlab.errors import UserError
from draftlab.target.check import check_loadable, check_weight_layout
from tests.support.tools import load_tool

ROOT = Path(__file__).resolve().parents[1]


def bench_module():
    spec = importlib.util.spec_from_file_location("weight_layout_bench", ROOT / "benchmarks/weight_layout.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    """A Qwen3-MoE micro target: 8 experts per layer, saved per expert (experts.0.gate_proj...),
    which transformers 5 fuses into experts.gate_up_proj on load."""
    return load_tool("micro_targets").build("qwen3-moe", tmp_path_factory.mktemp("moe") / "qwen3-moe")["pipeline"]


def edited(moe, tmp_path, fn) -> Path:
    path = tmp_path / "target"
    shutil.copytree(moe, path)
    tensors = load_file(str(path / "model.safetensors"))
    fn(tensors)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def no_reads(monkeypatch):
    """Every safetensors reader transformers and draftlab could use raises: the check must not need one."""
    import safetensors
    import safetensors.torch
    import transformers.modeling_utils

    def refuse(*a, **k):
        raise AssertionError("a tensor was read")
    for module, name in ((safetensors, "safe_open"), (safetensors.torch, "safe_open"), (safetensors.torch, "load_file"),
                         (safetensors.torch, "load"), (transformers.modeling_utils, "safe_open")):
        if hasattr(module, name):
            monkeypatch.setattr(module, name, refuse)


def test_a_moe_checkpoint_saved_per_expert_passes(moe):
    check_loadable(str(moe))


@pytest.mark.parametrize("how, why", [
    ("an expert's tensor missing",  # transformers 5 fuses the 8 experts' up_proj: 7 do not combine
     r"tensors do not combine into model.layers.0.mlp.experts.gate_up_proj \(.*Error: .*\): a tensor is missing"),
    ("the router of another shape", r"mlp.gate.weight is \[7, 256\] in the checkpoint, the config needs \[8, 256\]"),
    ("the embedding missing", r"lack 1 tensor\(s\) .*model.embed_tokens.weight"),
])
def test_a_broken_moe_checkpoint_is_refused_naming_the_tensor(moe, tmp_path, how, why):
    edits = {"an expert's tensor missing": lambda t: t.pop("model.layers.0.mlp.experts.3.up_proj.weight"),
             "the router of another shape": lambda t: t.update({"model.layers.0.mlp.gate.weight":
                                                                t["model.layers.0.mlp.gate.weight"][:7].contiguous()}),
             "the embedding missing": lambda t: t.pop("model.embed_tokens.weight")}
    path = edited(moe, tmp_path, edits[how])
    with pytest.raises(UserError, match=why) as e:
        check_loadable(str(path))
    assert str(path) in str(e.value)


def test_an_8b_checkpoint_is_checked_without_reading_a_tensor(tmp_path, monkeypatch):
    """Llama-3-8B's 291 tensors in sparse shards (16 GB declared, a few KB on disk), every tensor
    reader disabled: the check passes, then refuses the same folder with one shape changed.
    About a second (benchmarks/weight_layout.py); the bound is generous for a loaded machine."""
    bench = bench_module()
    folder = tmp_path / "llama-3-8b"
    bench.write_sparse_checkpoint(folder, bench.CONFIG)
    no_reads(monkeypatch)
    start = time.perf_counter()
    check_weight_layout(folder, str(folder), AutoConfig.from_pretrained(str(folder)))
    assert time.perf_counter() - start < 30
    wider = dict(bench.CONFIG, intermediate_size=14336 + 128)  # the config now wants wider MLPs than the shards hold
    with pytest.raises(UserError, match=r"mlp.*is \[14336, 4096\] in the checkpoint, the config needs \[14464, 4096\]"):
        check_weight_layout(folder, str(folder), AutoConfig.for_model(**wider))


def test_tensors_of_another_shape_are_named_in_layer_order_whatever_order_transformers_gives():
    """transformers lists mismatched tensors in a set's order: the message named other tensors on each run."""
    import random

    from draftlab.target.load_errors import check_weights

    names = [f"model.layers.{i}.mlp.{p}.weight" for i in range(12) for p in ("down_proj", "gate_proj", "up_proj")]
    messages = set()
    for seed in range(3):
        shuffled = random.Random(seed).sample(names, len(names))
        with pytest.raises(UserError) as e:
            check_weights({"mismatched_keys": [(n, (4, 8), (4, 9)) for n in shuffled]}, "m")
        messages.add(str(e.value))
    (message,) = messages
    assert "model.layers.0.mlp.down_proj.weight is [4, 8]" in message and "model.layers.0.mlp.up_proj" in message
    assert "layers.1." not in message and "(and 33 more)" in message
