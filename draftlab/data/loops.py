"""Loops in greedy answers: the tokens that close an n-gram already seen earlier in the same answer.

A small model decoding greedily often falls into a cycle, and a draft predicts a cycle almost
perfectly. So loop tokens inflate a draft's teacher-forced acceptance wherever training answers
run into loops that serving's answers do not reach (reports/real-workload/README.md). The rule:
token t is a loop token iff the n tokens ending at t (n = 8) already ended at an earlier position
of the same answer. The first pass through a repeated passage is not flagged; its repeats are,
from their n-th token on.
"""
from __future__ import annotations

import numpy as np

LOOP_NGRAM = 8  # tokens: long enough that ordinary phrasing rarely repeats it within one answer
POSITION_BANDS = (0, 64, 128, 256, 512)  # where each band of answer positions starts (tokens since the answer's first)


def band_names() -> list[str]:
    ends = [f"-{b - 1}" for b in POSITION_BANDS[1:]] + ["+"]
    return [f"{a}{e}" for a, e in zip(POSITION_BANDS, ends)]


def in_band_order(groups: dict) -> list[str]:
    """`groups`' names with the position bands from the answer's start on (a JSON file may hold them
    sorted as text), any other name where it stands."""
    names = band_names()
    bands = iter(sorted((k for k in groups if k in names), key=names.index))
    return [next(bands) if k in names else k for k in groups]


def band_of(position: int) -> int:
    """The index into POSITION_BANDS of an answer position."""
    return sum(position >= b for b in POSITION_BANDS) - 1


def loop_flags(ids, n: int = LOOP_NGRAM) -> list[bool]:
    """Per token of one answer: does the n-gram ending there repeat one ending earlier?"""
    ids = np.asarray(ids, dtype=np.int64)
    flags = np.zeros(len(ids), dtype=bool)
    if len(ids) <= n:  # a repeat needs at least n + 1 tokens
        return flags.tolist()
    grams = np.lib.stride_tricks.sliding_window_view(ids, n)  # [len - n + 1, n]: the gram ending at t = row t - n + 1
    _, first, inverse = np.unique(grams, axis=0, return_index=True, return_inverse=True)
    flags[n - 1:] = first[inverse.reshape(-1)] != np.arange(len(grams))
    return flags.tolist()


def spans(mask) -> list[tuple[int, int]]:
    """[start, end) of each run of True in a loss mask: one per learned answer (with its end token)."""
    out, start = [], None
    for i, m in enumerate(list(mask) + [False]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            out.append((start, i))
            start = None
    return out


def answer_loop_flags(ids: list[int], mask: list[bool], n: int = LOOP_NGRAM) -> list[bool]:
    """Per token of a rendered conversation: a loop token of the answer it belongs to (False off
    the loss mask). Each answer is its own: a passage that repeats an earlier turn is not a loop."""
    flags = [False] * len(ids)
    for a, b in spans(mask):
        flags[a:b] = loop_flags(ids[a:b], n)
    return flags
