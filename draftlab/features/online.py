"""train.features online: training batches whose hidden states the target computes on the fly.

Offline, extract stores (k+1)*H*2 bytes per token (32 KiB at H=4096, k=3 in bf16) and the train
stage reads them back every epoch. Online, the features hold only each split's tokens
(<split>/tokens.safetensors, written by extract and standardize), and OnlineFeatures makes every
batch by running the target over it and capturing the layers through draftlab.features.extract.capture,
the project's one capture path. The states are rounded to the storage dtype extract would have
written (extract.dtype, recorded in the tokens record) and back to float32, so a batch differs
from the offline one only by the target's rounding under another batch shape.
"""
from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.nn.functional as F

from draftlab.dtypes import torch_dtype
from draftlab.errors import UserError
from draftlab.features.extract import TOKENS_FILE, capture, read_tokens_record
from draftlab.features.dataset import REQUIRED_METADATA, Sequences, length_groups, pack, read_metadata
from draftlab.target.load import load_target


class OnlineTarget:
    """The target of one process, loaded on first use on the training device (eval mode,
    target.dtype) and shared by the train and eval datasets: one copy per process.

    extract_params: None or extract.engine transformers, the target in this process as extract
    captures it; extract.engine sglang, the states come from SGLang's engine instead (layer_ids:
    draftlab.sglang.layers.ids_for_physical, passed by the caller)."""

    def __init__(self, target_params, extract_params=None, layer_ids=None):
        self.params, self.extract_params, self.layer_ids = target_params, extract_params, layer_ids
        self.device: torch.device | None = None
        self._model = None
        self._engine = None

    def capture(self, ids: torch.Tensor, attention_mask: torch.Tensor, physical: list[int], device):
        """extract.capture's contract, from the chosen engine."""
        if getattr(self.extract_params, "engine", "transformers") == "transformers":
            return capture(self.model(device), ids, attention_mask, physical)
        if self._engine is None:
            from draftlab.features.engines import open_engine

            self._engine, self.device = open_engine(self.params, self.extract_params, str(device), layer_ids=self.layer_ids), torch.device(device)
        return self._engine.capture(ids, attention_mask, physical)

    def model(self, device) -> torch.nn.Module:
        device = torch.device(device)
        if self._model is None or device != self.device:
            self._model = load_target(self.params, str(device))[0]
            self._model.requires_grad_(False)  # never trained here: no grad buffers
            self.device = device
        return self._model


class OnlineFeatures(Sequences):
    """FeatureDataset's interface (len, length(i), physical_layers, items, batch) over one
    split's tokens record; the states of a batch come from `target` at batch time.

    tokens_served / seconds: real tokens of the batches made so far and the seconds spent
    making them (target forward included), for the stage's online rate.
    """

    def __init__(self, split_dir: str | Path, max_length: int | None, target: OnlineTarget):
        self.dir, self.max_length, self.target = Path(split_dir), max_length, target
        path = self.dir / TOKENS_FILE
        arrays, _ = read_tokens_record(path)
        self.metadata = read_metadata(path)
        missing = [k for k in REQUIRED_METADATA + ("dtype",) if k not in self.metadata]
        if missing:
            raise UserError(f"{path}: tokens record metadata lacks {missing}; re-run the standardize stage")
        self.storage = torch_dtype(self.metadata["dtype"], f"{path} metadata dtype")
        self.input_ids, self.loss_mask = arrays["input_ids"], arrays["loss_mask"]
        off = arrays["seq_offsets"].tolist()
        self.index = [(a, b) for a, b in zip(off[:-1], off[1:]) if b > a]  # the order FeatureDataset would see
        self.tokens_served, self.seconds = 0, 0.0

    def span(self, i: int) -> tuple[int, int]:
        return self.index[i]

    def _tokens(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        a, _ = self.index[i]
        n = self.length(i)  # a causal target: the states of a cut prefix are the prefix's states
        return self.input_ids[a : a + n], self.loss_mask[a : a + n]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        """One sequence as FeatureDataset gives it (float32 states on the CPU)."""
        batch = self.batch([i], self.target.device or "cpu")
        return {name: t[0].cpu() for name, t in batch.items()}

    @torch.no_grad()
    def batch(self, indices: list[int], device) -> dict[str, torch.Tensor]:
        """The batch FeatureDataset.batch would give for `indices`, states from the target."""
        t0 = time.perf_counter()
        seqs = [self._tokens(i) for i in indices]
        T = max(len(ids) for ids, _ in seqs)
        ids = torch.zeros((len(seqs), T), dtype=torch.long)  # right padding, id 0: as collate pads
        real = torch.zeros((len(seqs), T), dtype=torch.bool)
        loss_mask = torch.zeros((len(seqs), T), dtype=torch.bool)
        for j, (r, m) in enumerate(seqs):
            ids[j, : len(r)], real[j, : len(r)], loss_mask[j, : len(m)] = r, True, m
        ids, real = ids.to(device), real.to(device)
        physical = self.physical_layers
        aux, final = self.target.capture(ids, real.long(), physical, device)
        out = {
            "input_ids": ids,
            "loss_mask": loss_mask.to(device),
            "aux_hidden": self._as_stored(torch.cat([aux[i] for i in sorted(physical)], dim=-1), real),
            "final_hidden": self._as_stored(final, real),
        }
        self.tokens_served += sum(len(r) for r, _ in seqs)
        self.seconds += time.perf_counter() - t0
        return out

    def packed_batch(self, rows: list[list[int]], device) -> dict[str, torch.Tensor]:
        """Sequences.packed_batch with the states made by the target on the sequences padded apart,
        in groups of similar length of at most the packed batch's own slots each (length_groups):
        one padded batch of all of them would cost the target every sequence at the longest's length."""
        flat = [i for row in rows for i in row]
        lengths = [self.length(i) for i in flat]
        parts: list[dict[str, torch.Tensor] | None] = [None] * len(flat)
        for group in length_groups(lengths, len(rows) * max(sum(self.length(i) for i in row) for row in rows)):
            b = self.batch([flat[j] for j in group], device)
            for k, j in enumerate(group):
                parts[j] = {name: x[k, : lengths[j]] for name, x in b.items()}
        longest = max(lengths)
        padded = {name: torch.stack([F.pad(p[name], (0, 0) * (p[name].ndim - 1) + (0, longest - len(p[name]))) for p in parts])
                  for name in parts[0]}
        return pack(padded, [[self.length(i) for i in row] for row in rows])

    def _as_stored(self, x: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
        """Rounded as a stored shard holds it, as float32; padding 0.0 exactly as collate pads."""
        x = x.to(self.storage).float()
        return torch.where(real[..., None], x, torch.zeros((), dtype=x.dtype, device=x.device))
