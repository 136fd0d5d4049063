"""Entry-point wrapper for stage scripts: user errors print one clear message, no traceback."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from draftlab.errors import UserError


def run_stage(main, *args, **kwargs) -> None:
    try:
        main(*args, **kwargs)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        # Outputs are written atomically and per shard; re-running resumes from what is complete.
        print("interrupted; run the stage again to resume", file=sys.stderr)
        sys.exit(130)


def run_stage_cli(main, doc: str, **paths: str) -> None:
    """`python -m stages.X [--name PATH ...]`: one option per path argument of `main`, in order,
    defaulting to the path dvc.yaml passes (`resume_dir` becomes `--resume-dir`)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    for name, default in paths.items():
        parser.add_argument("--" + name.replace("_", "-"), type=Path, default=Path(default))
    args = vars(parser.parse_args())
    run_stage(main, *(args[name] for name in paths))
