import dataclasses
import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from draftlab.train.draft import KVCache
from draftlab.errors import UserError
from draftlab.sglang.checkpoint import ExportedDraft, export_sglang, load_exported, read_exported
from draftlab.sglang.layers import release_warning
from tiny_features import H, K, V, VD, make_draft

TARGET = {"architecture": "LlamaForCausalLM", "num_layers": 8, "max_position_embeddings": 4096, "model": "t", "revision": None,
          "hidden_size": H, "vocab_size": V}  # as standardize records it (the export checks it against the shards)


def trained_draft():
    draft = make_draft()
    d2t = torch.arange(draft.config.draft_vocab_size) * 0 + (V - draft.config.draft_vocab_size)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[V - draft.config.draft_vocab_size :] = True
    draft.set_vocab(d2t, t2d)
    return draft


@torch.no_grad()
def drafted(draft, seed=0):
    """Logits of a 3-step chain on random inputs (extend + 2 decode steps)."""
    g = torch.Generator().manual_seed(seed)
    ids, aux = torch.randint(0, V, (1, 9), generator=g), torch.randn(1, 6, K * draft.config.hidden_size, generator=g)
    kv = KVCache()
    logits, state = draft(ids[:, 1:7], draft.project(aux), torch.arange(6)[None], kv)
    out = [logits]
    for i in (1, 2):
        logits, state = draft(ids[:, 6 + i : 7 + i], state[:, -1:], torch.tensor([[5 + i]]), kv)
        out.append(logits)
    return torch.cat(out, dim=1)


def test_exported_draft_loads_back_with_identical_logits(tmp_path):
    draft = trained_draft()
    config = export_sglang(draft, tmp_path / "d", TARGET, [2, 4, 6], "0.5.14", dtype="float32")
    loaded, cfg_json = load_exported(tmp_path / "d", embed=draft.embed_tokens)
    assert cfg_json == config
    assert torch.equal(drafted(loaded), drafted(draft))
    assert torch.equal(loaded.to_target(torch.arange(3)), draft.to_target(torch.arange(3)))


def test_bfloat16_export_equals_the_draft_rounded_to_bfloat16(tmp_path):
    draft = trained_draft()
    export_sglang(draft, tmp_path / "d", TARGET, [2, 4, 6], "0.5.14", dtype="bfloat16")
    loaded, _ = load_exported(tmp_path / "d", embed=draft.embed_tokens)
    rounded = trained_draft()
    with torch.no_grad():
        for p in rounded.parameters():
            p.copy_(p.bfloat16().float())
    assert torch.equal(drafted(loaded), drafted(rounded))


def test_a_large_vocab_map_survives_export_exactly(tmp_path):
    # d2t values above 256 are not representable in bfloat16: they must stay int64.
    draft = make_draft(vocab=5000, draft_vocab=700)
    target_ids = torch.sort(torch.randperm(5000, generator=torch.Generator().manual_seed(0))[:700]).values
    t2d = torch.zeros(5000, dtype=torch.bool)
    t2d[target_ids] = True
    draft.set_vocab(target_ids - torch.arange(700), t2d)
    export_sglang(draft, tmp_path / "d", TARGET, [2, 4, 6], "0.5.14", dtype="bfloat16")
    loaded, _ = load_exported(tmp_path / "d")
    assert torch.equal(loaded.to_target(torch.arange(700)), target_ids) and torch.equal(loaded.t2d, t2d)


