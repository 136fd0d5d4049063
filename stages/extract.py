"""Stage extract: capture the target's hidden states at the capture layers, in safetensors shards.

    python -m stages.extract --synth data/synth --out data/hidden
    torchrun --nproc-per-node 8 -m stages.extract ...    (data parallel: one process and one writer per GPU)
Reads params sections: target, capture, extract, train.features, and export.sglang_version (only to
refuse, before any compute, layers that SGLang release cannot capture: the embedding output of a
Llama target before 0.5.22, say; it changes nothing the stage writes, so it stays out of the hash).
A conversation (several answered turns) is one sequence with the loss on every answer and on the
end-of-turn token after each answer the target ended itself (none after an answer cut at
synth.max_new_tokens: the row's finish_reasons); one longer than extract.max_length ends after its
last turn that fits (counted in the manifest).
With train.features online, only the first extract.online_sample_sequences rows of each split are
captured (the stats and the check need them); every row's tokens go to <split>/tokens.safetensors
(no states), and the train stage runs the target itself.
Resumable: shards are written atomically one by one; a re-run keeps every shard whose header
carries this run's config hash and computes only the missing ones.
Data parallel: the shard plan depends only on the data, so every process plans the same shards
and each data-parallel group takes every dp_size-th one (shard s by group s % dp_size); the shards
are those one process writes, and rank 0 writes the manifest once all have finished.
extract.engine picks what runs the target (draftlab.features.engines); with extract.tp_size > 1
(sglang only) consecutive ranks form one tensor-parallel group and only its first rank writes.
"""
from __future__ import annotations

import json
import multiprocessing
import os
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from draftlab import jsonl
from draftlab.data.answers import answers_kept, finish_reasons, sample_conversations
from draftlab.data.loops import answer_loop_flags
from draftlab.features import extract
from draftlab.features.engines import open_engine
from draftlab import parallel
from draftlab.sglang.layers import ids_for_physical, physical_from_spec, validate_capture
from draftlab.cli import run_stage_cli
from draftlab.dtypes import torch_dtype
from draftlab.errors import UserError
from draftlab.fsutil import canonicalize_safetensors_file
from draftlab.manifest import build_manifest, output_files, read_verified, write_manifest
from draftlab.params import as_dict, load_params
from draftlab.parallel import resolve_device
from draftlab.target.load import chat_template_hash, target_fingerprint, target_info, tokenizer_hash


def read_rows(path: Path) -> list[dict]:
    if not path.exists():
        raise UserError(f"{path} not found; run the synthesize stage first (dvc repro)")
    return [row for _, row in jsonl.read(path, "re-run the synthesize stage (dvc repro -f synthesize)")]


def shard_is_done(path: Path, config_hash: str) -> bool:
    if not path.exists():
        return False
    try:
        with safe_open(str(path), "pt") as f:
            return (f.metadata() or {}).get("config_hash") == config_hash
    except Exception:  # a foreign or damaged file: recompute it
        return False


def hashed_params(params) -> dict:
    """The params that make this stage's output: target, capture, extract, plus train.features.

    Offline, train.features and extract.online_sample_sequences change nothing extract writes,
    so they stay out of the hash (changing them keeps every shard); online, both do.
    export.sglang_version only decides whether the layers are refused: never hashed.
    """
    out = {name: sec for name, sec in as_dict(params).items() if name not in ("train", "export")}
    if params.train.features == "offline":
        out["extract"] = {k: v for k, v in out["extract"].items() if k != "online_sample_sequences"}
    else:
        out["train"] = {"features": params.train.features}
    return out


def fitted(tok, row: dict, limit: int, path: Path) -> tuple[list[int], list[bool], int]:
    """(ids, loss mask, turns left out) of a synthesized row within `limit` tokens. A conversation of
    several answered turns that runs longer ends after its last turn that fits (the loss on the
    answers kept); a single answer, or a first turn, that does not fit is an error naming the row."""
    messages, turns, reasons = row["messages"], row.get("turns", 1), finish_reasons(row)
    ids, mask = extract.render(tok, messages, turns, reasons)
    left_out = 0
    while len(ids) > limit and left_out < turns - 1:
        left_out += 1
        last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
        messages = messages[:last_user]  # the last (user, assistant) pair off
        ids, mask = extract.render(tok, messages, turns - left_out, reasons[:turns - left_out])
    if len(ids) > limit:
        what = ": its first turn alone has" if turns > 1 else " has"
        raise UserError(f"{path}: row {row['id']}{what} {len(ids)} tokens, more than extract.max_length/context {limit}; "
                        "raise extract.max_length or shorten synth.max_new_tokens")
    return ids, mask, left_out


