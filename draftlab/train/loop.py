"""Training the EAGLE-3 draft with training-time test (TTT), resumable and data-parallel.

One optimizer step: a batch of sequences (features.py states the alignment), unrolled for
`ttt_steps` steps. Step 0 reads fc(aux states); step i > 0 reads the draft's own state from step
i-1 (what it will see when drafting for real) and attends as TTTCache describes. Step i's loss is
the cross-entropy against the target's distribution over the draft vocab (soft labels from the
target's lm_head on final_hidden), averaged over the tokens that count, weighted ttt_decay**i.

Reproducibility: the batches of epoch e are a function of (seed, e) and the sequence lengths
(draftlab.train.batches: `batch_size` random sequences padded apart, or the same shuffle packed
end to end into rows within `batch_tokens`); a checkpoint holds weights, optimizer state and the
position in that list, so a resumed run replays exactly the batches an uninterrupted run would
have seen. Data parallel (torchrun): every optimizer step takes the same sequences, split across
processes (batch[rank::world], or rows[rank::world] when packed); the loss is normalized by the
global token count so the gradient equals the single-process one, whatever each process's share
holds.

Packed batches carry position_ids and seq_ids (draftlab.features.dataset.pack): rope restarts
for every sequence, attention stays within it (TTTCache), and a row counts only while the
tokens it reads and predicts are of its own sequence, so a packed batch gives the loss sums and
gradients of its sequences run one at a time.
"""
from __future__ import annotations

import functools
import io
import math
import time
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file
from safetensors.torch import save as st_save
from torch import nn
from tqdm import tqdm

from draftlab.train.checkpoint import resume
from draftlab.train.batches import epoch_batches, packed_batches, packed_padding_share, packed_slots, padding_share  # noqa: F401 - epoch_batches: also loop.epoch_batches
from draftlab.train.draft import DraftConfig, Eagle3Draft, TTTCache
from draftlab.errors import UserError
from draftlab.features.dataset import FeatureDataset, collate, draft_to_target  # noqa: F401 - collate: also train.collate
from draftlab.fsutil import atomic_write_bytes, atomic_write_json, canonical_safetensors
from draftlab import parallel
from draftlab.data.loops import POSITION_BANDS, answer_loop_flags, band_names, spans
from draftlab.metrics import acceptance_counts, chain_tau, conditional_acceptance

WEIGHTS = "draft.safetensors"
CONFIG = "draft_config.json"


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
# Batches and labels


def shift(x: torch.Tensor, n: int, fill=0) -> torch.Tensor:
    """x[:, t + n] at position t (along dim 1), `fill` past the end."""
    out = torch.full_like(x, fill)
    if n < x.shape[1]:
        out[:, : x.shape[1] - n] = x[:, n:]
    return out


@torch.no_grad()
def target_labels(final_hidden: torch.Tensor, head: torch.Tensor, d2t: torch.Tensor, chunk: int = 4096,
                  dtype: torch.dtype = torch.float32):
    """The target's view of the next token at every position j (over token j+1).

    Returns (logits over the draft vocab [B, T, Vd] float32, top-1 target token id over the FULL
    vocab [B, T]). The top-1 is what greedy verification compares the draft's proposal with.
    dtype: of the projection onto the vocab. bf16 under autocast on GPUs: the serving target's
    own precision, and 13x faster than fp32 for an 8B head (41.8 -> 3.1 ms per 2048 rows on an
    H200, reports/perf/); the logits are returned in fp32 either way.
    """
    B, T, H = final_hidden.shape
    rows = final_hidden.reshape(-1, H).to(dtype)
    head = head.to(dtype)
    keep = draft_to_target(d2t)
    logits, top1 = [], []
    for a in range(0, rows.shape[0], chunk):
        full = rows[a : a + chunk] @ head.T
        logits.append(full[:, keep].float())
        top1.append(full.argmax(-1))
    return torch.cat(logits).view(B, T, -1), torch.cat(top1).view(B, T)


def labels_dtype(autocast: bool) -> torch.dtype:
    """The soft labels' projection runs in the precision the draft trains in (see target_labels)."""
    return torch.bfloat16 if autocast else torch.float32


# ---------------------------------------------------------------------------------------------
# The TTT objective


