"""Readable reports of the check stage: reports/check.md (the findings) and reports/summary.md (the run).

Both are plain Markdown built from the same dicts that go into reports/check.json.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import yaml

from draftlab.bench.report import headline_markdown
from draftlab.check.findings import ERROR, INFO, WARNING, Finding
from draftlab.sglang.loading import config_dtype

IMAGES = (".png", ".svg")


def _fmt(x, digits: int = 3) -> str:
    if isinstance(x, float):
        return f"{x:.{digits}f}"
    return "-" if x is None else str(x)


def _counts(findings: list[Finding]) -> str:
    n = {s: sum(f.severity == s for f in findings) for s in (ERROR, WARNING, INFO)}
    return f"{n[ERROR]} error(s), {n[WARNING]} warning(s), {n[INFO]} ok-info"


def check_markdown(findings: list[Finding], parity: dict | None, settings: dict, config_hash: str) -> str:
    lines = ["# Wiring check", "",
             f"config_hash `{config_hash}`: {_counts(findings)}.", "",
             "| setting | value |", "|---|---|"]
    lines += [f"| {k} | {_fmt(v)} |" for k, v in settings.items()]
    lines += ["", "| severity | finding | cause |", "|---|---|---|"]
    lines += [f"| {f.severity} | `{f.name}` | {f.cause} |" for f in findings]
    for f in findings:
        if f.severity == INFO:
            continue
        lines += ["", f"## {f.severity}: `{f.name}`", "", f"**Cause.** {f.cause}", "", f"**Fix.** {f.fix or '-'}", "",
                  "**Evidence.**", ""]
        lines += [f"- {k}: `{json.dumps(v, default=str)}`" for k, v in f.evidence.items()]
    if parity and parity.get("slots"):
        lines += ["", "## Live parity", "",
                  f"Source: {parity['source']}; {len(parity['sequences'])} training sequences, {parity['tokens']} tokens.", "",
                  "| slot | trained physical | live physical | rel err | max abs diff | cos | norm ratio | best match |",
                  "|---|---|---|---|---|---|---|---|"]
        for s in parity["slots"]:
            lines.append(f"| {s['slot']} | {s['trained_physical']} | {_fmt(s['live_physical'])} | {s['rel_err']:.4f} | "
                         f"{s['max_abs_diff']:.4g} | {s['cos']:.4f} | {s['norm_ratio']:.3f} | {s['best_match']} ({s['best_rel_err']:.4f}) |")
    return "\n".join(lines) + "\n"


def _hash(m: dict | None) -> str:
    return f"`{m['config_hash'][:12]}`" if m and m.get("config_hash") else "-"


def stage_rows(run) -> list[str]:
    """One table row per stage output: its config hash and the facts a reader looks for first."""
    info = lambda m: (m or {}).get("info") or {}  # noqa: E731
    s, h, f, t, b = info(run.synth), info(run.hidden), info(run.features), run.train_metrics or {}, run.bench or {}
    cfg = run.draft.config if run.draft else {}
    eff = (b.get("flags") or {}).get("effective") or {}
    rows = [
        ("synthesize", run.synth, f"backend {s.get('backend', '-')}, {s.get('ok', '-')} answers, {s.get('errors', '-')} failed"),
        ("extract", run.hidden, f"target {(h.get('target') or {}).get('model', '-')}, physical layers "
                                f"{(h.get('target') or {}).get('physical_layers', '-')}, {h.get('counts', {}).get('train', {}).get('tokens', '-')} train tokens"),
        ("standardize", run.features, f"draft vocab {f.get('draft_vocab_size', '-')}, eval coverage "
                                      f"{_fmt((f.get('draft_vocab_coverage') or {}).get('eval'))}"),
        ("train", t, f"tau_pred {_fmt(t.get('tau_pred'))}, eval loss {_fmt(t.get('eval_loss'))}, {t.get('epochs', '-')} epochs"),
        ("export", run.export_manifest, f"eagle ids {(cfg.get('eagle_config') or {}).get('eagle_aux_hidden_state_layer_ids', '-')}, "
                                        f"SGLang {(cfg.get('draftlab') or {}).get('sglang_version', '-')}, {config_dtype(cfg)[1] or '-'}"),
        ("bench", b or None, f"backend {b.get('backend', '-')}, {eff.get('algorithm', '-')} steps {eff.get('num_steps', '-')} "
                             f"topk {eff.get('topk', '-')} draft tokens {eff.get('num_draft_tokens', '-')}" if b else "not run"),
    ]
    return [f"| {name} | {_hash(m)} | {facts} |" for name, m, facts in rows]


def _tps(x) -> str:
    return _fmt((x or {}).get("median"), 1) if isinstance(x, dict) else _fmt(x, 1)


def _declared_paths(dvc_yaml: Path) -> list[Path]:
    """Every output dvc.yaml declares: each stage's outs, metrics and plots, and the top-level plots."""
    spec = yaml.safe_load(dvc_yaml.read_text()) or {}
    names = []
    for stage in (spec.get("stages") or {}).values():
        for kind in ("outs", "metrics", "plots"):
            names += [e if isinstance(e, str) else next(iter(e)) for e in stage.get(kind) or []]
    for e in spec.get("plots") or []:
        entry = e if isinstance(e, str) else next(iter(e))
        names.append(entry)
        for axis in ("x", "y"):  # a named plot whose data files are given per axis
            files = (e.get(entry) or {}).get(axis) if isinstance(e, dict) else None
            names += list(files) if isinstance(files, dict) else []
    return [dvc_yaml.parent / n for n in names]