def train_subset(rows: list[dict], conversations: int | None, turns: int | None, say: bool) -> tuple[list[dict], dict]:
    """(rows, counts) of the train split as extract.train_conversations and extract.train_turns cut it:
    a sample of its conversations (draftlab.data.answers.sample_conversations), each cut after its
    first answers (answers_kept); counts: what was left out, {} when nothing is cut."""
    if conversations is None and turns is None:
        return rows, {}
    in_synth, answers = len(rows), sum(r.get("turns", 1) for r in rows)
    rows = [answers_kept(r, turns) for r in sample_conversations(rows, conversations)]
    counts = {"conversations_in_synth": in_synth, "answers_left_out": answers - sum(r.get("turns", 1) for r in rows)}
    if say:
        what = (f"{len(rows)} of {in_synth} conversations (extract.train_conversations)" if conversations is not None
                else f"all {in_synth} conversations")
        if turns is not None:
            what += f", each cut after its first {'answer' if turns == 1 else f'{turns} answers'} (extract.train_turns)"
        print(f"extract: train split: {what}; {counts['answers_left_out']} of its {answers} answers left out")
    return rows, counts


# Rendering is the chat template and the tokenizer, row by row: ~5 ms for a conversation of four turns
# on one core, about a minute for ten thousand. The rows are independent, so a pool of forked
# processes renders them; each child only tokenizes (no torch threads, no device), and the result does
# not depend on how many there are.
RENDER_ROWS_PER_WORKER = 512  # below this many rows a split renders in this process: a fork costs more