def soft_cross_entropy(logits: torch.Tensor, target_p: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
    """Per scored row r: -sum_v target_p[seen[r], v] * log_softmax(logits[r])_v, in float32.

    logits [N, Vd] (the draft's, bf16 under autocast), target_p [B*T, Vd] float32 (the target's
    distribution over the draft vocab), seen [N]: where each row's target view sits. Eager, this
    writes [N, Vd] float32 four times (the upcast, the gathered labels, log_softmax, the product)
    and keeps them for backward: 2 GB each at 32k rows and a 16k vocab, every TTT step.
    """
    return -(target_p[seen] * torch.log_softmax(logits.float(), dim=-1)).sum(-1)


@functools.cache
def compiled_soft_cross_entropy():
    """soft_cross_entropy under torch.compile (train.compile): the gather, upcast, log-softmax and
    row sum fuse into reductions that read the logits and labels without writing [N, Vd] copies.
    dynamic: N changes every step and batch. Made once per process."""
    return torch.compile(soft_cross_entropy, dynamic=True)


class TTT(nn.Module):
    """Loss and scores of one batch unrolled `steps` steps (a Module so DDP can wrap it)."""

    def __init__(self, draft: Eagle3Draft, steps: int, decay: float, kernel: str = "eager", compiled: bool = False,
                 compile_loss: bool = False):
        super().__init__()
        self.draft, self.steps, self.decay = draft, steps, decay
        self.kernel, self.compiled = kernel, compiled  # TTTCache's attention kernel (attention_kernel)
        self.compile_loss = compile_loss  # the soft cross-entropy under torch.compile (train.compile)

    def forward(self, batch, labels, token_counts, world: int = 1):
        """token_counts[i]: tokens that count at step i summed over all processes (the normalizer)."""
        draft = self.draft
        ids = batch["input_ids"]
        B, T = ids.shape
        target_logits, target_top1 = labels
        packed = batch.get("position_ids")  # packed rows: rope restarts for each sequence
        positions = torch.arange(T, device=ids.device).expand(B, T) if packed is None else packed
        # Row t at step i: embeds token t+1+i, predicts token t+2+i, scored iff it is an
        # assistant token (of t's own sequence, packed); the target's view of it is at position
        # t+1+i. Rope position t+i (of t's sequence).
        # The scored rows of every step as flat indices into [B*T], found once per batch: one
        # host sync here instead of several inside each step, so the GPU queue never drains.
        valid = scored_rows(batch, self.steps)  # [K, B*T]
        where = valid.nonzero()
        rows = where[:, 1].split(valid.sum(1).tolist())
        target_p = torch.softmax(target_logits.flatten(0, 1).float(), dim=-1)  # once, not once per step
        target_top1 = target_top1.flatten()
        cache = TTTCache(batch.get("seq_ids"), self.kernel, self.compiled)
        state = draft.project(batch["aux_hidden"])
        # Every row of step i sits at rope position t + i: one cos/sin table over 0..T+K-2, sliced
        # per step (packed: gathered at each row's position in its sequence).
        cos, sin = (x.to(state.dtype) for x in draft.rotary(torch.arange(T + self.steps - 1, device=ids.device)[None]))
        loss = torch.zeros((), device=ids.device)
        soft_ce = compiled_soft_cross_entropy() if self.compile_loss else soft_cross_entropy
        ce_sums = []
        correct = torch.zeros_like(valid)
        for i in range(self.steps):
            rope = (cos[:, i : i + T], sin[:, i : i + T]) if packed is None else (cos[0][packed + i], sin[0][packed + i])
            state = draft.step(shift(ids, 1 + i), state, positions + i, cache, rope=rope)
            r, seen = rows[i], rows[i] + 1 + i  # the rows that count, and where the target's view of each sits
            logits = draft.logits(state.flatten(0, 1)[r])  # only rows that count: [N_i, Vd]
            ce = soft_ce(logits, target_p, seen)
            loss = loss + self.decay**i * ce.sum() * world / token_counts[i].clamp(min=1)
            correct[i, r] = draft.to_target(logits.argmax(-1)) == target_top1[seen]
            ce_sums.append(ce.detach().sum())
        accepted, reached = acceptance_counts(correct, valid)
        self.scored = (valid, correct)  # [K, B*T] each: row t scored at step i, and its top-1 hit (evaluate splits them)
        stats = torch.stack([torch.stack(ce_sums), valid.sum(1).float(), (correct & valid).sum(1).float(), accepted.float(), reached.float()])
        return loss, stats  # stats [5, K]: ce sum, scored tokens, top-1 hits, accepted, reached


def scored_rows(batch: dict, steps: int) -> torch.Tensor:
    """[K, B*T] bool: row t counts at step i iff token t+2+i is an assistant token and, in a
    packed batch, of t's own sequence (so are the tokens t+1..t+1+i it reads: sequences are
    contiguous), so no row learns across a sequence's end."""
    loss_mask, seq = batch["loss_mask"], batch.get("seq_ids")
    valid = []
    for i in range(steps):
        v = shift(loss_mask, 2 + i, False)
        if seq is not None:
            v = v & (shift(seq, 2 + i, -2) == seq)
        valid.append(v.flatten())
    return torch.stack(valid)


def step_token_counts(batch: dict, steps: int, world: int) -> torch.Tensor:
    """Scored rows per TTT step, summed over processes: [K] float."""
    counts = scored_rows(batch, steps).sum(1).float()
    if world > 1:
        dist.all_reduce(counts)
    return counts


TURN_GROUPS = ("1", "2", "3+")  # an answer's turn in its conversation: the first, the second, any later one


def token_groups(batch: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per token [B, T]: a loop token of its answer (draftlab.data.loops), the band of its position
    in its answer (index into POSITION_BANDS), and its answer's turn in the row's conversation
    (0 for the first learned answer, 1 for the second, 2 for any later); -1 off the loss mask."""
    ids, mask = batch["input_ids"].tolist(), batch["loss_mask"].tolist()
    loop = torch.zeros(len(ids), len(ids[0]) if ids else 0, dtype=torch.bool)
    band = torch.full(loop.shape, -1, dtype=torch.long)
    turn = torch.full(loop.shape, -1, dtype=torch.long)
    starts = torch.tensor(POSITION_BANDS)
    for b, (row, m) in enumerate(zip(ids, mask)):
        loop[b] = torch.tensor(answer_loop_flags(row, m), dtype=torch.bool)
        for n, (a, e) in enumerate(spans(m)):
            band[b, a:e] = torch.bucketize(torch.arange(e - a), starts, right=True) - 1
            turn[b, a:e] = min(n, len(TURN_GROUPS) - 1)
    return loop, band, turn


def predicted_groups(batch: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`token_groups` of the token each row's first draft step predicts (row t predicts token t+2),
    flattened as TTT.scored's rows are."""
    return tuple(shift(g, 2, fill).flatten() for g, fill in zip(token_groups(batch), (False, -1, -1)))


def step1_groups(ttt: TTT, batch: dict, groups: tuple | None = None) -> torch.Tensor:
    """[2 + bands + turns, 2]: (scored, top-1 hits) at the first draft step of the batch `ttt` just
    ran, on loop tokens, other tokens, each position band, then each answer turn (TURN_GROUPS).
    The group is the predicted token's. groups: `predicted_groups(batch)`, when already made."""
    valid, correct = (x[0].cpu() for x in ttt.scored)
    loop, band, turn = groups if groups is not None else predicted_groups(batch)
    sels = ([loop, ~loop] + [band == k for k in range(len(POSITION_BANDS))]
            + [turn == k for k in range(len(TURN_GROUPS))])
    return torch.tensor([[float((valid & s).sum()), float((valid & correct & s).sum())] for s in sels], dtype=torch.float64)


def decoded_rounds(valid: torch.Tensor, correct: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
    """[K, 2] (rounds, tokens) of greedy chain decoding at depth 1..K, replayed over the eval answers.

    Row t's TTT steps are exactly a decoding round that starts after token t+1: step i embeds the
    token before it (in a round, the draft's own, equal to it while the chain holds) and predicts
    token t+2+i, a hit being the target's greedy choice. So a round at depth d starting at row t
    accepts its first run of hits, at most d, emits one token more (the target's), and the next
    round starts where it stopped. Decoding scores the rows rounds start at, which crowd where the
    draft misses; the teacher-forced a_i average every row, easy runs counted whole (tau_pred). The
    first row of an answer predicts its first token, which the prefill makes: rounds start after it.
    valid, correct: [K, N] bool (TTT.scored; rows of one answer contiguous). keep: [N] bool, the
    answers walked (those whose first row it marks); None = every one."""
    K = valid.shape[0]
    lead = (valid & correct).int().cumprod(0).sum(0).tolist()  # hits in a row from step 1, per row
    out = torch.zeros(K, 2, dtype=torch.float64)
    for a, e in spans(valid[0].tolist()):  # one answer each
        if keep is not None and not keep[a]:
            continue
        for d in range(1, K + 1):
            t, rounds, tokens = a + 1, 0, 0
            while t < e:
                step = min(lead[t], d) + 1
                rounds, tokens, t = rounds + 1, tokens + min(step, e - t), t + step
            out[d - 1] += torch.tensor([rounds, tokens], dtype=torch.float64)
    return out


def step1_breakdown(groups: torch.Tensor) -> dict:
    """Step-1 acceptance (the first draft token's top-1 hit rate) by kind of token and by position band."""
    def cell(scored, hits):
        return {"tokens": int(scored), "a_1": round(hits / scored, 4) if scored else None}
    rows = [cell(*g) for g in groups.tolist()]
    bands = 2 + len(POSITION_BANDS)
    return {"step1_by_kind": {"loop": rows[0], "other": rows[1]},
            "step1_by_position": dict(zip(band_names(), rows[2:bands])),
            "step1_by_turn": dict(zip(TURN_GROUPS, rows[bands:]))}


def summarize(stats: torch.Tensor, decay: float) -> dict:
    """Pooled stats [5, K] -> loss, per-position acceptance a_i, top-1 accuracy, predicted tau."""
    ce, scored, hits, accepted, reached = stats.tolist()
    K = len(ce)
    accept = conditional_acceptance(accepted, reached)
    per_step_loss = [c / s if s else 0.0 for c, s in zip(ce, scored)]
    return {
        "loss": sum(decay**i * per_step_loss[i] for i in range(K)),
        "loss_per_step": per_step_loss,
        "accept": accept,  # a_i, i = 1..K (index 0 = first draft token)
        "top1_acc": [h / s if s else 0.0 for h, s in zip(hits, scored)],
        "tau_pred": chain_tau(accept),
        "tau_by_steps": [chain_tau(accept[:n]) for n in range(1, K + 1)],
        "scored_tokens": int(scored[0]),
    }


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


@torch.no_grad()
def evaluate(ttt: TTT, dataset: FeatureDataset, head: torch.Tensor, batch_size: int, device, autocast: bool, rank: int = 0, world: int = 1,
             batch_tokens: int | None = None) -> dict:
    """Pooled stats of `dataset` (this process's share, rank::world), in batches of `batch_size`
    sequences, or of at most `batch_tokens` padded tokens when given; sums over tokens, so the
    batching changes nothing but float rounding."""
    draft = ttt.draft
    was_training = draft.training
    draft.eval()
    stats = torch.zeros(5, ttt.steps, device=device)
    groups = torch.zeros(2 + len(POSITION_BANDS) + len(TURN_GROUPS), 2, dtype=torch.float64)  # exact counts past 2**24 tokens
    rounds = torch.zeros(2, ttt.steps, 2, dtype=torch.float64)  # decoded_rounds, pooled: every answer, first answers
    mine = sorted(range(rank, len(dataset), world), key=dataset.length)  # similar lengths pad little
    for rows in eval_batches(mine, [dataset.length(i) for i in mine], batch_size, batch_tokens):
        batch = dataset.batch(rows, device)
        labels = target_labels(batch["final_hidden"], head, draft.d2t, dtype=labels_dtype(autocast))
        counts = step_token_counts(batch, ttt.steps, 1)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            _, s = ttt(batch, labels, counts)
        stats += s
        predicted = predicted_groups(batch)
        groups += step1_groups(ttt, batch, predicted)
        scored, first_turn = [x.cpu() for x in ttt.scored], predicted[2] == 0
        first = decoded_rounds(*scored, keep=first_turn)  # each answer walked once: first turns, then the rest
        rounds += torch.stack([first + decoded_rounds(*scored, keep=~first_turn), first])
    if world > 1:
        dist.all_reduce(stats)
        groups, rounds = groups.to(device), rounds.to(device)
        dist.all_reduce(groups)
        dist.all_reduce(rounds)
    draft.train(was_training)
    decoded, first = ([tok / n if n else 1.0 for n, tok in r] for r in rounds.cpu().tolist())
    # first: the first answer of each conversation alone, what a bench of first turns serves
    return {**summarize(stats.cpu(), ttt.decay), **step1_breakdown(groups.cpu()), "tau_decoded_by_steps": decoded,
            "tau_decoded_first_turns_by_steps": first}


def eval_batches(rows: list[int], lengths: list[int], batch_size: int, batch_tokens: int | None) -> list[list[int]]:
    """`rows` (sorted by length) cut into runs of `batch_size`, or of at most `batch_tokens` padded tokens.
    With batch_tokens, a last run of one row beside runs of several takes the longest row of the run
    before it where the two fit the budget: a batch of one row would make torch.compile (train.compile)
    build the no-grad graphs once more (it specializes a size of 1; draftlab.train.batches.at_least_two_rows)."""
    if batch_tokens is None:
        return [rows[a : a + batch_size] for a in range(0, len(rows), batch_size)]
    out, cur = [], []
    for i, n in zip(rows, lengths):  # ascending: the newest row is the batch's longest
        if cur and (len(cur) + 1) * n > batch_tokens:
            out.append(cur)
            cur = []
        cur.append(i)
    out += [cur] if cur else []
    if len(out) > 1 and len(out[-1]) == 1 and len(out[-2]) >= 3 and 2 * lengths[-1] <= batch_tokens:
        out[-1].insert(0, out[-2].pop())
    return out


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


# ---------------------------------------------------------------------------------------------
# The trained draft on disk (what export reads)


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


def save_draft(out_dir: str | Path, draft: Eagle3Draft) -> None:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(out_dir / WEIGHTS, canonical_safetensors(st_save({k: v.detach().cpu().contiguous() for k, v in draft.state_dict().items()})))
    atomic_write_json(out_dir / CONFIG, draft.config.to_dict())


def load_draft(out_dir: str | Path, embed: torch.Tensor | None = None) -> Eagle3Draft:
    """The trained draft written by save_draft (float32, CPU)."""
    import json

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
