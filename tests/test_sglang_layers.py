from itertools import combinations

import pytest

from draftlab.errors import UserError
from draftlab.sglang.layers import (EMBEDDING_CAPTURE_FROM, FAMILIES, can_capture_embedding, embedding_failure, embedding_refusal, capture_only_ids, captured_physical,
                                    dropped_ids, ids_for_physical, physical_from_spec, physical_from_user_layers,
                                    user_layers_from_physical, validate_capture)

LLAMA_LIKE = ["LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"]


@pytest.mark.parametrize("arch", LLAMA_LIKE)
def test_llama_family_ids_capture_the_next_physical_index(arch):
    # Measured on SGLang 0.5.14 with an 8-layer Llama: ids [1, 3, 5] gave hidden_states[2], [4], [6].
    assert captured_physical(arch, 8, [1, 3, 5], "0.5.14") == [2, 4, 6]
    assert ids_for_physical(arch, 8, [2, 4, 6], "0.5.14") == [1, 3, 5]


def test_no_eagle_config_captures_the_default_and_writing_it_explicitly_shifts_it():
    # Measured: no eagle_config gave hidden_states [2, 4, 5] for 8 layers.
    assert captured_physical("LlamaForCausalLM", 8, None, "0.5.14") == [2, 4, 5]
    assert captured_physical("LlamaForCausalLM", 8, [2, 4, 5], "0.5.14") == [3, 5, 6]
    assert ids_for_physical("LlamaForCausalLM", 8, [2, 4, 5], "0.5.14") == [1, 3, 4]


def test_llama_drops_the_last_layer_id_silently_and_order_does_not_matter():
    assert captured_physical("LlamaForCausalLM", 8, [1, 3, 7], "0.5.14") == [2, 4]
    assert captured_physical("LlamaForCausalLM", 8, [5, 1, 3], "0.5.14") == [2, 4, 6]


@pytest.mark.parametrize("physical, reason", [([0, 2, 4], "embedding"), ([2, 4, 8], "after the norm"), ([2, 4, 9], "does not exist")])
def test_impossible_llama_captures_are_refused_with_the_reason(physical, reason):
    with pytest.raises(UserError, match=reason):
        ids_for_physical("LlamaForCausalLM", 8, physical, "0.5.14")
    with pytest.raises(UserError, match=reason):
        validate_capture("LlamaForCausalLM", 8, physical, "0.5.14")


def test_deepseek_version_rule():
    L = 61
    # Before 0.5.13: always +1.
    assert captured_physical("DeepseekV3ForCausalLM", L, [2, 30, 57], "0.5.12") == [3, 31, 58]
    # From 0.5.13: +1 only when the first id is 1, otherwise as-is.
    assert captured_physical("DeepseekV3ForCausalLM", L, [1, 30, 57], "0.5.13") == [2, 31, 58]
    assert captured_physical("DeepseekV3ForCausalLM", L, [2, 30, 57], "0.5.13") == [2, 30, 57]
    # Inverse: physical 2 first works in every version through the "first id 1" form.
    for v in ("0.5.5", "0.5.12", "0.5.13", "0.5.18"):
        assert ids_for_physical("DeepseekV2ForCausalLM", L, [2, 31, 58], v) == [1, 30, 57]
    assert ids_for_physical("DeepseekV3ForCausalLM", L, [3, 31, 58], "0.5.12") == [2, 30, 57]
    assert ids_for_physical("DeepseekV3ForCausalLM", L, [3, 31, 58], "0.5.14") == [3, 31, 58]


def test_deepseek_layer_one_first_is_impossible_from_0_5_13_only():
    assert ids_for_physical("DeepseekV3ForCausalLM", 61, [1, 31, 58], "0.5.12") == [0, 30, 57]
    with pytest.raises(UserError, match="physical layer 1"):
        ids_for_physical("DeepseekV3ForCausalLM", 61, [1, 31, 58], "0.5.13")


