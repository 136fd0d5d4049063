"""Stage prompts: build the prompt set and split it into train/eval by content hash.

    python -m stages.prompts --out data/prompts --metrics reports/prompts.json --self-prompts data/self-prompts
Reads params: the prompts section; target.model and target.revision (the tokenizer, for
prompts.min_prompt_tokens / max_prompt_tokens).

Order: read (a file's rows, ShareGPT's first human turns or with prompts.turns all every human turn,
or the built-in generator), drop bad rows (prompts.on_bad_row) and duplicates, filter by length in
target tokens (the first turn; a later turn over prompts.max_prompt_tokens ends its conversation),
take the seeded subset of prompts.num_prompts (a file; the built-in generator draws that many),
split by the content hash of each row's first turn. Then the prompts the target wrote itself (stage
self_prompts; none unless self_prompts.count is set) join the train split, after the same length
filter: once each, none that repeats a source row's opening, none that hashes into the eval share.
"""
from __future__ import annotations

import sys
from pathlib import Path

from draftlab import jsonl
from draftlab.data import prompts
from draftlab.cli import run_stage_cli
from draftlab.errors import UserError
from draftlab.fsutil import atomic_write_json
from draftlab.manifest import build_manifest, dir_hash, read_verified, with_lineage, write_manifest
from draftlab.params import as_dict, load_params
from draftlab.target.load import load_tokenizer

MAX_LISTED = 20  # bad rows printed in full; the rest are counted


