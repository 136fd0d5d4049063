"""Throughput of the offline train stage's batch reader, without the model.

    python benchmarks/feature_loader.py --gb 0.3 --batches 40 --repeats 3
    python benchmarks/feature_loader.py --cold            # drop the shards from the page cache first
    python benchmarks/feature_loader.py --profile         # cProfile of one pass, top 15 by cumtime

Method. Synthetic feature shards are written to a temporary directory with the project's own
writer (draftlab.features.dataset.pack_sequences + write_shard, the calls standardize and the test
fixtures make): `--layers` captured layers plus the final state at `--hidden` width in bf16
((k+1)*H*2 bytes per token: 32 KiB at H=4096, k=3), rows of `--row-tokens` tokens +-
`--jitter` (uniform), `--shard-tokens` tokens per shard (params.yaml extract.shard_tokens),
`--gb` GB of states in all. The reader is then timed exactly as draftlab.train.loop.fit drives it in
offline mode: FeatureDataset(split, max_length).batch(indices, device) on the shuffled batches of
draftlab.train.batches.epoch_batches(len, batch, seed, epoch), one after the other (fit builds no
DataLoader: batch() is its only reader), with prefetch(next indices, device) after each batch
as fit calls it. `--sleep` seconds per step stand in for the device's training step (0: none),
so the prefetch overlap shows up as it would beside a GPU.

Three readers are timed in the same run, alternately, `--repeats` times each over `--batches`
batches: `legacy` (the reader as it was before this tool: per row get_slice from a
memory-mapped safe_open, then collate: F.pad every row, torch.stack, .to(device), .float())
`sync` (the current reader without prefetch: host_batch, then .to(device) and .float(), timed
apart) and `current` (draftlab.features.dataset.FeatureDataset.batch with prefetch, as fit drives it). Per reader and repeat:
rows/s, real tokens/s (tokens of the rows, padding excluded) and MB/s of states read
(real tokens x (k+1)*H*2 bytes, 1 MB = 1e6 bytes), all over the time spent in batch() (for
`current`: waiting for the prefetch included), and where the time goes, in ms per batch (legacy:
read = the per-row slices, pad_stack = F.pad + torch.stack, to_float = .to(device) + .float();
sync: host_batch, to_float). With a CUDA device, to_float runs on the GPU; the host part is what
the CPU pays per batch. With `--cold`, every shard file is dropped from the page
cache (posix_fadvise DONTNEED, these files only) before each repeat, so the rows come from the
disk as they do in a first epoch whose states the page cache no longer holds.
"""
from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from draftlab.features.dataset import FeatureDataset, pack_sequences, shard_name, write_shard  # noqa: E402
try:
    from draftlab.train.batches import epoch_batches  # noqa: E402
except ImportError:  # a machine without the train stage's other dependencies (tqdm, ...): the same shuffle
    def epoch_batches(n: int, batch_size: int, seed: int, epoch: int) -> list[list[int]]:
        g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
        order = torch.randperm(n, generator=g).tolist()
        return [order[i : i + batch_size] for i in range(0, n - batch_size + 1, batch_size)]


def make_shards(out: Path, gb: float, hidden: int, layers: int, row_tokens: int, jitter: int, shard_tokens: int,
                seed: int = 0) -> tuple[int, int]:
    """Write ~gb GB of bf16 states as feature shards under out; returns (rows, tokens)."""
    out.mkdir(parents=True, exist_ok=True)
    per_token = (layers + 1) * hidden * 2
    total_tokens = int(gb * 1e9 / per_token)
    g = torch.Generator().manual_seed(seed)
    meta = {"physical_layers": list(range(1, layers + 1)), "hidden_size": hidden, "num_layers": layers + 1,
            "architecture": "LlamaForCausalLM", "vocab_size": 128256}
    rows = tokens = shard = 0
    seqs, in_shard = [], 0
    # one random block reused for every row's states (writing speed; values do not matter here)
    block = torch.randn(row_tokens + jitter, (layers + 1) * hidden, generator=g).bfloat16()
    while tokens < total_tokens:
        n = row_tokens + int(torch.randint(-jitter, jitter + 1, (1,), generator=g)) if jitter else row_tokens
        seqs.append({"input_ids": torch.randint(0, 128256, (n,), generator=g), "loss_mask": torch.rand(n, generator=g) > 0.3,
                     "aux_hidden": block[:n, : layers * hidden], "final_hidden": block[:n, layers * hidden :]})
        rows, tokens, in_shard = rows + 1, tokens + n, in_shard + n
        if in_shard >= shard_tokens or tokens >= total_tokens:
            write_shard(out / shard_name(shard), pack_sequences(seqs), meta)
            shard, seqs, in_shard = shard + 1, [], 0
    return rows, tokens


