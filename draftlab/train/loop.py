"""Training the EAGLE-3 draft: the loop, resumable and data-parallel.

The objective of one step is draftlab.train.objective's (TTT), the eval figures
draftlab.train.evaluate's, and checkpoints draftlab.train.checkpoint's.

Reproducibility: the batches of epoch e are a function of (seed, e) and the sequence lengths
(draftlab.train.batches: `batch_size` random sequences padded apart, or the same shuffle packed
end to end into rows within `batch_tokens`); a checkpoint holds weights, optimizer state and the
position in that list, so a resumed run replays exactly the batches an uninterrupted run would
have seen. Data parallel (torchrun): every optimizer step takes the same sequences, split across
processes (batch[rank::world], or rows[rank::world] when packed); the loss is normalized by the
global token count so the gradient equals the single-process one, whatever each process's share
holds.
"""
from __future__ import annotations

import io
import math
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from tqdm import tqdm

from draftlab import parallel
from draftlab.errors import UserError
from draftlab.features.dataset import FeatureDataset, draft_to_target
from draftlab.fsutil import atomic_write_bytes
from draftlab.train.batches import epoch_batches, packed_batches, packed_padding_share, packed_slots, padding_share
from draftlab.train.checkpoint import resume
from draftlab.train.draft import DraftConfig, Eagle3Draft
from draftlab.train.evaluate import evaluate
from draftlab.train.objective import TTT, labels_dtype, step_token_counts, target_labels

# ---------------------------------------------------------------------------------------------
# Processes and devices


def resolve_device(name: str) -> torch.device:
    """train.device -> this process's device (under torchrun: its GPU, its share of the cores)."""
    return torch.device(parallel.local_device(parallel.resolve_device(name, "train.device")))


def attention_kernel(setting: str, device: torch.device) -> str:
    """train.attention -> TTTCache's kernel: auto is flex on CUDA (compiled FlexAttention), eager elsewhere."""
    if setting == "flex" and device.type != "cuda":
        raise UserError(f"params.yaml: train.attention flex needs a CUDA device (FlexAttention computes no gradients on "
                        f"{device.type}); set train.attention to auto or eager")
    if setting == "auto":
        return "flex" if device.type == "cuda" else "eager"
    return setting


def use_autocast(setting: str, device: torch.device) -> bool:
    """bf16 autocast: on CUDA unless disabled; never on CPU (bf16 matmuls are slow there)."""
    if setting == "bfloat16" and device.type != "cuda":
        raise UserError("train.autocast is 'bfloat16' but training runs on the CPU; use 'auto' or 'none'")
    return device.type == "cuda" and setting in ("auto", "bfloat16")


# ---------------------------------------------------------------------------------------------
# The loop


def new_optimizer(params, lr: float, weight_decay: float, device: torch.device) -> torch.optim.Optimizer:
    """AdamW; fused on CUDA (an 8B draft's clip + update on an H200: 10.3 ms unfused, 5.6 ms fused)."""
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=(0.9, 0.95), fused=device.type == "cuda")


