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
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
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
    draftlab.sglang.layers.ids_for_physical, passed by the caller); max_tokens: the most tokens one
    batch holds, which SGLang's engine sizes its KV pool for."""

    def __init__(self, target_params, extract_params=None, layer_ids=None, max_tokens: int | None = None):
        self.params, self.extract_params, self.layer_ids = target_params, extract_params, layer_ids
        self.max_tokens = max_tokens
        self.device: torch.device | None = None
        self._model = None
        self._engine = None

    def capture(self, ids: torch.Tensor, attention_mask: torch.Tensor, physical: list[int], device):
        """extract.capture's contract, from the chosen engine."""
        if getattr(self.extract_params, "engine", "transformers") == "transformers":
            return capture(self.model(device), ids, None, physical)  # OnlineFeatures pads at the end: no mask needed (capture)
        if self._engine is None:
            from draftlab.features.engines import open_engine

            self._engine = open_engine(self.params, self.extract_params, str(device), layer_ids=self.layer_ids,
                                       max_tokens=self.max_tokens)
            self.device = torch.device(device)
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

    target_ran: whether the last batch ran the target for any of its sequences (with a state
    cache, a batch of sequences kept before does not); target_lengths: the lengths of those it ran for.

    keep_states(device, n, host_n) gives the split a StateCache of its first n sequences (all by
    default) on the training device and the host_n after them in host memory: their states are
    kept, in the storage dtype, once the target has computed them, and later epochs read them back
    instead of running the target again; the target computes the other sequences' states every time
    (train.state_cache; draftlab.features.online.cache_states decides).
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
        self.cache: StateCache | None = None
        self.target_ran = False
        self.target_lengths: list[int] = []

    def token_bytes(self) -> int:
        """Bytes a StateCache takes per token: its captured and final states, in the storage dtype."""
        return (len(self.physical_layers) + 1) * int(self.metadata["hidden_size"]) * self.storage.itemsize

    def state_bytes(self, n: int | None = None) -> int:
        """Bytes a StateCache of this split's first `n` sequences (None: all) takes."""
        return sum(self.length(i) for i in range(len(self) if n is None else n)) * self.token_bytes()

    def keep_states(self, device, n: int | None = None, host_n: int = 0, host="cpu") -> None:
        """A StateCache of the first `n` sequences (None: every one) on `device` and the `host_n` after
        them on `host` (host memory), sized to their tokens."""
        self.cache = StateCache([self.length(i) for i in range(len(self))], len(self.physical_layers),
                                int(self.metadata["hidden_size"]), self.storage, device, keep=n, host_keep=host_n, host=host)

    def kept_sequences(self) -> int:
        """How many sequences the state cache keeps, both tiers (0: none, or no cache)."""
        return 0 if self.cache is None else self.cache.keep

    def host_sequences(self) -> int:
        """How many of them it keeps in host memory."""
        return 0 if self.cache is None else self.cache.host_keep

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
        # goes on to the next batch while the GPU runs the target and the draft's step (a put into
        # the host tier too: StateCache.put_rows, HostPuts).
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
        if cache is not None and todo:  # a no-op for a sequence the cache never keeps
            cache.put_rows([(indices[j], aux[j, :n], final[j, :n]) for j, n in zip(todo, self.target_lengths)])
        ids, real = on_device
        out = {
            "input_ids": ids,
            "loss_mask": to_device(loss_mask, device),
            "aux_hidden": self._as_stored(aux, real),
            "final_hidden": self._as_stored(final, real),
        }
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


