#!/usr/bin/env python3
"""RESULTS/families.json (tools/families_h200.py) -> OUT/README.md (one table) and OUT/results.json.

    python tools/families_report.py runs/families/families.json reports/families

One row per (family, layout): the architecture SGLang served, the SGLang release, the layout
(capture.layers), the ids the export wrote, the physical layers SGLang fed the draft (live
parity: the target layer each slot matches best), the largest relative error, the verdict and
where the row comes from: "measured on real SGLang X" (a server ran), "read from source" (the
project's rules refused the layout before any run), or the reference server (a dry run).
results.json is the same rows without log paths, for tests and diffs.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ORDER = ["llama", "qwen3", "qwen3-moe", "deepseek-v3", "kimi-k2.5", "gpt-oss"]
KEEP = ("family", "label", "architecture", "sglang_version", "layout", "status", "trained_physical", "ids_exported",
        "predicted_physical", "fed_physical", "rel_err", "max_rel_err", "every_layer_compared", "findings", "verdict",
        "source", "refusal", "error_lines", "seconds")


def _list(x) -> str:
    return "-" if x is None else "[" + ", ".join(str(v) for v in x) + "]"


def _err(x) -> str:
    return "-" if x is None else f"{x:.4f}"


def rows_in_order(record: dict) -> list[dict]:
    rows = list(record.get("rows", {}).values())
    rank = {f: i for i, f in enumerate(ORDER)}
    return sorted(rows, key=lambda r: (rank.get(r.get("family"), len(ORDER)), str(r.get("layout"))))


def markdown(record: dict) -> str:
    v, s = record.get("versions") or {}, record.get("settings") or {}
    lines = ["# Which layers SGLang feeds an EAGLE-3 draft, per target family", "",
             "Made by `tools/families_report.py` from the `families.json` of `tools/families_h200.py`. Targets are "
             f"tiny random models ({s.get('num_layers', '?')} decoder layers, `tools/micro_targets.py`); layer numbers "
             "as in `capture.layers` (k = output of decoder layer k, `embedding` = physical 0); physical index i = "
             "transformers' `hidden_states[i]`.", "",
             f"Versions: SGLang {v.get('sglang', 'not installed')}, torch {v.get('torch', '?')}, transformers "
             f"{v.get('transformers', '?')}, GPU {v.get('gpu') or 'none'}. Servers: `{' '.join(s.get('server_args', []))}` "
             f"({s.get('cuda_graphs', '')}). Parity tolerance {s.get('rtol', '?')}.", "",
             "| family | architecture | SGLang | layout | ids exported | physical layers fed | parity max rel err | verdict | source |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows_in_order(record):
        lines.append(f"| {r.get('label', r.get('family'))} | {r.get('architecture')} | {r.get('sglang_version', '-')} | "
                     f"{_list(r.get('layout'))} | {_list(r.get('ids_exported'))} | {_list(r.get('fed_physical'))} | "
                     f"{_err(r.get('max_rel_err'))} | {r.get('verdict', r.get('status'))} | {r.get('source', '-')} |")
    notes = [r for r in rows_in_order(record) if r.get("refusal") or r.get("error_lines")]
    if notes:
        lines += ["", "## Refusals and server errors", ""]
        for r in notes:
            text = r.get("refusal") or " / ".join(r["error_lines"])
            lines.append(f"- {r['family']} {_list(r.get('layout'))}: {text}")
    trained = [r for r in rows_in_order(record) if r.get("fed_physical") is not None]
    if trained:
        lines += ["", "Trained physical layers per measured row (what the draft was trained on): " +
                  "; ".join(f"{r['family']} {_list(r['layout'])} -> {_list(r.get('trained_physical'))}" for r in trained) + "."]
    return "\n".join(lines) + "\n"


def results(record: dict) -> dict:
    return {"versions": record.get("versions"), "settings": record.get("settings"),
            "rows": [{k: r[k] for k in KEEP if k in r} for r in rows_in_order(record)]}


def write(families_json: Path, out: Path) -> None:
    record = json.loads(Path(families_json).read_text())
    out.mkdir(parents=True, exist_ok=True)
    for name, text in (("README.md", markdown(record)), ("results.json", json.dumps(results(record), indent=1) + "\n")):
        tmp = out / f".{name}.tmp"
        tmp.write_text(text)
        os.replace(tmp, out / name)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("families_json", type=Path)
    ap.add_argument("out", type=Path)
    args = ap.parse_args(argv)
    if not args.families_json.exists():
        print(f"error: {args.families_json}: no such file (run tools/families_h200.py first)", file=sys.stderr)
        return 2
    write(args.families_json, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
