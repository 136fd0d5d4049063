"""python -m draftlab.check draft PATH --target MODEL: the verdict on a draft trained anywhere.

Every checkpoint is built here from a micro target (no binaries committed); the SpecForge and
speculators configs mirror the JSON under tests/fixtures/external/ (see the notes there for the
versions they were read from).
"""
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from draftlab.check import __main__
from draftlab.check import parity
from draftlab.check.external import check_external, read_draft
from draftlab.check.findings import names
from draftlab.train.draft import DraftConfig, Eagle3Draft
from draftlab.errors import UserError
from draftlab.features.dataset import build_draft_vocab, load_draft_vocab
from draftlab.sglang.checkpoint import export_sglang
from draftlab.target.tokenizer import save_tokenizer
from tests.support.micro import make_micro_tokenizer, save_micro_model
from tests.tiny_features import make_features, target_facts

FIXTURES = Path(__file__).parent / "fixtures" / "external"
L, H, V, VD = 8, 64, 256, 128  # micro target: SGLang's default layers [2, 4, 5] are three distinct ones


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """(target dir, its facts) of an 8-layer micro Llama."""
    path = tmp_path_factory.mktemp("target") / "micro"
    model = save_micro_model(path, arch="llama", num_layers=L, hidden_size=H, vocab_size=V)
    return path, target_facts(model, path)


def make_draft(facts: dict) -> Eagle3Draft:
    cfg = DraftConfig.from_target(facts, num_aux_layers=3, draft_vocab_size=VD, intermediate_size=96)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        draft = Eagle3Draft(cfg)
    counts = torch.randint(1, 1000, (V,), generator=torch.Generator().manual_seed(1))
    draft.set_vocab(*build_draft_vocab(counts, VD))  # a real reduced vocab: d2t far from all zeros
    return draft


def sglang_tensors(facts: dict) -> dict[str, torch.Tensor]:
    """The tensors SpecForge's exporter writes: the draft's own names (midlayer.*, fc, norm, lm_head, d2t, t2d)."""
    return {k: v.contiguous() if k in ("d2t", "t2d") else v.to(torch.bfloat16).contiguous()
            for k, v in make_draft(facts).state_dict().items()}


def write_specforge(path: Path, facts: dict, shards: int = 1, **changes) -> Path:
    path.mkdir(parents=True)
    config = json.loads((FIXTURES / "specforge_config.json").read_text())
    config.update(hidden_size=H, intermediate_size=96, num_attention_heads=facts["num_attention_heads"], head_dim=facts["head_dim"],
                  num_key_value_heads=facts["num_key_value_heads"], vocab_size=V, draft_vocab_size=VD, **changes)
    (path / "config.json").write_text(json.dumps(config))
    tensors = sglang_tensors(facts)
    if shards == 1:
        save_file(tensors, str(path / "model.safetensors"))
        return path
    names_ = sorted(tensors)
    weight_map = {}
    for i in range(shards):
        shard = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = names_[i::shards]
        save_file({n: tensors[n] for n in part}, str(path / shard))
        weight_map.update({n: shard for n in part})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path


def write_speculators(path: Path, facts: dict, ids=None) -> Path:
    """speculators' layout: sizes under transformer_layer_config, layers.0.*, its own embedding copy."""
    path.mkdir(parents=True)
    config = json.loads((FIXTURES / "speculators_config.json").read_text())
    config["transformer_layer_config"].update(
        hidden_size=H, intermediate_size=96, num_attention_heads=facts["num_attention_heads"], head_dim=facts["head_dim"],
        num_key_value_heads=facts["num_key_value_heads"], vocab_size=V, max_position_embeddings=facts["max_position_embeddings"])
    config.update(draft_vocab_size=VD, target_hidden_size=None, eagle_aux_hidden_state_layer_ids=ids)
    (path / "config.json").write_text(json.dumps(config))
    tensors = {k.replace("midlayer.", "layers.0."): v for k, v in sglang_tensors(facts).items()}
    tensors["embed_tokens.weight"] = torch.zeros(V, H, dtype=torch.bfloat16)
    save_file(tensors, str(path / "model.safetensors"))
    return path


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_:
        __main__.main(["draft", *map(str, argv)])
    out = capsys.readouterr()
    return exit_.value.code, out.out, out.err


def test_this_projects_export_is_clean(target, tmp_path, capsys):
    path, facts = target
    export_sglang(make_draft(facts), tmp_path / "draft", facts, [2, 4, 6], "0.5.14")
    code, out, _ = run_cli(capsys, tmp_path / "draft", "--target", path, "--json", tmp_path / "v.json")
    report = json.loads((tmp_path / "v.json").read_text())
    assert code == 0, out
    assert report["ok"] and report["counts"]["warning"] == 0, out
    assert report["settings"]["layout"] == "draftlab" and report["settings"]["sglang_captures"] == [2, 4, 6]
    assert report["settings"]["trained_basis"] == "recorded"


@pytest.mark.parametrize("shards", [1, 2])
def test_specforge_draft_names_the_missing_eagle_config_and_the_default_it_gets(target, tmp_path, capsys, shards):
    path, facts = target
    draft = write_specforge(tmp_path / "specforge", facts, shards)
    code, out, _ = run_cli(capsys, draft, "--target", path, "--sglang-version", "0.5.14", "--json", tmp_path / "v.json")
    report = json.loads((tmp_path / "v.json").read_text())
    found = {f["name"]: f for f in report["findings"]}
    assert code == 0, out  # SpecForge trains its default layers when no eagle_config is given: servable, by coincidence
    assert report["settings"]["layout"] == "sglang" and report["settings"]["sglang_captures"] == [2, 4, 5]
    assert found["eagle_config_missing"]["severity"] == "warning"
    assert "default physical [2, 4, 5]" in found["eagle_config_missing"]["cause"]
    assert "[1, 3, 4]" in found["eagle_config_missing"]["fix"]  # the ids to write, in SGLang's numbering
    assert "trained_layers_inferred" in found and "draft_tensors_mismatch" not in found
    assert "eagle_config_missing" in out


