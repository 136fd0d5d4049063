"""The offline run's prompts decoded by several processes at once, each with its own copy of the
target and the draft on the one device (bench.offline_workers).

In-process decoding of a small target is bound by the host launching kernels, not by the GPU: a
135M target's verify step took 30 ms eager against 1.1 ms in SGLang's CUDA graphs (one H100), so
the GPU sat mostly idle and the bench waited ~100 s on this run after its servers were up. Four
processes decoded its 32 prompts 2.7 times as fast as one (1.97 s a prompt against ~5.3, one H100),
each with its own copy of both models. Each prompt's output and counts are
those one process would give (greedy, batch 1, the same kernels); only the seconds differ, so the
round timings the advice is fed come from a prompt decoded again alone (draftlab.bench.run.time_offline).

    n = worker_count("auto", "cuda:0", prompts=32, copy_bytes=..., room_bytes=...)
    with DecodePool(target_params, draft_path, device, n) as pool:
        results, baselines = pool.decode(prompts, flags, physical, max_new_tokens, tokenizer_eos, ignore_eos, with_baseline)
"""
from __future__ import annotations

import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

import torch

from draftlab.bench.offline import decode_one
from draftlab.errors import UserError

AUTO_MAX = 4  # processes `auto` starts at most (the count measured: 2.7x one process for SmolLM2 on an H100)
CORES_PER_WORKER = 4  # host cores `auto` leaves each process (the servers starting beside it need theirs)


def worker_count(setting, device, prompts: int, copy_bytes: int, room_bytes: int | None) -> int:
    """Processes for the offline decode: bench.offline_workers (an int, or "auto": 1 on a CPU, where
    the processes would share the same cores; on a GPU up to AUTO_MAX, one per CORES_PER_WORKER host
    cores), never more than the prompts nor than the copies of both models (copy_bytes each) that
    fit room_bytes (None: not known, not limited)."""
    if setting == "auto":
        if torch.device(device).type != "cuda":
            return 1
        want = min(AUTO_MAX, max(1, (os.cpu_count() or 1) // CORES_PER_WORKER))
    else:
        want = int(setting)
    if room_bytes is not None and copy_bytes > 0:
        want = min(want, max(1, room_bytes // copy_bytes))
    return max(1, min(want, prompts))


def load_models(target_params, draft_path, device: str):
    """(target, draft): the target as transformers loads it and the exported draft as SGLang would
    load it (faults included), both on `device`."""
    from draftlab.sglang.checkpoint import load_exported
    from draftlab.target.load import load_target

    target, _ = load_target(target_params, device)
    embed = target.get_input_embeddings().weight
    draft, _ = load_exported(draft_path, embed=embed, dtype=embed.dtype, as_sglang=True)
    draft.to(device)
    return target, draft


def stop_ids(target, tokenizer_eos: int | None) -> set[int]:
    """The tokens that end an answer: the target's generation config's and the tokenizer's."""
    return {target.generation_config.eos_token_id, tokenizer_eos} - {None}


_MODELS = None  # a worker's (target, draft), loaded once by _start


def _start(target_params, draft_path, device: str, threads: int) -> None:
    global _MODELS
    torch.set_num_threads(threads)  # the host's cores shared between the workers, not each taking them all
    _MODELS = load_models(target_params, draft_path, device)


def _decode(prompt, flags, physical, max_new_tokens, tokenizer_eos, ignore_eos, with_baseline):
    target, draft = _MODELS
    return decode_one(target, draft, prompt, flags, physical, max_new_tokens, stop_ids(target, tokenizer_eos), ignore_eos,
                      with_baseline)


class DecodePool:
    """`workers` processes, each holding its own target and draft on `device`, that decode prompts
    one per task. Spawned (CUDA cannot be forked); a worker's error is raised by decode; leaving the
    `with` block (Ctrl-C included) stops them and frees their copies."""

    def __init__(self, target_params, draft_path, device: str, workers: int):
        threads = max(1, (os.cpu_count() or 1) // workers)
        self.workers = workers
        self._pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"), initializer=_start,
                                         initargs=(target_params, draft_path, str(device), threads))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._pool.shutdown(wait=True, cancel_futures=True)
        return False

    def decode(self, prompts: list[list[int]], flags, physical: list[int], max_new_tokens: int, tokenizer_eos: int | None,
               ignore_eos: bool, with_baseline: bool, done=None) -> tuple[list, list]:
        """(spec_engine results, baseline results) of `prompts`, in their order, as
        draftlab.bench.offline.decode_each gives them. done(): called as each prompt ends."""
        futures = [self._pool.submit(_decode, p, flags, physical, max_new_tokens, tokenizer_eos, ignore_eos, with_baseline)
                   for p in prompts]
        if done:
            for f in futures:
                f.add_done_callback(lambda _: done())
        try:
            pairs = [f.result() for f in futures]
        except BrokenProcessPool as e:  # a worker killed (out of memory, a signal): say which setting runs without them
            raise UserError(f"a process of the bench's offline run died before its prompts were decoded ({e}); it holds its "
                            f"own copy of the target and the draft: set bench.offline_workers to fewer than {self.workers} "
                            "(1 decodes in the bench's own process)") from e
        return [got for got, _ in pairs], [base for _, base in pairs if base is not None]
