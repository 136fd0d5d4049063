"""Which target layers SGLang captures for an EAGLE-3 draft, and the ids that make it capture ours.

Convention (DESIGN.md section 4): a *physical* index i is transformers' `output_hidden_states[i]`:
0 = embedding output, i = output of decoder layer i-1, L = final output AFTER the final norm.
SGLang captures `hidden_states + residual` before running decoder layer i, i.e. physical i for
i in 0..L-1, and never the post-norm state L. Which i it captures depends on the ids in the
draft's `eagle_config.eagle_aux_hidden_state_layer_ids`, the target's architecture family and
the SGLang version:

- llama (Llama, Qwen2/3, Qwen MoE): id k captures physical k+1; with no ids, physical
  [2, L//2, L-3]. The id L-1 (physical L) is silently dropped. The embedding output (physical 0,
  id -1): see EMBEDDING_CAPTURE_FROM (Llama crashes before 0.5.22; Qwen2/3 dense feed an overwritten
  tensor before 0.5.21; the Qwen MoE families capture it).
- deepseek (DeepSeek-V2/V3, Kimi): before 0.5.13 id k -> k+1; from 0.5.13 on, k+1 only when the
  FIRST id of the list is 1, otherwise the ids are physical indices as-is (so a first id 0 is the
  embedding output, captured from 0.5.14 on).
- gpt-oss: from 0.5.17, if max(id) == L the ids are physical boundaries (0 = embedding,
  L = last block output BEFORE the final norm); otherwise k+1, and the capture loop then also
  reaches boundary L (id L-1) and boundary 0 (id -1).
Aux states are concatenated in ascending physical order whatever order the ids are listed in.
The id rules (set_eagle3_layers_to_capture) read the same in every release 0.5.17..0.5.23
(reports/sglang-releases.md); the capture loops changed (EMBEDDING_CAPTURE_FROM).

The user's layer numbers (params `capture.layers`, the reports' `capture_layers`) count decoder
layer outputs from 0: user layer k = output of decoder layer k = physical k+1, and the word
`embedding` = physical 0. In the +1 rule above, SGLang's ids are exactly the user's layer
numbers (the embedding's id is -1).

This module owns every translation between the three (physical index, SGLang id, user layer);
nothing else in the project adds or subtracts 1 to a layer.
"""
from __future__ import annotations

from draftlab.errors import UserError

FAMILIES = {
    "llama": ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"),
    # KimiK25ForConditionalGeneration hands its ids to its DeepseekV3ForCausalLM language model
    # (sgl-project/sglang v0.5.17..v0.5.23 python/sglang/srt/models/kimi_k25.py set_eagle3_layers_to_capture).
    "deepseek": ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "KimiK2ForCausalLM", "KimiK25ForConditionalGeneration"),
    "gpt-oss": ("GptOssForCausalLM",),
}
# Releases whose source the rules above were read from; others get the newest known rule.
SGLANG_AUX_LAYERS = 3  # SGLang's EAGLE-3 fc is hard-wired to 3 x target_hidden_size inputs
VERIFIED_VERSIONS = ("0.5.5", "0.5.23")
DEEPSEEK_AS_IS_FROM = (0, 5, 13)
GPT_OSS_BOUNDARY_FROM = (0, 5, 17)
EMBEDDING = "embedding"  # the word in capture.layers (and the reports' capture_layers) for physical 0

