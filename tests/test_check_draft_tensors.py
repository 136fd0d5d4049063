"""check-draft verifies what a draft IS, whatever wrote its config.json (transformers 4 `torch_dtype`,
transformers 5 `dtype`, or neither): every tensor SGLang loads, by name and shape, and what the
folder holds when it is no draft at all. A check that cannot run says "not checked", never "ok".

The SpecForge and speculators layouts are written the way their trainers save them under
transformers 5 (`save_pretrained` of their config class: `dtype`, `rope_parameters`); the names of
the tensors are the ones their source gives (tests/fixtures/external/README.md).
"""
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from draftlab.check.draft import check_d2t, check_draft_shapes
from draftlab.check.external import check_external
from draftlab.check.findings import names
from draftlab.sglang.checkpoint import export_sglang, read_exported, tensor_specs
from tests.test_check_external import FIXTURES, H, V, VD, make_draft, run_cli, sglang_tensors, target  # noqa: F401 (fixture)

TINY = Path(__file__).resolve().parents[1] / "models" / "tiny-target"


def edit_config(path: Path, **changes) -> None:
    config = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        if value is ...:
            config.pop(key, None)
        else:
            config[key] = value
    (path / "config.json").write_text(json.dumps(config))


def edit_weights(path: Path, change) -> None:
    tensors = load_file(str(path / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(path / "model.safetensors"))


def exported(target, tmp_path) -> Path:
    path, facts = target
    export_sglang(make_draft(facts), tmp_path / "draft", facts, [2, 4, 6], "0.5.14")
    return tmp_path / "draft"


def by_name(verdict) -> dict:
    return {f.name: f for f in verdict.findings}


def write_transformers5(path: Path, facts: dict, fixture: str, tensors: dict, **changes) -> Path:
    """A foreign draft whose config.json went through transformers 5's save_pretrained (dtype, rope_parameters)."""
    from transformers import LlamaConfig

    path.mkdir(parents=True)
    config = json.loads((FIXTURES / fixture).read_text())
    sizes = dict(hidden_size=H, intermediate_size=96, num_attention_heads=facts["num_attention_heads"], head_dim=facts["head_dim"],
                 num_key_value_heads=facts["num_key_value_heads"], vocab_size=V, max_position_embeddings=facts["max_position_embeddings"])
    if "transformer_layer_config" in config:  # speculators: the layer's config saved by transformers 5, nested
        LlamaConfig(**{**config["transformer_layer_config"], **sizes}).save_pretrained(path)
        config["transformer_layer_config"] = json.loads((path / "config.json").read_text())
        config.pop("torch_dtype")
        config.update(dtype="bfloat16", draft_vocab_size=VD, target_hidden_size=None, transformers_version="5.8.1", **changes)
        (path / "config.json").write_text(json.dumps(config))
    else:
        LlamaConfig(**{**config, **sizes, "draft_vocab_size": VD, "dtype": "bfloat16", **changes}).save_pretrained(path)
    save_file(tensors, str(path / "model.safetensors"))
    return path


# ---------------------------------------------------------------------------------------------
# the two cases


def test_the_embedded_target_dressed_as_a_draft_is_named_a_target_model(tmp_path, capsys):
    """models/tiny-target with the two fixes the tool once suggested (architectures, eagle_config)."""
    fake = tmp_path / "fake"
    fake.mkdir()
    for f in TINY.iterdir():
        (fake / f.name).symlink_to(f)
    (fake / "config.json").unlink()
    config = json.loads((TINY / "config.json").read_text())
    assert "torch_dtype" not in config and config["dtype"] == "float32"  # saved by transformers 5
    config.update(architectures=["LlamaForCausalLMEagle3"], eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 3, 4]})
    (fake / "config.json").write_text(json.dumps(config))
    code, out, _ = run_cli(capsys, fake, "--target", TINY, "--json", tmp_path / "v.json")
    report = json.loads((tmp_path / "v.json").read_text())
    found = {f["name"]: f for f in report["findings"]}
    assert code == 1 and not report["ok"], out
    assert "a target model, not an EAGLE-3 draft" in found["not_an_eagle3_draft"]["cause"]
    assert found["not_an_eagle3_draft"]["evidence"]["decoder_layers_in_weights"] == 8
    assert "verdict: NOT ready" in out and "not_an_eagle3_draft" in out


