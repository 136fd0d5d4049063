"""check.serve_parity: the check stage serves the exported draft itself for its live parity.

    with live_server.parity_server(check_params, Path("models/draft"), Path("reports/bench.json")) as check_params:
        diagnose.diagnose(paths, check_params)      # check_params.server_url is the started server's URL

With check.serve_parity true, a speculative server of the draft starts with
--enable-return-hidden-states, launched as the bench stage launched its own (bench.backend sglang or
reference, bench.*'s launch flags, the speculative flags bench.json records as effective), so that
the parity is measured on the serving path the bench measured; it is stopped after the check. So a
params profile gets live parity against real SGLang with no server started by hand.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import tempfile
from pathlib import Path

from draftlab.errors import UserError


@contextlib.contextmanager
def parity_server(check_params, draft: Path, bench_json: Path):
    """check_params as given (serve_parity false), or with server_url the URL of a started server."""
    if not check_params.serve_parity:
        yield check_params
        return
    from draftlab.bench import servers as bench  # the server launch: imported only when a server is started
    from draftlab.params import load_params
    from draftlab.sglang.flags import SpecFlags
    from draftlab.sglang.launch import free_port

    p = load_params(["target", "bench", "export"])
    if p.bench.backend == "url":
        raise UserError("check.serve_parity starts a server the way the bench stage does, but bench.backend is 'url'; set "
                        "check.serve_parity: false and check.server_url to a server started with --enable-return-hidden-states")
    if not bench_json.exists():
        raise UserError(f"check.serve_parity serves the flags the bench ran, but {bench_json} is missing; run the bench stage first")
    flags = SpecFlags(**json.loads(bench_json.read_text())["flags"]["effective"])
    port = free_port() if p.bench.backend == "sglang" else None  # bench.port may still be held by a server stopping
    with tempfile.TemporaryDirectory(prefix="draftlab-parity-") as tmp:
        log = Path(tmp) / "server-parity.log"
        with bench.start(p.bench.backend, p.bench, p.target, draft, flags, p.export.sglang_version, log,
                         speculative=True, hidden=True, port=port) as url:
            print(f"check: live parity against a {p.bench.backend} server of {draft} at {url}")
            yield dataclasses.replace(check_params, server_url=url)
