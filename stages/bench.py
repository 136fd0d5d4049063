"""Stage bench: the exported draft served against a no-speculation baseline, plus the offline run.

    python -m stages.bench --draft models/draft --prompts data/prompts --out reports/bench --metrics reports/bench.json
Reads params sections: target, spec, bench, and export.sglang_version (whose rules apply).

One client for every backend: `reference` starts the project's own server (CPU or GPU),
`sglang` launches `python -m sglang.launch_server`, `url` measures a server already running.
Before anything starts, the flags SGLang would really run are computed (draftlab.sglang.flags);
with spec.on_adjust: error a request SGLang would silently change stops here.
The run itself is draftlab.bench_run.
"""
from __future__ import annotations

from pathlib import Path

from draftlab import bench_plots, bench_run
from draftlab.cli import run_stage_cli
from draftlab.fsutil import atomic_write_json
from draftlab.manifest import build_manifest, read_manifest, read_verified, with_lineage, write_manifest
from draftlab.params import as_dict, load_params
from draftlab.sglang.checkpoint import read_exported


def main(draft_dir: Path, prompts: Path, out: Path, metrics: Path) -> None:
    params = load_params(["target", "spec", "bench", "export"])
    version = params.export.sglang_version
    export_manifest = read_manifest(draft_dir)
    draft = read_exported(draft_dir)
    plan = bench_run.prepare(params.target, params.spec, params.bench, version, draft, prompts)
    inputs = {"export": export_manifest["config_hash"], "prompts": read_verified(prompts)["config_hash"]}
    used = as_dict(params)
    used["export"] = {"sglang_version": version}  # the one export key bench reads (as dvc.yaml lists it)
    manifest = build_manifest("bench", used, inputs, __file__)

    result = bench_run.run(plan, out)
    bench_plots.write_plots(out, result.report)
    manifest["info"] = {"figures": result.figures, "flags": result.report["flags"]}
    write_manifest(out, manifest)
    atomic_write_json(metrics, with_lineage({**result.figures, **result.report}, manifest, result.key))
    print(f"bench: {bench_run.summary(result.report)} -> {metrics}")


if __name__ == "__main__":
    run_stage_cli(main, __doc__, draft="models/draft", prompts="data/prompts", out="reports/bench", metrics="reports/bench.json")
