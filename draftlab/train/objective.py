"""The training-time test (TTT) objective of the EAGLE-3 draft: one batch's loss and scores.

One optimizer step: a batch of sequences (features.py states the alignment), unrolled for
`ttt_steps` steps. Step 0 reads fc(aux states); step i > 0 reads the draft's own state from step
i-1 (what it will see when drafting for real) and attends as TTTCache describes. Step i's loss is
the cross-entropy against the target's distribution over the draft vocab (soft labels from the
target's lm_head on final_hidden), averaged over the tokens that count, weighted ttt_decay**i.

Packed batches carry position_ids and seq_ids (draftlab.features.dataset.pack): rope restarts
for every sequence, attention stays within it (TTTCache), and a row counts only while the
tokens it reads and predicts are of its own sequence, so a packed batch gives the loss sums and
gradients of its sequences run one at a time.
"""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import nn

from draftlab.features.dataset import draft_to_target
from draftlab.metrics import acceptance_counts
from draftlab.train.draft import Eagle3Draft, TTTCache


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
