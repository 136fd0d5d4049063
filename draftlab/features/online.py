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

import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from draftlab.dtypes import torch_dtype
from draftlab.errors import UserError
from draftlab.features.extract import TOKENS_FILE, capture, read_tokens_record
from draftlab.features.dataset import REQUIRED_METADATA, Sequences, length_groups, pack, read_metadata, to_device
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
            return capture(self.model(device), ids, None, physical)  # OnlineFeatures pads at the end: no mask needed (capture)
        if self._engine is None:
            from draftlab.features.engines import open_engine

            self._engine, self.device = open_engine(self.params, self.extract_params, str(device), layer_ids=self.layer_ids), torch.device(device)
        return self._engine.capture(ids, attention_mask, physical)

    def load(self, device) -> None:
        """Load the target on `device` now (it is loaded on first use otherwise): extract.engine
        transformers' copy; SGLang's engine opens on first use."""
        if getattr(self.extract_params, "engine", "transformers") == "transformers":
            self.model(device)

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
    making them (target forward included), for the stage's online rate. target_ran: whether the
    last batch ran the target for any of its sequences (with a state cache, a batch of sequences
    kept before does not); target_lengths: the lengths of those it ran for.

    keep_states(device, n) gives the split a StateCache of its first n sequences (all by default):
    their states are kept, in the storage dtype, once the target has computed them, and later
    epochs read them back instead of running the target again; the target computes the other
    sequences' states every time (train.state_cache; draftlab.features.online.cache_states decides).
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
        self.cache: StateCache | None = None
        self.target_ran = False
        self.target_lengths: list[int] = []

    def token_bytes(self) -> int:
        """Bytes a StateCache takes per token: its captured and final states, in the storage dtype."""
        return (len(self.physical_layers) + 1) * int(self.metadata["hidden_size"]) * self.storage.itemsize

    def state_bytes(self, n: int | None = None) -> int:
        """Bytes a StateCache of this split's first `n` sequences (None: all) takes."""
        return sum(self.length(i) for i in range(len(self) if n is None else n)) * self.token_bytes()

    def keep_states(self, device, n: int | None = None) -> None:
        """A StateCache on `device` for the first `n` sequences (None: every one), sized to their tokens."""
        self.cache = StateCache([self.length(i) for i in range(len(self))], len(self.physical_layers),
                                int(self.metadata["hidden_size"]), self.storage, device, keep=n)

    def kept_sequences(self) -> int:
        """How many sequences the state cache keeps (0: none, or no cache)."""
        return 0 if self.cache is None else self.cache.keep

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
        cache = self.cache
        todo = list(range(len(indices))) if cache is None else [j for j, i in enumerate(indices) if not cache.has(i)]
        self.target_ran = bool(todo)
        self.target_lengths = [len(seqs[j][0]) for j in todo]
        # Every index and mask is made on the host and copied without a wait (to_device): the host
        # goes on to the next batch while the GPU runs the target and the draft's step.
        on_device = to_device(ids, device), to_device(real, device)
        if cache is None or len(todo) == len(indices):  # every row computed now (the first epoch, mostly): the copies already made
            aux, final = self._states(*on_device, device)
        elif todo:  # the target runs on the rows not kept (their own padded batch); the kept rows are read back
            n = self.target_lengths
            new_aux, new_final = self._states(to_device(ids[todo, : max(n)], device), to_device(real[todo, : max(n)], device), device)
            fresh = set(todo)
            aux, final = cache.read([None if j in fresh else i for j, i in enumerate(indices)], T)
            for k, j in enumerate(todo):
                aux[j, : n[k]], final[j, : n[k]] = new_aux[k, : n[k]], new_final[k, : n[k]]
        else:
            aux, final = cache.read(indices, T)
        if cache is not None:
            for k, j in enumerate(todo):  # a no-op for a sequence the cache never keeps
                cache.put(indices[j], aux[j, : self.target_lengths[k]], final[j, : self.target_lengths[k]])
        ids, real = on_device
        out = {
            "input_ids": ids,
            "loss_mask": to_device(loss_mask, device),
            "aux_hidden": self._as_stored(aux, real),
            "final_hidden": self._as_stored(final, real),
        }
        self.tokens_served += sum(len(r) for r, _ in seqs)
        self.seconds += time.perf_counter() - t0
        return out

    def _states(self, ids: torch.Tensor, real: torch.Tensor, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(aux [B, T, k*H], final [B, T, H]) from the target, in the storage dtype."""
        physical = self.physical_layers
        aux, final = self.target.capture(ids, real.long(), physical, device)
        return torch.cat([aux[i] for i in sorted(physical)], dim=-1).to(self.storage), final.to(self.storage)

    def packed_batch(self, rows: list[list[int]], device) -> dict[str, torch.Tensor]:
        """Sequences.packed_batch with the states made by the target on the sequences padded apart,
        in groups of similar length of at most the packed batch's own slots each (length_groups):
        one padded batch of all of them would cost the target every sequence at the longest's length."""
        flat = [i for row in rows for i in row]
        lengths = [self.length(i) for i in flat]
        parts: list[dict[str, torch.Tensor] | None] = [None] * len(flat)
        ran, ran_lengths = False, []
        for group in length_groups(lengths, len(rows) * max(sum(self.length(i) for i in row) for row in rows)):
            b = self.batch([flat[j] for j in group], device)
            ran |= self.target_ran
            ran_lengths += self.target_lengths
            for k, j in enumerate(group):
                parts[j] = {name: x[k, : lengths[j]] for name, x in b.items()}
        self.target_ran, self.target_lengths = ran, ran_lengths
        longest = max(lengths)
        padded = {name: torch.stack([F.pad(p[name], (0, 0) * (p[name].ndim - 1) + (0, longest - len(p[name]))) for p in parts])
                  for name in parts[0]}
        return pack(padded, [[self.length(i) for i in row] for row in rows])

    def _as_stored(self, x: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
        """Rounded as a stored shard holds it, as float32; padding 0.0 exactly as collate pads."""
        x = x.to(self.storage).float()
        return torch.where(real[..., None], x, torch.zeros((), dtype=x.dtype, device=x.device))


class StateCache:
    """The states of a split's first `keep` sequences (None: all), once computed, in one pair of flat
    tensors on one device sized to those sequences' tokens (the storage dtype: what a stored shard
    would hold): sequence i's tokens at offsets[i]:offsets[i+1]. A sequence from `keep` on is never
    kept (keeps(i) False, put a no-op): the target computes its states every time."""

    def __init__(self, lengths: list[int], layers: int, hidden: int, dtype: torch.dtype, device, keep: int | None = None):
        self.keep = len(lengths) if keep is None else min(keep, len(lengths))
        self.offsets = [0]
        for n in lengths[: self.keep]:
            self.offsets.append(self.offsets[-1] + n)
        total = self.offsets[-1]
        self.aux = torch.empty((total, layers * hidden), dtype=dtype, device=device)
        self.final = torch.empty((total, hidden), dtype=dtype, device=device)
        self.kept = [False] * self.keep

    def keeps(self, i: int) -> bool:
        """Whether sequence i's states are kept once computed."""
        return i < self.keep

    def has(self, i: int) -> bool:
        return i < self.keep and self.kept[i]

    def nbytes(self) -> int:
        return self.aux.nbytes + self.final.nbytes

    def put(self, i: int, aux: torch.Tensor, final: torch.Tensor) -> None:
        if not self.keeps(i):
            return
        a, b = self.offsets[i], self.offsets[i + 1]
        self.aux[a:b].copy_(aux)
        self.final[a:b].copy_(final)
        self.kept[i] = True

    def read(self, indices: list[int | None], T: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(aux [B, T, k*H], final [B, T, H]) of `indices`, zero past each sequence's end and in the
        rows whose index is None (the caller fills those)."""
        aux = torch.zeros((len(indices), T, self.aux.shape[1]), dtype=self.aux.dtype, device=self.aux.device)
        final = torch.zeros((len(indices), T, self.final.shape[1]), dtype=self.final.dtype, device=self.final.device)
        for j, i in enumerate(indices):
            if i is None:
                continue
            a, b = self.offsets[i], self.offsets[i + 1]
            aux[j, : b - a], final[j, : b - a] = self.aux[a:b], self.final[a:b]
        return aux, final


STATE_CACHE_SHARE = 0.6  # of the training device's free memory, at most, for the state caches of both splits


def plan_states(splits: list[OnlineFeatures], budget: float) -> tuple[list[int], int | None]:
    """(how many of each split's sequences to keep within `budget` bytes, a prefix in index order;
    the split cut short, None where all fit). The splits smallest first (the eval split: small, and
    read after every epoch), each whole while it fits; the first that does not fit keeps its
    sequences in index order up to the first that would pass the budget, and the splits after it
    keep none. A rule of the lengths alone: every run, resumed or not, keeps the same sequences."""
    keep, left = [0] * len(splits), budget
    for s in sorted(range(len(splits)), key=lambda s: (splits[s].state_bytes(), s)):
        ds = splits[s]
        if ds.state_bytes() <= left:
            keep[s], left = len(ds), left - ds.state_bytes()
            continue
        per_token = ds.token_bytes()
        while ds.length(keep[s]) * per_token <= left:  # stops before the end: the whole split did not fit
            left -= ds.length(keep[s]) * per_token
            keep[s] += 1
        return keep, s
    return keep, None


def cache_states(splits: list[OnlineFeatures], setting: str, device, world: int = 1) -> str:
    """train.state_cache: give the splits StateCaches (auto: one training process) holding as many
    sequences' states as fit STATE_CACHE_SHARE of the device's free memory (plan_states: every
    sequence where all fit, else the smaller splits whole and a prefix of the next); returns the line
    that says what was decided. Every sequence kept saves the target's forward over it in each epoch
    after the first.

    The rest of the free memory is the training step's: at SmolLM2's shape (32,768-token packed
    steps, 7 TTT steps, draft vocab 16,384) its peak was 17.5 GB, 22% of an 80 GB GPU."""
    if setting == "off":
        return "train: state cache off (train.state_cache): the target runs on every batch of every epoch"
    if world > 1:
        return (f"train: state cache off: {world} processes see other sequences every epoch (train.state_cache auto keeps "
                "states for one process)")
    need = sum(ds.state_bytes() for ds in splits)
    free = free_memory(device)
    if free is None:
        return (f"train: state cache off: the splits' states take {need / 2**30:.1f} GiB and the memory free on {device} "
                "cannot be read; the target runs on every batch of every epoch")
    keep, cut = plan_states(splits, STATE_CACHE_SHARE * free)
    if not any(keep):
        return (f"train: state cache off: the splits' states take {need / 2**30:.1f} GiB, more than {STATE_CACHE_SHARE:.0%} of "
                f"the {free / 2**30:.1f} GiB free on {device}; the target runs on every batch of every epoch")
    for ds, n in zip(splits, keep):
        if n:
            ds.keep_states(device, n)
        else:
            ds.cache = None
    if cut is None:
        return (f"train: state cache on {device}: {need / 2**30:.1f} GiB of states (of {free / 2**30:.1f} GiB free), computed by "
                "the target in the first epoch and read back after it (train.state_cache off: the target runs every epoch)")
    kept = sum(ds.state_bytes(n) for ds, n in zip(splits, keep))
    others = "; ".join(f"the {ds.dir.name} split whole" if n == len(ds) else f"none of the {ds.dir.name} split"
                       for s, (ds, n) in enumerate(zip(splits, keep)) if s != cut)
    ds = splits[cut]
    return (f"train: state cache on {device} for {keep[cut]:,} of {len(ds):,} {ds.dir.name} sequences ({kept / 2**30:.1f} of "
            f"{need / 2**30:.1f} GiB{'; ' + others if others else ''}): all that fits {STATE_CACHE_SHARE:.0%} of the "
            f"{free / 2**30:.1f} GiB free, computed by the target in the first epoch and read back after it; the target "
            "computes the rest every epoch")


def free_memory(device) -> int | None:
    """Bytes free on `device`: the GPU's (CUDA), the host's available memory (CPU, Linux); None if unknown."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
