"""Which sequences make each optimizer step of an epoch: a fixed count, or packed rows.

Both plans are functions of (seed, epoch) and the sequence lengths only, so a resumed run replays
the batches of an uninterrupted one, and every process of a data-parallel run computes the same
list.

- `epoch_batches` (train.batch_tokens null): `batch_size` sequences drawn at random, padded to
  the longest. Full batches only: the last n % batch_size sequences of the shuffle wait for the
  next epoch. Each process takes `batch[rank::world]` of every step.
- `packed_batches` (train.batch_tokens set): the same shuffle, laid end to end into rows of
  `width` tokens, batch_tokens // width rows per step, every sequence exactly once per epoch and
  never split across rows; rows are padded only at their end. A step is a run of the shuffle, so
  steps stay random mixes of lengths (sorting by length cost tau on the embedded default:
  3.25 against 3.57). Each process takes `rows[rank::world]` of every step: equal row counts (to
  one row), equal row widths, so equal work.
"""
from __future__ import annotations

import torch

LOOKAHEAD = 32  # sequences a packed step may take ahead of their place to fill its rows: 4000 chat-like
# lengths (20-512) in 4 rows of 512: padding 10.8% at 0, 4.0% at 8, 1.3% at 32


def _order(n: int, seed: int, epoch: int) -> list[int]:
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n, generator=g).tolist()


def epoch_batches(n: int, batch_size: int, seed: int, epoch: int) -> list[list[int]]:
    """Sequence indices of every optimizer step of `epoch` (full batches only): a shuffle seeded
    by (seed, epoch). Not bucketed by length: on the embedded default that cost more accuracy
    per epoch than it saved in padding (lengths follow the task family)."""
    order = _order(n, seed, epoch)
    return [order[i : i + batch_size] for i in range(0, n - batch_size + 1, batch_size)]


def packed_batches(lengths: list[int], width: int, rows: int, seed: int, epoch: int, min_rows: int = 1) -> list[list[list[int]]]:
    """Rows (lists of sequence indices, laid end to end) of every optimizer step of `epoch`.

    Sequences are taken in the order of `epoch_batches`' shuffle. Each goes into the first row
    of the current step with room for it (a row holds at most `width` tokens), or opens a row.
    When it fits nowhere and the step has `rows` rows, the step's rest is filled from the next
    LOOKAHEAD sequences of the shuffle that fit, and the step closes: a sequence moves up at
    most LOOKAHEAD places, so steps stay random mixes. A last step of fewer than `min_rows`
    rows (the number of processes: each takes at least one) joins the step before it. Where
    steps give each process several rows, a last step that would give a process one row takes
    rows from the step before it (`at_least_two_rows`).
    """
    if any(n > width for n in lengths):
        raise ValueError(f"a sequence of {max(lengths)} tokens cannot fit a row of {width}")
    order = _order(len(lengths), seed, epoch)
    steps: list[list[list[int]]] = []
    step: list[list[int]] = []
    room: list[int] = []  # tokens left in each row of the open step
    used: set[int] = set()  # sequences a step took ahead of their place
    for k, i in enumerate(order):
        if i in used:
            continue
        r = _fits(room, lengths[i])
        if r is None and len(step) == rows:
            for j in order[k + 1 : k + 1 + LOOKAHEAD]:
                rj = None if j in used else _fits(room, lengths[j])
                if rj is not None:
                    step[rj].append(j)
                    room[rj] -= lengths[j]
                    used.add(j)
            steps.append(step)
            step, room = [], []
        if r is None:
            step.append([])
            room.append(width)
            r = len(step) - 1
        step[r].append(i)
        room[r] -= lengths[i]
    if step:
        steps.append(step)
    if len(steps) > 1 and len(steps[-1]) < min_rows:
        last = steps.pop()  # popped first: `steps[-2] += steps.pop()` would store into the wrong step
        steps[-1] += last
    return at_least_two_rows(steps, rows, max(1, min_rows))


def at_least_two_rows(steps: list[list[list[int]]], rows: int, world: int) -> list[list[list[int]]]:
    """The last step given at least two rows per process, rows moved to it from the step before,
    where steps hold at least 4 rows per process (so that step keeps at least two each).

    Why: torch.compile(dynamic=True) still specializes a size of 1, so a step of one row per
    process compiles the draft's layer and loss once more, forward and backward: the last step of
    the first epoch took 19 s instead of 0.28 on one H100 (reports/real-workload/README.md).
    """
    short = 2 * world - len(steps[-1])
    if len(steps) > 1 and rows >= 4 * world and short > 0:
        moved = steps[-2][len(steps[-2]) - short :]
        steps[-2] = steps[-2][: len(steps[-2]) - short]
        steps[-1] = moved + steps[-1]
    return steps


def _fits(room: list[int], n: int) -> int | None:
    """The first row with room for n tokens, or None."""
    return next((r for r, free in enumerate(room) if free >= n), None)


def packed_slots(step: list[list[int]], lengths: list[int], world: int = 1) -> int:
    """Token slots one packed step computes on: each process's rows (rows[rank::world]) are as
    wide as its fullest (draftlab.features.dataset.pack)."""
    slots = 0
    for rank in range(world):
        mine = step[rank::world]
        slots += len(mine) * max((sum(lengths[i] for i in row) for row in mine), default=0)
    return slots


def packed_padding_share(steps: list[list[list[int]]], lengths: list[int], world: int = 1) -> float:
    """Row padding / all row slots of an epoch's packed steps."""
    slots = sum(packed_slots(step, lengths, world) for step in steps)
    real = sum(lengths[i] for step in steps for row in step for i in row)
    return (slots - real) / slots if slots else 0.0


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
