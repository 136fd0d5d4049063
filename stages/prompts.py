"""Stage prompts: build the prompt set and split it into train/eval by content hash.

    python -m stages.prompts --out data/prompts --metrics reports/prompts.json
Reads params section: prompts.
"""
from __future__ import annotations

import sys
from pathlib import Path

from draftlab import jsonl, prompts
from draftlab.cli import run_stage_cli
from draftlab.errors import UserError
from draftlab.fsutil import atomic_write_json
from draftlab.manifest import build_manifest, dir_hash, with_lineage, write_manifest
from draftlab.params import as_dict, load_params

MAX_LISTED = 20  # bad rows printed in full; the rest are counted


def main(out: Path, metrics: Path) -> None:
    params = load_params(["prompts"])
    pp = params.prompts
    if not 0.0 < pp.eval_fraction < 1.0:
        raise UserError(f"params.yaml: prompts.eval_fraction must be between 0 and 1, got {pp.eval_fraction}")
    if pp.source == "builtin":
        ps = prompts.builtin_prompts(pp.num_prompts, pp.seed)
        inputs = {"source": "builtin"}
    else:
        ps = prompts.read_prompt_file(pp.source)
        inputs = {"source": pp.source, "source_sha256": dir_hash(pp.source)}
    if ps.bad:
        listed = "\n  ".join(str(b) for b in ps.bad[:MAX_LISTED])
        more = f"\n  ... and {len(ps.bad) - MAX_LISTED} more" if len(ps.bad) > MAX_LISTED else ""
        if pp.on_bad_row == "error":
            raise UserError(
                f"{len(ps.bad)} bad prompt row(s):\n  {listed}{more}\n"
                "fix them, or set prompts.on_bad_row: skip to drop them (they are then counted in the manifest)"
            )
        print(f"warning: skipped {len(ps.bad)} bad prompt row(s):\n  {listed}{more}", file=sys.stderr)
    if not ps.rows:
        raise UserError(f"prompts.source {pp.source}: no valid prompts")
    train, evals = prompts.split(ps.rows, pp.eval_fraction)
    if not train or not evals:
        raise UserError(
            f"prompts: split gave {len(train)} train and {len(evals)} eval prompts; "
            "need at least one of each (add prompts or change prompts.eval_fraction)"
        )
    out.mkdir(parents=True, exist_ok=True)
    for name, rows in (("train", train), ("eval", evals)):
        jsonl.write(out / f"{name}.jsonl", rows)
    counts = {"train": len(train), "eval": len(evals), "skipped_bad_rows": len(ps.bad), "duplicates": ps.duplicates}
    info = {**counts, "bad_rows": [str(b) for b in ps.bad[:MAX_LISTED]]}
    if ps.families is not None:  # built-in: the mix drawn, and the families that ran out (the others filled in for them)
        info |= {"families": ps.families, "families_ran_out": ps.ran_out}
        counts["families_ran_out"] = ps.ran_out
        for family in ps.ran_out:
            print(f"warning: prompts.num_prompts {pp.num_prompts}: the built-in family {family!r} has only "
                  f"{ps.families.get(family, 0)} distinct held-out prompts; the other families filled in for it "
                  f"(the mix is in {out / 'manifest.json'}, info.families)", file=sys.stderr)
    # The outputs' content hash is an input too: it makes the hash follow the data exactly.
    manifest = build_manifest("prompts", as_dict(params), {**inputs, "outputs_sha256": dir_hash(out)}, __file__, info)
    write_manifest(out, manifest)
    atomic_write_json(metrics, with_lineage(counts, manifest, {"source": pp.source, "eval_fraction": pp.eval_fraction}))
    print(f"prompts: {len(train)} train, {len(evals)} eval, {len(ps.bad)} bad rows skipped, {ps.duplicates} duplicates -> {out}")


if __name__ == "__main__":
    run_stage_cli(main, __doc__, out="data/prompts", metrics="reports/prompts.json")