@pytest.mark.parametrize("dtype_key", ["torch_dtype", "dtype", None])
def test_the_projects_export_without_fc_and_q_proj_is_refused_whatever_the_dtype_key(target, tmp_path, capsys, dtype_key):
    draft = exported(target, tmp_path)
    edit_weights(draft, lambda t: (t.pop("fc.weight"), t.pop("midlayer.self_attn.q_proj.weight")))
    dtype = json.loads((draft / "config.json").read_text())["torch_dtype"]
    edit_config(draft, **{"torch_dtype": ..., **({dtype_key: dtype} if dtype_key else {})})
    code, out, _ = run_cli(capsys, draft, "--target", target[0], "--json", tmp_path / "v.json")
    found = {f["name"]: f for f in json.loads((tmp_path / "v.json").read_text())["findings"]}
    assert code == 1, out
    assert found["fc_missing"]["severity"] == "error"
    assert found["draft_tensors_mismatch"]["evidence"]["problems"] == ["missing midlayer.self_attn.q_proj.weight [64, 128]"]
    assert "midlayer.self_attn.q_proj.weight" in out  # named in the text, not only in the JSON
    assert ("draft_dtype_missing" in found) == (dtype_key is None)  # not checked, and said so


def test_an_intact_export_saved_with_dtype_is_clean_and_a_wrong_dtype_is_still_caught(target, tmp_path):
    draft = exported(target, tmp_path)
    edit_config(draft, dtype="bfloat16", torch_dtype=...)
    assert not check_external(draft, str(target[0]), "0.5.14").errors
    edit_weights(draft, lambda t: t.update({"norm.weight": t["norm.weight"].float()}))
    # stored float32 where config.json says bfloat16: SGLang casts it on load, which the check says
    assert "weights_cast_on_load" in names(check_external(draft, str(target[0]), "0.5.14").findings)


@pytest.mark.parametrize("value, finding", [(None, "draft_dtype_missing"), ("float8", "draft_dtype_unknown"), (["x"], "draft_dtype_unknown")])
def test_a_missing_or_unknown_dtype_is_its_own_finding_and_shapes_are_checked_anyway(target, tmp_path, value, finding):
    draft = exported(target, tmp_path)
    edit_config(draft, torch_dtype=..., dtype=... if value is None else value)
    edit_weights(draft, lambda t: t.update({"norm.weight": torch.ones(H + 1, dtype=torch.bfloat16)}))
    found = by_name(check_external(draft, str(target[0]), "0.5.14"))
    assert found[finding].severity == "warning" and found[finding].cause.startswith("not checked")
    assert "norm.weight has shape [65], SGLang expects [64]" in found["draft_tensors_mismatch"].evidence["problems"]


# ---------------------------------------------------------------------------------------------
# other trainers' layouts under transformers 5


@pytest.mark.parametrize("layer_prefix", ["midlayer.", "layers.0."])
def test_specforge_under_transformers_5_is_checked_tensor_by_tensor(target, tmp_path, layer_prefix):
    path, facts = target
    tensors = {k.replace("midlayer.", layer_prefix): v for k, v in sglang_tensors(facts).items()}
    draft = write_transformers5(tmp_path / "sf", facts, "specforge_config.json", tensors)
    config = json.loads((draft / "config.json").read_text())
    assert config["dtype"] == "bfloat16" and "torch_dtype" not in config and "rope_parameters" in config
    clean = by_name(check_external(draft, str(path), "0.5.14"))
    assert not [f for f in clean.values() if f.severity == "error"], clean
    assert "draft_dtype_missing" not in clean
    edit_weights(draft, lambda t: t.pop(f"{layer_prefix}mlp.down_proj.weight"))
    broken = by_name(check_external(draft, str(path), "0.5.14"))
    assert "missing midlayer.mlp.down_proj.weight [64, 96]" in broken["draft_tensors_mismatch"].evidence["problems"]


