"""What train.state_cache costs and keeps at a real run's shape, without the target model.

    python benchmarks/state_cache.py                      # a GPU: the shape of 40,022 conversations (21.4M tokens)
    python benchmarks/state_cache.py --device-free-gib 78.4        # an H100's budget, on any GPU
    python benchmarks/state_cache.py --device cpu --sequences 2000 --device-free-gib 1 --host-gib 4   # both tiers, dry run

Method. Two splits are written as the extract stage writes them for train.features online (a
tokens record per split, draftlab.features.extract.tokens_record, read back by OnlineFeatures):
`--sequences` train rows and 728/40,022 as many eval rows, lengths uniform in [64, 1007] tokens (a
mean of 535: the SmolLM2 run's 21.4M train tokens over 40,022 conversations), `--layers` captured
layers plus the final state at `--hidden` width, stored in bf16 ((k+1)*H*2 bytes a token: 4.5 KiB
at SmolLM2's 576). The target is a stand-in: each token's states are a fixed function of its id
(one embedding lookup), so any row is the same whatever batch it comes in, and a row read back
from the cache must equal, to the bit, the row computed without one.

Then, on `--device`:
- draftlab.features.online.cache_states(..., "auto") decides as the train stage does, against this
  machine's free GPU memory and available host memory; its line is printed;
- a batch mixing rows of the device tier, the host tier and rows never kept is compared bit for
  bit with the same batch without a cache, on its first pass (the rows put into the cache) and its
  second (read back);
- timed, each as a median of `--repeats` (ms, the device synchronized around each): a batch of
  ~`--batch-tokens` tokens from the device tier, from the host tier, and computed by the stand-in
  target with no cache (the floor of the target's cost: a real target adds its forward); and a
  first-epoch batch of host-tier rows (computed, then copied to the host) against the same rows
  with no cache. With `--fill`, every host-tier row is put once first, a batch's rows in one copy as
  training puts them, and the fill's GiB/s printed (pages of a fresh host tier are mapped in by that
  first write).
- with `--steps N`: first-epoch steps as training makes them, each batch followed by a
  stand-in for the draft's step (`--step-ms` of matrix products queued on the GPU, no wait), ms a
  step over N steps each: with no cache; putting fresh host-tier rows with the copy made in
  put_rows itself (a device-to-host copy that waits for the GPU); and putting them through
  HostPuts (queued, copied in by a background thread). Each variant takes its own fresh rows, so
  each maps in its own pages; the three run twice, interleaved, and the median is printed.
A step of the SmolLM2 run took ~290 ms on one H100 with the target in it; these figures say what
part of that the cache's copies take.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from draftlab.features import online  # noqa: E402
from draftlab.features.extract import TOKENS_FILE, tokens_record  # noqa: E402

VOCAB = 49152
GiB = 2**30


class StandInTarget:
    """Per-token states from the token id alone (OnlineTarget's capture interface): no model."""

    device = None

    def __init__(self, hidden: int, device):
        self.table = torch.randn(VOCAB, hidden, generator=torch.Generator().manual_seed(0)).to(device)

    def capture(self, ids, mask, physical, device):
        e = self.table[ids]
        return {layer: e * (layer + 1) + 0.1 for layer in physical}, e * 0.5


def write_split(folder: Path, rows: int, seed: int, layers: int, hidden: int) -> Path:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(64, 1008, (rows,), generator=g).tolist()
    ids = torch.randint(0, VOCAB, (sum(lengths),), generator=g).tolist()
    out, at = [], 0
    for n in lengths:
        out.append((ids[at: at + n], [True] * n))
        at += n
    folder.mkdir(parents=True)
    meta = {"physical_layers": list(range(2, 2 + layers)), "hidden_size": hidden, "num_layers": layers + 2,
            "architecture": "LlamaForCausalLM", "vocab_size": VOCAB, "dtype": "bfloat16"}
    save_file(tokens_record(out), str(folder / TOKENS_FILE), metadata={k: json.dumps(v) for k, v in meta.items()})
    return folder


def rows_of(ds, pool, tokens: int) -> list[int]:
    """The first rows of `pool` that fit `tokens`."""
    out, total = [], 0
    for i in pool:
        if total + ds.length(i) > tokens:
            break
        out.append(i)
        total += ds.length(i)
    return out


class CopyInPut:
    """Host-tier puts copied in by put_rows itself (HostPuts' interface): the device-to-host copy
    waits for every kernel queued before it."""

    def __init__(self, put):
        self.put = put

    def submit(self, rows) -> None:
        for i, a, f in zip([i for i, _, _ in rows], *online.moved(rows, lambda t: t.to("cpu"))):
            self.put(i, a, f)

    def wait_for(self, i: int) -> None:
        pass

    def wait(self) -> None:
        pass


def stand_in_step(ms: float, device):
    """A function queuing ~`ms` of matrix products on `device` without a wait: the draft's step."""
    n = 4096 if torch.device(device).type == "cuda" else 256  # a CPU: a dry run of the method
    x, y = (torch.randn(n, n, dtype=torch.bfloat16, device=device) for _ in range(2))

    def products(count: int) -> None:
        for _ in range(count):  # into one buffer: ~1,000 products a step would otherwise hold ~32 GB of results
            torch.matmul(x, x, out=y)
    per = timed_ms(lambda: products(50), 3, device) / 50
    n = max(1, round(ms / per))
    return lambda: products(n)


def steps_ms(ds, batches: list[list[int]], step, device, wait=lambda: None) -> float:
    """ms a step over `batches`, each batch made then `step` queued, the device synchronized at the ends."""
    sync(device)
    t0 = time.perf_counter()
    for rows in batches:
        ds.batch(rows, device)
        step()
    sync(device)
    wait()
    return (time.perf_counter() - t0) * 1e3 / len(batches)


def timed_ms(fn, repeats: int, device) -> float:
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--sequences", type=int, default=40022)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--batch-tokens", type=int, default=32768)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--fill", action="store_true", help="put every host-tier row once and time it")
    ap.add_argument("--steps", type=int, default=0, help="time N first-epoch steps into the host tier each way")
    ap.add_argument("--step-ms", type=float, default=250.0, help="the stand-in draft step's GPU time (ms)")
    ap.add_argument("--device-free-gib", type=float, help="take the device's free memory as this (another GPU's budget)")
    ap.add_argument("--host-gib", type=float, help="take the host's available memory as this; on a CPU device, also "
                                                   "give it a host tier (a dry run of the two tiers)")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if args.device_free_gib is not None:
        online.free_memory = lambda _device: int(args.device_free_gib * GiB)
    if args.host_gib is not None:
        online.host_memory = lambda: int(args.host_gib * GiB)
    target = StandInTarget(args.hidden, device)
    with tempfile.TemporaryDirectory() as tmp:
        splits = [online.OnlineFeatures(write_split(Path(tmp) / name, n, seed, args.layers, args.hidden), None, target)
                  for name, n, seed in (("train", args.sequences, 1), ("eval", max(1, args.sequences * 728 // 40022), 2))]
        plain = online.OnlineFeatures(Path(tmp) / "train", None, target)  # the same rows, no cache
        train = splits[0]
        tokens = sum(train.length(i) for i in range(len(train)))
        print(f"{len(train):,} train sequences, {tokens / 1e6:.1f}M tokens, {train.token_bytes()} bytes of states a token; "
              f"free on {device}: {online.free_memory(device) / GiB:.1f} GiB, host available: {online.host_memory() / GiB:.1f} GiB")
        print(online.cache_states(splits, "auto", device, host="cpu" if device.type == "cpu" and args.host_gib else None))
        cache = train.cache
        if cache is None:
            print("nothing kept: nothing more to time")
            return
        k, m = cache.keep - cache.host_keep, cache.host_keep
        print(f"train: {k:,} on {device}, {m:,} in host memory, {len(train) - k - m:,} never kept")
        # bit identity over the three kinds of row, first pass then read back
        pick = [i for lo, hi in ((0, k), (k, k + m), (k + m, len(train))) if hi > lo for i in range(lo, min(hi, lo + 12))]
        want = plain.batch(pick, device)
        for label in ("first pass (computed, put)", "second pass (read back)"):
            got = train.batch(pick, device)
            print(f"mixed batch of {len(pick)} rows, {label}: bit-identical {all(torch.equal(got[n], want[n]) for n in want)}")
        if args.fill and m:
            sync(device)
            t0 = time.perf_counter()
            aux = torch.zeros(1008, args.layers * args.hidden, dtype=torch.bfloat16, device=device)
            final = torch.zeros(1008, args.hidden, dtype=torch.bfloat16, device=device)
            todo = list(range(k, k + m))
            while todo:  # as the first epoch puts them: a batch's states on the device, copied to the host in one piece
                rows = rows_of(train, todo, args.batch_tokens) or todo[:1]
                cache.put_rows([(i, aux[: train.length(i)], final[: train.length(i)]) for i in rows])
                todo = todo[len(rows):]
            sync(device)
            cache.host_puts.wait()
            s = time.perf_counter() - t0
            print(f"host tier filled: {cache.host_nbytes() / GiB:.1f} GiB in {s:.1f} s ({cache.host_nbytes() / GiB / s:.2f} GiB/s)")
        for label, ds, rows in (("device tier", train, rows_of(train, range(k), args.batch_tokens)),
                                ("host tier", train, rows_of(train, range(k, k + m), args.batch_tokens)),
                                ("no cache (stand-in target)", plain, rows_of(plain, range(len(train)), args.batch_tokens))):
            if not rows:
                continue
            ds.batch(rows, device)  # once untimed: with a cache the rows are put, so the timed passes read them back
            n = sum(ds.length(i) for i in rows)
            ms = timed_ms(lambda: ds.batch(rows, device), args.repeats, device)
            print(f"batch from the {label}: {len(rows)} rows, {n:,} tokens ({n * train.token_bytes() / 1e6:.0f} MB of states): "
                  f"{ms:.1f} ms")
        if m:
            fresh = rows_of(train, range(k + m - 1, k - 1, -1), args.batch_tokens)

            def first_epoch():
                for i in fresh:
                    cache.on_host.kept[i - cache.on_host.start] = False
                train.batch(fresh, device)
                cache.host_puts.wait()
            print(f"first-epoch batch into the host tier ({sum(train.length(i) for i in fresh):,} tokens): "
                  f"{timed_ms(first_epoch, args.repeats, device):.1f} ms; the same rows with no cache: "
                  f"{timed_ms(lambda: plain.batch(fresh, device), args.repeats, device):.1f} ms")

        if args.steps and m:
            first_epoch_steps(train, plain, k, m, args, device)


def first_epoch_steps(train, plain, k: int, m: int, args, device) -> None:
    """--steps: the three ways of a first-epoch step, each on its own fresh host-tier rows."""
    cache, step = train.cache, stand_in_step(args.step_ms, device)
    background = cache.host_puts
    pool = list(range(k + m - 1, k - 1, -1))  # from the tier's end: rows --fill and the timings above left alone
    for i in pool:
        cache.on_host.kept[i - cache.on_host.start] = False
    times = {"no cache": [], "copy in put_rows": [], "background copy (HostPuts)": []}
    for _ in range(2):
        for label in times:
            batches = []
            for _ in range(args.steps):
                rows = rows_of(train, pool, args.batch_tokens)
                pool = pool[len(rows):]
                batches.append(rows)
            if not batches[-1]:
                print(f"--steps {args.steps}: the host tier ran out of fresh rows; fewer steps or a larger --host-gib")
                return
            cache.host_puts = CopyInPut(cache.put) if label == "copy in put_rows" else background
            ds = plain if label == "no cache" else train
            times[label].append(steps_ms(ds, batches, step, device, wait=cache.host_puts.wait))
    cache.host_puts = background
    base = statistics.median(times["no cache"])
    print(f"first-epoch steps, {args.steps} each, a stand-in draft step of {args.step_ms:.0f} ms (ms a step, median of 2):")
    for label, t in times.items():
        print(f"  {label}: {statistics.median(t):.1f} ms ({statistics.median(t) / base:.2f}x no cache)")


if __name__ == "__main__":
    main()