def test_config_and_files_are_what_sglang_reads(tmp_path):
    draft = trained_draft()
    config = export_sglang(draft, tmp_path / "d", {**TARGET, "max_position_embeddings": 131072}, [2, 4, 6], "0.5.14")
    on_disk = json.loads((tmp_path / "d/config.json").read_text())
    assert on_disk == config
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["num_hidden_layers"] == 1
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 5]
    assert config["max_position_embeddings"] == 131072  # never shorter than the target's context
    assert config["draft_vocab_size"] == draft.config.draft_vocab_size and config["vocab_size"] == V
    assert config["tie_word_embeddings"] is False and "target_hidden_size" not in config
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == ["config.json", "model.safetensors"]
    with safe_open(str(tmp_path / "d/model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert f.get_tensor("d2t").dtype == torch.int64 and f.get_tensor("t2d").dtype == torch.bool
        assert f.get_tensor("fc.weight").dtype == torch.bfloat16
    assert "midlayer.hidden_norm.weight" in names and not any("embed" in n for n in names)


def test_layer_ids_follow_the_architecture_and_version_rule(tmp_path):
    draft = trained_draft()
    deepseek = {**TARGET, "architecture": "DeepseekV3ForCausalLM", "num_layers": 61}
    assert export_sglang(draft, tmp_path / "a", deepseek, [3, 31, 58], "0.5.14")["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [3, 31, 58]
    assert export_sglang(draft, tmp_path / "b", deepseek, [3, 31, 58], "0.5.12")["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 30, 57]


def test_export_writes_the_ids_that_capture_the_embedding_where_the_release_serves_it(tmp_path):
    draft = trained_draft()
    deepseek = {**TARGET, "architecture": "DeepseekV3ForCausalLM"}
    # DeepSeek-V3 from 0.5.14: a first id 0 is taken as-is (measured: [0, 3, 5] fed hidden_states[0], [3], [5])
    config = export_sglang(draft, tmp_path / "a", deepseek, [0, 3, 5], "0.5.14")
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 3, 5]
    assert config["draftlab"]["physical_layers"] == [0, 3, 5]
    # Llama from 0.5.22 (layer-boundary capture): id -1
    config = export_sglang(draft, tmp_path / "b", TARGET, [0, 4, 6], "0.5.22")
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [-1, 3, 5]
    assert read_exported(tmp_path / "b").served_physical("LlamaForCausalLM", 8, "0.5.22") == [0, 4, 6]
    # and refused where the release crashes on it, with the release that serves it
    with pytest.raises(UserError, match=r"SGLang 0.5.21 cannot capture the embedding.*SGLang >= 0.5.22"):
        export_sglang(draft, tmp_path / "c", TARGET, [0, 4, 6], "0.5.21")
    with pytest.raises(UserError, match=r"SGLang 0.5.13 cannot capture the embedding.*SGLang >= 0.5.14"):
        export_sglang(draft, tmp_path / "c", deepseek, [0, 3, 5], "0.5.13")
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize("physical, target, reason", [
    ([2, 4, 8], TARGET, "after the norm"),
    ([0, 4, 6], TARGET, "embedding"),
    ([1, 31, 58], {**TARGET, "architecture": "DeepseekV3ForCausalLM", "num_layers": 61}, "physical layer 1"),
    ([2, 4], TARGET, "exactly 3"),
])
def test_export_refuses_what_sglang_cannot_capture_or_load(tmp_path, physical, target, reason):
    with pytest.raises(UserError, match=reason):
        export_sglang(trained_draft(), tmp_path / "d", target, physical, "0.5.14")
    assert not (tmp_path / "d").exists()


def damaged(kind):
    state = {k: (v if k in ("d2t", "t2d") else v.to(torch.bfloat16)) for k, v in trained_draft().state_dict().items()}
    if kind == "missing":
        del state["lm_head.weight"]
    elif kind == "renamed":
        state["midlayer.hidden_norms.weight"] = state.pop("midlayer.hidden_norm.weight")
    elif kind == "shape":
        state["fc.weight"] = state["fc.weight"][:, :-1]
    return state


@pytest.mark.parametrize("kind, named", [("missing", "missing lm_head.weight"), ("renamed", "unexpected midlayer.hidden_norms.weight"),
                                         ("shape", "fc.weight has shape")])
def test_exporter_rejects_a_missing_renamed_or_misshaped_weight(tmp_path, kind, named):
    with pytest.raises(UserError, match=named):
        export_sglang(trained_draft(), tmp_path / "d", TARGET, [2, 4, 6], "0.5.14", tensors=damaged(kind))
    assert not (tmp_path / "d").exists()


def test_loader_rejects_a_damaged_checkpoint(tmp_path):
    export_sglang(trained_draft(), tmp_path / "d", TARGET, [2, 4, 6], "0.5.14")
    save_file(damaged("renamed"), str(tmp_path / "d/model.safetensors"))
    with pytest.raises(UserError, match="midlayer.hidden_norm.weight"):
        load_exported(tmp_path / "d")


def stage_inputs(root, physical, trained_on_features=None):
    """What the export stage reads: the train stage's checkpoint, the features manifest (the target)
    and a feature shard (its header holds the physical layers)."""
    from draftlab.features.dataset import pack_sequences, shard_name, write_shard
    from draftlab.manifest import build_manifest, write_manifest
    from draftlab.train.saved import save_draft

    draft = trained_draft()
    save_draft(root / "ckpt", draft)
    features = build_manifest("standardize", {}, {}, info={"target": TARGET})
    write_manifest(root / "features", features)
    T, H = 4, draft.config.hidden_size
    seq = {"input_ids": torch.zeros(T, dtype=torch.int64), "loss_mask": torch.ones(T, dtype=torch.bool),
           "aux_hidden": torch.zeros(T, len(physical) * H, dtype=torch.bfloat16), "final_hidden": torch.zeros(T, H, dtype=torch.bfloat16)}
    meta = {"physical_layers": physical, "hidden_size": H, "num_layers": TARGET["num_layers"], "architecture": TARGET["architecture"],
            "vocab_size": V}
    write_shard(root / "features/train" / shard_name(0), pack_sequences([seq]), meta)
    inputs = {"features": trained_on_features or features["config_hash"]}
    write_manifest(root / "ckpt", build_manifest("train", {"train": {"ttt_steps": 3}}, inputs))
    (root / "params.yaml").write_text('export: {sglang_version: "0.5.14", formats: [sglang], dtype: bfloat16}\n')
    return draft


def test_export_stage_writes_the_checkpoint_and_a_report_with_lineage(tmp_path, monkeypatch):
    from stages.export import main

    draft = stage_inputs(tmp_path, [2, 4, 6])
    monkeypatch.chdir(tmp_path)
    main(tmp_path / "ckpt", tmp_path / "features", tmp_path / "draft", tmp_path / "export.json")
    report = json.loads((tmp_path / "export.json").read_text())
    manifest = json.loads((tmp_path / "draft/manifest.json").read_text())
    assert report["config_hash"] == manifest["config_hash"]
    assert report["eagle_aux_hidden_state_layer_ids"] == [1, 3, 5]
    assert report["settings"]["capture_layers"] == [1, 3, 5] and report["settings"]["physical_layers"] == [2, 4, 6]
    loaded, _ = load_exported(tmp_path / "draft", embed=draft.embed_tokens)
    assert loaded.config == dataclasses.replace(draft.config, max_position_embeddings=TARGET["max_position_embeddings"])


def test_a_release_outside_the_ones_read_is_exported_with_a_warning_naming_the_nearest(tmp_path, monkeypatch, capsys):
    from stages.export import main

    stage_inputs(tmp_path, [2, 4, 6])
    monkeypatch.chdir(tmp_path)
    main(tmp_path / "ckpt", tmp_path / "features", tmp_path / "draft", tmp_path / "export.json")
    assert "warning" not in capsys.readouterr().err  # 0.5.14: a release whose rules were read
    assert "sglang_version_warning" not in json.loads((tmp_path / "export.json").read_text())["settings"]
    (tmp_path / "params.yaml").write_text('export: {sglang_version: "0.5.30", formats: [sglang], dtype: bfloat16}\n')
    main(tmp_path / "ckpt", tmp_path / "features", tmp_path / "draft", tmp_path / "export.json")
    err = capsys.readouterr().err
    assert "0.5.30 is newer than every SGLang release" in err and "the rules of 0.5.23, the nearest" in err
    assert "0.5.23" in json.loads((tmp_path / "export.json").read_text())["settings"]["sglang_version_warning"]
    assert release_warning("0.5.4").startswith("export.sglang_version 0.5.4 is older") and "rules of 0.5.5" in release_warning("0.5.4")
    assert release_warning("0.5.5") is None and release_warning("0.5.23") is None


def test_export_stage_takes_the_layers_from_the_feature_shards_not_from_a_manifest(tmp_path, monkeypatch):
    from stages.export import main

    stage_inputs(tmp_path, [2, 3, 6])  # the features manifest names no layers (stage_inputs)
    monkeypatch.chdir(tmp_path)
    main(tmp_path / "ckpt", tmp_path / "features", tmp_path / "draft", tmp_path / "export.json")
    assert read_exported(tmp_path / "draft").layer_ids == [1, 2, 5]


def test_export_stage_refuses_a_checkpoint_trained_on_other_features(tmp_path, monkeypatch):
    from stages.export import main

    stage_inputs(tmp_path, [2, 4, 6], trained_on_features="f" * 64)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match="trained on other features"):
        main(tmp_path / "ckpt", tmp_path / "features", tmp_path / "draft", tmp_path / "export.json")
    assert not (tmp_path / "draft").exists()


def test_export_stage_refuses_layers_sglang_cannot_capture(tmp_path, monkeypatch):
    from stages.export import main

    stage_inputs(tmp_path, [2, 4, 8])  # physical 8 = the post-norm final state of an 8-layer target
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match="physical layer 8"):
        main(tmp_path / "ckpt", tmp_path / "features", tmp_path / "draft", tmp_path / "export.json")
    assert not (tmp_path / "draft").exists() and not (tmp_path / "export.json").exists()


def test_a_draft_without_eagle_config_serves_on_sglangs_default_layers(tmp_path):
    """SGLang starts such a draft silently on its default layers; the reference engine does the same."""
    import json
    import types

    from draftlab.train.draft import DraftConfig, Eagle3Draft
    from tests.support.micro import make_micro_model
    from draftlab.params import TargetParams
    from draftlab.engine.server import SpecEngine
    from draftlab.target.load import target_info

    target = make_micro_model("llama", num_layers=8, seed=0)
    target.config.architectures = ["LlamaForCausalLM"]
    info = {**target_info(target, TargetParams("m", None, "float32", "cpu")), "physical_layers": [2, 4, 6]}
    draft = Eagle3Draft(DraftConfig.from_target(info, 3, 64), embed_weight=target.get_input_embeddings().weight.detach())
    export_sglang(draft, tmp_path / "d", info, [2, 4, 6], "0.5.14")
    config = json.loads((tmp_path / "d/config.json").read_text())
    config.pop("eagle_config")
    (tmp_path / "d/config.json").write_text(json.dumps(config))
    assert load_exported(tmp_path / "d")[0].fc.weight.shape[1] == 3 * info["hidden_size"]
    engine = SpecEngine(target, types.SimpleNamespace(eos_token_id=None), "cpu", 512, str(tmp_path / "d"), 3, 1, 4, "0.5.14")
    assert engine.physical == [2, 4, 5]  # SGLang 0.5.14's default for 8 layers, as measured


def test_a_draft_without_d2t_is_refused_or_served_as_sglang_serves_it(tmp_path, capsys):
    """The export contract refuses it; the serving path (reference server, bench's offline run)
    maps draft ids to the same target ids, as SGLang does with no hot-token map."""
    draft = make_draft(seed=3)
    export_sglang(draft, tmp_path / "d", TARGET, [2, 4, 6], "0.5.14", dtype="float32")
    weights = tmp_path / "d" / "model.safetensors"
    with safe_open(str(weights), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys() if k != "d2t"}
    save_file(tensors, str(weights))
    with pytest.raises(UserError, match="missing d2t"):
        load_exported(tmp_path / "d")
    served, _ = load_exported(tmp_path / "d", as_sglang=True)
    assert torch.equal(served.d2t, torch.zeros(VD, dtype=torch.long)) and "no d2t" in capsys.readouterr().out
    assert all(torch.equal(served.state_dict()[k], v.float()) for k, v in tensors.items() if k != "t2d")


# --- the exported draft as SGLang reads it (ExportedDraft) ---------------------------------------


def exported_with(tmp_path, edit=None) -> ExportedDraft:
    export_sglang(trained_draft(), tmp_path / "d", TARGET, [2, 4, 6], "0.5.14")
    if edit:
        config = json.loads((tmp_path / "d/config.json").read_text())
        edit(config)
        (tmp_path / "d/config.json").write_text(json.dumps(config))
    return read_exported(tmp_path / "d")


def test_exported_draft_is_fed_the_layers_it_was_exported_for(tmp_path):
    draft = exported_with(tmp_path)
    assert draft.layer_ids == [1, 3, 5] and draft.sglang_version == "0.5.14"
    assert draft.served_physical("LlamaForCausalLM", 8, "0.5.14") == [2, 4, 6]
    assert draft.draft_config() == load_exported(tmp_path / "d")[0].config


def test_exported_draft_with_ids_shifted_by_one_is_fed_the_next_layers(tmp_path):
    draft = exported_with(tmp_path, lambda c: c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[2, 4, 6]))
    assert draft.served_physical("LlamaForCausalLM", 8, "0.5.14") == [3, 5, 7]


