"""Which target layers SGLang captures for an EAGLE-3 draft, and the ids that make it capture ours.

Convention (DESIGN.md section 4): a *physical* index i is transformers' `output_hidden_states[i]`:
0 = embedding output, i = output of decoder layer i-1, L = final output AFTER the final norm.
SGLang captures `hidden_states + residual` before running decoder layer i, i.e. physical i for
i in 0..L-1, and never the post-norm state L. Which i it captures depends on the ids in the
draft's `eagle_config.eagle_aux_hidden_state_layer_ids`, the target's architecture family and
the SGLang version:

- llama (Llama, Qwen2/3, Qwen MoE): id k captures physical k+1; with no ids, physical
  [2, L//2, L-3]. The id L-1 (physical L) is silently dropped; physical 0 crashes (TypeError).
- deepseek (DeepSeek-V2/V3, Kimi): before 0.5.13 id k -> k+1; from 0.5.13 on, k+1 only when the
  FIRST id of the list is 1, otherwise the ids are physical indices as-is.
- gpt-oss: from 0.5.17, if max(id) == L the ids are physical boundaries (0 = embedding,
  L = last block output BEFORE the final norm); otherwise k+1.
Aux states are concatenated in ascending physical order whatever order the ids are listed in.

The user's layer numbers (params `capture.layers`, the reports' `capture_layers`) count decoder
layer outputs from 0: user layer k = output of decoder layer k = physical k+1. In the +1 rule
above, SGLang's ids are exactly the user's layer numbers.

This module owns every translation between the three (physical index, SGLang id, user layer);
nothing else in the project adds or subtracts 1 to a layer.
"""
from __future__ import annotations

from draftlab.errors import UserError

FAMILIES = {
    "llama": ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"),
    "deepseek": ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "KimiK2ForCausalLM"),
    "gpt-oss": ("GptOssForCausalLM",),
}
# Releases whose source the rules above were read from; others get the newest known rule.
SGLANG_AUX_LAYERS = 3  # SGLang's EAGLE-3 fc is hard-wired to 3 x target_hidden_size inputs
VERIFIED_VERSIONS = ("0.5.5", "0.5.18")
DEEPSEEK_AS_IS_FROM = (0, 5, 13)
GPT_OSS_BOUNDARY_FROM = (0, 5, 17)


def family(architecture: str) -> str:
    for name, archs in FAMILIES.items():
        if architecture in archs:
            return name
    known = ", ".join(a for archs in FAMILIES.values() for a in archs)
    raise UserError(f"no SGLang EAGLE-3 capture rule is known for architecture {architecture!r} (known: {known})")


def parse_version(version: str) -> tuple[int, ...]:
    try:
        return tuple(int(p) for p in str(version).strip().lstrip("v").split(".")[:3])
    except ValueError:
        raise UserError(f"export.sglang_version: {version!r} is not a version like \"0.5.14\"") from None


def physical_from_user_layers(layers: list[int]) -> list[int]:
    """The user's layer numbers -> physical indices, in the same order: layer k -> physical k+1."""
    return [k + 1 for k in layers]


def user_layers_from_physical(physical: list[int]) -> list[int]:
    """Physical indices -> the user's layer numbers, in the same order: physical p -> layer p-1
    (the embedding output, physical 0, comes out as -1: it is no decoder layer's output)."""
    return [p - 1 for p in physical]


