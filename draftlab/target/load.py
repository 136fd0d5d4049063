"""Loading the target LLM (hub id or local path) the same way in every stage."""
from __future__ import annotations

from pathlib import Path

from draftlab.errors import UserError, shown
from draftlab.manifest import dir_hash, sha256_text
from draftlab.target.gguf import dequantized_dir, gguf_file
from draftlab.target.load_errors import check_config, check_weights, loading


def model_path(model: str) -> str:
    """What transformers and SGLang load for `target.model`: the dequantized folder stage target
    made for a GGUF file (draftlab.target.gguf), else `model` itself (a folder or a hub id)."""
    return str(dequantized_dir(model)) if gguf_file(model) else model


HUB_ID_RULE = "a hub id is org/name (or name) of letters, digits, '-', '_' and '.', at most 96 characters"


def check_model_name(model: str) -> None:
    """UserError unless `model` (target.model) can name a target at all: an existing folder or file,
    pkg:MODULE/PATH, or a valid hub id. Run before anything asks the hub, whose own validation error
    would otherwise surface as a traceback (HFValidationError)."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if not isinstance(model, str) or not model.strip():
        raise UserError(f"target.model is empty ({shown(model)}); give a model folder, a .gguf file, pkg:MODULE/FILE.gguf "
                        "or a hub id like org/name")
    if model.startswith("pkg:") and not model.lower().endswith(".gguf"):
        raise UserError(f"target.model {shown(model)}: a file inside a package is a target only as a GGUF model file "
                        "(pkg:MODULE/FILE.gguf); give a model folder or a hub id otherwise")
    try:
        exists, under_folder = Path(model).expanduser().exists(), Path(model.split("/")[0]).is_dir()
    except OSError:  # a name longer than the file system allows (ENAMETOOLONG): no path, and no hub id either
        exists = under_folder = False
    if not exists and model != model.strip():
        raise UserError(f"target.model {shown(model)} has spaces around it and names nothing; remove them")
    # a path, a package file or a GGUF file: their own checks name what is missing
    if exists or under_folder or model.startswith(("pkg:", ".", "/", "~")) or model.lower().endswith(".gguf") or model.count("/") > 1:
        return
    try:
        validate_repo_id(model)
    except HFValidationError:
        raise UserError(f"target.model {shown(model)}: neither an existing folder or file nor a valid hub id: "
                        f"{HUB_ID_RULE}; give a model folder, a .gguf file, pkg:MODULE/FILE.gguf or a hub id") from None


def _source(model: str, revision: str | None) -> dict:
    check_model_name(model)
    model = model_path(model)
    local = Path(model)
    if local.exists():
        return {"pretrained_model_name_or_path": str(local)}
    # "models/tiny-target" looks like a hub id; if its first part is a local folder the user
    # meant a path (asking the hub would only retry for half a minute, then fail).
    if model.startswith((".", "/", "~")) or model.count("/") > 1 or Path(model.split("/")[0]).is_dir():
        raise UserError(f"target.model: local path {shown(model)} does not exist (or give a hub id like org/name)")
    return {"pretrained_model_name_or_path": model, "revision": revision}


def load_tokenizer(model: str, revision: str | None = None):
    from transformers import AutoTokenizer

    with loading(model, "the tokenizer", "tokenizer"):
        tok = AutoTokenizer.from_pretrained(**_source(model, revision))
    if tok.chat_template is None:
        raise UserError(f"target.model {model!r}: tokenizer has no chat template; a chat (instruct) model is required")
    with loading(model, "its chat template (rendering one user turn)", "tokenizer"):
        tok.apply_chat_template([{"role": "user", "content": "q"}], add_generation_prompt=True, tokenize=False)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def load_target(target_params, device: str | None = None):
    """(model, tokenizer) for TargetParams `target_params`; model in eval mode on the resolved device."""
    from transformers import AutoModelForCausalLM

    from draftlab.dtypes import torch_dtype
    from draftlab.parallel import resolve_device  # imports torch: kept out of the prompts stage

    device = device or resolve_device(target_params.device)
    dtype = torch_dtype(target_params.dtype, "target.dtype")
    load_config(target_params)  # config.json checked first: its faults named before transformers trips on them
    with loading(target_params.model, "the model", "model"):
        # The loading info names a tensor the checkpoint lacks (left random) or of another shape.
        model, info = AutoModelForCausalLM.from_pretrained(**_source(target_params.model, target_params.revision), dtype=dtype,
                                                           output_loading_info=True, ignore_mismatched_sizes=True)
    check_weights(info, target_params.model)
    model.to(device).eval()
    return model, load_tokenizer(target_params.model, target_params.revision)


def tokenizer_hash(tok) -> str:
    """Hash of the vocabulary + special tokens: equal hashes mean identical tokenization."""
    import json

    vocab = sorted(tok.get_vocab().items())
    return sha256_text(json.dumps([vocab, tok.all_special_tokens, type(tok).__name__]))


def chat_template_hash(tok) -> str:
    return sha256_text(tok.chat_template or "")


def target_fingerprint(target_params) -> dict:
    """What identifies the target for the configuration hash: a local dir's content hash or hub id+revision."""
    source = gguf_file(target_params.model)
    if source:  # the file and the folder made of it: a change to either changes the hash
        return {"model": target_params.model, "gguf_sha256": dir_hash(source),
                "content_sha256": dir_hash(dequantized_dir(target_params.model))}
    local = Path(target_params.model)
    if local.exists():
        return {"model": target_params.model, "content_sha256": dir_hash(local)}
    return {"model": target_params.model, "revision": target_params.revision}


def load_config(target_params):
    """The target's transformers config alone: no weights read (for target_info before a server starts)."""
    from transformers import AutoConfig

    with loading(target_params.model, "its config"):
        cfg = AutoConfig.from_pretrained(**_source(target_params.model, target_params.revision))
    check_config(cfg, target_params.model)
    return cfg


def target_info(model, target_params) -> dict:
    """Architecture facts later stages need (export, check) without loading the model again.
    `model`: the loaded model, or only its config (load_config)."""
    cfg = getattr(model, "config", model)
    text_cfg = getattr(cfg, "get_text_config", lambda: cfg)()
    return {
        "model": target_params.model,
        "revision": target_params.revision,
        "architecture": (cfg.architectures or [type(model).__name__])[0],
        "model_type": cfg.model_type,
        "num_layers": text_cfg.num_hidden_layers,
        "hidden_size": text_cfg.hidden_size,
        "vocab_size": text_cfg.vocab_size,
        "intermediate_size": getattr(text_cfg, "intermediate_size", None),
        "num_attention_heads": text_cfg.num_attention_heads,
        "num_key_value_heads": getattr(text_cfg, "num_key_value_heads", text_cfg.num_attention_heads),
        "head_dim": getattr(text_cfg, "head_dim", None) or text_cfg.hidden_size // text_cfg.num_attention_heads,
        "max_position_embeddings": getattr(text_cfg, "max_position_embeddings", None),
        "rms_norm_eps": getattr(text_cfg, "rms_norm_eps", None),
        "rope_theta": getattr(text_cfg, "rope_theta", None) or (getattr(text_cfg, "rope_parameters", None) or {}).get("rope_theta"),
        "rope_scaling": getattr(text_cfg, "rope_scaling", None),
        "torch_dtype": target_params.dtype,
        "tie_word_embeddings": bool(getattr(cfg, "tie_word_embeddings", False)),
    }
