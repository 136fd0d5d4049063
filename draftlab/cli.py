"""Entry-point wrapper for stage scripts: user errors print one clear message, no traceback."""
from __future__ import annotations

import sys

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