class StateTier:
    """The states of sequences [start, stop) of a split on one device, in one pair of flat tensors sized to
    those sequences' tokens (the storage dtype: what a stored shard would hold): sequence i's tokens at
    offsets[i - start]:offsets[i - start + 1]. kept[i - start]: whether its states are in yet."""

    def __init__(self, lengths: list[int], start: int, stop: int, layers: int, hidden: int, dtype: torch.dtype, device):
        self.start, self.stop = start, stop
        self.offsets = [0]
        for n in lengths[start:stop]:
            self.offsets.append(self.offsets[-1] + n)
        total = self.offsets[-1]
        self.aux = torch.empty((total, layers * hidden), dtype=dtype, device=device)
        self.final = torch.empty((total, hidden), dtype=dtype, device=device)
        self.kept = [False] * (stop - start)

    def __contains__(self, i: int) -> bool:
        return self.start <= i < self.stop

    def __len__(self) -> int:
        return self.stop - self.start

    def rows(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(aux, final) of sequence i: views of this tier's tensors."""
        a, b = self.offsets[i - self.start], self.offsets[i - self.start + 1]
        return self.aux[a:b], self.final[a:b]

    def nbytes(self) -> int:
        return self.aux.nbytes + self.final.nbytes


class StateCache:
    """The states of a split's first `keep` sequences (None: all) on the training `device`, and of the
    `host_keep` after them on `host` (host memory: a second tier where the device's budget ends), once
    computed: a StateTier each. Every read lands on `device`: a host row is copied there, and put
    copies a computed row to its tier; bf16 in, bf16 out, so the values are the target's to the bit
    either way. The host tier is pageable memory, not pinned (a pinned allocation of tens of GiB can
    be slow, or refused under a container's memlock limit): a read gathers a batch's host rows and
    copies them over in one piece through pinned memory, queued without a wait. put_rows, in the
    first epoch, queues a batch's host rows into a pinned staging buffer without a wait, and a
    background thread copies them into the tier once that copy has run (HostPuts). A sequence
    past both tiers is never kept (keeps(i) False, put a no-op): the target computes its states
    every time. keep: how many sequences the cache keeps, both tiers."""

    def __init__(self, lengths: list[int], layers: int, hidden: int, dtype: torch.dtype, device, keep: int | None = None,
                 host_keep: int = 0, host="cpu"):
        self.device, self.dtype, self.widths = torch.device(device), dtype, (layers * hidden, hidden)
        n = len(lengths) if keep is None else min(keep, len(lengths))
        m = max(0, min(host_keep, len(lengths) - n))
        self.on_device: StateTier | None = StateTier(lengths, 0, n, layers, hidden, dtype, self.device)
        self.on_host: StateTier | None = StateTier(lengths, n, n + m, layers, hidden, dtype, host) if m else None
        self.host_puts = HostPuts(self.put)

    @property
    def tiers(self) -> list[StateTier]:
        return [t for t in (self.on_device, self.on_host) if t is not None]

    @property
    def keep(self) -> int:
        return sum(len(t) for t in self.tiers)

    @property
    def host_keep(self) -> int:
        return 0 if self.on_host is None else len(self.on_host)

    def _tier(self, i: int) -> StateTier | None:
        return next((t for t in self.tiers if i in t), None)

    def keeps(self, i: int) -> bool:
        """Whether sequence i's states are kept once computed."""
        return self._tier(i) is not None

    def has(self, i: int) -> bool:
        tier = self._tier(i)
        if tier is None:
            return False
        if not tier.kept[i - tier.start] and tier is self.on_host:
            self.host_puts.wait_for(i)  # put but maybe not copied in yet: a resumed run's refill, a test
        return tier.kept[i - tier.start]

    def nbytes(self) -> int:
        """Bytes of both tiers."""
        return sum(t.nbytes() for t in self.tiers)

    def device_nbytes(self) -> int:
        """Bytes on the training device: what giving back the device tier frees there."""
        return 0 if self.on_device is None else self.on_device.nbytes()

    def host_nbytes(self) -> int:
        return 0 if self.on_host is None else self.on_host.nbytes()

    def drop_device(self) -> None:
        """Give back the device tier (a training step ran out of memory beside it): its sequences are
        computed by the target from here; the host tier stays."""
        self.on_device = None

    def put(self, i: int, aux: torch.Tensor, final: torch.Tensor) -> None:
        tier = self._tier(i)
        if tier is None:
            return
        kept_aux, kept_final = tier.rows(i)
        kept_aux.copy_(aux)  # the host tier's rows come here from HostPuts' thread, already on the host
        kept_final.copy_(final)
        tier.kept[i - tier.start] = True

    def put_rows(self, rows: list[tuple[int, torch.Tensor, torch.Tensor]]) -> None:
        """put for each (i, aux, final); the host tier's rows handed to HostPuts in one piece."""
        host = self.on_host
        far = [(i, a, f) for i, a, f in rows if host is not None and i in host]
        for i, a, f in rows:
            if host is None or i not in host:
                self.put(i, a, f)
        if far:
            self.host_puts.submit(far)

    def read(self, indices: list[int | None], T: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(aux [B, T, k*H], final [B, T, H]) of `indices` on the training device, zero past each
        sequence's end and in the rows whose index is None (the caller fills those)."""
        aux = torch.zeros((len(indices), T, self.widths[0]), dtype=self.dtype, device=self.device)
        final = torch.zeros((len(indices), T, self.widths[1]), dtype=self.dtype, device=self.device)
        far = []  # (row, aux, final) of the host tier's rows: copied over in one piece
        for j, i in enumerate(indices):
            if i is None:
                continue
            tier = self._tier(i)
            kept_aux, kept_final = tier.rows(i)
            if tier is self.on_host:
                far.append((j, kept_aux, kept_final))
                continue
            aux[j, : len(kept_aux)].copy_(kept_aux)
            final[j, : len(kept_final)].copy_(kept_final)
        if far:
            # Through pinned memory, queued without a wait (to_device): a pageable copy per row would block
            # the host until the GPU finished every kernel queued before it, each time.
            for j, a, f in zip([j for j, _, _ in far], *moved(far, lambda t: to_device(t, self.device))):
                aux[j, : len(a)].copy_(a)
                final[j, : len(f)].copy_(f)
        return aux, final


def moved(rows: list[tuple[int, torch.Tensor, torch.Tensor]], move) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """The aux and final rows of (i, aux, final) moved by `move` in one piece each (one copy, not one
    per row), split back into rows."""
    sizes = [len(a) for _, a, _ in rows]
    return (move(torch.cat([a for _, a, _ in rows])).split(sizes), move(torch.cat([f for _, _, f in rows])).split(sizes))


class HostPuts:
    """Rows put into the host tier, copied there off the training thread. A plain device-to-host copy
    waits for every kernel queued before it (the target's forward, and the draft's step before
    that): the host could not queue the next step meanwhile, the GPU ran dry while the host copied,
    and a fresh tier's pages are mapped in by that first write. On one H100 the first epoch of a
    95 GiB cache ran ~0.2 s a step slower than without a cache (docs/scale.md); this wait is the
    suspected share (`benchmarks/state_cache.py --steps` measures it). Here a batch's rows are
    queued into a pinned staging buffer without a wait, an event marks that copy, and one worker
    thread waits on the event and copies the rows into the tier (torch's copies let go of the GIL).
    A row is kept (has) once copied; a wait_for on a row still in flight waits for its batch. At
    most `depth` batches are in flight (each ~150 MB of pinned memory at 32,768 tokens and 4.5 KiB
    a token): a training faster than the copies waits for the oldest. `put(i, aux, final)` writes
    one row."""

    def __init__(self, put, depth: int = 2):
        self.put, self.depth = put, depth
        self.jobs: deque[Future] = deque()
        self.of_row: dict[int, Future] = {}
        self.worker: ThreadPoolExecutor | None = None

    def submit(self, rows: list[tuple[int, torch.Tensor, torch.Tensor]]) -> None:
        while self.jobs and (self.jobs[0].done() or len(self.jobs) >= self.depth):
            self.jobs.popleft().result()  # a copy that failed raises here, in the training thread
        ids, sizes = [i for i, _, _ in rows], [len(a) for _, a, _ in rows]
        staged = [torch.cat([a for _, a, _ in rows]), torch.cat([f for _, _, f in rows])]  # new tensors: the batch's may change
        done = None
        if staged[0].device.type == "cuda":
            stream = torch.cuda.current_stream(staged[0].device)
            staged = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True) for t in staged]
            done = torch.cuda.Event()
            done.record(stream)
        if self.worker is None:
            self.worker = ThreadPoolExecutor(1, thread_name_prefix="state-cache-host-puts")
        job = self.worker.submit(self._keep, ids, sizes, staged, done)
        self.jobs.append(job)
        self.of_row.update(dict.fromkeys(ids, job))

    def _keep(self, ids, sizes, staged, done) -> None:
        if done is not None:
            done.synchronize()
        for i, a, f in zip(ids, staged[0].split(sizes), staged[1].split(sizes)):
            self.put(i, a, f)

    def wait_for(self, i: int) -> None:
        job = self.of_row.pop(i, None)
        if job is not None:
            if job in self.jobs:
                self.jobs.remove(job)  # its failure raised here once, not again at the next submit
            job.result()

    def wait(self) -> None:
        """Every row put so far copied in."""
        while self.jobs:
            self.jobs.popleft().result()
        self.of_row.clear()