def render_workers(rows: int) -> int:
    """Processes that render a split of `rows` rows: this machine's cores, at most one per
    RENDER_ROWS_PER_WORKER rows; 1 (no pool) where fork is not available."""
    if "fork" not in multiprocessing.get_all_start_methods():
        return 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(cores, rows // RENDER_ROWS_PER_WORKER))


_pool_job: tuple | None = None  # (tok, limit, path): set in the parent before the fork, read by the children


def _pool_init() -> None:
    torch.set_num_threads(1)  # a forked child must not enter the parent's OpenMP pool


def _render_one(row: dict) -> tuple[list[int], list[bool], int, list[bool]]:
    tok, limit, path = _pool_job
    ids, mask, left_out = fitted(tok, row, limit, path)
    return ids, mask, left_out, answer_loop_flags(ids, mask)


def render_rows(tok, rows: list[dict], limit: int, path: Path, workers: int | None = None, desc: str = "render",
                quiet: bool = False):
    """(ids, loss mask, turns left out, loop flags) of every row, in order: `fitted` and
    `answer_loop_flags`, in `workers` forked processes (None = `render_workers`), with a progress bar."""
    global _pool_job
    workers = render_workers(len(rows)) if workers is None else workers
    _pool_job = (tok, limit, path)
    bar = dict(total=len(rows), desc=desc, unit="row", mininterval=2.0, disable=quiet)
    try:
        if workers <= 1:
            return [_render_one(r) for r in tqdm(rows, **bar)]
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # the Rust tokenizer's threads do not survive a fork
        try:  # a worker killed (out of memory) stops the stage with BrokenProcessPool, never a hang
            with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork"), initializer=_pool_init) as pool:
                return list(tqdm(pool.map(_render_one, rows, chunksize=64), **bar))
        except OSError as e:  # no room for more processes here (a container's limit): this process renders them
            print(f"extract: rendering in this process ({e})")
            return [_render_one(r) for r in tqdm(rows, **bar)]
    finally:
        _pool_job = None


def save_atomic(tensors: dict, path: Path, metadata: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata=metadata)
    canonicalize_safetensors_file(tmp)  # the same bytes on every recompute
    tmp.replace(path)  # atomic: a file is either complete or absent


def sample_plan(lengths: list[int], n: int, shard_tokens: int) -> list[list[int]]:
    """Online mode: the shard plan of the split's first `n` rows (file order, so the sample is
    as mixed as the split; the plan's length sort would keep only the shortest rows)."""
    first = list(range(min(n, len(lengths))))
    return [[first[i] for i in shard] for shard in extract.plan_shards([lengths[i] for i in first], shard_tokens)]


def main(synth: Path, out: Path) -> None:
    # of train, only train.features is read; of export, only export.sglang_version (as dvc.yaml lists them)
    params = load_params(["target", "capture", "extract", "train", "export"])
    target_params, extract_params, mode = params.target, params.extract, params.train.features
    synth_manifest = read_verified(synth)  # every answer file as synthesize wrote it, before any compute
    device = resolve_device(target_params.device)
    rank, world = parallel.setup_distributed(torch.device(device).type)
    device = parallel.local_device(device)
    layout = parallel.rank_layout(world, extract_params.tp_size, rank)
    engine = open_engine(target_params, extract_params, device, layout, layer_ids=ids_for_physical,
                         max_tokens=extract_params.batch_size * extract_params.max_length)  # one forward's rows
    tok = engine.tokenizer
    info = target_info(engine.config, target_params)
    # Refuse a layer spec the SGLang release that will serve the draft cannot capture, before any compute.
    physical = physical_from_spec(params.capture.layers, info["architecture"], info["num_layers"])
    validate_capture(info["architecture"], info["num_layers"], physical, params.export.sglang_version)
    info["physical_layers"] = physical  # their one record among the manifests; each shard's header has them too
    inputs = {"synth": synth_manifest["config_hash"], "target": target_fingerprint(target_params)}
    manifest = build_manifest("extract", hashed_params(params), inputs, __file__)
    config_hash = manifest["config_hash"]
    dtype = torch_dtype(extract_params.dtype, "extract.dtype")
    limit = min(extract_params.max_length, info["max_position_embeddings"] or extract_params.max_length)
    meta = {
        "config_hash": config_hash,
        "target_model": target_params.model,
        "target_revision": str(target_params.revision),
        "architecture": info["architecture"],
        "num_layers": str(info["num_layers"]),
        "hidden_size": str(info["hidden_size"]),
        "vocab_size": str(info["vocab_size"]),
        "physical_layers": json.dumps(physical),
        "dtype": extract_params.dtype,
        "chat_template_sha256": chat_template_hash(tok),
        "tokenizer_sha256": tokenizer_hash(tok),
        "max_length": str(limit),
    }
    out.mkdir(parents=True, exist_ok=True)
    t0, tokens_done, bytes_written, counts = time.time(), 0, 0, {}
    for split in ("train", "eval"):
        rows = read_rows(synth / f"{split}.jsonl")
        subset = {}
        if split == "train":
            rows, subset = train_subset(rows, extract_params.train_conversations, extract_params.train_turns, layout.writes)
        rendered, dropped = [], []  # dropped: later turns left out of each conversation cut to fit
        loop_tokens = answer_tokens = 0
        for ids, mask, left_out, looped in render_rows(tok, rows, limit, synth / f"{split}.jsonl", desc=f"render {split}",
                                                      quiet=not layout.writes):
            loop_tokens, answer_tokens = loop_tokens + sum(looped), answer_tokens + sum(mask)
            if split == "train" and extract_params.loop_tokens == "skip":
                mask = [m and not f for m, f in zip(mask, looped)]
            rendered.append((ids, mask))
            dropped.append(left_out)
        lengths = [len(ids) for ids, _ in rendered]
        plan = extract.plan_shards(lengths, extract_params.shard_tokens)
        (out / split).mkdir(exist_ok=True)
        record = out / split / extract.TOKENS_FILE
        if mode == "online":
            # Every row's tokens, in the order the offline shards hold them (so online training
            # sees the same sequence i); the states themselves only for a sample.
            order = [i for shard in plan for i in shard]
            if rank == 0:
                save_atomic(extract.tokens_record([rendered[i] for i in order]), record,
                            {**meta, "row_ids": json.dumps([rows[i]["id"] for i in order])})
            plan = sample_plan(lengths, extract_params.online_sample_sequences, extract_params.shard_tokens)
        elif rank == 0:
            record.unlink(missing_ok=True)  # of an earlier online run
        if rank == 0:
            for old in (out / split).glob("shard-*.safetensors"):  # shards of an older plan
                if int(old.stem.split("-")[1]) >= len(plan):
                    old.unlink()
        counts[split] = {"rows": len(rows), "shards": len(plan), "tokens": sum(lengths), "answer_tokens": answer_tokens,
                         "loop_tokens": loop_tokens, "loop_share": round(loop_tokens / max(1, answer_tokens), 4), **subset}
        if split == "train" and extract_params.loop_tokens == "skip":
            counts[split]["loop_tokens_learned"] = 0  # extract.loop_tokens skip: off the loss
        if any(dropped):  # conversations longer than extract.max_length: their first turns kept
            counts[split] |= {"conversations_cut": sum(n > 0 for n in dropped), "turns_cut": sum(dropped)}
        if mode == "online":
            counts[split] |= {"sample_rows": sum(len(s) for s in plan), "sample_tokens": sum(lengths[i] for s in plan for i in s)}
            if len(rows) < extract_params.online_sample_sequences and rank == 0:  # said, and recorded in counts: no silent clamp
                print(f"extract: warning: extract.online_sample_sequences {extract_params.online_sample_sequences} is more than "
                      f"the {len(rows)} rows of {split}: the sample is all {len(rows)} of them")
        # Every rank of a TP group runs every forward of its share; only the group's first rank writes.
        mine = [(s, idx) for s, idx in enumerate(plan) if s % layout.dp_size == layout.dp_rank]
        bar = tqdm(mine, desc=f"extract {split}" + (f" (rank {rank} of {world})" if world > 1 else ""), unit="shard",
                   position=rank, disable=not layout.writes)
        # Judged once, before any forward: the ranks of a TP group must all run the same forwards, and
        # a shard their writer finishes during this loop must not look done to the others.
        done = {s for s, _ in mine if shard_is_done(out / split / f"shard-{s:05d}.safetensors", config_hash)}
        for s, idx in bar:
            path = out / split / f"shard-{s:05d}.safetensors"
            if s in done:
                continue
            tensors = extract.extract_shard(engine, [rendered[i] for i in idx], physical, extract_params.batch_size, dtype, device)
            if not layout.writes:
                continue
            save_atomic(tensors, path, {**meta, "row_ids": json.dumps([rows[i]["id"] for i in idx])})
            tokens_done += len(tensors["input_ids"])
            bytes_written += path.stat().st_size
            bar.set_postfix(tok_s=f"{tokens_done / (time.time() - t0):.0f}")
    tokens_done, bytes_written = (int(x) for x in parallel.all_sum([tokens_done, bytes_written], device, world))
    seconds = time.time() - t0  # after the sum: the slowest process's time
    if rank == 0:  # one manifest, once every process has written its shards
        per_token = bytes_written / tokens_done if tokens_done else None
        manifest["info"] = {
            "mode": mode,  # online: the shards are a sample; TOKENS_FILE lists every row (standardize reads this)
            "target": info,
            "chat_template_sha256": meta["chat_template_sha256"],
            "tokenizer_sha256": meta["tokenizer_sha256"],
            "counts": counts,
            "seconds": round(seconds, 2),
            "tokens_per_s": round(tokens_done / seconds, 1) if tokens_done else None,
            "bytes_per_token": round(per_token, 1) if per_token else None,
            "device": device if world == 1 else f"{torch.device(device).type} x {world} processes",
            "engine": extract_params.engine,  # what ran the target: the states carry its kernels' rounding
            "tp_size": extract_params.tp_size,
            "dtype": extract_params.dtype,
            "files": output_files(out),  # per shard bytes + tokens: standardize names the one missing or cut
        }
        write_manifest(out, manifest)
        what = "sample " if mode == "online" else ""
        if tokens_done:
            print(f"extract: {tokens_done} {what}tokens in {seconds:.1f}s ({tokens_done / seconds:.0f} tok/s), "
                  f"{per_token:.0f} bytes/token, physical layers {physical} -> {out}")
        else:
            print(f"extract: all {what}shards already present for config {config_hash[:12]} -> {out}")
        loops = ", ".join(f"{c['loop_share']:.1%} of {split}" for split, c in counts.items())
        print(f"extract: loop tokens (an 8-gram repeated within one answer): {loops} answer tokens"
              + ("; the train split's are off the loss (extract.loop_tokens skip)" if extract_params.loop_tokens == "skip" else ""))
        if mode == "online":
            sampled = ", ".join(f"{c['sample_rows']} of {c['rows']} {split}" for split, c in counts.items())
            print(f"extract: train.features online: tokens of every row in {out}/<split>/{extract.TOKENS_FILE}, "
                  f"hidden states of a sample only (the first rows: {sampled})")
    engine.close()
    parallel.finish(world)

if __name__ == "__main__":
    run_stage_cli(main, __doc__, synth="data/synth", out="data/hidden")
