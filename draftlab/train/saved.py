"""The trained draft on disk, as the train stage writes it and the export stage reads it:
models/draft-ckpt/draft.safetensors (the draft's state dict, float32) beside draft_config.json
(its DraftConfig). The SGLang checkpoint is the export stage's (draftlab.sglang.checkpoint).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file
from safetensors.torch import save as st_save

from draftlab.errors import UserError
from draftlab.fsutil import atomic_write_bytes, atomic_write_json, canonical_safetensors
from draftlab.train.draft import DraftConfig, Eagle3Draft

WEIGHTS = "draft.safetensors"
CONFIG = "draft_config.json"


def save_draft(out_dir: str | Path, draft: Eagle3Draft) -> None:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(out_dir / WEIGHTS, canonical_safetensors(st_save({k: v.detach().cpu().contiguous() for k, v in draft.state_dict().items()})))
    atomic_write_json(out_dir / CONFIG, draft.config.to_dict())


def load_draft(out_dir: str | Path, embed: torch.Tensor | None = None) -> Eagle3Draft:
    """The trained draft written by save_draft (float32, CPU)."""
    out_dir = Path(out_dir)
    fix = "re-run the train stage (dvc repro -f train)"
    if not (out_dir / WEIGHTS).exists():
        raise UserError(f"{out_dir}: no {WEIGHTS}; run the train stage first (dvc repro train)")
    try:
        cfg = DraftConfig(**json.loads((out_dir / CONFIG).read_bytes()))
    except (OSError, ValueError, TypeError, RecursionError) as e:  # missing, not JSON, not an object, unknown or missing keys
        raise UserError(f"{out_dir / CONFIG}: not a draft config as the train stage writes it ({type(e).__name__}: {e}); {fix}") from None
    draft = Eagle3Draft(cfg)
    try:
        draft.load_state_dict(load_file(str(out_dir / WEIGHTS)))
    except Exception as e:  # noqa: BLE001 - a damaged file (SafetensorError) or weights of another config (RuntimeError)
        first = " ".join(str(e).split())[:300] or type(e).__name__
        raise UserError(f"{out_dir / WEIGHTS} does not load into the draft {out_dir / CONFIG} describes ({first}); {fix}") from None
    if embed is not None:
        draft.set_embedding(embed.float())
    return draft