def lr_at(step: int, total: int, lr: float, warmup_ratio: float, min_lr_ratio: float) -> float:
    """Linear warmup, then cosine decay to lr * min_lr_ratio at the last step."""
    warmup = max(1, int(total * warmup_ratio)) if warmup_ratio > 0 else 0
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return lr * (min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


def epoch_plans(train_ds, tp, world: int) -> list[list[list[int]]]:
    """The sequence indices of every optimizer step of every epoch (draftlab.train.batches): a
    function of the seed, the epoch and the lengths, the same in every process."""
    n = len(train_ds)
    if tp.batch_tokens is None:
        if tp.batch_size % world:
            raise UserError(f"train.batch_size {tp.batch_size} must be a multiple of the number of processes ({world})")
        if n < tp.batch_size:
            raise UserError(f"params.yaml: train.batch_size {tp.batch_size} is more than the {n} sequences of the train "
                            f"split; set train.batch_size to {n} or less, or synthesize more prompts")
        return [epoch_batches(n, tp.batch_size, tp.seed, e) for e in range(tp.epochs)]
    if n < world:
        raise UserError(f"the train split has {n} sequences, fewer than the {world} processes; synthesize more prompts")
    lengths = [train_ds.length(i) for i in range(n)]
    longest = max(lengths)
    if tp.batch_tokens < world * longest:
        raise UserError(f"params.yaml: train.batch_tokens {tp.batch_tokens} cannot hold one sequence of {longest} tokens "
                        f"(the longest, after train.max_length) per process ({world}); set train.batch_tokens to at least "
                        f"{world * longest}")
    # Rows as wide as the longest sequence (train.max_length once any sequence reaches it): any
    # sequence fits a row, and no budget goes to width no sequence can use.
    return [packed_batches(lengths, longest, tp.batch_tokens // longest, tp.seed, e, world) for e in range(tp.epochs)]


def refill_state_cache(train_ds, steps: list, packed: bool, device, world: int, rank: int) -> None:
    """A resumed run with a state cache (draftlab.features.online.StateCache) starts with it empty:
    the states the steps before it kept are computed again, batch by batch as those steps made
    them (each sequence in the step it first appeared in), so that later epochs read what the
    uninterrupted run read, to the bit. Only the steps holding a sequence the cache keeps and has
    not yet are made again: a partial cache never keeps the others, and their states are computed
    when a step needs them."""
    cache = getattr(train_ds, "cache", None)
    if cache is None or not steps:
        return
    if rank == 0:
        print(f"state cache: the target computes again the states the {len(steps)} steps before the checkpoint kept", flush=True)
    for plan in steps:
        mine = plan[rank::world]
        if all(cache.has(i) or not cache.keeps(i) for i in ([i for row in mine for i in row] if packed else mine)):
            continue
        train_ds.packed_batch(mine, device) if packed else train_ds.batch(mine, device)


def held_states(splits) -> int:
    """Bytes the state caches of `splits` hold on the training device (draftlab.features.online.StateCache's
    device tier; 0: none, as for stored states): what giving them back frees there. The host tier
    is not counted: a step short of the device's memory gains nothing from it. Here by duck typing:
    the stages that import this module (export, check) must not depend on the target's code that
    draftlab.features.online imports."""
    return sum(ds.cache.device_nbytes() for ds in splits if getattr(ds, "cache", None) is not None)


def give_back_states(splits, held: int, device, rank: int) -> None:
    """A step that ran out of memory beside the state caches' `held` bytes on the device: those are
    given back, and the target computes their sequences on every batch from here (as train.state_cache
    off), rather than the run failing. A host tier stays: it takes none of the device's memory."""
    for ds in splits:
        if getattr(ds, "cache", None) is not None:
            ds.cache.drop_device()
            if not ds.cache.keep:
                ds.cache = None
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if rank == 0:
        print(f"warning: a training step ran out of memory beside the state cache ({held / 2**30:.1f} GiB on the device): "
              "those states are dropped and the target computes them on every batch from here"
              + (" (the states in host memory stay)" if any(getattr(ds, "cache", None) is not None for ds in splits) else "")
              + "; set train.state_cache: off to start without it", flush=True)


def fit(
    draft: Eagle3Draft,
    head: torch.Tensor,
    train_ds: FeatureDataset,
    eval_ds: FeatureDataset,
    tp,
    resume_path: str | Path,
    run_key: str,
    device: torch.device,
    rank: int = 0,
    world: int = 1,
    stop_after_steps: int | None = None,
    on_step=None,
    meter=None,
    identity: dict | None = None,
    across_code: bool = False,
    notes: dict | None = None,
) -> list[dict]:
    """Train `draft` in place with TrainParams `tp`; returns the per-epoch history.

    Resumes from `resume_path` when it holds a checkpoint of the same `run_key` (the stage's
    config hash); a checkpoint of any other run is ignored. `stop_after_steps` stops early as an
    interruption would (tests). `on_step(step, global_loss, seconds)` is called after every
    optimizer step (benchmarks/data_parallel.py records the loss curve with it). `meter`
    (draftlab.train.flops.Meter) counts each step's tokens, padding and FLOPs against its time.
    `identity` (the stage manifest's params, inputs, code and packages) is saved with each checkpoint,
    so that one of another configuration names what differs. Such a checkpoint is kept beside, as
    `<name>.<its key>.pt`, and found again there when its configuration runs again; `across_code`
    resumes from one whose params and inputs are this run's, only the code or packages changed, and
    records that in `notes["resumed_across_code"]`.
    """
    plans = epoch_plans(train_ds, tp, world)
    packed = tp.batch_tokens is not None  # a plan's step is then a list of rows, not of sequences
    lengths = [train_ds.length(i) for i in range(len(train_ds))]  # after train.max_length
    autocast = use_autocast(tp.autocast, device)
    head = head.to(device)
    draft.to(device).train()
    if tp.compile:  # in place: the parameter names, so checkpoints and the export, stay the eager ones
        draft.midlayer.compile(dynamic=True)
    ttt = TTT(draft, tp.ttt_steps, tp.ttt_decay, attention_kernel(tp.attention, device), device.type == "cuda",
              compile_loss=tp.compile)
    model = nn.parallel.DistributedDataParallel(ttt, broadcast_buffers=False) if world > 1 else ttt
    params = [p for p in draft.parameters() if p.requires_grad]
    opt = new_optimizer(params, tp.lr, tp.weight_decay, device)
    epoch_steps = [len(p) for p in plans]  # equal under batch_size; under batch_tokens each epoch packs its own
    total = sum(epoch_steps)

    step, epoch0, batch0, history = 0, 0, 0, []
    running = [0.0, 0]  # train loss sum and steps of the current epoch (checkpointed: resume must not change it)
    resume_path = Path(resume_path)
    if resume_path.exists() and not resume_path.is_file():  # not ours to discard: it may hold anything
        raise UserError(f"{resume_path} is not a file, so no checkpoint can be written there; move or delete it")
    state, opt = resume(resume_path, run_key, draft, opt, lambda: new_optimizer(params, tp.lr, tp.weight_decay, device), device,
                        epoch_steps, identity, across_code, rank, world)
    if state is not None:
        step, epoch0, batch0, history, running, counters, other = state
        if meter is not None:
            meter.resume(counters, step)
        if other is not None and notes is not None:
            notes["resumed_across_code"] = {"from_step": step, "differences": other}
        if rank == 0:
            print(f"resuming from {resume_path} at step {step} (epoch {epoch0 + 1}, batch {batch0})"
                  + (f", across a change of {'; '.join(other)} (DRAFTLAB_TRAIN_RESUME=across-code)" if other else ""))
        before = [plans[e][b] for e in range(epoch0 + 1) for b in range(len(plans[e]) if e < epoch0 else batch0)]
        refill_state_cache(train_ds, before, packed, device, world, rank)

    def save(epoch, batch):
        if rank == 0:
            buf = io.BytesIO()
            state = {"run_key": run_key, "step": step, "epoch": epoch, "batch": batch, "history": history, "running": running,
                     "model": draft.state_dict(), "optim": opt.state_dict()}
            if meter is not None:
                state["meter"] = meter.state_dict()
            if identity is not None:
                state["identity"] = identity
            torch.save(state, buf)
            atomic_write_bytes(resume_path, buf.getvalue())
        if world > 1:
            dist.barrier()

    bar = tqdm(total=total, initial=step, disable=rank != 0, desc="train", unit="step", dynamic_ncols=True)
    # A step's loss is read back from the GPU (a wait for everything queued) only once the next step is
    # queued behind it: the host makes the next batch while the GPU still runs this step's backward
    # and optimizer, instead of the GPU waiting for the host at every step. A step's seconds: from the
    # read of the step before to its own read (the first: from its start), so they add up to the wall
    # time of the steps. Every step is read before a checkpoint, an evaluation and a stop; the first step
    # after any of them (and a run's first: torch.compile's) is read at once, so its seconds are its own.
    pending: dict | None = None  # the step queued but not read yet
    mark: float | None = None  # when the last step was read (None: none since a checkpoint or an evaluation)

    def read(p: dict) -> None:
        nonlocal running, mark
        loss_value = p["loss"].item()  # read from the GPU once: every use below shares this copy
        now = time.perf_counter()
        seconds, mark = now - (p["t0"] if mark is None else mark), now
        running = [running[0] + loss_value, running[1] + 1]
        if meter is not None:  # after the .item() above: the counts are ready, no extra wait
            meter.step(p["lengths"], p["counts"].tolist(), seconds, world, p["slots"], target_ran=p["target_ran"],
                       target_lengths=p["target_lengths"])
        if on_step is not None:
            on_step(p["step"], loss_value, seconds)
        if rank == 0 and p["step"] == 1:  # its one-off costs: torch.compile, the first kernels' tuning, the target's first forward
            tqdm.write(f"train: the first step took {seconds:.1f} s"
                       + (" (torch.compile of the draft's layer and loss included)" if tp.compile else ""))
        bar.update(1)
        bar.set_postfix(epoch=p["epoch"] + 1, loss=f"{loss_value:.3f}", tok_s=f"{p['tokens'] / seconds:.0f}")

    for epoch in range(epoch0, tp.epochs):
        batches = plans[epoch]
        for b in range(batch0 if epoch == epoch0 else 0, len(batches)):
            t0 = time.perf_counter()

            def forward_backward():  # the step up to its gradients; run again once if the state cache is dropped
                mine = batches[b][rank::world]
                batch = train_ds.packed_batch(mine, device) if packed else train_ds.batch(mine, device)
                if b + 1 < len(batches) and hasattr(train_ds, "prefetch"):  # stored states: read the next batch during this step
                    ahead = batches[b + 1][rank::world]
                    train_ds.prefetch([i for row in ahead for i in row] if packed else ahead, device)
                labels = target_labels(batch["final_hidden"], head, draft.d2t, dtype=labels_dtype(autocast))
                counts = step_token_counts(batch, tp.ttt_steps, world)
                for group in opt.param_groups:
                    group["lr"] = lr_at(step, total, tp.lr, tp.warmup_ratio, tp.min_lr_ratio)
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
                    loss, _ = model(batch, labels, counts, world)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                return batch, counts, loss

            try:
                done = forward_backward()
            except torch.OutOfMemoryError:
                held = held_states((train_ds, eval_ds))
                if not held:
                    raise
                done = None  # retried below, once the failed step's tensors are freed with its traceback
            if done is None:
                give_back_states((train_ds, eval_ds), held, device, rank)
                done = forward_backward()
            batch, counts, loss = done
            if tp.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(params, tp.grad_clip)
            opt.step()
            step += 1
            global_loss = loss.detach() / world  # each process holds its share of the global loss
            if world > 1:
                dist.all_reduce(global_loss)
            alone = mark is None  # the first step since the start, a checkpoint or an evaluation: read at once, timed alone
            if pending is not None:
                read(pending)
            pending = {"step": step, "epoch": epoch, "loss": global_loss, "counts": counts, "t0": t0,
                       "tokens": int(batch["input_ids"].numel()) * world}
            if meter is not None:  # what the meter counts of this step, taken now: the dataset's record is the last batch's
                seqs = [i for row in batches[b] for i in row] if packed else batches[b]
                # a partial state cache (one process): the target ran on some of the step's sequences only
                ran = getattr(train_ds, "target_lengths", None) if getattr(train_ds, "cache", None) is not None else None
                pending |= {"lengths": [lengths[i] for i in seqs], "slots": packed_slots(batches[b], lengths, world) if packed else None,
                            "target_ran": getattr(train_ds, "target_ran", True), "target_lengths": ran}
            checkpoint = tp.checkpoint_every > 0 and step % tp.checkpoint_every == 0
            stop = stop_after_steps is not None and step >= stop_after_steps
            if alone or checkpoint or stop or b + 1 == len(batches):
                read(pending)
                pending = None
            if checkpoint:
                save(epoch, b + 1)
                mark = None  # the checkpoint's write is not a step's time
            if stop:
                bar.close()
                return history
        mark = None
        eval_started = time.perf_counter()
        metrics = evaluate(ttt, eval_ds, head, max(1, tp.batch_size // world), device, autocast, rank, world,
                           None if tp.batch_tokens is None else max(1, tp.batch_tokens // world))
        eval_s = time.perf_counter() - eval_started
        if meter is not None:
            meter.evaluated(epoch + 1, eval_s)
        share = packed_padding_share(batches, lengths, world) if packed else padding_share(batches, lengths, world)
        history.append({"epoch": epoch + 1, "step": step, "train_loss": running[0] / max(1, running[1]),
                        "train_padding_share": share,
                        **{f"eval_{k}": v for k, v in metrics.items()}})
        running = [0.0, 0]
        if rank == 0:
            tqdm.write(f"epoch {epoch + 1}: eval loss {metrics['loss']:.4f}, accept {[round(a, 3) for a in metrics['accept']]}, tau_pred {metrics['tau_pred']:.3f} "
                       f"({eval_s:.1f} s)")
        save(epoch + 1, 0)
    bar.close()
    return history


def init_draft(cfg: DraftConfig, embed: torch.Tensor, head: torch.Tensor, d2t: torch.Tensor, t2d: torch.Tensor, seed: int) -> Eagle3Draft:
    """A fresh draft: seeded random layer weights; lm_head starts as the target's rows of the
    draft vocab (the draft's normed state aims at the target's final state), norms at 1."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        draft = Eagle3Draft(cfg, embed_weight=embed.float())
    draft.set_vocab(d2t, t2d)
    with torch.no_grad():
        draft.lm_head.weight.copy_(head.float()[draft_to_target(d2t)])
    return draft