STATE_CACHE_SHARE = 0.6  # of the training device's free memory, at most, for the state caches of both splits
# Of the host's available memory, at most, for the host tier (sequences past the device's budget).
# Half, not more: the rest is the process's own growth after the cache is sized (torch.compile's
# worker processes, a GiB or so each; the pinned buffers of the batches' copies) and other
# processes', and running the host out of memory gets the process killed (the kernel's OOM killer),
# where a GPU short of memory raises an error the run survives (draftlab.train.loop.give_back_states).
HOST_SHARE = 0.5


def smallest_first(splits: list[OnlineFeatures]) -> list[int]:
    """The splits' positions, the one whose states take fewest bytes first: the order plan_states keeps them in."""
    return sorted(range(len(splits)), key=lambda s: (splits[s].state_bytes(), s))


def plan_states(splits: list[OnlineFeatures], budgets: list[float]) -> list[list[int]]:
    """How many of each split's sequences each tier keeps ([tier][split]), tier t within budgets[t]
    bytes (the device's, then the host's). The sequences in one order: the splits smallest first
    (the eval split: small, and read after every epoch), each in index order. Each tier takes them
    in that order, from where the tier before it stopped, up to the first that would pass its
    budget: the device tier the smaller splits whole (while they fit) and then a prefix of the next,
    the host tier the run of sequences after it; the sequences after both are never kept. A rule of
    the lengths alone: every run, resumed or not, keeps the same sequences in the same tier."""
    order = smallest_first(splits)
    plan = [[0] * len(splits) for _ in budgets]
    k, i = 0, 0  # the next sequence: order[k]'s sequence i
    for t, left in enumerate(budgets):
        while k < len(order):
            ds = splits[order[k]]
            if i == len(ds):
                k, i = k + 1, 0
                continue
            size = ds.length(i) * ds.token_bytes()
            if size > left:
                break
            left -= size
            plan[t][order[k]] += 1
            i += 1
    return plan


