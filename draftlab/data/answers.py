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
