"""Read only the target's token embedding and lm_head from its checkpoint (never the whole model).

Works on a local directory or a hub id already in the local HF cache (offline), with a single
`model.safetensors` or a sharded one (`model.safetensors.index.json`). A target with tied
embeddings (no lm_head tensor) uses the embedding as lm_head, as transformers does.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from draftlab.errors import UserError
from draftlab.target.load_errors import loading

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def resolve_model_dir(model: str, revision: str | None = None) -> Path:
    """A local directory, or the cached snapshot of a hub id (no network access)."""
    from draftlab.target.load import model_path

    local = Path(model_path(model))
    if local.is_dir():
        return local
    if model.startswith((".", "/")) or model.count("/") > 1:
        raise UserError(f"target.model: local path {model!r} does not exist")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model, revision=revision, local_files_only=True, allow_patterns=["*.json", "*.safetensors"]))
    except Exception as e:  # noqa: BLE001 - any hub failure means: not in the cache
        raise UserError(f"target.model {model!r} (revision {revision}) is not in the local HF cache ({type(e).__name__}); download it first") from None


def _tensor_files(model_dir: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file that holds it."""
    if (model_dir / INDEX).exists():
        weight_map = json.loads((model_dir / INDEX).read_text())["weight_map"]
        return {name: model_dir / file for name, file in weight_map.items()}
    if (model_dir / SINGLE).exists():
        with safe_open(str(model_dir / SINGLE), framework="pt") as f:
            return {name: model_dir / SINGLE for name in f.keys()}
    raise UserError(f"{model_dir}: no {SINGLE} or {INDEX}; the target must be a safetensors checkpoint")


def _find(names, suffix: str) -> str | None:
    hits = sorted(n for n in names if n == suffix or n.endswith("." + suffix))
    return hits[0] if hits else None


def load_target_head(model: str, revision: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(embedding [vocab, H], lm_head [vocab, H]) of the target, in the checkpoint's dtype; any
    failure to read them (a damaged file or index) is one UserError naming the folder (target_check)."""
    model_dir = resolve_model_dir(model, revision)
    with loading(model, "its embedding and lm_head", "model"):
        return _head(model_dir)


def _head(model_dir: Path) -> tuple[torch.Tensor, torch.Tensor]:
    files = _tensor_files(model_dir)
    embed_name = _find(files, "embed_tokens.weight")
    head_name = _find(files, "lm_head.weight")
    if embed_name is None:
        raise UserError(f"{model_dir}: no '*embed_tokens.weight' tensor in the checkpoint")
    config = json.loads((model_dir / "config.json").read_text()) if (model_dir / "config.json").exists() else {}
    tied = config.get("tie_word_embeddings", False) or head_name is None

    def get(name):
        with safe_open(str(files[name]), framework="pt") as f:
            return f.get_tensor(name)

    embed = get(embed_name)
    return embed, (embed if tied else get(head_name))