def test_gpt_oss_boundary_rule_from_0_5_17():
    L = 24
    assert captured_physical("GptOssForCausalLM", L, [1, 11, 20], "0.5.16") == [2, 12, 21]
    assert captured_physical("GptOssForCausalLM", L, [1, 11, 20], "0.5.17") == [2, 12, 21]
    assert captured_physical("GptOssForCausalLM", L, [2, 12, 24], "0.5.17") == [2, 12, 24]  # boundaries
    assert ids_for_physical("GptOssForCausalLM", L, [2, 12, 21], "0.5.17") == [1, 11, 20]
    # From 0.5.17 the +1 loop reaches boundary 0 (id -1) and boundary L (id L-1, the last block output
    # before the final norm). Boundary 0 is the embedding tensor itself, overwritten in place by the later
    # layers until 0.5.21 copies it (measured on 0.5.17: the slot matched no layer); 0.5.16 and before crash.
    for ids in ([-1, 11, 20], [0, 12, 24]):
        with pytest.raises(UserError, match="overwrite it in place.*measured on a real server.*SGLang >= 0.5.21"):
            captured_physical("GptOssForCausalLM", L, ids, "0.5.17")
    assert ids_for_physical("GptOssForCausalLM", L, [0, 12, 21], "0.5.21") == [-1, 11, 20]
    assert captured_physical("GptOssForCausalLM", L, [0, 12, 24], "0.5.23") == [0, 12, 24]
    assert captured_physical("GptOssForCausalLM", L, [1, 11, 23], "0.5.17") == [2, 12, 24]
    assert dropped_ids("GptOssForCausalLM", L, [1, 11, 23], "0.5.17") == []
    assert dropped_ids("GptOssForCausalLM", L, [1, 11, 23], "0.5.16") == [23]
    with pytest.raises(UserError, match="embedding"):
        ids_for_physical("GptOssForCausalLM", L, [0, 12, 21], "0.5.16")


@pytest.mark.parametrize("arch, version", [("LlamaForCausalLM", "0.5.14"), ("Qwen3ForCausalLM", "0.5.5"),
                                           ("DeepseekV3ForCausalLM", "0.5.12"), ("DeepseekV3ForCausalLM", "0.5.18"),
                                           ("GptOssForCausalLM", "0.5.18")])
def test_every_possible_choice_round_trips_through_sglangs_rule(arch, version):
    for L in (4, 8, 13):
        for physical in combinations(range(0, L + 1), 3):
            try:
                ids = ids_for_physical(arch, L, list(physical), version)
            except UserError:
                continue
            assert captured_physical(arch, L, ids, version) == list(physical)
    # and the ordinary choices are never refused
    assert ids_for_physical(arch, 8, [3, 5, 6], version)


def test_unknown_architecture_is_refused_by_name():
    with pytest.raises(UserError, match="MambaForCausalLM"):
        ids_for_physical("MambaForCausalLM", 8, [2, 4, 6], "0.5.14")


def test_params_spec_maps_to_physical():
    assert physical_from_spec([5, 1, 3], "LlamaForCausalLM", 8) == [2, 4, 6]
    assert physical_from_spec("default", "LlamaForCausalLM", 8) == [2, 4, 5]
    assert physical_from_spec("default", "Qwen2ForCausalLM", 28) == [2, 14, 25]
    with pytest.raises(UserError, match="layer 7 is out of range"):
        physical_from_spec([1, 3, 7], "LlamaForCausalLM", 8)
    with pytest.raises(UserError, match="same layer twice"):
        physical_from_spec([1, 1, 3], "LlamaForCausalLM", 8)
    with pytest.raises(UserError, match="list of decoder layer numbers"):
        physical_from_spec("last", "LlamaForCausalLM", 8)


def test_user_layer_k_is_the_output_of_decoder_layer_k_physical_k_plus_one():
    # capture.layers [1, 3, 5] = outputs of decoder layers 1, 3, 5 = hidden_states[2], [4], [6]
    assert physical_from_user_layers([1, 3, 5]) == [2, 4, 6]
    assert user_layers_from_physical([2, 4, 6]) == [1, 3, 5]
    assert physical_from_user_layers([5, 1]) == [6, 2]  # the order is kept
    assert user_layers_from_physical([0]) == ["embedding"]  # the embedding output is no decoder layer's
    assert physical_from_user_layers(["embedding", 3, 5]) == [0, 4, 6]
    assert user_layers_from_physical([0, 4, 6]) == ["embedding", 3, 5]


