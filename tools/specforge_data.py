#!/usr/bin/env python3
"""Our regenerated conversations as SpecForge's conversation data, split for split and id for id:
the peer trainer's own data path (its rendering, loss mask and capture) on exactly our answers.

    python tools/specforge_data.py --synth data/synth --out runs/specforge-data
    PYTHONPATH=runs/specforge-data/site specforge train --config online.yaml \\
        data.train_data_path=runs/specforge-data/train.jsonl data.chat_template=smollm2-chatml

SpecForge 0.2.0 reads raw conversations (`data.train_data_path`) with `datasets.load_dataset("json")`
and `build_eagle3_dataset` (data/preprocessing.py), one row per conversation:
  {"id": ..., "conversations": [{"role": "system" | "user" | "assistant", "content": ...}, ...]}
It drops "id", and passes every other column to the tokenizer's chat template as a template
variable, so a row here carries these two fields only. Its GeneralParser (data/parse.py) cuts a
conversation at the first role out of order, so such a row is refused here rather than shortened there.
Written here:
  OUT/train.jsonl, OUT/eval.jsonl   the rows of SYNTH/train.jsonl and SYNTH/eval.jsonl, in their order
  OUT/manifest.json                 per split: rows, answers, source file and its sha256; the template
                                    name and the `data.train_only_last_turn` that learns our answers
  OUT/site/sitecustomize.py         tools/specforge_templates.py: registers `smollm2-chatml` in every
                                    process started with OUT/site on PYTHONPATH
SpecForge 0.2.0 evaluates only offline features (`data.eval_data_path` is refused), so eval.jsonl is
for its offline capture or for benchmarking the drafts on the same held-out conversations.
"""
from __future__ import annotations

import argparse
import hashlib
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from draftlab import jsonl  # noqa: E402
from draftlab.data.answers import finish_reasons, finish_reasons_problem  # noqa: E402
from draftlab.errors import UserError, shown  # noqa: E402
from draftlab.fsutil import atomic_write_json, atomic_write_text  # noqa: E402

SPLITS = ("train", "eval")
TEMPLATE = "smollm2-chatml"
TEMPLATES_FILE = Path(__file__).resolve().with_name("specforge_templates.py")
FIX = "re-run the synthesize stage (dvc repro -f synthesize)"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--synth", required=True, help="the synthesize stage's output (data/synth: train.jsonl, eval.jsonl)")
    ap.add_argument("--out", required=True)
    return ap.parse_args(argv)


