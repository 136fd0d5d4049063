"""Stage bench: the exported draft served against a no-speculation baseline, plus the offline run.

    python -m stages.bench --draft models/draft --prompts data/prompts --out reports/bench --metrics reports/bench.json
Reads params sections: target, spec, bench, and export.sglang_version (whose rules apply).

One client for every backend: `reference` starts the project's own server (CPU or GPU),
`sglang` launches `python -m sglang.launch_server`, `url` measures a server already running.
Before anything starts, the flags SGLang would really run are computed (draftlab.sglang.flags);
with spec.on_adjust: error a request SGLang would silently change stops here. bench.sweep adds
configurations, each served beside the same baseline (draftlab.bench.sweep).
The stage's body is draftlab.bench.stage.bench, the run itself draftlab.bench.run.
"""
from __future__ import annotations

from pathlib import Path

from draftlab.bench.stage import bench
from draftlab.cli import run_stage_cli


def main(draft_dir: Path, prompts: Path, out: Path, metrics: Path) -> None:
    bench(draft_dir, prompts, out, metrics, script=__file__)


if __name__ == "__main__":
    run_stage_cli(main, __doc__, draft="models/draft", prompts="data/prompts", out="reports/bench", metrics="reports/bench.json")