# The first release whose capture loop takes the embedding output (physical 0) for the
# architecture; before it the loop computes `hidden_states + residual` with residual None
# before layer 0 and the server crashes (TypeError) on the first forward pass.
EMBEDDING_CAPTURE_FROM = {
    # Layer-boundary capture: before layer 0 the residual stream is empty and the boundary
    # captures its input (sgl-project/sglang v0.5.22 python/sglang/srt/layers/layer_boundary/stage.py
    # _prepare_attention, capture_before_read; python/sglang/srt/models/llama.py LlamaDecoderLayer.forward).
    "LlamaForCausalLM": (0, 5, 22),
    # v0.5.21 captures a copy (layer_boundary/residual/access.py snapshot: `hidden_states.clone()` when the
    # residual is None); v0.5.5..v0.5.20 keep the embedding tensor itself, which later layers overwrite
    # (EMBEDDING_ALIASED_FROM).
    "Qwen2ForCausalLM": (0, 5, 21),
    "Qwen3ForCausalLM": (0, 5, 21),
    # The communicator captures the residual after prepare_attn, the layer input at layer 0
    # (sgl-project/sglang v0.5.5 python/sglang/srt/layers/communicator.py prepare_attn_and_capture_last_layer_outputs).
    "Qwen2MoeForCausalLM": (0, 5, 5),
    "Qwen3MoeForCausalLM": (0, 5, 5),
    # v0.5.13 deepseek_v2.py DeepseekV2Model.forward still adds the residual; v0.5.14 passes
    # captured_last_layer_outputs to the communicator (measured on 0.5.14: ids [0, 3, 5] -> hidden_states[0], [3], [5]).
    "DeepseekV2ForCausalLM": (0, 5, 14),
    "DeepseekV3ForCausalLM": (0, 5, 14),
    "KimiK2ForCausalLM": (0, 5, 14),
    "KimiK25ForConditionalGeneration": (0, 5, 14),
    # v0.5.21 captures through layer boundaries into an accumulator that copies (layers/aux_hidden_states.py
    # AuxHiddenStateAccumulator.capture); v0.5.17..v0.5.20 keep the embedding tensor itself (EMBEDDING_ALIASED_FROM);
    # v0.5.14 adds the residual (TypeError, measured).
    "GptOssForCausalLM": (0, 5, 21),
}
# Releases from these on, up to EMBEDDING_CAPTURE_FROM, do not crash on the embedding output: their capture
# loop appends `hidden_states + residual if residual is not None else hidden_states`, and before layer 0 that
# is the embedding tensor itself, not a copy. Layer 0 keeps it as its residual, and every later fused
# add+RMSNorm adds into that residual in place, so by the time the draft reads the slot it holds the residual
# stream of the last layer. The server runs and the draft gets a wrong state with no error. Measured on
# SGLang 0.5.14 (Qwen3ForCausalLM) and 0.5.17 (GptOssForCausalLM): the slot is 11.6x and 13.0x the embedding's
# relative error and matches no layer (reports/families).
EMBEDDING_ALIASED_FROM = {
    "Qwen2ForCausalLM": (0, 5, 5),
    "Qwen3ForCausalLM": (0, 5, 5),
    "GptOssForCausalLM": (0, 5, 17),
}
EMBEDDING_ALIAS_SOURCE = {
    "Qwen2ForCausalLM": "sgl-project/sglang v0.5.20 python/sglang/srt/models/qwen2.py Qwen2Model.forward",
    "Qwen3ForCausalLM": "sgl-project/sglang v0.5.20 python/sglang/srt/models/qwen2.py Qwen2Model.forward (Qwen3Model inherits it)",
    "GptOssForCausalLM": "sgl-project/sglang v0.5.20 python/sglang/srt/models/gpt_oss.py GptOssModel.forward",
}
# Each failure measured on a real server (reports/families).
EMBEDDING_MEASURED = {("LlamaForCausalLM", "0.5.14"), ("GptOssForCausalLM", "0.5.14"), ("Qwen3ForCausalLM", "0.5.14"),
                      ("GptOssForCausalLM", "0.5.17")}
# Where the crash is, for the refusal (the last release read before the architecture's entry above).
EMBEDDING_CRASH_SOURCE = {
    "llama": "sgl-project/sglang v0.5.21 python/sglang/srt/models/llama.py LlamaModel.forward",
    "deepseek": "sgl-project/sglang v0.5.13 python/sglang/srt/models/deepseek_v2.py DeepseekV2Model.forward",
    "gpt-oss": "sgl-project/sglang v0.5.14 python/sglang/srt/models/gpt_oss.py GptOssModel.forward",
}
# --enable-return-aux-hidden-states (capture on the target without a draft) and its
# --return-aux-hidden-state-layer-ids, which must be non-negative (sgl-project/sglang v0.5.23
# python/sglang/srt/arg_groups/validation_hook.py handle_aux_hidden_state_capture).
CAPTURE_ONLY_FROM = (0, 5, 23)


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


