#!/usr/bin/env python3
"""RESULTS/families.json (the family runs) -> OUT/README.md (one table) and OUT/results.json.

    python tools/families_report.py runs/families/families.json [runs/families-0.5.17/families.json ...] reports/families

Several families.json (one per SGLang release) make one table, release by release.

One row per (family, layout): the architecture SGLang served, the SGLang release, the layout
(capture.layers), the ids the export wrote, the physical layers SGLang fed the draft (live
parity: the target layer each slot matches best), the largest relative error, the verdict and
where the row comes from: "measured on real SGLang X" (a server ran), "read from source" (the
project's rules refused the layout before any run), or the reference server (a dry run). A refused
layout that was served anyway (the probe) says what the server did. The last column is what the
project's rules say of the layout now (draftlab.sglang.layers), so a row measured before a rule
changed shows both.
results.json is the same rows without log paths, for tests and diffs.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from draftlab.errors import UserError  # noqa: E402
from draftlab.sglang import layers as rules  # noqa: E402

ORDER = ["llama", "qwen3", "qwen3-moe", "deepseek-v3", "kimi-k2.5", "gpt-oss"]
KEEP = ("family", "label", "architecture", "sglang_version", "layout", "status", "trained_physical", "ids_exported",
        "predicted_physical", "fed_physical", "rel_err", "max_rel_err", "every_layer_compared", "findings", "verdict",
        "source", "refusal", "error_lines", "best_rel_err", "probe", "probe_source", "rules_now", "seconds")
NUM_LAYERS = 8  # tools/micro_targets.py


def _list(x) -> str:
    return "-" if x is None else "[" + ", ".join(str(v) for v in x) + "]"


def _err(x) -> str:
    return "-" if x is None else f"{x:.4f}"


def refusal_now(row: dict, num_layers: int = NUM_LAYERS) -> str | None:
    """Why the project's rules refuse the row's layout on its release today, or None."""
    try:
        physical = rules.physical_from_spec(row["layout"], row["architecture"], num_layers)
        rules.validate_capture(row["architecture"], num_layers, physical, row["sglang_version"])
    except UserError as e:
        return str(e)
    return None


def rules_now(row: dict) -> str:
    """What the project's rules say of the row's layout on its release today."""
    if refusal_now(row) is None:
        return "allowed"
    failure = rules.embedding_failure(row["architecture"], row["sglang_version"])
    return {"crash": "refused (crashes)", "alias": "refused (feeds an overwritten state)"}.get(failure, "refused")


def rows_in_order(record: dict) -> list[dict]:
    rows = list(record.get("rows", {}).values())
    rank = {f: i for i, f in enumerate(ORDER)}
    return sorted(rows, key=lambda r: (rank.get(r.get("family"), len(ORDER)), str(r.get("sglang_version")), str(r.get("layout"))))


def merged(records: list[dict]) -> dict:
    """One record of several runs (one per release): rows keyed by release and row id."""
    rows = {f"{r.get('sglang_version')} {rid}": {**r, "rules_now": rules_now(r)} for rec in records for rid, r in rec.get("rows", {}).items()}
    return {"versions": [rec.get("versions") or {} for rec in records], "settings": records[0].get("settings") or {}, "rows": rows}


def markdown(record: dict) -> str:
    s = record.get("settings") or {}
    versions = "; ".join(f"SGLang {v.get('sglang', 'not installed')}, torch {v.get('torch', '?')}, transformers "
                         f"{v.get('transformers', '?')}" for v in record.get("versions") or [])
    gpu = next((v.get("gpu") for v in record.get("versions") or [] if v.get("gpu")), None)
    lines = ["# Which layers SGLang feeds an EAGLE-3 draft, per target family", "",
             "Made by `tools/families_report.py` from the `families.json` of the family runs. Targets are "
             f"tiny random models ({s.get('num_layers', '?')} decoder layers, `tools/micro_targets.py`); layer numbers "
             "as in `capture.layers` (k = output of decoder layer k, `embedding` = physical 0); physical index i = "
             "transformers' `hidden_states[i]`.", "",
             f"Versions: {versions}; GPU {gpu or 'none'}. Servers: `{' '.join(s.get('server_args', []))}` "
             f"({s.get('cuda_graphs', '')}). Parity tolerance {s.get('rtol', '?')}.", "",
             "| family | architecture | SGLang | layout | ids exported | physical layers fed | parity max rel err | verdict | source | the rules now |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows_in_order(record):
        probe = r.get("probe") or {}
        ids = r.get("ids_exported") if r.get("ids_exported") is not None else probe.get("ids")
        source = r.get("probe_source") or r.get("source", "-")
        if r.get("status") == "skipped":  # the run's deadline came first
            source = "not run (out of time)"
        lines.append(f"| {r.get('label', r.get('family'))} | {r.get('architecture')} | {r.get('sglang_version', '-')} | "
                     f"{_list(r.get('layout'))} | {_list(ids)} | {_list(r.get('fed_physical'))} | "
                     f"{_err(r.get('max_rel_err'))} | {r.get('verdict', r.get('status'))} | {source} | {r.get('rules_now', rules_now(r))} |")
    notes = [r for r in rows_in_order(record) if r.get("refusal") or r.get("error_lines") or r.get("rules_now", "").startswith("refused")]
    if notes:
        lines += ["", "## Refusals and server errors", "",
                  "What the server said (its first error lines), then why the project's rules refuse the layout today "
                  "(`draftlab.sglang.layers`, the message extract stops with).", ""]
        for r in notes:
            probe, said = r.get("probe") or {}, []
            if probe.get("outcome"):
                said.append(f"served anyway with ids {_list(probe.get('ids'))} (the draft of {probe.get('draft_from')}): "
                            f"{' / '.join(probe.get('error_lines') or [probe['outcome']])}")
            elif r.get("error_lines"):
                said.append("server: " + " / ".join(r["error_lines"]))
            elif r.get("status") == "measured":
                said.append(f"served: {r.get('verdict')}")
            if refusal_now(r):
                said.append(f"rules: {refusal_now(r)}")
            lines.append(f"- {r['family']} {_list(r.get('layout'))} on SGLang {r.get('sglang_version')}: " + "; ".join(said))
    trained = [r for r in rows_in_order(record) if r.get("fed_physical") is not None]
    if trained:
        lines += ["", "Trained physical layers per measured row (what the draft was trained on): " +
                  "; ".join(f"{r['family']} {_list(r['layout'])} -> {_list(r.get('trained_physical'))}" for r in trained) + "."]
    lines += ["", "## Remaking a row", "",
              "One command per family and layout (after `python tools/micro_targets.py FAMILY models/families`):",
              "`draftlab exp run configs/sglang.yaml -S target.model=models/families/FAMILY -S 'capture.layers=[1,3,5]' "
              "-S train.epochs=1 -S target.device=cpu`.",
              "Its reports/check.json has the live parity of the row (the physical layer each slot matches).",
              "The table itself is `python tools/families_report.py run/families.json reports/families` on the",
              "committed run, whose probe rows (a refused layout served once anyway) the profile does not repeat."]
    return "\n".join(lines) + "\n"


def results(record: dict) -> dict:
    return {"versions": record.get("versions"), "settings": record.get("settings"),
            "rows": [{k: r[k] for k in KEEP if k in r} for r in rows_in_order(record)]}


def write(families_json: Path | list[Path], out: Path) -> None:
    paths = families_json if isinstance(families_json, list) else [families_json]
    record = merged([json.loads(Path(p).read_text()) for p in paths])
    out.mkdir(parents=True, exist_ok=True)
    for name, text in (("README.md", markdown(record)), ("results.json", json.dumps(results(record), indent=1) + "\n")):
        tmp = out / f".{name}.tmp"
        tmp.write_text(text)
        os.replace(tmp, out / name)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("families_json", type=Path, nargs="+", help="one or more families.json (one per SGLang release)")
    ap.add_argument("out", type=Path)
    args = ap.parse_args(argv)
    for path in args.families_json:
        if not path.exists():
            print(f"error: {path}: no such file (the family runs write it)", file=sys.stderr)
            return 2
    write(args.families_json, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