def test_exported_draft_without_eagle_config_is_fed_sglangs_default(tmp_path):
    draft = exported_with(tmp_path, lambda c: c.pop("eagle_config"))
    assert draft.layer_ids is None
    assert draft.served_physical("LlamaForCausalLM", 8, "0.5.14") == [2, 4, 5]  # physical [2, L//2, L-3], no +1
    assert draft.served_physical("Qwen2ForCausalLM", 28, "0.5.14") == [2, 14, 25]


def test_exported_draft_ids_at_the_top_level_are_not_read(tmp_path):
    draft = exported_with(tmp_path, lambda c: c.update(eagle_aux_hidden_state_layer_ids=c.pop("eagle_config")["eagle_aux_hidden_state_layer_ids"]))
    assert draft.layer_ids is None and draft.top_level_ids == [1, 3, 5]
    assert draft.served_physical("LlamaForCausalLM", 8, "0.5.14") == [2, 4, 5]


def test_exported_draft_follows_the_serving_versions_rule(tmp_path):
    deepseek = {**TARGET, "architecture": "DeepseekV3ForCausalLM", "num_layers": 61}
    export_sglang(trained_draft(), tmp_path / "d", deepseek, [3, 31, 58], "0.5.12")
    draft = read_exported(tmp_path / "d")
    assert draft.layer_ids == [2, 30, 57]
    assert draft.served_physical("DeepseekV3ForCausalLM", 61, "0.5.12") == [3, 31, 58]
    assert draft.served_physical("DeepseekV3ForCausalLM", 61, "0.5.14") == [2, 30, 57]  # served by a newer SGLang: as-is


def test_read_exported_names_a_missing_or_damaged_config(tmp_path):
    with pytest.raises(UserError, match="not an exported draft"):
        read_exported(tmp_path)
    (tmp_path / "config.json").write_text("{")
    with pytest.raises(UserError, match="not valid JSON"):
        read_exported(tmp_path)