def cache_states(splits: list[OnlineFeatures], setting: str, device, world: int = 1, host=None) -> str:
    """train.state_cache: give the splits StateCaches (auto: one training process) holding as many
    sequences' states as fit STATE_CACHE_SHARE of the device's free memory and, on a GPU, the next
    ones up to HOST_SHARE of the host's available memory (plan_states: every sequence on the device
    where all fit, else the smaller splits whole and a prefix of the next there, then the sequences
    after it in host memory); returns the line that says what was decided. Every sequence kept
    saves the target's forward over it in each epoch after the first.

    host: the host tier's device; None: the CPU, for a training device that is not the CPU itself
    (a CPU device has one tier, its own). A test passes "cpu" to get two tiers on a CPU.

    The rest of the free memory is the training step's: at SmolLM2's shape (32,768-token packed
    steps, 7 TTT steps, draft vocab 16,384) its peak was 17.5 GB, 22% of an 80 GB GPU."""
    if setting == "off":
        return "train: state cache off (train.state_cache): the target runs on every batch of every epoch"
    if world > 1:
        return (f"train: state cache off: {world} processes see other sequences every epoch (train.state_cache auto keeps "
                "states for one process)")
    device = torch.device(device)
    if host is None and device.type != "cpu":
        host = "cpu"
    need = sum(ds.state_bytes() for ds in splits)
    free = free_memory(device)
    if free is None:
        return (f"train: state cache off: the splits' states take {need / 2**30:.1f} GiB and the memory free on {device} "
                "cannot be read; the target runs on every batch of every epoch")
    budgets = [STATE_CACHE_SHARE * free]
    available = host_memory() if host is not None and need > budgets[0] else None  # a host tier only where the device's ends
    if available is not None:
        budgets.append(HOST_SHARE * available)
    plan = plan_states(splits, budgets)
    on_device, on_host = plan[0], plan[1] if len(plan) > 1 else [0] * len(splits)
    keep = [a + b for a, b in zip(on_device, on_host)]
    if not any(keep):
        host_too = f" and {HOST_SHARE:.0%} of the {available / 2**30:.1f} GiB available in host memory" if available is not None else ""
        return (f"train: state cache off: the splits' states take {need / 2**30:.1f} GiB, more than {STATE_CACHE_SHARE:.0%} of "
                f"the {free / 2**30:.1f} GiB free on {device}{host_too}; the target runs on every batch of every epoch")
    for ds, n, m in zip(splits, on_device, on_host):
        if n + m:
            ds.keep_states(device, n, host_n=m, host=host)
        else:
            ds.cache = None
    if all(n == len(ds) for ds, n in zip(splits, on_device)):
        return (f"train: state cache on {device}: {need / 2**30:.1f} GiB of states (of {free / 2**30:.1f} GiB free), computed by "
                "the target in the first epoch and read back after it (train.state_cache off: the target runs every epoch)")
    kept = sum(ds.state_bytes(n) for ds, n in zip(splits, keep))
    order = smallest_first(splits)
    cut = next((s for s in order if keep[s] < len(splits[s])), order[-1])  # the split kept in part (plan_states: one at most)
    others = "; ".join(f"the {ds.dir.name} split whole" if n == len(ds) else f"none of the {ds.dir.name} split"
                       for s, (ds, n) in enumerate(zip(splits, keep)) if s != cut)
    ds, others = splits[cut], "; " + others if others else ""
    rest = "" if kept == need else "; the target computes the rest every epoch"
    if not any(on_host):
        return (f"train: state cache on {device} for {keep[cut]:,} of {len(ds):,} {ds.dir.name} sequences ({kept / 2**30:.1f} of "
                f"{need / 2**30:.1f} GiB{others}): all that fits {STATE_CACHE_SHARE:.0%} of the {free / 2**30:.1f} GiB free, "
                f"computed by the target in the first epoch and read back after it{rest}")
    in_host = sum(ds.state_bytes(n + m) - ds.state_bytes(n) for ds, n, m in zip(splits, on_device, on_host))
    share = f"{kept / 2**30:.1f} of {need / 2**30:.1f} GiB" if rest else f"{need / 2**30:.1f} GiB"
    return (f"train: state cache for {keep[cut]:,} of {len(ds):,} {ds.dir.name} sequences ({share}{others}): "
            f"{(kept - in_host) / 2**30:.1f} GiB on {device} ({STATE_CACHE_SHARE:.0%} of its {free / 2**30:.1f} GiB free), "
            f"{in_host / 2**30:.1f} GiB in host memory ({HOST_SHARE:.0%} of its {available / 2**30:.1f} GiB available); "
            f"computed by the target in the first epoch and read back after it{rest}")