def row_problem(row) -> str | None:
    """Why an answer row is not a conversation SpecForge renders whole, or None: an optional system
    message, then user and assistant turns in turn, ending with an answer; `turns` and
    `finish_reasons` as extraction reads them (stages/extract.py, fitted)."""
    if not isinstance(row, dict):
        return f"a JSON {type(row).__name__}, not an answer row (an object with id and messages)"
    if not isinstance(row.get("id"), str) or not row["id"]:
        return "no 'id' (a non-empty string)"
    msgs = row.get("messages")
    if not (isinstance(msgs, list) and msgs and all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                                     and isinstance(m.get("content"), str) for m in msgs)):
        return f"row {row['id']}: 'messages' must be a non-empty list of {{role, content}} objects (strings)"
    roles = [m["role"] for m in msgs]
    talk = roles[1:] if roles[0] == "system" else roles
    expected = ["user", "assistant"] * (len(talk) // 2)
    if not talk or talk != expected:
        return (f"row {row['id']}: roles {shown(roles, 120)}: SpecForge needs an optional system message, then user "
                "and assistant in turn, ending with the assistant's answer (it cuts a conversation at the first role out of order)")
    turns = row.get("turns", 1)
    if isinstance(turns, bool) or not isinstance(turns, int) or not 1 <= turns <= len(talk) // 2:
        return f"row {row['id']}: 'turns' must be an integer from 1 to its {len(talk) // 2} answer(s), got {shown(turns)}"
    problem = finish_reasons_problem(row)
    return f"row {row['id']}: {problem}" if problem else None


def read_split(path: Path) -> list[dict]:
    """The answer rows of one split; a row that cannot be exported is a UserError naming file:line."""
    if not path.is_file():
        raise UserError(f"{path} not found; run the synthesize stage first (dvc repro synthesize)")
    rows, seen = [], {}
    for n, row in jsonl.read(path, FIX):
        problem = row_problem(row)
        if problem:
            raise UserError(f"{path}:{n}: {problem}; {FIX}")
        if row["id"] in seen:
            raise UserError(f"{path}:{n}: row id {row['id']} repeats line {seen[row['id']]}; ids key the comparison "
                            f"with SpecForge's draft, so each must be unique; {FIX}")
        seen[row["id"]] = n
        rows.append(row)
    return rows


def specforge_row(row: dict) -> dict:
    """The conversation as SpecForge reads it: the id, and role and content of each message."""
    return {"id": row["id"], "conversations": [{"role": m["role"], "content": m["content"]} for m in row["messages"]]}


def answer_counts(rows: list[dict]) -> dict:
    """Answers in the rows: all, the ones the target wrote (the last `turns` of each row; the ones
    we learn), and of those the ones cut at synth.max_new_tokens."""
    answers = sum(sum(m["role"] == "assistant" for m in r["messages"]) for r in rows)
    written = sum(r.get("turns", 1) for r in rows)
    cut = sum(reason == "length" for r in rows for reason in finish_reasons(r))
    return {"answers": answers, "answers_by_target": written, "answers_cut": cut}


def last_turn_only(rows: list[dict]) -> bool | None:
    """SpecForge's `data.train_only_last_turn` that learns the answers we learn: False when the target
    wrote every answer (SpecForge learns them all), True when it wrote only each row's last one
    (earlier answers came with the prompt), None when the rows mix both (no setting matches)."""
    every = all(r.get("turns", 1) == sum(m["role"] == "assistant" for m in r["messages"]) for r in rows)
    last = all(r.get("turns", 1) == 1 for r in rows)
    return False if every else True if last else None


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def main(argv=None) -> dict:
    args = parse_args(argv)
    synth, out = Path(args.synth), Path(args.out)
    if out.resolve() == synth.resolve():
        raise UserError(f"--out {out} is the synthesize stage's folder; the export would overwrite its "
                        "train.jsonl and eval.jsonl: give another folder")
    rows = {split: read_split(synth / f"{split}.jsonl") for split in SPLITS}
    splits = {}
    for split, part in rows.items():
        source = synth / f"{split}.jsonl"
        jsonl.write(out / f"{split}.jsonl", (specforge_row(r) for r in part))
        splits[split] = {"rows": len(part), **answer_counts(part), "source": str(source), "source_sha256": sha256(source),
                         "sha256": sha256(out / f"{split}.jsonl")}
    # One setting for the run: SpecForge trains on train.jsonl only.
    only_last = last_turn_only(rows["train"])
    atomic_write_text(out / "site" / "sitecustomize.py", TEMPLATES_FILE.read_text())
    manifest = {"chat_template": TEMPLATE, "train_only_last_turn": only_last, "splits": splits}
    atomic_write_json(out / "manifest.json", manifest)
    command = (f"PYTHONPATH={out / 'site'} specforge train --config YOUR_RUN.yaml data.train_data_path={out / 'train.jsonl'} "
               f"data.chat_template={TEMPLATE}")
    if only_last is None:
        note = ("\n  note: no data.train_only_last_turn learns just the target's answers here: some rows hold earlier "
                "answers that came with the prompt, others several of the target's")
    else:
        command, note = command + f" data.train_only_last_turn={str(only_last).lower()}", ""
    print(f"specforge_data: {splits['train']['rows']} train and {splits['eval']['rows']} eval conversations -> {out}\n"
          f"  {command}{note}")
    return manifest


if __name__ == "__main__":
    try:
        main()
    except UserError as e:
        sys.exit(f"specforge_data: {e}")