def _version_text(v: tuple[int, ...]) -> str:
    return ".".join(str(p) for p in v)


def release_warning(sglang_version: str) -> str | None:
    """A warning for a release outside VERIFIED_VERSIONS, naming the nearest release whose rules apply; None inside."""
    v, first, last = parse_version(sglang_version), parse_version(VERIFIED_VERSIONS[0]), parse_version(VERIFIED_VERSIONS[-1])
    if first <= v <= last:
        return None
    nearest = VERIFIED_VERSIONS[0] if v < first else VERIFIED_VERSIONS[-1]
    return (f"export.sglang_version {sglang_version} is {'older' if v < first else 'newer'} than every SGLang release whose "
            f"capture and flag rules were read ({VERIFIED_VERSIONS[0]}-{VERIFIED_VERSIONS[-1]}); the rules of {nearest}, the "
            f"nearest, are applied. Prove the wiring on your server with the check stage's live parity (check.server_url)")


def can_capture_embedding(architecture: str, sglang_version: str) -> bool:
    """Whether SGLang `sglang_version` can capture the embedding output (physical 0) of the target."""
    family(architecture)  # an unknown architecture is refused by name
    return parse_version(sglang_version) >= EMBEDDING_CAPTURE_FROM[architecture]


def embedding_failure(architecture: str, sglang_version: str) -> str | None:
    """How SGLang `sglang_version` fails on the target's embedding output: "crash" (a TypeError on the
    first forward), "alias" (it runs and feeds an overwritten tensor), or None where it captures it."""
    if can_capture_embedding(architecture, sglang_version):
        return None
    aliased = EMBEDDING_ALIASED_FROM.get(architecture)
    return "alias" if aliased is not None and parse_version(sglang_version) >= aliased else "crash"


def embedding_refusal(architecture: str, sglang_version: str) -> str:
    """Why SGLang `sglang_version` cannot capture the embedding output of the target, and the alternatives."""
    since = _version_text(EMBEDDING_CAPTURE_FROM[architecture])
    measured = " measured on a real server;" if (architecture, _version_text(parse_version(sglang_version))) in EMBEDDING_MEASURED else ""
    if embedding_failure(architecture, sglang_version) == "alias":
        why = (f"its capture loop keeps the embedding tensor itself before decoder layer 0 (no residual to add, no copy), and "
               f"the later layers' fused add+RMSNorm overwrite it in place, so the server runs and feeds the draft the last "
               f"layer's residual stream in that slot, with no error ({measured} {EMBEDDING_ALIAS_SOURCE[architecture]})")
    else:
        why = (f"its capture loop adds the residual stream, which is None before decoder layer 0, and the server crashes with "
               f"a TypeError ({measured} {EMBEDDING_CRASH_SOURCE[family(architecture)]})")
    return (f"SGLang {sglang_version} cannot capture the embedding output (physical 0) of a {architecture} target: {why}. "
            f"Capture decoder layer 0's output instead (capture.layers 0 in place of {EMBEDDING}), or serve with SGLang >= "
            f"{since} (export.sglang_version: \"{since}\")").replace("( ", "(")


def physical_from_user_layers(layers: list) -> list[int]:
    """The user's layer numbers -> physical indices, in the same order: layer k -> physical k+1,
    the word `embedding` -> physical 0."""
    return [0 if k == EMBEDDING else k + 1 for k in layers]


def user_layers_from_physical(physical: list[int]) -> list:
    """Physical indices -> the user's layer numbers, in the same order: physical p -> layer p-1,
    physical 0 (the embedding output, no decoder layer's) -> the word `embedding`."""
    return [EMBEDDING if p == 0 else p - 1 for p in physical]


def _plus_one_ids(physical: list[int]) -> list[int]:
    """SGLang ids under the +1 rule (id k captures physical k+1; the embedding's id is -1)."""
    return [p - 1 for p in physical]


