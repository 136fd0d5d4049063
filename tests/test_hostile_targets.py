"""A target folder that transformers cannot load is one named error wherever it is loaded (the
target stage, the stages, the reference server, the check), never a traceback, and the target
stage pins no such folder (draftlab/target/check.py)."""
import json
import shutil

import pytest
import yaml
from safetensors.torch import load_file, save_file

from draftlab.errors import UserError
from draftlab.params import TargetParams
from draftlab.target.load import load_config, load_target, load_tokenizer
from draftlab.target.check import check_loadable
from tests.support.micro import save_micro_model
from tests.test_target_pin import ROOT


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    path = tmp_path_factory.mktemp("target") / "good"
    save_micro_model(path, num_layers=1)
    return path


def params(path) -> TargetParams:
    return TargetParams(model=str(path), revision=None, dtype="float32", device="cpu")


def config_edit(**values):
    def edit(d):
        c = json.loads((d / "config.json").read_text())
        c.update(values)
        (d / "config.json").write_text(json.dumps(c))
    return edit


def write(name, data):
    return lambda d: (d / name).write_bytes(data)


def tensors_edit(fn):
    def edit(d):
        t = load_file(str(d / "model.safetensors"))
        fn(t)
        save_file(t, str(d / "model.safetensors"), metadata={"format": "pt"})
    return edit


def empty(d):
    for p in d.iterdir():
        p.unlink()


def cut(d):
    p = d / "model.safetensors"
    p.write_bytes(p.read_bytes()[:-100])


# (how the folder is broken, what the error must say): each case a user met or could meet
BROKEN = {
    "empty folder": (empty, r"the folder .* is empty"),
    "a string where config.json needs an int": (config_edit(hidden_size="64"), r"config.json: .*'hidden_size' expected int, got str"),
    "config.json not JSON": (write("config.json", b"{not json"), r"config.json is not valid JSON \(.* line 1 column 2\)"),
    "config.json a list": (write("config.json", b"[1, 2]"), r"config.json holds a JSON list, not an object"),
    "no model_type": (write("config.json", b"{}"), r"config.json has no model_type"),
    "unknown model_type": (config_edit(model_type="wizard"), r"model type `wizard`, which this transformers release does not know"),
    "zero layers": (config_edit(num_hidden_layers=0), r"num_hidden_layers must be a positive integer, got 0"),
    "architectures a string": (config_edit(architectures="LlamaForCausalLM"), r"architectures must be a list"),
    "an unknown dtype": (config_edit(dtype="float13"), r"dtype 'float13', which torch does not have"),
    "heads that do not divide the width": (config_edit(num_attention_heads=3), r"not a multiple of the number of attention heads"),
    "no tokenizer": (lambda d: (d / "tokenizer.json").unlink(), r"no tokenizer in"),
    "tokenizer.json damaged": (write("tokenizer.json", b"{bad"), r"tokenizer.json is not valid JSON"),
    "a chat template that does not render": (lambda d: config_in(d, "tokenizer_config.json", chat_template="{% for %}"),
                                             r"cannot load its chat template .*TemplateSyntaxError"),
    "generation_config.json damaged": (write("generation_config.json", b"{bad"), r"generation_config.json is not valid JSON"),
    "no weights": (lambda d: (d / "model.safetensors").unlink(), r"no weights in"),
    "weights cut short": (cut, r"model.safetensors: truncated"),
    "a tensor missing": (tensors_edit(lambda t: t.pop("model.layers.0.mlp.up_proj.weight")),
                         r"lack 1 tensor\(s\) .*model.layers.0.mlp.up_proj.weight.*random"),
    "a tensor of another shape": (tensors_edit(lambda t: t.update({"model.embed_tokens.weight": t["model.embed_tokens.weight"][:, :32].contiguous()})),
                                  r"model.embed_tokens.weight is \[256, 32\] in the checkpoint, the config needs \[256, 64\]"),
    "an index naming absent shards": (write("model.safetensors.index.json", json.dumps({"weight_map": {"x": "model-00002.safetensors"}}).encode()),
                                      r"names shard\(s\) \['model-00002.safetensors'\] that are not in"),
}


def config_in(d, name, **values):
    c = json.loads((d / name).read_text())
    c.update(values)
    (d / name).write_text(json.dumps(c))


def broken(good, tmp_path, edit):
    path = tmp_path / "target"
    shutil.copytree(good, path)
    edit(path)
    return path


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_the_target_stage_check_names_what_is_wrong_and_the_fix(good, tmp_path, case):
    edit, why = BROKEN[case]
    path = broken(good, tmp_path, edit)
    with pytest.raises(UserError, match=why) as e:
        check_loadable(str(path))
    assert str(path) in str(e.value) and "set target.model to a complete transformers model folder" in str(e.value)


def test_a_whole_folder_passes_the_check(good):
    check_loadable(str(good))  # and so does the shipped target
    check_loadable(str(ROOT / "models/tiny-target"))


@pytest.mark.parametrize("case", ["empty folder", "a string where config.json needs an int", "no model_type", "a tensor missing",
                                  "a tensor of another shape", "weights cut short", "tokenizer.json damaged"])
def test_every_load_of_the_target_is_one_named_error(good, tmp_path, case):
    """What the stages, the reference server and the check call: load_target, load_config and load_tokenizer."""
    edit, why = BROKEN[case]
    path = broken(good, tmp_path, edit)
    with pytest.raises(UserError, match=why):
        load_target(params(path), "cpu")
    if case in ("empty folder", "a string where config.json needs an int", "no model_type"):
        with pytest.raises(UserError, match=why):
            load_config(params(path))
    if case == "tokenizer.json damaged":
        with pytest.raises(UserError, match=why):
            load_tokenizer(str(path))


def test_the_target_stage_refuses_and_pins_nothing(good, tmp_path, monkeypatch):
    from stages.target import main

    path = broken(good, tmp_path, config_edit(hidden_size="64"))
    p = yaml.safe_load((ROOT / "params.yaml").read_text())
    p["target"]["model"] = str(path)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(p))
    monkeypatch.chdir(tmp_path)
    pin = tmp_path / "target-pin.json"
    with pytest.raises(UserError, match="hidden_size"):
        main(pin)
    assert not pin.exists()
    config_in(path, "config.json", hidden_size=64)  # fixed: pinned
    main(pin)
    assert json.loads(pin.read_text())["kind"] == "local"
