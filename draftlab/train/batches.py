"""Which sequences make each optimizer step of an epoch: a fixed count, or a token budget.

Both plans are functions of (seed, epoch) and the sequence lengths only, so a resumed run replays
the batches of an uninterrupted one, and every process of a data-parallel run computes the same
list (each takes `batch[rank::world]` of every step).

- `epoch_batches` (train.batch_tokens null): `batch_size` sequences drawn at random, padded to
  the longest. Full batches only: the last n % batch_size sequences of the shuffle wait for the
  next epoch.
- `token_batches` (train.batch_tokens set): sequences of similar length, at most `batch_tokens`
  padded tokens (sequences x longest) per step, every sequence exactly once per epoch. The shuffle
  of the epoch is cut into chunks of about CHUNK_BATCHES budgets (equal sequence counts); each
  chunk is sorted by length and cut greedily by the budget (the part batch a chunk leaves over
  joins the next chunk); the batches are then shuffled, so long and short steps alternate at random through the epoch.
"""
from __future__ import annotations

import torch

CHUNK_BATCHES = 128  # budgets per sorted chunk: larger pads less, smaller mixes more. 60k chat-like lengths
# (20-1600, log-uniform) at 32k tokens: padding 16% at 8, 5.6% at 32, 1.5% at 128, 0.3% sorted whole


def _order(n: int, seed: int, epoch: int) -> list[int]:
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n, generator=g).tolist()


def epoch_batches(n: int, batch_size: int, seed: int, epoch: int) -> list[list[int]]:
    """Sequence indices of every optimizer step of `epoch` (full batches only): a shuffle seeded
    by (seed, epoch). Not bucketed by length: on the embedded default that cost more accuracy
    per epoch than it saved in padding (lengths follow the task family)."""
    order = _order(n, seed, epoch)
    return [order[i : i + batch_size] for i in range(0, n - batch_size + 1, batch_size)]


def token_batches(lengths: list[int], batch_tokens: int, seed: int, epoch: int, min_sequences: int = 1) -> list[list[int]]:
    """Sequence indices of every optimizer step of `epoch` under a budget of `batch_tokens`
    padded tokens (len(batch) x its longest length); every index exactly once.

    min_sequences: the fewest sequences of a step (the number of processes: each takes at least
    one). A batch closes only when the next sequence would break the budget, so with
    batch_tokens >= min_sequences x the longest length every batch but the epoch's last has
    enough; a last batch with fewer joins the one before it (the only step that may pass the
    budget, by less than min_sequences sequences).
    """
    order = _order(len(lengths), seed, epoch)
    # Chunks of equal sequence counts, about CHUNK_BATCHES budgets each: no small last chunk,
    # whose few sequences would spread over every length and pad much.
    chunks = max(1, round(sum(lengths) / (CHUNK_BATCHES * batch_tokens)))
    bounds = [len(order) * c // chunks for c in range(chunks + 1)]
    batches: list[list[int]] = []
    pending: list[int] = []  # the not yet full batch a chunk leaves over: sorted into the next chunk
    for a, b in zip(bounds[:-1], bounds[1:]):
        chunk = sorted(pending + order[a:b], key=lambda i: (-lengths[i], i))  # longest first; ties by index
        full, pending = _cut(chunk, lengths, batch_tokens)
        batches += full
    if pending:
        batches.append(pending)
    if len(batches) > 1 and len(batches[-1]) < min_sequences:
        batches[-2] += batches.pop()
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch + 500_009)  # another stream than the order's
    return [batches[j] for j in torch.randperm(len(batches), generator=g).tolist()]


def _cut(chunk: list[int], lengths: list[int], budget: int) -> tuple[list[list[int]], list[int]]:
    """Cut a chunk sorted longest first into batches of at most `budget` padded tokens; the
    last, not yet full, batch is returned apart (it joins the next chunk)."""
    out, cur = [], []
    for i in chunk:
        longest = lengths[cur[0]] if cur else lengths[i]
        if cur and (len(cur) + 1) * longest > budget:
            out.append(cur)
            cur = []
        cur.append(i)
    return out, cur


def padding(batches: list[list[int]], lengths: list[int], world: int = 1) -> tuple[int, int]:
    """(real tokens, padded slots) of an epoch's batches: each process pads its share
    batch[rank::world] to that share's longest sequence."""
    real = slots = 0
    for batch in batches:
        for rank in range(world):
            mine = [lengths[i] for i in batch[rank::world]]
            real += sum(mine)
            slots += len(mine) * max(mine, default=0)
    return real, slots


def padding_share(batches: list[list[int]], lengths: list[int], world: int = 1) -> float:
    """Padded tokens / all tokens (real + padded) the steps of an epoch compute on."""
    real, slots = padding(batches, lengths, world)
    return (slots - real) / slots if slots else 0.0