def default_physical(num_layers: int) -> list[int]:
    """What SGLang captures when the draft config names no layers (all known families)."""
    L = num_layers
    return [2, L // 2, L - 3]


def physical_from_spec(spec, architecture: str, num_layers: int) -> list[int]:
    """params `capture.layers` -> physical indices, ascending.

    A list of 0-based decoder-layer output indices k gives physical k+1; the word "default"
    gives SGLang's no-config default for the architecture.
    """
    if spec == "default":
        if family(architecture) == "gpt-oss":
            raise UserError("capture.layers: 'default' is not known for gpt-oss targets; list the layers, e.g. [1, 11, 20]")
        physical = default_physical(num_layers)
    elif isinstance(spec, list) and all(isinstance(k, int) and not isinstance(k, bool) for k in spec):
        physical = physical_from_user_layers(spec)
        for k in spec:
            if not 0 <= k <= num_layers - 2:
                raise UserError(
                    f"capture.layers: layer {k} is out of range for a {num_layers}-layer target "
                    f"(valid 0..{num_layers - 2}; the last layer's output cannot be captured by SGLang)"
                )
    else:
        raise UserError(f"capture.layers must be a list of layer numbers or 'default', got {spec!r}")
    if len(set(physical)) != len(physical):
        raise UserError(f"capture.layers: {spec!r} names the same layer twice")
    return sorted(physical)


def captured_physical(architecture: str, num_layers: int, layer_ids: list[int] | None, sglang_version: str) -> list[int]:
    """The physical indices SGLang captures for `layer_ids` (None = no eagle_config), ascending.

    Ids SGLang never reaches are dropped silently, as SGLang does. In gpt-oss boundary mode the
    index L means the last block output BEFORE the final norm (not the physical L of features).
    """
    L, fam, v = num_layers, family(architecture), parse_version(sglang_version)
    if layer_ids is None:
        physical = default_physical(L)
    elif fam == "deepseek" and v >= DEEPSEEK_AS_IS_FROM and not (layer_ids and layer_ids[0] == 1):
        physical = list(layer_ids)
    elif fam == "gpt-oss" and v >= GPT_OSS_BOUNDARY_FROM and layer_ids and max(layer_ids) == L:
        return sorted({i for i in layer_ids if 0 <= i <= L})
    else:  # +1: the ids are user layer numbers
        physical = physical_from_user_layers(layer_ids)
    physical = sorted({p for p in physical if 0 <= p < L})  # the capture loop runs i = 0..L-1
    if 0 in physical:
        raise UserError(f"SGLang would crash (TypeError) capturing the embedding output of a {fam} target")
    return physical


def _check_physical(fam: str, num_layers: int, physical: list[int]) -> None:
    L = num_layers
    if len(physical) != len(set(physical)):
        raise UserError(f"physical layers {physical} contain a duplicate; SGLang captures each layer once")
    for p in physical:
        if p == 0:
            raise UserError(
                f"physical layer 0 is the embedding output: SGLang cannot capture it for a {fam} target "
                f"(TypeError on Llama; on gpt-oss only together with the pre-norm last block output)"
            )
        if p == L:
            raise UserError(
                f"physical layer {L} is the final hidden state after the norm: SGLang never captures it "
                f"(the id {L - 1} is silently dropped); use decoder layers 0..{L - 2}"
            )
        if not 0 < p < L:
            raise UserError(f"physical layer {p} does not exist in a {L}-layer target (valid 1..{L - 1})")


def ids_for_physical(architecture: str, num_layers: int, physical: list[int], sglang_version: str) -> list[int]:
    """The `eagle_aux_hidden_state_layer_ids` that make SGLang capture exactly `physical`.

    Raises UserError naming the layer and the reason when no id list does.
    """
    fam = family(architecture)
    physical = sorted(physical)
    _check_physical(fam, num_layers, physical)
    v = parse_version(sglang_version)
    if fam == "deepseek" and v >= DEEPSEEK_AS_IS_FROM:
        if physical[0] == 1:
            raise UserError(
                f"DeepSeek-V2/V3 with SGLang {sglang_version}: physical layer 1 (output of decoder layer 0) cannot be "
                f"captured: a first id of 1 switches SGLang to +1 mode (capturing layer 2), and id 0 is taken as the embedding"
            )
        # First id 1 (physical 2) means +1 in every version; otherwise the ids are taken as-is.
        ids = user_layers_from_physical(physical) if physical[0] == 2 else list(physical)
    else:  # +1 rule (gpt-oss too: boundary mode is only needed for physical 0, refused above)
        ids = user_layers_from_physical(physical)
    got = captured_physical(architecture, num_layers, ids, sglang_version)
    if got != physical:  # the forward rule is the ground truth; never write ids it disagrees with
        raise UserError(f"internal: ids {ids} capture {got}, not {physical}")
    return ids


def dropped_ids(architecture: str, num_layers: int, layer_ids: list[int], sglang_version: str) -> list[int]:
    """The ids of `layer_ids` that SGLang's capture loop never reaches (it drops them silently).

    Each id is judged on its own; an id that would capture the embedding is not listed (that is
    a crash, not a silent drop: captured_physical raises for it).
    """
    dropped = []
    for i in layer_ids:
        try:
            if not captured_physical(architecture, num_layers, [i], sglang_version):
                dropped.append(i)
        except UserError:
            pass
    return dropped


def validate_capture(architecture: str, num_layers: int, physical: list[int], sglang_version: str | None = None) -> None:
    """Raise UserError (naming the layer and the reason) unless SGLang can capture `physical` and
    its EAGLE-3 draft can take them (exactly SGLANG_AUX_LAYERS of them).

    Called by extract before any compute, so an impossible choice fails in seconds, not after
    hours of extraction and training. Without a version, the newest known rule decides.
    """
    if len(physical) != SGLANG_AUX_LAYERS:
        raise UserError(
            f"capture.layers: {len(physical)} layer(s) (physical {sorted(physical)}); SGLang's EAGLE-3 draft "
            f"(LlamaForCausalLMEagle3) takes exactly {SGLANG_AUX_LAYERS}: its fc is {SGLANG_AUX_LAYERS} x the target's "
            f"hidden size wide. List {SGLANG_AUX_LAYERS} layers, e.g. [1, {num_layers // 2 - 1}, {num_layers - 4}]"
        )
    ids_for_physical(architecture, num_layers, physical, sglang_version or VERIFIED_VERSIONS[-1])