def test_layers_0_names_are_dropped_by_sglang_before_0_5_12(target, tmp_path):
    path, facts = target
    tensors = {k.replace("midlayer.", "layers.0."): v for k, v in sglang_tensors(facts).items()}
    draft = write_transformers5(tmp_path / "sf", facts, "specforge_config.json", tensors)
    found = by_name(check_external(draft, str(path), "0.5.11"))
    problems = found["draft_tensors_mismatch"].evidence["problems"]
    assert "unexpected layers.0.self_attn.q_proj.weight (SGLang would drop it silently)" in problems
    assert "loads the draft layer from midlayer.* only" in found["draft_tensors_mismatch"].cause
    assert "draft_tensors_mismatch" not in names(check_external(draft, str(path), "0.5.12").findings)


def test_speculators_under_transformers_5_is_checked_tensor_by_tensor(target, tmp_path):
    path, facts = target
    tensors = {k.replace("midlayer.", "layers.0."): v for k, v in sglang_tensors(facts).items()}
    tensors["embed_tokens.weight"] = torch.zeros(V, H, dtype=torch.bfloat16)
    draft = write_transformers5(tmp_path / "spec", facts, "speculators_config.json", tensors, eagle_aux_hidden_state_layer_ids=[2, 4, 6])
    config = json.loads((draft / "config.json").read_text())
    assert "torch_dtype" not in config and config["transformer_layer_config"]["dtype"] == "bfloat16"
    found = by_name(check_external(draft, str(path), "0.5.14"))
    assert "speculators_layout" in found  # SGLang cannot serve the layout as written: named
    assert not {"draft_tensors_mismatch", "draft_dtype_missing", "fc_missing"} & set(found)
    edit_weights(draft, lambda t: t.pop("fc.weight"))
    assert "fc_missing" in names(check_external(draft, str(path), "0.5.14").errors)


def test_model_prefixed_names_load_as_sglang_loads_them(target, tmp_path):
    """SGLang's load_weights tries `model.NAME` too: model.fc.weight, model.midlayer.* load."""
    draft = exported(target, tmp_path)
    edit_weights(draft, lambda t: t.update({f"model.{k}": t.pop(k) for k in [k for k in t if k.startswith(("fc.", "midlayer."))]}))
    assert not check_external(draft, str(target[0]), "0.5.14").errors


# ---------------------------------------------------------------------------------------------
# the config keys SGLang reads with defaults or fails on


@pytest.mark.parametrize("version, name, severity", [("0.5.11", "draft_layer_count", "error"), ("0.5.14", "draft_layer_count", "error")])
def test_a_missing_num_hidden_layers_is_llamas_default_of_32(target, tmp_path, version, name, severity):
    draft = exported(target, tmp_path)
    edit_config(draft, num_hidden_layers=...)
    found = by_name(check_external(draft, str(target[0]), version))
    assert found[name].severity == severity and "32" in found[name].cause


def test_a_two_layer_draft_is_served_from_0_5_12_and_its_second_layer_is_not_checked(target, tmp_path):
    path, facts = target
    tensors = sglang_tensors(facts)
    tensors.update({k.replace("midlayer.", "layers.1."): v.clone() for k, v in tensors.items() if k.startswith("midlayer.")})
    draft = write_transformers5(tmp_path / "sf", facts, "specforge_config.json", tensors, num_hidden_layers=2)
    new = by_name(check_external(draft, str(path), "0.5.14"))
    assert new["draft_layers_unchecked"].severity == "warning" and new["draft_layers_unchecked"].cause.startswith("not checked")
    assert "draft_tensors_mismatch" not in new
    old = by_name(check_external(draft, str(path), "0.5.9"))
    assert old["draft_layer_count"].severity == "error" and "only supports 1 layer" in old["draft_layer_count"].cause


@pytest.mark.parametrize("changes, finding", [
    ({"tie_word_embeddings": True}, "draft_head_dropped"),
    ({"draft_vocab_size": None}, "draft_head_replaced"),
    ({"draft_vocab_size": ...}, "draft_vocab_size_missing"),
    ({"intermediate_size": ...}, "draft_config_incomplete"),
])
def test_head_and_size_keys_sglang_reads_differently_are_errors(target, tmp_path, changes, finding):
    draft = exported(target, tmp_path)
    edit_config(draft, **changes)
    assert finding in names(check_external(draft, str(target[0]), "0.5.14").errors)


