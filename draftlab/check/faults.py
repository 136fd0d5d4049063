"""Deliberately miswired drafts and launches: the faults teams hit when wiring EAGLE-3 into SGLang.

Each fault is one mistake a user makes by hand after a correct export; rehearsing it against a
real server records what SGLang does (it starts, it refuses, it silently adjusts) and whether
the wiring check names it. tools/sglang_h200.py runs them; the check tests assert the names.

    miswire(Path("models/draft"), Path("faults/ids_shifted/draft"), FAULTS["ids_shifted"])
"""
from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from safetensors.torch import load_file, save_file

from draftlab.sglang.checkpoint import WEIGHTS
from draftlab.sglang.layers import physical_from_user_layers


def _shift_ids(config: dict) -> None:
    """The hidden_states (physical) index of each layer written where SGLang wants the layer number:
    on Llama/Qwen, where the ids are the user's layer numbers, every id one too high."""
    ids = config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = physical_from_user_layers(ids)


def _drop_eagle_config(config: dict) -> None:
    config.pop("eagle_config", None)


@dataclass(frozen=True)
class Fault:
    name: str
    what: str  # the mistake, in the user's words
    edit_config: Callable[[dict], None] | None = None  # applied to config.json
    drop_tensors: tuple[str, ...] = ()  # removed from model.safetensors
    spec: dict = field(default_factory=dict)  # params.yaml spec.* the user asked for
    force_requested: bool = False  # launch with the requested flags, not the ones the project would pass
    expect: tuple[str, ...] = ()  # wiring-check findings (any of them) that name this fault


FAULTS = {f.name: f for f in (
    Fault("ids_shifted", "eagle_aux_hidden_state_layer_ids shifted by one (hidden_states indices written as layer ids)",
          edit_config=_shift_ids, expect=("capture_layers_shifted", "layer_shift")),
    Fault("no_eagle_config", "eagle_config removed from config.json (SGLang then captures its default layers)",
          edit_config=_drop_eagle_config, expect=("eagle_config_missing",)),
    Fault("eagle_not_eagle3", "the EAGLE-3 draft served with --speculative-algorithm EAGLE",
          spec={"algorithm": "EAGLE"}, force_requested=True, expect=("eagle_instead_of_eagle3",)),
    Fault("d2t_dropped", "d2t removed from the checkpoint (draft-vocab ids read as target ids)",
          drop_tensors=("d2t",), expect=("d2t_missing",)),
    Fault("chain_draft_tokens_forced", "topk=1, num_steps=1 with num_draft_tokens=16 forced through to the server",
          spec={"num_steps": 1, "topk": 1, "num_draft_tokens": 16, "on_adjust": "allow"}, force_requested=True,
          expect=("flag_adjusted",)),
)}


def miswire(draft: Path, out: Path, fault: Fault) -> Path:
    """A copy of the exported `draft` at `out` with `fault`'s edits (a fault of flags only: an exact copy)."""
    draft, out = Path(draft), Path(out)
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(draft, out)
    if fault.edit_config:
        config = json.loads((out / "config.json").read_text())
        fault.edit_config(config)
        (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if fault.drop_tensors:
        tensors = load_file(str(out / WEIGHTS))
        save_file({k: v for k, v in tensors.items() if k not in fault.drop_tensors}, str(out / WEIGHTS))
    return out