def test_specforge_draft_with_a_short_context_and_no_d2t_is_an_error(target, tmp_path):
    path, facts = target
    draft = write_specforge(tmp_path / "specforge", facts, max_position_embeddings=256)
    tensors = sglang_tensors(facts)
    del tensors["d2t"]
    save_file(tensors, str(draft / "model.safetensors"))
    verdict = check_external(draft, str(path), "0.5.14")
    assert {"draft_context_shorter", "d2t_missing"} <= set(names(verdict.errors))


def test_speculators_null_ids_are_named_with_what_sglang_and_vllm_feed(target, tmp_path, capsys):
    path, facts = target
    draft = write_speculators(tmp_path / "speculators", facts, ids=None)
    code, out, _ = run_cli(capsys, draft, "--target", path, "--sglang-version", "0.5.14", "--json", tmp_path / "v.json")
    report = json.loads((tmp_path / "v.json").read_text())
    found = {f["name"]: f for f in report["findings"]}
    assert code == 1
    null = found["speculators_layer_ids_null"]
    assert null["severity"] == "error" and null["evidence"]["sglang_feeds_physical"] == [2, 4, 5]
    assert "eagle_aux_hidden_state_layer_ids" in null["fix"] and "[1, 3, 4]" in null["fix"]
    assert found["speculators_layout"]["severity"] == "error"
    assert "draft_tensors_mismatch" not in found  # layers.0.* read under SGLang's midlayer.* names
    assert "speculators_layer_ids_null" in out


def test_speculators_ids_are_read_as_vllm_physical_indices(target, tmp_path):
    path, facts = target
    draft = write_speculators(tmp_path / "speculators", facts, ids=[2, 4, 6])
    verdict = check_external(draft, str(path), "0.5.14")
    found = {f.name: f for f in verdict.findings}
    assert found["speculators_ids_numbering"].evidence["sglang_ids"] == [1, 3, 5]
    assert found["layer_ids_at_top_level"].severity == "error"  # SGLang ignores them and feeds [2, 4, 5]


@pytest.mark.parametrize("make, words", [
    (lambda p: p, "no such checkpoint directory"),
    (lambda p: (p.mkdir(), p)[1], "config.json not found"),
    (lambda p: (p.mkdir(), (p / "config.json").write_text("{}"), (p / "pytorch_model.bin").write_bytes(b"x"), p)[-1], ".bin"),
])
def test_bad_path_exits_2_naming_it(target, tmp_path, capsys, make, words):
    bad = make(tmp_path / "nope")
    code, _, err = run_cli(capsys, bad, "--target", target[0])
    assert code == 2 and str(bad) in err and words in err


def test_features_prove_the_layers_and_compare_norms_in_process(tmp_path):
    feat, target_dir, model = make_features(tmp_path, num_layers=6, physical=(1, 2, 3))
    save_tokenizer(make_micro_tokenizer(model.config.vocab_size), target_dir)  # the target loads as a user's would
    facts = target_facts(model, target_dir)
    draft = Eagle3Draft(DraftConfig.from_target(facts, 3, 128))
    draft.set_vocab(*load_draft_vocab(feat / "draft_vocab.safetensors"))
    export_sglang(draft, tmp_path / "draft", facts, [1, 2, 3], "0.5.14")
    verdict = check_external(tmp_path / "draft", str(target_dir), features=feat, samples=2)
    assert verdict.settings["trained_basis"] == "training features"
    assert "live_parity_ok" in names(verdict.findings) and not verdict.errors


def test_a_server_feeding_other_layers_is_named_against_the_target_run_here(target, tmp_path, monkeypatch):
    path, facts = target
    draft = write_specforge(tmp_path / "specforge", facts, eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 3, 4]})
    from draftlab.check.diagnose import load_local_target

    shifted = parity.inprocess_capture(load_local_target(str(path), None), [3, 5, 6])  # a server one layer off
    monkeypatch.setattr(parity, "http_capture", lambda url, hidden, timeout: shifted)
    monkeypatch.setattr("draftlab.check.external.server_algorithm", lambda url, config: [])
    verdict = check_external(draft, str(path), "0.5.14", server="http://127.0.0.1:1", samples=2)
    shift = {f.name: f for f in verdict.findings}["layer_shift"]
    assert [s["matches_physical"] for s in shift.evidence["slots"]] == [3, 5, 6]


def test_read_draft_refuses_another_speculator_kind(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "config.json").write_text(json.dumps({"speculators_model_type": "dflash"}))
    with pytest.raises(UserError, match="dflash"):
        read_draft(tmp_path / "d")


def test_a_variant_flag_is_named_only_for_releases_that_ignore_it(target, tmp_path):
    # fc_norm is read by llama_eagle3.py from 0.5.14, norm_before_fc from 0.5.17 (the released wheels)
    path, facts = target
    draft = write_specforge(tmp_path / "specforge", facts, fc_norm=True, norm_before_fc=True)

    def variant(version):
        found = {f.name: f for f in check_external(draft, str(path), version).findings}
        return found["draft_variant_unsupported"].evidence["flags"] if "draft_variant_unsupported" in found else []

    assert variant("0.5.5") == ["fc_norm", "norm_before_fc"]
    assert variant("0.5.14") == ["norm_before_fc"]
    assert variant("0.5.17") == []
