"""Launch SGLang and read its log: the argv (never a shell string), the decode lines, and the
flag adjustments SGLang printed.

    argv = launch_argv("models/target", port, draft_model="models/draft", flags=res.effective)
    with serve(argv, "logs/sglang.log", startup_timeout_s=600) as srv:   # draftlab.lifecycle underneath
        ...
    log = read_log("logs/sglang.log")   # decode stats + the adjustment lines SGLang printed

Source of the decode line (sgl-project/sglang): python/sglang/srt/managers/scheduler_metrics_mixin.py
(`log_decode_stats`: "Decode batch. #running-req: ..." in older releases, "Decode batch, ..."
in 0.5.14 as measured). Parsing is tolerant: a field missing from a release is None.
"""
from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

from draftlab import lifecycle
from draftlab.errors import UserError
from draftlab.sglang.flags import RULES, SpecFlags

# ---------------------------------------------------------------------------------------------
# launch argv

# Flags launch_argv sets from params; the same flag in bench.extra_server_args would silently
# override ours (argparse keeps the last), so it is refused there with the key to use instead.
MANAGED_FLAGS = {
    "--model-path": "target.model", "--model": "target.model",
    "--host": "(always 127.0.0.1)", "--port": "bench.port",
    "--tp-size": "bench.tp_size", "--tp": "bench.tp_size", "--tensor-parallel-size": "bench.tp_size",
    "--dtype": "bench.dtype",
    "--max-running-requests": "bench.max_running_requests",
    "--page-size": "bench.page_size",
    "--attention-backend": "bench.attention_backend",
    "--enable-return-hidden-states": "(set by the stage that needs hidden states)",
    "--speculative-algorithm": "spec.algorithm",
    "--speculative-draft-model-path": "the draft the pipeline exported", "--speculative-draft-model": "the draft the pipeline exported",
    "--speculative-num-steps": "spec.num_steps",
    "--speculative-eagle-topk": "spec.topk",
    "--speculative-num-draft-tokens": "spec.num_draft_tokens",
    "--speculative-ngram-min-bfs-breadth": "the ngram configuration of bench.sweep (ngram-N-B)",
    "--speculative-ngram-max-bfs-breadth": "the ngram configuration of bench.sweep (ngram-N-B)",
    "--speculative-ngram-max-trie-depth": "the ngram configuration of bench.sweep (ngram-N-B)",
}


# SGLang (0.5.14, measured) derives its gRPC port as --port + 10000 unless SGLANG_GRPC_PORT is
# set, and refuses to start when that passes 65535: "SGLANG_GRPC_PORT (69419) must be between 1
# and 65535" (ServerArgs._handle_deprecated_args). So its --port must be at most 55535.
GRPC_PORT_OFFSET = 10000
MAX_PORT = 65535 - GRPC_PORT_OFFSET


def free_port(host: str = "127.0.0.1") -> int:
    """A free port SGLang accepts as --port (see MAX_PORT)."""
    return lifecycle.free_port(host, highest=MAX_PORT)


def launch_argv(target_model: str, port: int, *, draft_model: str | None = None, flags: SpecFlags | None = None,
                baseline: bool = False, host: str = "127.0.0.1", tp_size: int = 1, dtype: str = "auto",
                extra_args: Sequence[str] = (), return_hidden_states: bool = False,
                python: str = sys.executable, extra_key: str = "bench.extra_server_args",
                managed: dict[str, str] = MANAGED_FLAGS) -> list[str]:
    """argv (a list, never a shell string) for `python -m sglang.launch_server`.

    flags: pass the EFFECTIVE flags (sglang_flags.resolve(...).effective), so SGLang has nothing
    left to change and the report shows exactly what ran. baseline=True launches the same target
    with no speculative flag at all; the server-wide flags in `flags` (max_running_requests,
    page_size, attention_backend) still apply, so both servers differ only in speculation.
    NGRAM (flags.algorithm) needs no draft model: --speculative-num-draft-tokens and the n-gram
    settings; SGLang sets topk and num_steps from them (draftlab.sglang.flags, rule ngram_topk).
    """
    check_extra_args(extra_args, extra_key, managed)
    if port > MAX_PORT and not os.environ.get("SGLANG_GRPC_PORT"):
        raise UserError(f"SGLang refuses --port {port}: it derives its gRPC port as port + {GRPC_PORT_OFFSET}, which must be "
                        f"<= 65535; use a port <= {MAX_PORT} (bench.port) or set SGLANG_GRPC_PORT")
    argv = [python, "-m", "sglang.launch_server", "--model-path", str(target_model), "--host", host,
            "--port", str(port), "--tp-size", str(tp_size), "--dtype", dtype]
    if not baseline and flags is not None and flags.algorithm == "NGRAM":
        argv += ["--speculative-algorithm", "NGRAM"]
        for flag, value in (("--speculative-num-draft-tokens", flags.num_draft_tokens),
                            ("--speculative-ngram-min-bfs-breadth", flags.ngram_min_bfs_breadth),
                            ("--speculative-ngram-max-bfs-breadth", flags.ngram_max_bfs_breadth),
                            ("--speculative-ngram-max-trie-depth", flags.ngram_max_trie_depth)):
            if value is not None:
                argv += [flag, str(value)]
    elif not baseline:
        if draft_model is None or flags is None:
            raise ValueError("a speculative launch needs draft_model and flags (or baseline=True)")
        argv += ["--speculative-algorithm", flags.algorithm, "--speculative-draft-model-path", str(draft_model)]
        for flag, value in (("--speculative-num-steps", flags.num_steps), ("--speculative-eagle-topk", flags.topk),
                            ("--speculative-num-draft-tokens", flags.num_draft_tokens)):
            if value is not None:
                argv += [flag, str(value)]
    if flags is not None:
        for flag, value in (("--max-running-requests", flags.max_running_requests), ("--page-size", flags.page_size),
                            ("--attention-backend", flags.attention_backend)):
            if value is not None:
                argv += [flag, str(value)]
    if return_hidden_states:
        argv.append("--enable-return-hidden-states")
    return argv + [str(a) for a in extra_args]