@pytest.mark.parametrize("layers", [[0], [1, 3, 5], [5, 1, 3], [0, 13, 26], ["embedding", 3, 5], [5, "embedding"]])
def test_user_layers_round_trip_through_physical(layers):
    assert user_layers_from_physical(physical_from_user_layers(layers)) == layers
    assert physical_from_user_layers(user_layers_from_physical(physical_from_user_layers(layers))) == physical_from_user_layers(layers)


def test_on_llama_sglangs_ids_are_the_users_layer_numbers():
    for layers in ([1, 3, 5], [0, 2, 6], [2, 4, 5]):
        physical = physical_from_user_layers(layers)
        assert physical_from_spec(layers, "LlamaForCausalLM", 8) == physical
        assert ids_for_physical("LlamaForCausalLM", 8, physical, "0.5.14") == layers
        assert captured_physical("LlamaForCausalLM", 8, layers, "0.5.14") == physical


def test_ids_shifted_by_one_capture_the_next_layer():
    ids = ids_for_physical("LlamaForCausalLM", 8, [2, 4, 6], "0.5.14")
    assert captured_physical("LlamaForCausalLM", 8, [i + 1 for i in ids], "0.5.14") == [3, 5, 7]


def test_dropped_ids_are_the_ones_the_capture_loop_never_reaches():
    assert dropped_ids("LlamaForCausalLM", 8, [1, 3, 7], "0.5.14") == [7]
    assert dropped_ids("LlamaForCausalLM", 8, [1, 3, 5], "0.5.14") == []
    assert dropped_ids("LlamaForCausalLM", 8, [-1, 3, 5], "0.5.14") == []  # the embedding crashes: not a silent drop
    assert dropped_ids("LlamaForCausalLM", 8, [-1, 3, 5], "0.5.22") == []  # and is captured from 0.5.22


@pytest.mark.parametrize("physical", [[], [2, 4], [2, 3, 4, 6]])
def test_a_capture_spec_the_eagle3_draft_cannot_take_is_refused_before_extraction(physical):
    # SGLang's fc takes exactly 3 x hidden: [1, 3] passed extract, standardize and train before
    # export refused it; [] crashed standardize.
    with pytest.raises(UserError, match=rf"{len(physical)} layer\(s\).*takes exactly 3"):
        validate_capture("LlamaForCausalLM", 8, physical)


# --- the embedding output (physical 0, capture.layers `embedding`) ---------------------------------


def test_embedding_in_the_params_spec_is_physical_zero():
    assert physical_from_spec(["embedding", 3, 5], "LlamaForCausalLM", 8) == [0, 4, 6]
    assert physical_from_spec([5, "embedding", 3], "DeepseekV3ForCausalLM", 8) == [0, 4, 6]
    with pytest.raises(UserError, match="same layer twice"):
        physical_from_spec(["embedding", "embedding", 3], "LlamaForCausalLM", 8)
    with pytest.raises(UserError, match="list of decoder layer numbers"):
        physical_from_spec(["embed", 3, 5], "LlamaForCausalLM", 8)


def test_llama_captures_the_embedding_from_0_5_22_only():
    # v0.5.21 llama.py LlamaModel.forward: hidden_states + residual with residual None before layer 0 (TypeError);
    # v0.5.22 layer boundaries capture the stack's input there.
    with pytest.raises(UserError, match=r"TypeError.*llama.py.*decoder layer 0's output instead.*SGLang >= 0.5.22"):
        ids_for_physical("LlamaForCausalLM", 8, [0, 4, 6], "0.5.21")
    with pytest.raises(UserError, match="TypeError"):
        captured_physical("LlamaForCausalLM", 8, [-1, 3, 5], "0.5.21")
    assert ids_for_physical("LlamaForCausalLM", 8, [0, 4, 6], "0.5.22") == [-1, 3, 5]
    assert captured_physical("LlamaForCausalLM", 8, [-1, 3, 5], "0.5.23") == [0, 4, 6]


@pytest.mark.parametrize("arch", ["Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"])
def test_qwen_moe_families_capture_the_embedding_in_every_release_read(arch):
    # the communicator's capture after prepare_attn, from 0.5.5 on (measured on 0.5.14: parity clean, rel err 0.0)
    for v in ("0.5.5", "0.5.14", "0.5.21", "0.5.23"):
        assert ids_for_physical(arch, 8, [0, 4, 6], v) == [-1, 3, 5]
        assert captured_physical(arch, 8, [-1, 3, 5], v) == [0, 4, 6]


