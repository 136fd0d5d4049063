"""The answer row: what synthesize writes (data/synth/<split>.jsonl) and later stages read.

A row holds the regenerated conversation (`messages`), `finish_reasons` (one per answer the target
wrote, in order: "stop" when the target ended it, "length" when it was cut at synth.max_new_tokens),
`finish_reason` (the last answer's) and `completion_tokens`; a conversation adds `turns` (answers
written) and `stopped` when it ended before its last user turn.

Rows written before `finish_reasons` existed hold only `finish_reason`: back then a cut answer always
ended its conversation, so every earlier answer had stopped; finish_reasons() gives those rows the
same list a new row would hold. A row that records neither (answers written by hand) is taken as
ended by the target throughout, as extraction always took it.
"""
from __future__ import annotations

import hashlib

FINISH_REASONS = ("stop", "length")


def finish_reasons(row: dict) -> list[str]:
    """How each answer the target wrote ended, in order (as many as the row's `turns`)."""
    if "finish_reasons" in row:
        return list(row["finish_reasons"])
    return ["stop"] * (row.get("turns", 1) - 1) + [row.get("finish_reason", "stop")]


def finish_reasons_problem(row: dict) -> str | None:
    """Why a row's `finish_reasons` (when present) is not one reason per answer, the last its
    `finish_reason`, or None."""
    if "finish_reasons" not in row:
        return None  # a row written before the key existed
    reasons = row["finish_reasons"]
    turns = row.get("turns", 1)
    if not (isinstance(reasons, list) and len(reasons) == turns and all(r in FINISH_REASONS for r in reasons)):
        return f"'finish_reasons' must list \"stop\" or \"length\" for each of its {turns} answer(s), got {reasons!r}"
    if reasons[-1] != row.get("finish_reason"):
        return f"'finish_reasons' ends with {reasons[-1]!r} but 'finish_reason' (the last answer's) is {row.get('finish_reason')!r}"
    return None


def sample_conversations(rows: list[dict], n: int | None) -> list[dict]:
    """The n rows whose ids hash lowest (sha256), in the rows' own order; every row for n None or at
    least their number. The sample does not depend on the order the rows were written in (synthesize
    writes them as they finish, short conversations first), and a smaller sample lies inside every
    larger one: the points of a data curve add data to each other."""
    if n is None or n >= len(rows):
        return rows
    ranked = sorted(range(len(rows)), key=lambda i: hashlib.sha256(str(rows[i]["id"]).encode()).hexdigest())
    keep = set(ranked[:n])
    return [r for i, r in enumerate(rows) if i in keep]


def answers_kept(row: dict, n: int | None) -> dict:
    """The row cut after the n-th answer the target wrote (its later user turns and answers off), its
    turns and finish reasons to match; the row itself for n None or at least its answers. Answers that
    came with the prompt (before the target's) are kept, as they are context."""
    turns = row.get("turns", 1)
    if n is None or n >= turns:
        return row
    answers = [i for i, m in enumerate(row["messages"]) if m["role"] == "assistant"]
    written = answers[len(answers) - turns:]  # the last `turns` answers are the target's
    reasons = finish_reasons(row)[:n]
    return {**row, "messages": row["messages"][:written[n - 1] + 1], "turns": n, "finish_reasons": reasons,
            "finish_reason": reasons[-1]}