def serve(argv: list[str], log_path, startup_timeout_s: float, env: dict | None = None):
    """Run SGLang through lifecycle.serve (own process group, /health wait, log tail on failure,
    always stopped, log kept); the URL comes from argv's --host/--port. A context manager."""
    host, port = argv[argv.index("--host") + 1], argv[argv.index("--port") + 1]
    return lifecycle.serve(argv, f"http://{host}:{port}", log_path, startup_timeout_s=startup_timeout_s, env=env)


def check_extra_args(extra_args: Sequence[str], key: str = "bench.extra_server_args",
                     managed: dict[str, str] = MANAGED_FLAGS) -> None:
    """Refuse a shell string, a flag and its value in one item, and flags the params own (`managed`:
    flag -> the params key that sets it); `key` names the params key in the messages."""
    if isinstance(extra_args, str):
        raise UserError(f"{key} must be a list, one item per argument, got the string {extra_args!r}")
    for item in extra_args:
        item = str(item)
        name = item.split("=", 1)[0]
        if name.startswith("--") and " " in name.strip():
            raise UserError(f"{key}: {item!r} is one list item; write each argument as its own item: {item.split()!r}")
        if name in managed:
            raise UserError(f"{key}: {name} is set from {managed[name]}; remove it from {key}")


# ---------------------------------------------------------------------------------------------
# the server log

_DECODE = re.compile(r"^(?P<prefix>.*?)Decode batch(?: \[\d+\])?[.,]\s*(?P<body>.*?)\s*$")
# key in the log -> (attribute, type); "<x> graph" keys (cuda/cpu/npu graph) go to `graph`
_DECODE_KEYS = {
    "#running-req": ("running_req", int),
    "#token": ("tokens", int),
    "token usage": ("token_usage", float),
    "accept len": ("accept_len", float),
    "accept rate": ("accept_rate", float),
    "gen throughput (token/s)": ("gen_throughput", float),
    "#queue-req": ("queue_req", int),
}


@dataclass(frozen=True)
class DecodeStats:
    """One "Decode batch" log line (printed every --decode-log-interval decode steps, 40 by default)."""

    running_req: int | None = None
    tokens: int | None = None  # KV-cache tokens in use
    token_usage: float | None = None  # share of the KV cache in use, 0..1
    accept_len: float | None = None  # tau over the interval; absent without speculation
    accept_rate: float | None = None  # SGLang's own definition, changed across releases: never compare
    graph: bool | None = None  # ran with CUDA (or CPU) graphs
    gen_throughput: float | None = None  # tokens/s over the interval, all requests
    queue_req: int | None = None
    prefix: str = ""  # what precedes "Decode batch" (timestamp, TP/DP rank)
    fields: dict = field(default_factory=dict)  # every "key: value" pair as printed


@dataclass(frozen=True)
class LogAdjustment:
    """A log line in which SGLang states one of the rules of sglang_flags.RULES."""

    rule: str
    line: str


@dataclass(frozen=True)
class ServerLog:
    decode: list[DecodeStats]
    adjustments: list[LogAdjustment]


def _number(text: str, kind):
    try:
        return kind(text)
    except ValueError:
        return None


def parse_decode_line(line: str) -> DecodeStats | None:
    """DecodeStats from a "Decode batch" line, or None for any other line."""
    m = _DECODE.match(line)
    if not m:
        return None
    fields, values = {}, {}
    for part in m.group("body").split(","):
        key, sep, value = part.partition(":")
        key, value = key.strip(), value.strip()
        if not sep or not key:
            continue
        fields[key] = value
        if key in _DECODE_KEYS:
            name, kind = _DECODE_KEYS[key]
            values[name] = _number(value, kind)
        elif key.endswith(" graph"):
            values["graph"] = {"True": True, "False": False}.get(value)
    return DecodeStats(**values, prefix=m.group("prefix").strip(), fields=fields)


_ADJUST = [(r.name, re.compile(r.log_pattern)) for r in RULES if r.log_pattern]


def parse_adjustment_line(line: str) -> LogAdjustment | None:
    for rule, pattern in _ADJUST:
        if pattern.search(line):
            return LogAdjustment(rule, line.strip())
    return None


def parse_log(lines: Iterable[str]) -> ServerLog:
    decode, adjustments = [], []
    for line in lines:
        stats = parse_decode_line(line)
        if stats is not None:
            decode.append(stats)
            continue
        adj = parse_adjustment_line(line)
        if adj is not None:
            adjustments.append(adj)
    return ServerLog(decode, adjustments)


def read_log(path) -> ServerLog:
    with open(Path(path), encoding="utf-8", errors="replace") as f:
        return parse_log(f)


