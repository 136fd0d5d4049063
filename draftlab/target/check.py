"""The target stage's check before it pins a local folder, so that no pin is made of a folder the
later stages cannot load: the folder's files (JSON files parse to objects, safetensors headers
complete, the index's shards present), config.json and the tokenizer loaded as the stages load
them, then the model's tensors against the safetensors headers (check_weight_layout,
draftlab.target.layout). No tensor is read: a header is a few kilobytes, and the meta build of an
8B model takes about a second, where the pin's sha256 of its 16 GB takes 12 s or more. Weights that
are not safetensors (.bin, .gguf) are left to the stages' own load.
"""
from __future__ import annotations

from pathlib import Path

from draftlab.errors import UserError
from draftlab.target.diagnosis import folder_problem, local_folder
from draftlab.target.load_errors import check_weights, fix_for, loading


def check_loadable(model: str, revision: str | None = None) -> None:
    """UserError unless the local folder `model` loads as a target: its files, config.json and the
    tokenizer (with a chat template that renders a user turn). Hub ids are left to the stages."""
    folder = local_folder(model)
    if folder is None:
        return
    problem = folder_problem(folder, "all")
    if problem:
        raise UserError(f"target.model {model!r}: not a loadable model folder: {problem}; {fix_for(model, damaged=True)}")
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

    from draftlab.params import TargetParams
    from draftlab.target.load import load_config, load_tokenizer

    cfg = load_config(TargetParams(model=model, revision=revision, dtype="float32", device="cpu"))
    if type(cfg) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise UserError(f"target.model {model!r}: config.json's model_type {cfg.model_type!r} is not a causal language model "
                        f"that transformers' AutoModelForCausalLM loads; {fix_for(model)}")
    load_tokenizer(model, revision)
    if any(folder.glob("*.safetensors")):
        check_weight_layout(folder, model, cfg)


def check_weight_layout(folder: Path, model: str, cfg) -> None:
    """The model of `cfg` (config.json as load_config read it) against the safetensors headers
    (draftlab.target.layout: a meta-device skeleton, transformers' own name conversions applied, no
    tensor read): a tensor missing or of another shape is refused. About a second for an 8B
    checkpoint, against the pin's ~12 s of sha256 over its 16 GB."""
    from draftlab.target.layout import loading_info

    with loading(model, "the weights (config.json against the safetensors headers)", "model"):
        info = loading_info(folder, cfg)
    if info is not None:  # None: a transformers release without these loading steps; the stages' load checks
        check_weights(info, model)