@pytest.mark.parametrize("arch", ["Qwen2ForCausalLM", "Qwen3ForCausalLM"])
def test_qwen_dense_feeds_an_overwritten_embedding_until_0_5_21(arch):
    # Measured on 0.5.14 (Qwen3): ids [-1, 3, 5] served without error, but slot 0 held the residual stream the
    # later layers wrote into the embedding tensor (11.6x relative error). 0.5.21's snapshot copies it.
    for v in ("0.5.5", "0.5.14", "0.5.20"):
        with pytest.raises(UserError, match="runs and feeds the draft the last layer's residual stream.*with no error"):
            ids_for_physical(arch, 8, [0, 4, 6], v)
        with pytest.raises(UserError, match="SGLang >= 0.5.21"):
            captured_physical(arch, 8, [-1, 3, 5], v)
    for v in ("0.5.21", "0.5.23"):
        assert ids_for_physical(arch, 8, [0, 4, 6], v) == [-1, 3, 5]
        assert captured_physical(arch, 8, [-1, 3, 5], v) == [0, 4, 6]


def test_the_embedding_failure_says_crash_or_silent_alias_and_whether_it_was_measured():
    assert embedding_failure("LlamaForCausalLM", "0.5.14") == "crash" and embedding_failure("LlamaForCausalLM", "0.5.22") is None
    assert embedding_failure("GptOssForCausalLM", "0.5.16") == "crash" and embedding_failure("GptOssForCausalLM", "0.5.17") == "alias"
    assert embedding_failure("Qwen3ForCausalLM", "0.5.14") == "alias" and embedding_failure("Qwen3MoeForCausalLM", "0.5.14") is None
    assert "measured on a real server" in embedding_refusal("LlamaForCausalLM", "0.5.14")
    assert "measured on a real server" not in embedding_refusal("LlamaForCausalLM", "0.5.21")  # read from source only


@pytest.mark.parametrize("arch", ["DeepseekV3ForCausalLM", "KimiK25ForConditionalGeneration"])
def test_deepseek_first_id_zero_is_the_embedding_from_0_5_14(arch):
    # Measured on 0.5.14 (DeepseekV3ForCausalLM): ids [0, 3, 5] fed hidden_states[0], [3], [5].
    # Kimi-K2.5 hands its ids to its DeepseekV3 language model (kimi_k25.py).
    assert ids_for_physical(arch, 8, [0, 3, 5], "0.5.14") == [0, 3, 5]
    assert captured_physical(arch, 8, [0, 3, 5], "0.5.23") == [0, 3, 5]
    for v in ("0.5.12", "0.5.13"):  # +1 (id -1) or as-is (id 0): both add a None residual before layer 0
        with pytest.raises(UserError, match="TypeError.*deepseek_v2.py"):
            ids_for_physical(arch, 8, [0, 3, 5], v)


def test_embedding_rule_covers_every_known_architecture():
    for archs in FAMILIES.values():
        for arch in archs:
            assert arch in EMBEDDING_CAPTURE_FROM
            since = ".".join(map(str, EMBEDDING_CAPTURE_FROM[arch]))
            assert can_capture_embedding(arch, since)


@pytest.mark.parametrize("version, ok", [("0.5.14", False), ("0.5.21", False), ("0.5.22", True), ("0.5.23", True)])
def test_extract_validation_of_the_embedding_on_llama_depends_on_the_serving_version(version, ok):
    physical = physical_from_spec(["embedding", 3, 5], "LlamaForCausalLM", 8)
    if ok:
        validate_capture("LlamaForCausalLM", 8, physical, version)
    else:
        with pytest.raises(UserError, match=rf'capture.layers: embedding .*export.sglang_version "{version}".*decoder layer 0'):
            validate_capture("LlamaForCausalLM", 8, physical, version)