def drop_cache(split: Path) -> None:
    for path in split.glob("shard-*.safetensors"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


class LegacyReader:
    """The reader before this tool (FeatureDataset.batch -> collate), kept here for before/after."""

    def __init__(self, ds: FeatureDataset):
        self.ds = ds
        self.timers = {"read": 0.0, "pad_stack": 0.0, "to_float": 0.0}

    def batch(self, indices, device):
        t0 = time.perf_counter()
        items = [self.ds[i] for i in indices]  # FeatureDataset.__getitem__: get_slice per field (unchanged)
        t1 = time.perf_counter()
        T = max(len(x["input_ids"]) for x in items)

        def pad(name, fill):
            rows = [F.pad(x[name], (0, 0) * (x[name].ndim - 1) + (0, T - len(x[name])), value=fill) for x in items]
            return torch.stack(rows)

        host = {"input_ids": pad("input_ids", 0), "loss_mask": pad("loss_mask", False),
                "aux_hidden": pad("aux_hidden", 0.0), "final_hidden": pad("final_hidden", 0.0)}
        t2 = time.perf_counter()
        out = {k: v.to(device) for k, v in host.items()}
        out["aux_hidden"], out["final_hidden"] = out["aux_hidden"].float(), out["final_hidden"].float()
        sync(device)
        self.timers["read"] += t1 - t0
        self.timers["pad_stack"] += t2 - t1
        self.timers["to_float"] += time.perf_counter() - t2
        return out


class SyncReader:
    """The current reader without prefetch, its host part (host_batch: preadv into the padded
    batch) timed apart from the transfer and float conversion (which batch() runs on the device)."""

    def __init__(self, ds: FeatureDataset):
        self.ds = ds
        self.timers = {"host_batch": 0.0, "to_float": 0.0}

    def batch(self, indices, device):
        pin = torch.device(device).type == "cuda"
        t0 = time.perf_counter()
        host = self.ds.host_batch(list(indices), pin)
        t1 = time.perf_counter()
        out = {k: v.to(device, non_blocking=pin) for k, v in host.items()}
        out["aux_hidden"], out["final_hidden"] = out["aux_hidden"].float(), out["final_hidden"].float()
        sync(device)
        self.timers["host_batch"] += t1 - t0
        self.timers["to_float"] += time.perf_counter() - t1
        return out


def sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def run_pass(name: str, split: Path, args, epoch: int) -> dict:
    ds = FeatureDataset(split, args.max_length)
    reader = {"legacy": LegacyReader, "sync": SyncReader}.get(name, lambda d: d)(ds)
    batches = epoch_batches(len(ds), args.batch, args.seed, epoch)[: args.batches]
    lengths = [sum(ds.length(i) for i in b) for b in batches]
    per_token = (len(ds.physical_layers) + 1) * int(ds.metadata["hidden_size"]) * 2
    in_batch = 0.0
    t0 = time.perf_counter()
    for b, idx in enumerate(batches):
        t = time.perf_counter()
        batch = reader.batch(idx, args.device)
        if name == "current" and b + 1 < len(batches):
            ds.prefetch(batches[b + 1], args.device)
        sync(args.device)
        in_batch += time.perf_counter() - t
        assert batch["aux_hidden"].dtype == torch.float32
        if args.sleep:
            time.sleep(args.sleep)
    wall = time.perf_counter() - t0
    rows, tokens = len(batches) * args.batch, sum(lengths)
    out = {"reader": name, "wall_s": wall, "batch_s": in_batch, "rows_per_s": rows / in_batch,
           "tokens_per_s": tokens / in_batch, "MB_per_s": tokens * per_token / 1e6 / in_batch,
           "ms_per_batch": in_batch / len(batches) * 1e3, "step_tokens_per_s": tokens / wall}
    if hasattr(reader, "timers"):
        out.update({f"{k}_ms_per_batch": v / len(batches) * 1e3 for k, v in reader.timers.items()})
    if hasattr(ds, "close"):
        ds.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gb", type=float, default=1.0, help="GB of states to write (default 1.0; 0.3 for a quick run)")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=3, help="captured layers (plus the final state)")
    ap.add_argument("--row-tokens", type=int, default=100)
    ap.add_argument("--jitter", type=int, default=20, help="row length = row-tokens +- jitter (uniform)")
    ap.add_argument("--shard-tokens", type=int, default=65536)
    ap.add_argument("--batch", type=int, default=16, help="rows per batch (train.batch_size)")
    ap.add_argument("--batches", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-length", type=int, default=None, help="train.max_length")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--sleep", type=float, default=0.0, help="seconds per step standing in for the training step")
    ap.add_argument("--cold", action="store_true", help="drop the shards from the page cache before every pass")
    ap.add_argument("--readers", default="legacy,sync,current", help="legacy: the reader before; sync: the current "
                    "reader without prefetch, host part timed apart; current: FeatureDataset.batch + prefetch as fit drives it")
    ap.add_argument("--profile", action="store_true", help="cProfile one pass of each reader (top 15 by cumtime)")
    ap.add_argument("--dir", default=None, help="shards directory to (re)use; default: a temporary one")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    tmp = None
    if args.dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="bench-loader-")
        args.dir = tmp.name
    split = Path(args.dir) / "train"
    if not list(split.glob("shard-*.safetensors")):
        t = time.perf_counter()
        rows, tokens = make_shards(split, args.gb, args.hidden, args.layers, args.row_tokens, args.jitter, args.shard_tokens)
        print(f"wrote {rows} rows, {tokens} tokens, {sum(p.stat().st_size for p in split.iterdir()) / 1e9:.2f} GB "
              f"in {len(list(split.iterdir()))} shards ({time.perf_counter() - t:.1f} s)")
    print(f"device {args.device}, batch {args.batch}, {args.batches} batches per pass, cold={args.cold}, sleep={args.sleep}, "
          f"torch threads {torch.get_num_threads()}, cpus {os.cpu_count()}")
    readers = args.readers.split(",")
    results = {r: [] for r in readers}
    for rep in range(args.repeats):
        for r in readers:
            if args.cold:
                drop_cache(split)
            res = run_pass(r, split, args, epoch=rep)
            results[r].append(res)
            extra = "".join(f", {k} {v:.1f}" for k, v in res.items() if k.endswith("_ms_per_batch"))
            print(f"rep {rep} {r:8s}: {res['rows_per_s']:8.1f} rows/s {res['tokens_per_s']:9.0f} tok/s "
                  f"{res['MB_per_s']:8.1f} MB/s  {res['ms_per_batch']:7.1f} ms/batch{extra}"
                  + (f"  (with sleep: {res['step_tokens_per_s']:.0f} tok/s per step)" if args.sleep else ""))
    print("median over repeats:")
    med = {r: statistics.median(x["tokens_per_s"] for x in results[r]) for r in readers}
    for r in readers:
        mb = statistics.median(x["MB_per_s"] for x in results[r])
        print(f"  {r:8s}: {med[r]:9.0f} tok/s {mb:8.1f} MB/s")
    for r in readers:
        if r != "legacy" and "legacy" in med:
            ratios = [c["tokens_per_s"] / l["tokens_per_s"] for l, c in zip(results["legacy"], results[r])]
            print(f"  {r}/legacy tok/s per repeat: {', '.join(f'{x:.2f}' for x in ratios)}")
    if args.profile:
        for r in readers:
            if args.cold:
                drop_cache(split)
            prof = cProfile.Profile()
            prof.enable()
            run_pass(r, split, args, epoch=args.repeats)
            prof.disable()
            print(f"--- cProfile, {r}, top 15 by cumtime")
            pstats.Stats(prof).sort_stats("cumulative").print_stats(15)
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