def pipeline_plots(dvc_yaml: str | Path, out_dir: str | Path) -> list[Path]:
    """The images under `out_dir` that the pipeline's own stages write: those dvc.yaml declares, or that
    lie in a folder it declares (reports/train/plots, reports/bench). Other runs' plots kept under
    reports/ (a GPU experiment's, a sweep's) are not this run's; none without a dvc.yaml."""
    dvc_yaml = Path(dvc_yaml)
    if not dvc_yaml.exists():
        return []
    declared = [p.resolve() for p in _declared_paths(dvc_yaml)]
    images = (p for p in Path(out_dir).rglob("*") if p.suffix in IMAGES and p.is_file())
    return sorted(p for p in images if any(p.resolve() == d or p.resolve().is_relative_to(d) for d in declared))


def summary_markdown(run, findings: list[Finding], config_hash: str, out_dir: Path, plots: list[Path] = ()) -> str:
    """The run on one page; `plots` (pipeline_plots) are linked relative to `out_dir`."""
    t, b = run.train_metrics or {}, run.bench or {}
    spec, base, off = b.get("spec") or {}, b.get("baseline") or {}, b.get("offline") or {}
    lines = ["# Run summary", "", f"Check config_hash `{config_hash}`. Check: {_counts(findings)} (details: [check.md](check.md)).", ""]
    for s in b.get("prompt_sets") or []:  # the bench's headline: baseline, the best n-gram lookup and the best draft
        lines += [f"## Does training pay? ({s['name']}: {s['requests']} requests)", "", headline_markdown(s["training_pays"]), ""]
    lines += ["## What ran", "", "| stage | config hash | facts |", "|---|---|---|", *stage_rows(run), "",
             "## Key figures", "", "| figure | value |", "|---|---|",
             f"| tau predicted by training | {_fmt(t.get('tau_pred'))} |",
             f"| tau offline (in-process engine) | {_fmt(off.get('tau'))} |",
             f"| tau served | {_fmt(spec.get('tau'))} |",
             f"| per-position acceptance (train eval) | {', '.join(_fmt(v) for v in (t.get('accept') or {}).values()) or '-'} |",
             f"| per-position acceptance (served) | {', '.join(_fmt(v) for v in spec.get('acceptance') or []) or '-'} |",
             f"| accept rate (served) | {_fmt(spec.get('accept_rate'))} |",
             f"| tokens/s baseline (median) | {_tps(base.get('tokens_per_s'))} |",
             f"| tokens/s speculative (median) | {_tps(spec.get('tokens_per_s'))} |",
             f"| speedup | {_fmt(b.get('speedup'))} |"]
    lines += ["", "## Plots", ""]
    lines += [f"- [{p.relative_to(out_dir).as_posix()}]({os.path.relpath(p, out_dir)})" for p in plots] or ["- none yet"]
    lines += ["", "## Findings", ""]
    lines += [f"- **{f.severity}** `{f.name}`: {f.cause}." + (f" Fix: {f.fix}." if f.fix else "") for f in findings if f.severity != INFO]
    if not any(f.severity != INFO for f in findings):
        lines.append("- no errors or warnings: " + ", ".join(f"`{f.name}`" for f in findings))
    return "\n".join(lines) + "\n"
