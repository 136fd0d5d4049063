from itertools import combinations

import pytest

from draftlab.errors import UserError
from draftlab.sglang.layers import (captured_physical, dropped_ids, ids_for_physical, physical_from_spec, physical_from_user_layers,
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
        validate_capture("LlamaForCausalLM", 8, physical)


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
    assert captured_physical("GptOssForCausalLM", L, [0, 12, 24], "0.5.17") == [0, 12, 24]  # boundaries
    assert ids_for_physical("GptOssForCausalLM", L, [2, 12, 21], "0.5.17") == [1, 11, 20]
    with pytest.raises(UserError, match="embedding"):
        ids_for_physical("GptOssForCausalLM", L, [0, 12, 21], "0.5.17")


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
    with pytest.raises(UserError, match="list of layer numbers"):
        physical_from_spec("last", "LlamaForCausalLM", 8)


def test_user_layer_k_is_the_output_of_decoder_layer_k_physical_k_plus_one():
    # capture.layers [1, 3, 5] = outputs of decoder layers 1, 3, 5 = hidden_states[2], [4], [6]
    assert physical_from_user_layers([1, 3, 5]) == [2, 4, 6]
    assert user_layers_from_physical([2, 4, 6]) == [1, 3, 5]
    assert physical_from_user_layers([5, 1]) == [6, 2]  # the order is kept
    assert user_layers_from_physical([0]) == [-1]  # the embedding output is no decoder layer's


@pytest.mark.parametrize("layers", [[0], [1, 3, 5], [5, 1, 3], [0, 13, 26]])
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


@pytest.mark.parametrize("physical", [[], [2, 4], [2, 3, 4, 6]])
def test_a_capture_spec_the_eagle3_draft_cannot_take_is_refused_before_extraction(physical):
    # SGLang's fc takes exactly 3 x hidden: [1, 3] passed extract, standardize and train before
    # export refused it; [] crashed standardize.
    with pytest.raises(UserError, match=rf"{len(physical)} layer\(s\).*takes exactly 3"):
        validate_capture("LlamaForCausalLM", 8, physical)
