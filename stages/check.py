"""Stage check: the wiring check. Proves that capture, export and serving agree, or names the fault.

    python -m stages.check --synth data/synth --hidden data/hidden --features data/features \
        --train-metrics reports/train/metrics.json --draft models/draft --bench reports/bench.json --out reports
Reads params section: check.
Writes reports/check.json (findings + config_hash + key settings), reports/check.md (the same,
readable) and reports/summary.md (the whole run on one page). Exits non-zero when a finding is
an error, unless check.fail_on_error is false; the reports are written either way.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from draftlab.check import diagnose, live_server
from draftlab.cli import run_stage
from draftlab.check.report import check_markdown, pipeline_plots, summary_markdown
from draftlab.errors import UserError
from draftlab.fsutil import atomic_write_json, atomic_write_text
from draftlab.manifest import build_manifest, with_lineage
from draftlab.params import as_dict, load_params


def validate_check_params(check_params) -> None:
    rules = [
        (check_params.tau_tolerance >= 0, "check.tau_tolerance must be >= 0 (a share, e.g. 0.10)"),
        (check_params.live_parity_samples >= 0, "check.live_parity_samples must be >= 0 (0 = no live parity)"),
        (check_params.parity_rtol > 0, "check.parity_rtol must be > 0 (a share, e.g. 0.05)"),
        (check_params.norm_tolerance > 0, "check.norm_tolerance must be > 0 (a share, e.g. 0.15)"),
        (check_params.request_timeout_s > 0, "check.request_timeout_s must be > 0"),
    ]
    for ok, msg in rules:
        if not ok:
            raise UserError(f"params.yaml: {msg}")


def main(paths: diagnose.Paths, out: Path, load_model=diagnose.load_local_target) -> diagnose.Diagnosis:
    params = load_params(["check"])
    check_params = params.check
    validate_check_params(check_params)
    with live_server.parity_server(check_params, paths.draft, paths.bench) as served_params:
        diagnosis = diagnose.diagnose(paths, served_params, load_model)
    run = diagnosis.run
    inputs = {name: (m or {}).get("config_hash") for name, m in (
        ("synth", run.synth), ("extract", run.hidden), ("features", run.features), ("train", run.train_metrics),
        ("export", run.export_manifest), ("bench", run.bench))}
    manifest = build_manifest("check", as_dict(params), inputs, __file__)
    report = with_lineage(diagnose.report_dict(diagnosis), manifest, diagnosis.settings)
    report["inputs"] = inputs
    atomic_write_json(out / "check.json", report)
    atomic_write_text(out / "check.md", check_markdown(diagnosis.findings, diagnosis.parity, diagnosis.settings, manifest["config_hash"]))
    plots = pipeline_plots("dvc.yaml", out)  # this run's plots only: dvc runs the stage next to dvc.yaml
    atomic_write_text(out / "summary.md", summary_markdown(run, diagnosis.findings, manifest["config_hash"], out, plots))
    for f in diagnosis.findings:
        if f.severity != "ok-info":
            print(f"check: {f.severity}: {f.name}: {f.cause}")
    print(f"check: {report['counts']['error']} error(s), {report['counts']['warning']} warning(s) -> {out / 'check.md'}, {out / 'summary.md'}")
    if diagnosis.errors and check_params.fail_on_error:
        raise UserError(f"wiring check found {len(diagnosis.errors)} error(s): {', '.join(f.name for f in diagnosis.errors)}; "
                        f"see {out / 'check.md'} (or set check.fail_on_error: false)")
    return diagnosis


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--synth", type=Path, default=Path("data/synth"))
    parser.add_argument("--hidden", type=Path, default=Path("data/hidden"))
    parser.add_argument("--features", type=Path, default=Path("data/features"))
    parser.add_argument("--train-metrics", type=Path, default=Path("reports/train/metrics.json"))
    parser.add_argument("--draft", type=Path, default=Path("models/draft"))
    parser.add_argument("--bench", type=Path, default=Path("reports/bench.json"))
    parser.add_argument("--out", type=Path, default=Path("reports"))
    args = parser.parse_args()
    paths = diagnose.Paths(args.synth, args.hidden, args.features, args.train_metrics, args.draft, args.bench)
    run_stage(main, paths, args.out)