def default_physical(num_layers: int) -> list[int]:
    """What SGLang captures when the draft config names no layers (all known families)."""
    L = num_layers
    return [2, L // 2, L - 3]


def _is_layer_number(k) -> bool:
    return isinstance(k, int) and not isinstance(k, bool)


def physical_from_spec(spec, architecture: str, num_layers: int) -> list[int]:
    """params `capture.layers` -> physical indices, ascending.

    A list of 0-based decoder-layer output indices k gives physical k+1, the word `embedding`
    physical 0; the word "default" gives SGLang's no-config default for the architecture.
    Whether the SGLang release can serve the embedding output is validate_capture's question.
    """
    if spec == "default":
        if family(architecture) == "gpt-oss":
            raise UserError("capture.layers: 'default' is not known for gpt-oss targets; list the layers, e.g. [1, 11, 20]")
        physical = default_physical(num_layers)
    elif isinstance(spec, list) and all(_is_layer_number(k) or k == EMBEDDING for k in spec):
        physical = physical_from_user_layers(spec)
        for k in spec:
            if k != EMBEDDING and not 0 <= k <= num_layers - 2:
                raise UserError(
                    f"capture.layers: layer {k} is out of range for a {num_layers}-layer target "
                    f"(valid 0..{num_layers - 2} or the word {EMBEDDING}; the last layer's output cannot be captured by SGLang)"
                )
    else:
        raise UserError(f"capture.layers must be a list of decoder layer numbers (and optionally the word {EMBEDDING}) "
                        f"or 'default', got {spec!r}")
    if len(set(physical)) != len(physical):
        raise UserError(f"capture.layers: {spec!r} names the same layer twice")
    return sorted(physical)


def _capture_top(architecture: str, num_layers: int, v: tuple[int, ...]) -> int:
    """The highest physical index the capture loop reaches: L-1, or L (the pre-norm last block output)
    for gpt-oss from 0.5.17, whose loop also captures the boundary after the last block."""
    return num_layers if family(architecture) == "gpt-oss" and v >= GPT_OSS_BOUNDARY_FROM else num_layers - 1


def captured_physical(architecture: str, num_layers: int, layer_ids: list[int] | None, sglang_version: str) -> list[int]:
    """The physical indices SGLang captures for `layer_ids` (None = no eagle_config), ascending.

    Ids SGLang never reaches are dropped silently, as SGLang does. For gpt-oss from 0.5.17 the
    index L means the last block output BEFORE the final norm (not the physical L of features).
    Raises UserError when the ids make SGLang capture the embedding output and that release
    crashes on it.
    """
    L, fam, v = num_layers, family(architecture), parse_version(sglang_version)
    if layer_ids is None:
        physical = default_physical(L)
    elif fam == "deepseek" and v >= DEEPSEEK_AS_IS_FROM and not (layer_ids and layer_ids[0] == 1):
        physical = list(layer_ids)
    elif fam == "gpt-oss" and v >= GPT_OSS_BOUNDARY_FROM and layer_ids and max(layer_ids) == L:
        physical = list(layer_ids)
    else:  # +1: the ids are user layer numbers
        physical = [i + 1 for i in layer_ids]
    physical = sorted({p for p in physical if 0 <= p <= _capture_top(architecture, L, v)})
    if 0 in physical and not can_capture_embedding(architecture, sglang_version):
        raise UserError(embedding_refusal(architecture, sglang_version))
    return physical


def _check_physical(architecture: str, num_layers: int, physical: list[int], sglang_version: str) -> None:
    L = num_layers
    if len(physical) != len(set(physical)):
        raise UserError(f"physical layers {physical} contain a duplicate; SGLang captures each layer once")
    for p in physical:
        if p == 0 and not can_capture_embedding(architecture, sglang_version):
            raise UserError(embedding_refusal(architecture, sglang_version))
        if p == L:
            raise UserError(
                f"physical layer {L} is the final hidden state after the norm: SGLang never captures it "
                f"(the id {L - 1} is silently dropped); use decoder layers 0..{L - 2}"
            )
        if not 0 <= p < L:
            raise UserError(f"physical layer {p} does not exist in a {L}-layer target (valid 0..{L - 1})")


def ids_for_physical(architecture: str, num_layers: int, physical: list[int], sglang_version: str) -> list[int]:
    """The `eagle_aux_hidden_state_layer_ids` that make SGLang capture exactly `physical`.

    Raises UserError naming the layer and the reason when no id list does.
    """
    fam = family(architecture)
    physical = sorted(physical)
    _check_physical(architecture, num_layers, physical, sglang_version)
    v = parse_version(sglang_version)
    if fam == "deepseek" and v >= DEEPSEEK_AS_IS_FROM:
        if physical[0] == 1:
            raise UserError(
                f"DeepSeek-V2/V3 with SGLang {sglang_version}: physical layer 1 (output of decoder layer 0) cannot be "
                f"captured: a first id of 1 switches SGLang to +1 mode (capturing layer 2), and id 0 is taken as the embedding"
            )
        # First id 1 (physical 2) means +1 in every version; otherwise the ids are taken as-is
        # (a first id 0 is the embedding output).
        ids = _plus_one_ids(physical) if physical[0] == 2 else list(physical)
    else:  # +1 rule (gpt-oss too: id -1 reaches boundary 0 from 0.5.17 without boundary mode)
        ids = _plus_one_ids(physical)
    got = captured_physical(architecture, num_layers, ids, sglang_version)
    if got != physical:  # the forward rule is the ground truth; never write ids it disagrees with
        raise UserError(f"internal: ids {ids} capture {got}, not {physical}")
    return ids


def capture_only_ids(architecture: str, num_layers: int, physical: list[int], sglang_version: str) -> list[int]:
    """The `--return-aux-hidden-state-layer-ids` of a capture-only server (--enable-return-aux-hidden-states
    with --speculative-algorithm EAGLE3, SGLang 0.5.23+) that return exactly `physical`.

    The ids go through the same per-family rule as a draft's (the EAGLE3 capture hook), but that
    flag refuses negative ids, so the embedding output's -1 of the +1 rule cannot be asked for.
    """
    v = parse_version(sglang_version)
    if v < CAPTURE_ONLY_FROM:
        raise UserError(f"SGLang {sglang_version} has no --enable-return-aux-hidden-states (added in "
                        f"{_version_text(CAPTURE_ONLY_FROM)}); serve a draft with --enable-return-hidden-states instead")
    ids = ids_for_physical(architecture, num_layers, physical, sglang_version)
    if any(i < 0 for i in ids):
        raise UserError(f"SGLang {sglang_version}'s --return-aux-hidden-state-layer-ids must be non-negative, and the "
                        f"embedding output of a {architecture} target needs id -1 ({ids}); capture it through a draft's "
                        f"eagle_config, or capture decoder layer 0's output instead")
    return ids


def dropped_ids(architecture: str, num_layers: int, layer_ids: list[int], sglang_version: str) -> list[int]:
    """The ids of `layer_ids` that SGLang's capture loop never reaches (it drops them silently).

    Each id is judged on its own; an id that would capture the embedding where SGLang crashes on
    it is not listed (that is a crash, not a silent drop: captured_physical raises for it).
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
    """Raise UserError (naming the layer and the reason) unless SGLang `sglang_version` can capture
    `physical` and its EAGLE-3 draft can take them (exactly SGLANG_AUX_LAYERS of them).

    Called by extract before any compute (with export.sglang_version), so an impossible choice,
    such as the embedding output on a Llama target served by SGLang 0.5.21, fails in seconds, not
    after hours of extraction and training. Without a version, the newest known rule decides.
    """
    if len(physical) != SGLANG_AUX_LAYERS:
        raise UserError(
            f"capture.layers: {len(physical)} layer(s) (physical {sorted(physical)}); SGLang's EAGLE-3 draft "
            f"(LlamaForCausalLMEagle3) takes exactly {SGLANG_AUX_LAYERS}: its fc is {SGLANG_AUX_LAYERS} x the target's "
            f"hidden size wide. List {SGLANG_AUX_LAYERS} layers, e.g. [1, {num_layers // 2 - 1}, {num_layers - 4}]"
        )
    version = sglang_version or VERIFIED_VERSIONS[-1]
    try:
        ids_for_physical(architecture, num_layers, physical, version)
    except UserError as e:
        if 0 in physical and not can_capture_embedding(architecture, version):
            raise UserError(f"capture.layers: {EMBEDDING} (physical 0) with export.sglang_version \"{version}\": {e}") from None
        raise