def main(out: Path, metrics: Path, self_prompts: Path = Path("data/self-prompts")) -> None:
    params = load_params(["prompts", "target"])
    pp = params.prompts
    if not 0.0 < pp.eval_fraction < 1.0:
        raise UserError(f"params.yaml: prompts.eval_fraction must be between 0 and 1, got {pp.eval_fraction}")
    if pp.source == "builtin":
        if pp.num_prompts is None:
            raise UserError("params.yaml: prompts.num_prompts: the built-in generator needs a number (null means "
                            "'every prompt' for a prompt file only)")
        ps = prompts.builtin_prompts(pp.num_prompts, pp.seed)
        inputs = {"source": "builtin"}
    else:
        path = prompts.resolve_source(pp.source)
        ps = prompts.read_prompt_file(path, pp.turns, pp.leading_assistant)
        inputs = {"source": pp.source, "source_sha256": dir_hash(path)}
        if ps.truncated and ps.truncated["dropped_bytes"]:
            print(f"warning: {path.name} ends inside a record: read its {ps.truncated['records']:,} complete records, "
                  f"dropped the last {ps.truncated['dropped_bytes']:,} bytes", file=sys.stderr)
    if ps.bad:
        listed = "\n  ".join(str(b) for b in ps.bad[:MAX_LISTED])
        more = f"\n  ... and {len(ps.bad) - MAX_LISTED} more" if len(ps.bad) > MAX_LISTED else ""
        if pp.on_bad_row == "error":
            raise UserError(
                f"{len(ps.bad)} bad prompt row(s):\n  {listed}{more}\n"
                "fix them, or set prompts.on_bad_row: skip to drop them (they are then counted in the manifest)"
            )
        print(f"warning: skipped {len(ps.bad)} bad prompt row(s):\n  {listed}{more}", file=sys.stderr)
    if ps.skipped:
        print("prompts: left out by the ShareGPT rule: " + ", ".join(f"{n} {why}" for why, n in sorted(ps.skipped.items())),
              file=sys.stderr)
    if ps.opened_after_assistant:
        print(f"prompts: {ps.opened_after_assistant} conversations opened at their first human turn, their leading assistant "
              "turns dropped (prompts.leading_assistant drop)", file=sys.stderr)
    if not ps.rows:
        raise UserError(f"prompts.source {pp.source}: no valid prompts")
    rows, dropped, long_turns = ps.rows, {"too_short": 0, "too_long": 0}, None
    # The self_prompts stage's file (none where the stage never ran: this stage run on its own)
    own_upstream = read_verified(self_prompts) if self_prompts.exists() else None
    own = prompts.read_self_prompts(self_prompts) if own_upstream else []
    own_counts = {"read": len(own)}
    if pp.min_prompt_tokens is not None or pp.max_prompt_tokens is not None:
        tokenizer = load_tokenizer(params.target.model, params.target.revision)
        own, own_dropped = prompts.filter_length(own, tokenizer, pp.min_prompt_tokens, pp.max_prompt_tokens)
        own_counts |= own_dropped
        rows, dropped = prompts.filter_length(rows, tokenizer, pp.min_prompt_tokens, pp.max_prompt_tokens)
        if not rows:
            raise UserError(f"prompts: no prompt of {pp.source} is {pp.min_prompt_tokens}-{pp.max_prompt_tokens} target tokens "
                            f"long ({dropped['too_short']} shorter, {dropped['too_long']} longer); widen "
                            f"prompts.min_prompt_tokens / prompts.max_prompt_tokens")
        if pp.turns == "all":
            rows, long_turns = prompts.cut_long_turns(rows, tokenizer, pp.max_prompt_tokens)
    usable = len(rows)
    if pp.source != "builtin":
        if pp.num_prompts is not None and pp.num_prompts > usable:
            print(f"warning: prompts.num_prompts is {pp.num_prompts}, but {pp.source} has {usable} usable prompts: "
                  f"using all {usable} (the manifest records both)", file=sys.stderr)
        rows = prompts.seeded_subset(rows, pp.num_prompts, pp.seed)
    train, evals = prompts.split(rows, pp.eval_fraction)
    own, left_out = prompts.train_only(own, {prompts.opening_id(r) for r in rows}, pp.eval_fraction)
    own_counts |= left_out | {"used": len(own)}
    train += own
    if not train or not evals:
        raise UserError(
            f"prompts: split gave {len(train)} train and {len(evals)} eval prompts; "
            "need at least one of each (add prompts or change prompts.eval_fraction)"
        )
    out.mkdir(parents=True, exist_ok=True)
    for name, rows in (("train", train), ("eval", evals)):
        jsonl.write(out / f"{name}.jsonl", rows)
    counts = {"train": len(train), "eval": len(evals), "skipped_bad_rows": len(ps.bad), "duplicates": ps.duplicates,
              "read": len(ps.rows), "usable": usable, **dropped,
              "num_prompts_requested": pp.num_prompts, "used": len(train) + len(evals), "self_prompts_used": len(own)}
    if pp.turns == "all":  # rows are conversations: how many user turns each side holds, and what ended some early
        counts |= {"train_turns": sum(1 + len(r.get("next_turns", ())) for r in train),
                   "eval_turns": sum(1 + len(r.get("next_turns", ())) for r in evals),
                   "cut_at_long_turn": (long_turns or {}).get("cut_at_long_turn", 0),
                   "duplicates_after_cut": (long_turns or {}).get("duplicates", 0),
                   "cut_at_empty_turn": ps.cut.get("empty later human turn", 0)}
    info = {**counts, **ps.counts(), "bad_rows": [str(b) for b in ps.bad[:MAX_LISTED]], "self_prompts": own_counts}
    if ps.families is not None:  # built-in: the mix drawn, and the families that ran out (the others filled in for them)
        info |= {"families": ps.families, "families_ran_out": ps.ran_out}
        counts["families_ran_out"] = ps.ran_out
        for family in ps.ran_out:
            print(f"warning: prompts.num_prompts {pp.num_prompts}: the built-in family {family!r} has only "
                  f"{ps.families.get(family, 0)} distinct held-out prompts; the other families filled in for it "
                  f"(the mix is in {out / 'manifest.json'}, info.families)", file=sys.stderr)
    # The outputs' content hash is an input too: it makes the hash follow the data exactly.
    used = as_dict(params)
    used["target"] = {"model": params.target.model, "revision": params.target.revision}  # the keys dvc.yaml lists
    if own_upstream:
        inputs["self_prompts"] = own_upstream["config_hash"]
    manifest = build_manifest("prompts", used, {**inputs, "outputs_sha256": dir_hash(out)}, __file__, info)
    write_manifest(out, manifest)
    atomic_write_json(metrics, with_lineage(counts, manifest, {"source": pp.source, "eval_fraction": pp.eval_fraction}))
    length = f", {dropped['too_short']} too short, {dropped['too_long']} too long" if any(dropped.values()) else ""
    turns = f" ({counts['train_turns']} and {counts['eval_turns']} user turns)" if pp.turns == "all" else ""
    own_text = f" ({len(own)} of them written by the target itself)" if own else ""
    print(f"prompts: {len(train)} train{own_text}, {len(evals)} eval{turns}, {len(ps.bad)} bad rows skipped, {ps.duplicates} duplicates{length} -> {out}")


if __name__ == "__main__":
    run_stage_cli(main, __doc__, out="data/prompts", metrics="reports/prompts.json", self_prompts="data/self-prompts")
