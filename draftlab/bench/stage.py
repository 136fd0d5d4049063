"""The bench stage as one call: params.yaml's sections in, bench.json, reports/bench/ and the manifest out.

    from draftlab.bench.stage import bench
    report = bench(Path("models/draft"), Path("data/prompts"), Path("reports/bench"), Path("reports/bench.json"))
    report = bench(..., sweep=["3-1-4", "6-8-32", "advised"])   # these configurations instead of bench.sweep's

stages/bench.py (what `dvc repro` runs) calls it with params.yaml's bench.sweep; a command line that
names the configurations itself passes `sweep` (checked as params.yaml's would be, errors naming
`sweep`), and the manifest records the configurations that ran. Beside bench.json it writes
reports/bench/report.md ("does training pay?" first, then every prompt set by turn and category)
and categories.png (tau by category for each configuration).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

from draftlab.bench import plots, report as bench_report, run as bench_run
from draftlab.fsutil import atomic_write_json, atomic_write_text
from draftlab.manifest import ROOT, build_manifest, read_manifest, read_verified, with_lineage, write_manifest
from draftlab.errors import UserError
from draftlab.params import PARAMS_FILE, as_dict, check_sweep, load_params
from draftlab.sglang.checkpoint import read_exported

STAGE_SCRIPT = ROOT / "stages" / "bench.py"  # whose imports the code hash covers


def bench(draft_dir: Path, prompts: Path, out: Path, metrics: Path, sweep: list[str] | None = None,
          params_file: str | Path = PARAMS_FILE, script: str | Path = STAGE_SCRIPT) -> dict:
    """Serve the exported draft against a baseline (and every configuration of bench.sweep, or of
    `sweep` when given), then the offline run and the advice; writes `metrics` (bench.json), the
    plots, logs and manifest under `out`, prints the one-line summary, and returns bench.json's content."""
    params = load_params(["target", "spec", "bench", "export"], params_file)
    if sweep is not None:
        try:
            check_sweep(list(sweep))
        except ValueError as e:
            raise UserError(f"sweep {list(sweep)!r} {e}".replace(" :", ":")) from None
        params.bench = dataclasses.replace(params.bench, sweep=list(sweep))
    version = params.export.sglang_version
    export_manifest = read_manifest(draft_dir)
    draft = read_exported(draft_dir)
    plan = bench_run.prepare(params.target, params.spec, params.bench, version, draft, prompts)
    inputs = {"export": export_manifest["config_hash"], "prompts": read_verified(prompts)["config_hash"]}
    for bset in plan.sets:  # a set read from elsewhere than the prompts stage (mt-bench, a file): its content
        if bset.name != "heldout":
            inputs[f"prompt_set:{bset.name}"] = bset.sha256
    used = as_dict(params)
    used["export"] = {"sglang_version": version}  # the one export key bench reads (as dvc.yaml lists it)
    manifest = build_manifest("bench", used, inputs, script)

    result = bench_run.run(plan, out)
    plots.write_plots(out, result.report)
    plots.write_configuration_plots(out, result.report)
    plots.write_category_plots(out, result.report)
    manifest["info"] = {"figures": result.figures, "flags": result.report["flags"],
                        "configurations": [r["configuration"] for r in result.report["configurations"]],
                        "prompt_sets": [{k: v for k, v in s.items() if k not in ("configurations", "training_pays")}
                                        for s in result.report["prompt_sets"]]}
    write_manifest(out, manifest)
    report = with_lineage({**result.figures, **result.report}, manifest, result.key)
    atomic_write_json(metrics, report)
    atomic_write_text(out / "report.md", bench_report.markdown(report))
    print(f"bench: {bench_run.summary(result.report)} -> {metrics}")
    return report