def test_checks_that_lack_a_fact_say_not_checked(target, tmp_path):
    path, facts = target
    draft = read_exported(exported(target, tmp_path))
    tensors = tensor_specs(draft.weights)
    no_ctx = {**facts, "max_position_embeddings": None}
    found = {f.name: f for f in check_draft_shapes(draft, tensors, no_ctx, 3, sglang_version="0.5.14")}
    assert found["target_facts_missing"].evidence["missing"] == ["max_position_embeddings"]
    broken = read_exported(draft.path)
    broken.config["vocab_size"] = "many"
    (d2t,) = [f for f in check_d2t(broken, torch.zeros(VD, dtype=torch.int64))]
    assert d2t.name == "d2t_unchecked" and d2t.cause.startswith("not checked")


def test_a_huge_config_value_is_quoted_bounded(target, tmp_path, capsys):
    draft = exported(target, tmp_path)
    edit_config(draft, architectures=["X" * 1_000_000], dtype="y" * 1_000_000)
    code, out, _ = run_cli(capsys, draft, "--target", target[0], "--json", tmp_path / "v.json")
    assert code == 1 and len(out) < 20_000 and (tmp_path / "v.json").stat().st_size < 50_000


# ---------------------------------------------------------------------------------------------
# hostile folders: named, never a traceback


@pytest.mark.parametrize("config_bytes, words", [
    (b'{"architectures": "\xff"}', "config.json: not valid JSON text"),
    (b"[" * 100_000, "config.json: JSON nested too deeply"),
    (None, "config.json: cannot read it"),  # a folder named config.json
])
def test_an_unreadable_config_exits_2_naming_it(target, tmp_path, capsys, config_bytes, words):
    draft = exported(target, tmp_path)
    (draft / "config.json").unlink()
    if config_bytes is None:
        (draft / "config.json").mkdir()
    else:
        (draft / "config.json").write_bytes(config_bytes)
    code, _, err = run_cli(capsys, draft, "--target", target[0])
    assert code == 2 and words in err and "Traceback" not in err


@pytest.mark.parametrize("changes, finding", [
    ({"eagle_config": [1, 3, 5]}, "eagle_config_invalid"),
    ({"draftlab": "not a block"}, None),  # read as a foreign (SGLang-layout) draft
])
def test_malformed_blocks_of_config_json_are_findings(target, tmp_path, changes, finding):
    draft = exported(target, tmp_path)
    edit_config(draft, **changes)
    verdict = check_external(draft, str(target[0]), "0.5.14")
    assert (finding in names(verdict.errors)) if finding else not verdict.errors


def test_recorded_layers_that_are_not_numbers_are_said_and_inferred(target, tmp_path, capsys):
    draft = exported(target, tmp_path)
    config = json.loads((draft / "config.json").read_text())
    config["draftlab"]["physical_layers"] = ["two", 4, 6]
    (draft / "config.json").write_text(json.dumps(config))
    found = by_name(check_external(draft, str(target[0]), "0.5.14"))
    assert found["recorded_layers_invalid"].severity == "warning" and "trained_layers_inferred" in found
    config["draftlab"]["sglang_version"] = "banana"
    (draft / "config.json").write_text(json.dumps(config))
    code, _, err = run_cli(capsys, draft, "--target", target[0])
    assert code == 2 and "draftlab.sglang_version 'banana' is not a version" in err and "--sglang-version" in err


@pytest.mark.parametrize("d2t", [torch.zeros(2, VD // 2, dtype=torch.int64), torch.tensor(3), torch.zeros(VD)])
def test_a_d2t_of_another_shape_or_dtype_is_named(target, tmp_path, d2t):
    draft = exported(target, tmp_path)
    edit_weights(draft, lambda t: t.update(d2t=d2t))
    found = by_name(check_external(draft, str(target[0]), "0.5.14"))
    assert found["d2t_malformed"].severity == "error" and found["d2t_malformed"].evidence["shape"] == list(d2t.shape)


@pytest.mark.parametrize("given, words", [
    ("draft", "a draft model, not the model it drafts for"),
    ("bad name", "--target 'bad name': neither an existing folder or file nor a valid hub id"),
    ("nowhere/x/y", "--target: local path 'nowhere/x/y' does not exist"),
])
def test_a_target_that_is_no_target_exits_2_in_the_commands_words(target, tmp_path, capsys, given, words):
    draft = exported(target, tmp_path)
    code, _, err = run_cli(capsys, draft, "--target", draft if given == "draft" else given)
    assert code == 2 and words in err and "target.model" not in err
