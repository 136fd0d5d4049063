"""The tensors a model needs, against the safetensors headers of its folder: no tensor read.

transformers renames checkpoint tensors on load (a base-model prefix added or dropped, legacy
names, per-expert MoE tensors fused into one), so comparing names by hand would refuse good
checkpoints. Instead the model is built on the meta device from config.json (no memory), the
headers become meta tensors of the same names, shapes and dtypes, and transformers' own loader
(the two steps from_pretrained runs after building the model) loads those into the skeleton
with every conversion applied. Its loading info is what from_pretrained(output_loading_info=True)
reports for the real weights: the missing tensors and those of another shape.

This avoids from_pretrained(device_map="meta"), which transformers 5.25 refuses when the
`kernels` package is installed (its hub kernels reject the meta device). Both steps are
internals of transformers 5 (tested under 5.8.1, SGLang 0.5.14's pin, and 5.25.0); on a release
where they are missing or take other arguments, `loading_info` returns None and the weights are checked when a stage
loads them (draftlab.target.load.load_target), as before.
"""
from __future__ import annotations

from pathlib import Path

# safetensors dtype names -> torch dtype names (the header's "dtype" field)
DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64", "I32": "int32",
          "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}


def meta_state_dict(folder: Path) -> dict:
    """{name: meta tensor} of every tensor in the folder's *.safetensors headers (a few KB each)."""
    import torch

    from draftlab.manifest import safetensors_header

    tensors = {}
    for path in sorted(folder.glob("*.safetensors")):
        for name, entry in safetensors_header(path).items():
            if name == "__metadata__":
                continue
            dtype = getattr(torch, DTYPES.get(entry.get("dtype"), "float32"), torch.float32)
            tensors[name] = torch.empty(entry["shape"], dtype=dtype, device="meta")
    return tensors


def _loader():
    """transformers' loading steps (PreTrainedModel, LoadStateDictConfig, get_model_conversion_mapping),
    or None on a release that lacks them."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.modeling_utils import LoadStateDictConfig, PreTrainedModel
    except ImportError:
        return None
    if not all(hasattr(PreTrainedModel, f) for f in ("_load_pretrained_model", "_finalize_model_loading")):
        return None
    return PreTrainedModel, LoadStateDictConfig, get_model_conversion_mapping


def loading_info(folder: Path, config) -> dict | None:
    """from_pretrained's loading info (missing_keys, mismatched_keys, unexpected_keys) for the model
    of `config` and the safetensors in `folder`, computed on the meta device, or
    {"conversion_errors": {tensor: traceback}} when checkpoint tensors do not combine into one the
    model needs (e.g. an expert missing from a fused MoE tensor); None when this transformers
    release does not have the loading steps used here."""
    loader = _loader()
    if loader is None:
        return None
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    PreTrainedModel, LoadStateDictConfig, get_model_conversion_mapping = loader
    with torch.device("meta"):  # parameters without storage: an 8B skeleton costs no memory
        model = AutoModelForCausalLM.from_config(config)
    state_dict = meta_state_dict(folder)
    try:
        load_config = LoadStateDictConfig(device_map={"": "meta"}, ignore_mismatched_sizes=True,
                                          weight_mapping=get_model_conversion_mapping(model))
    except TypeError:  # the config's fields changed: leave the check to the stages' own load
        return None
    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()  # its load report and progress bar would read as if weights were loaded
    hf_logging.disable_progress_bar()
    try:
        try:
            info, _ = PreTrainedModel._load_pretrained_model(model, state_dict, None, load_config)
        except (TypeError, AttributeError):  # other internals: not the checkpoint's fault; the stages' load checks
            return None
        conversion = dict(getattr(info, "conversion_errors", None) or {})
        if conversion:  # finalizing would raise one RuntimeError that names none of them
            return {"missing_keys": [], "mismatched_keys": [], "conversion_errors": conversion}
        info = PreTrainedModel._finalize_model_loading(model, load_config, info)
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
    return info.to_dict() if hasattr(info, "to_dict") else dict(info)

