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


def test_rows_are_grouped_so_each_forward_fits_the_kv_pool():
    from draftlab.features.engines.sglang_engine import parts

    assert parts([6, 5, 3, 10, 1], 10) == [[0], [1, 2], [3], [4]]
    assert parts([2, 2, 2], 100) == [[0, 1, 2]]
    with pytest.raises(UserError, match="a row of 11 tokens does not fit the engine's KV pool of 10 tokens; lower "
                                        "extract.max_length or raise extract.engine_args.max_total_tokens"):
        parts([3, 11], 10)


def test_a_capture_over_several_forwards_puts_every_row_back_in_its_place(monkeypatch):
    """capture() with a KV pool smaller than the batch: each row's states come back at its own row
    and positions, padding zero, whatever forward computed them."""
    from draftlab.features.engines.sglang_engine import SGLangEngine

    forwards = []

    def forward(self, rows):  # stands in for SGLang: layer k's state of token t is (t, k); final (t, -1)
        forwards.append([len(r) for r in rows])
        flat = torch.tensor([t for r in rows for t in r], dtype=torch.float32)
        aux = [torch.stack([flat, torch.full_like(flat, k)], dim=1) for k in range(2)]
        return aux, torch.stack([flat, -torch.ones_like(flat)], dim=1)

    monkeypatch.setattr(SGLangEngine, "_forward", forward)
    monkeypatch.setattr(SGLangEngine, "_set_layers", lambda self, physical: None)
    engine = SGLangEngine(types.SimpleNamespace(max_total_num_tokens=8), None, None, None, "LlamaForCausalLM", "0.5.14", None)
    lengths = [6, 3, 4, 2]
    ids = torch.zeros(4, 6, dtype=torch.long)
    mask = torch.zeros(4, 6, dtype=torch.long)
    for j, n in enumerate(lengths):
        ids[j, :n], mask[j, :n] = torch.arange(1, n + 1) + 10 * j, 1
    layers, final = engine.capture(ids, mask, [5, 2])
    assert forwards == [[6], [3, 4], [2]] and sorted(layers) == [2, 5]
    for k, p in enumerate([2, 5]):  # ascending physical order, as SGLang hands them
        assert torch.equal(layers[p][..., 0], (ids * mask).float()) and torch.equal(layers[p][..., 1], k * mask.float())
    assert torch.equal(final[..., 0], (ids * mask).float()) and torch.equal(final[..., 1], -mask.float())


def fake_sglang(monkeypatch, refuse=()):
    """Just enough of SGLang's module tree for SGLangEngine.load; ServerArgs records its fields and
    refuses those in `refuse` as the real dataclass refuses an unknown keyword (TypeError)."""
    made = {}

    class ServerArgs:
        def __init__(self, **kw):
            bad = [k for k in kw if k in refuse]
            if bad:
                raise TypeError(f"__init__() got an unexpected keyword argument '{bad[0]}'")
            self.__dict__.update(kw, mem_fraction_static=0.8)
            made["server_args"] = kw

    class LogitsProcessor(torch.nn.Module):
        pass

    class ModelRunner:
        def __init__(self, **kw):
            self.model = torch.nn.Module()
            self.model.logits_processor = LogitsProcessor()

        def __getattr__(self, name):  # alloc_memory_pool, init_attention_backends, init_cuda_graphs
            if name.startswith("init_") or name.startswith("alloc_"):
                return lambda: made.setdefault("calls", []).append(name)
            raise AttributeError(name)

    modules = {"sglang": types.SimpleNamespace(__version__="0.5.14"),
               "sglang.srt.configs.model_config": types.SimpleNamespace(
                   ModelConfig=types.SimpleNamespace(from_server_args=lambda args: None)),
               "sglang.srt.layers.logits_processor": types.SimpleNamespace(LogitsProcessor=LogitsProcessor),
               "sglang.srt.model_executor.model_runner": types.SimpleNamespace(ModelRunner=ModelRunner),
               "sglang.srt.server_args": types.SimpleNamespace(ServerArgs=ServerArgs)}
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    import draftlab.features.engines.sglang_engine as eng

    monkeypatch.setattr(eng, "_require", lambda device, layout: None)
    return made


def test_the_sglang_engine_sizes_its_kv_pool_for_one_batch_and_passes_engine_args(tmp_path, monkeypatch):
    from draftlab.features.engines.sglang_engine import SGLangEngine
    from draftlab.params import TargetParams

    save_micro_model(tmp_path / "micro", arch="llama", num_layers=4)
    target = TargetParams(model=str(tmp_path / "micro"), revision=None, dtype="bfloat16", device="auto")
    made = fake_sglang(monkeypatch)
    extract_params = types.SimpleNamespace(engine="sglang", tp_size=1, engine_args={"attention_backend": "triton"})
    engine = SGLangEngine.load(target, extract_params, "cuda:0", None, lambda *a: [0], max_tokens=4096)
    args = made["server_args"]
    assert (args["max_total_tokens"], args["attention_backend"], args["disable_cuda_graph"]) == (4096, "triton", True)
    assert made["calls"] == ["alloc_memory_pool", "init_attention_backends", "init_cuda_graphs"]
    assert engine.architecture == "LlamaForCausalLM"
    # the fields params refuses in extract.engine_args are exactly those the engine sets itself
    from draftlab.params import ENGINE_OWN_ARGS
    assert set(args) - {"max_total_tokens", "attention_backend"} == set(ENGINE_OWN_ARGS)
    # extract.engine_args may set the pool itself; no max_tokens leaves SGLang's own sizing
    extract_params.engine_args = {"max_total_tokens": 512}
    SGLangEngine.load(target, extract_params, "cuda:0", None, lambda *a: [0], max_tokens=4096)
    assert made["server_args"]["max_total_tokens"] == 512
    extract_params.engine_args = {}
    SGLangEngine.load(target, extract_params, "cuda:0", None, lambda *a: [0])
    assert "max_total_tokens" not in made["server_args"]


def test_an_engine_arg_serverargs_lacks_is_a_user_error_naming_the_key(tmp_path, monkeypatch):
    from draftlab.features.engines.sglang_engine import SGLangEngine
    from draftlab.params import TargetParams

    save_micro_model(tmp_path / "micro", arch="llama", num_layers=4)
    fake_sglang(monkeypatch, refuse={"attention_backnd"})
    extract_params = types.SimpleNamespace(engine="sglang", tp_size=1, engine_args={"attention_backnd": "triton"})
    with pytest.raises(UserError, match=r"extract.engine_args: SGLang 0.5.14's ServerArgs refused them \(.*'attention_backnd'"):
        SGLangEngine.load(TargetParams(model=str(tmp_path / "micro"), revision=None, dtype="bfloat16", device="auto"), extract_params, "cuda:0", None,
                          lambda *a: [0])


@pytest.mark.parametrize("extract,message", [
    ({"engine_args": {"attention_backend": "triton"}},
     "key extract.engine_args {'attention_backend': 'triton'} is for extract.engine sglang"),
    ({"engine": "sglang", "engine_args": {"dtype": "float16"}},
     r"key extract.engine_args.dtype: the engine sets it itself \(target.dtype\)")])
def test_engine_args_the_engine_cannot_take_are_refused_naming_the_key(tmp_path, extract, message):
    import yaml
    from pathlib import Path
    from draftlab.params import ParamsError, load_params

    p = yaml.safe_load((Path(__file__).resolve().parents[1] / "params.yaml").read_text())
    p["extract"].update(extract)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(p))
    with pytest.raises(ParamsError, match=message):
        load_params(["extract"], tmp_path / "params.yaml")
