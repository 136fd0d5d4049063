"""What SGLang's LlamaForCausalLMEagle3 makes of a draft checkpoint, by release: which config.json keys
it reads (and their defaults when absent), and which tensor names its load_weights maps to a parameter.

Read from llama_eagle3.py in the released wheels 0.5.5-0.5.23:
- 0.5.5-0.5.11 build one decoder layer named `midlayer` and refuse num_hidden_layers != 1
  (ValueError "EAGLE3 currently only supports 1 layer"). From 0.5.12 the layers are
  `layers.0..N-1`, built from num_hidden_layers, and `midlayer` is a legacy alias of `layers.0`.
  So `layers.0.*` tensors load from 0.5.12 on and are dropped silently before.
- load_weights tries a name as given, then under `model.` ("model.fc.weight" and "fc.weight" both
  load); a name matching no parameter is dropped without a word (its parameter stays random).
- d2t sets the hot-token map; t2d is skipped; embed_tokens.weight loads but the target's embedding
  replaces it (the EAGLE worker's set_embed), so it is never what is served.
- The config is transformers' LlamaConfig: a missing key takes LlamaConfig's default (32 layers,
  context 2048), and a missing draft_vocab_size (no default) fails the load with AttributeError.
  draft_vocab_size null, or tie_word_embeddings true, serves the target's lm_head / embedding
  instead of the draft's lm_head.weight.
"""
from __future__ import annotations

import re

from draftlab.sglang.layers import parse_version

LAYERS_NAMED_FROM = (0, 5, 12)  # first release with layers.0..N-1 (midlayer.* an alias) and N > 1 allowed
# Variant flags and the first release whose llama_eagle3.py reads them (and so loads their norm weights).
VARIANT_READ_FROM = {"fc_norm": (0, 5, 14), "norm_before_fc": (0, 5, 17)}
LLAMA_DEFAULTS = {"num_hidden_layers": 32, "max_position_embeddings": 2048}  # transformers' LlamaConfig
MODEL_PARAMS = ("fc.", "midlayer.", "layers.", "norm.", "embed_tokens.", "fc_norm.", "input_norm.")  # under LlamaModel
SHARED = "embed_tokens.weight"  # loaded, then replaced by the target's embedding
LAYER = re.compile(r"^(?:model\.)?layers\.(\d+)\.")


def config_dtype(config: dict) -> tuple[str | None, object]:
    """(key, value) of the weights' dtype in config.json: transformers 5 writes `dtype`, 4.x `torch_dtype`
    (transformers 5 reads `dtype` first when both are there); (None, None) when neither is set."""
    for key in ("dtype", "torch_dtype"):
        if config.get(key) is not None:
            return key, config[key]
    return None, None


def layers_named(version: str | None) -> bool:
    """Whether SGLang `version` loads `layers.0.*` (None: the newest rules)."""
    return version is None or parse_version(version) >= LAYERS_NAMED_FROM


def served_name(name: str, version: str | None) -> str:
    """The name this project's tensor contract gives to stored tensor `name` once SGLang `version`
    has loaded it (midlayer.* for the draft layer); a name SGLang drops comes back unchanged."""
    if name.startswith("model.") and name[len("model."):].startswith(MODEL_PARAMS):
        name = name[len("model."):]
    if name.startswith("layers.0.") and layers_named(version):
        name = "midlayer." + name[len("layers.0."):]
    return name


def decoder_layers(names) -> list[int]:
    """The decoder layer indices the tensor names hold (layers.N.*, model.layers.N.*), ascending."""
    return sorted({int(m.group(1)) for n in names if (m := LAYER.match(n))})


def variants_read(config: dict, version: str | None) -> set[str]:
    """The variant flags set in config.json that SGLang `version` computes (and loads weights for)."""
    v = parse_version(version) if version else max(VARIANT_READ_FROM.values())
    eagle = config.get("eagle_config") if isinstance(config.get("eagle_config"), dict) else {}
    on = {"fc_norm": bool(config.get("fc_norm") or config.get("use_aux_norm")),
          "norm_before_fc": bool(eagle.get("norm_before_fc", config.get("norm_before_fc")))}
    return {k for k, since in VARIANT_READ_FROM.items() if on[k] and v >= since}