def free_memory(device) -> int | None:
    """Bytes free on `device`: the GPU's (CUDA), the host's available memory (CPU: host_memory); None if unknown."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    return host_memory()


MEMINFO, PROC_CGROUP, CGROUP = Path("/proc/meminfo"), Path("/proc/self/cgroup"), Path("/sys/fs/cgroup")


def host_memory() -> int | None:
    """Bytes of host memory this process can still take (Linux); None if unknown. /proc/meminfo's
    MemAvailable: the free pages and the page cache the kernel gives back on demand (the free pages
    alone, SC_AVPHYS_PAGES, where it cannot be read: on a machine up for a while the page cache holds
    most of the memory, and the free pages can be a few GiB). At most what this process's cgroups
    leave under their memory limits (a container's): the kernel kills a process past such a limit,
    however much the machine has free."""
    try:
        available = next(int(line.split()[1]) * 1024 for line in MEMINFO.read_text().splitlines()
                         if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        try:
            available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            return None
    room = cgroup_room()
    return available if room is None else min(available, room)


def cgroup_room() -> int | None:
    """The least that this process's cgroup and those above it leave under their memory limits, in
    bytes (cgroup v2's memory.max, v1's memory.limit_in_bytes, less the usage: memory.current or
    memory.usage_in_bytes less the inactive page cache the kernel reclaims first, as `docker stats`
    counts it); None where no limit is set or none can be read."""
    try:
        lines = PROC_CGROUP.read_text().splitlines()
    except OSError:
        return None
    room = None
    for line in lines:
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if controllers == "":
            root, limit, usage, cache = CGROUP, "memory.max", "memory.current", "inactive_file"
        elif "memory" in controllers.split(","):
            root, limit, usage, cache = CGROUP / "memory", "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"
        else:
            continue
        group = root / path.strip().lstrip("/")
        group = group if group.is_dir() else root  # a container's own group mounted at the root
        for d in [group, *group.parents]:
            try:
                cap, used = (d / limit).read_text().strip(), (d / usage).read_text().strip()
            except OSError:
                cap = used = ""
            if cap.isdigit() and used.isdigit():  # v2's "max": no limit
                left = int(cap) - int(used) + _memory_stat(d, cache)
                room = left if room is None else min(room, left)
            if d == root:
                break
    return None if room is None else max(0, room)


def _memory_stat(group: Path, key: str) -> int:
    """A cgroup's memory.stat entry, in bytes (0 where missing)."""
    try:
        return next(int(line.split()[1]) for line in (group / "memory.stat").read_text().splitlines()
                    if line.split()[:1] == [key])
    except (OSError, StopIteration, ValueError, IndexError):
        return 0