def test_default_layers_keep_their_physical_indices_and_ids():
    # The default pipeline: capture.layers [1, 3, 5] on the 8-layer Llama target, SGLang 0.5.14.
    physical = physical_from_spec([1, 3, 5], "LlamaForCausalLM", 8)
    assert physical == [2, 4, 6] and ids_for_physical("LlamaForCausalLM", 8, physical, "0.5.14") == [1, 3, 5]
    validate_capture("LlamaForCausalLM", 8, physical, "0.5.14")


# --- release rules 0.5.18..0.5.23 (reports/sglang-releases.md) -------------------------------------


@pytest.mark.parametrize("version", ["0.5.18", "0.5.19", "0.5.20", "0.5.21", "0.5.22", "0.5.23"])
def test_id_rules_read_the_same_in_every_release_through_0_5_23(version):
    assert captured_physical("LlamaForCausalLM", 8, [1, 3, 5], version) == [2, 4, 6]
    assert captured_physical("Qwen3MoeForCausalLM", 8, None, version) == [2, 4, 5]
    assert captured_physical("DeepseekV3ForCausalLM", 61, [1, 30, 57], version) == [2, 31, 58]
    assert captured_physical("DeepseekV3ForCausalLM", 61, [3, 30, 57], version) == [3, 30, 57]
    assert captured_physical("GptOssForCausalLM", 24, [2, 12, 24], version) == [2, 12, 24]  # boundary ids


def test_capture_only_server_ids_from_0_5_23_refuse_the_negative_embedding_id():
    assert capture_only_ids("LlamaForCausalLM", 8, [2, 4, 6], "0.5.23") == [1, 3, 5]
    assert capture_only_ids("DeepseekV3ForCausalLM", 8, [0, 3, 5], "0.5.23") == [0, 3, 5]  # as-is: non-negative
    with pytest.raises(UserError, match="non-negative"):
        capture_only_ids("LlamaForCausalLM", 8, [0, 4, 6], "0.5.23")
    with pytest.raises(UserError, match="no --enable-return-aux-hidden-states"):
        capture_only_ids("LlamaForCausalLM", 8, [2, 4, 6], "0.5.22")


# --- extract: the embedding output captured, or refused before any compute -------------------------


def _extract_project(root, version):
    import json

    import yaml

    from draftlab.manifest import ROOT, build_manifest, output_files, write_manifest
    from tests.support.micro import save_micro_model

    model = save_micro_model(root / "micro", arch="llama", num_layers=4)
    p = yaml.safe_load((ROOT / "params.yaml").read_text())
    p["target"].update(model=str(root / "micro"), device="cpu")
    p["capture"]["layers"] = ["embedding", 1, 2]
    p["export"]["sglang_version"] = version
    (root / "params.yaml").write_text(yaml.safe_dump(p))
    synth = root / "synth"
    synth.mkdir()
    for split, n in (("train", 3), ("eval", 1)):
        rows = [{"id": f"{split}{i}", "messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "an answer"}]}
                for i in range(n)]
        (synth / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    write_manifest(synth, build_manifest("synthesize", {}, {}, info={"files": output_files(synth)}))
    return model, synth


def test_extract_refuses_the_embedding_where_the_serving_release_crashes_on_it(tmp_path, monkeypatch):
    from stages.extract import main

    _, synth = _extract_project(tmp_path, "0.5.14")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match=r"capture.layers: embedding .*0.5.14.*TypeError.*SGLang >= 0.5.22"):
        main(synth, tmp_path / "hidden")
    assert not (tmp_path / "hidden").exists()  # refused before any compute


def test_extract_captures_the_embedding_output_as_physical_zero(tmp_path, monkeypatch):
    import json

    import torch
    from safetensors import safe_open

    from stages.extract import main

    model, synth = _extract_project(tmp_path, "0.5.22")
    monkeypatch.chdir(tmp_path)
    main(synth, tmp_path / "hidden")
    with safe_open(str(tmp_path / "hidden/train/shard-00000.safetensors"), "pt") as f:
        assert json.loads(f.metadata()["physical_layers"]) == [0, 2, 3]
        ids, emb = f.get_tensor("input_ids"), f.get_tensor("hidden.0")
    # physical 0 is the token embedding itself (stored in extract.dtype)
    want = model.get_input_embeddings()(ids.long()).to(emb.dtype)
    assert torch.equal(emb, want)
