"""Talk to SGLang: its launch argv, its log, its /generate meta_info, and an HTTP client.

    argv = launch_argv("models/target", port, draft_model="models/draft", flags=res.effective)
    with serve(argv, "logs/sglang.log", startup_timeout_s=600) as srv:   # draftlab.lifecycle underneath
        with Client(srv.url) as client:
            text, meta = client.generate("Hello", {"max_new_tokens": 64, "temperature": 0})
    log = read_log("logs/sglang.log")   # decode stats + the adjustment lines SGLang printed

The client speaks SGLang's native API (/generate, /health, /server_info), so the same code
benchmarks a launched SGLang, a server the user already runs, and the project's reference server
(draftlab/server.py). Parsing is tolerant: fields come and go across SGLang releases, so a missing
field is None, never an error.

Sources (sgl-project/sglang): decode log line in python/sglang/srt/managers/scheduler_metrics_mixin.py
(`log_decode_stats`: "Decode batch. #running-req: ..." in older releases, "Decode batch, ..."
in 0.5.14 as measured, see gpu/README.md); meta_info spec fields in the tokenizer manager's
`_calculate_spec_decoding_metrics` (python/sglang/srt/managers/tokenizer_manager.py), whose names
changed: spec_accept_token_num -> spec_accepted_drafts -> spec_num_correct_drafts, and
spec_accept_histogram -> spec_correct_drafts_histogram.
"""
from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence
from urllib.parse import urlparse

import httpx

from draftlab import lifecycle
from draftlab.errors import UserError
from draftlab.sglang_flags import RULES, SpecFlags

# ---------------------------------------------------------------------------------------------
# (a) launch argv

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
                python: str = sys.executable) -> list[str]:
    """argv (a list, never a shell string) for `python -m sglang.launch_server`.

    flags: pass the EFFECTIVE flags (sglang_flags.resolve(...).effective), so SGLang has nothing
    left to change and the report shows exactly what ran. baseline=True launches the same target
    with no speculative flag at all; the server-wide flags in `flags` (max_running_requests,
    page_size, attention_backend) still apply, so both servers differ only in speculation.
    """
    check_extra_args(extra_args)
    if port > MAX_PORT and not os.environ.get("SGLANG_GRPC_PORT"):
        raise UserError(f"SGLang refuses --port {port}: it derives its gRPC port as port + {GRPC_PORT_OFFSET}, which must be "
                        f"<= 65535; use a port <= {MAX_PORT} (bench.port) or set SGLANG_GRPC_PORT")
    argv = [python, "-m", "sglang.launch_server", "--model-path", str(target_model), "--host", host,
            "--port", str(port), "--tp-size", str(tp_size), "--dtype", dtype]
    if not baseline:
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


def check_extra_args(extra_args: Sequence[str]) -> None:
    """Refuse a shell string, a flag and its value in one item, and flags the params own."""
    if isinstance(extra_args, str):
        raise UserError(f"bench.extra_server_args must be a list, one item per argument, got the string {extra_args!r}")
    for item in extra_args:
        item = str(item)
        name = item.split("=", 1)[0]
        if name.startswith("--") and " " in name.strip():
            raise UserError(f"bench.extra_server_args: {item!r} is one list item; write each argument as its own item: {item.split()!r}")
        if name in MANAGED_FLAGS:
            raise UserError(f"bench.extra_server_args: {name} is set from {MANAGED_FLAGS[name]}; remove it from extra_server_args")


# ---------------------------------------------------------------------------------------------
# (b) the server log

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


# ---------------------------------------------------------------------------------------------
# (c) /generate meta_info

# field -> older names of the same count, newest first
_ALIASES = {
    "spec_num_correct_drafts": ("spec_accepted_drafts", "spec_accept_token_num"),
    "spec_num_proposed_drafts": ("spec_proposed_drafts", "spec_draft_token_num"),
    "spec_correct_drafts_histogram": ("spec_accept_histogram",),
}


@dataclass(frozen=True)
class GenerateMeta:
    """meta_info of one /generate answer; spec_* are None without speculation."""

    prompt_tokens: int | None = None
    completion_tokens: int | None = None  # generated tokens, the stop token included
    e2e_latency: float | None = None  # seconds, server side, queueing included
    spec_verify_ct: int | None = None  # target verify steps
    spec_accept_length: float | None = None  # completion_tokens / spec_verify_ct (bonus token included)
    spec_accept_rate: float | None = None  # correct / proposed drafts, as this SGLang release defines it
    spec_num_correct_drafts: int | None = None  # draft tokens accepted, bonus excluded
    spec_num_proposed_drafts: int | None = None  # spec_verify_ct * (num_draft_tokens - 1)
    spec_correct_drafts_histogram: list[int] | None = None  # [i] = verify steps that accepted i drafts
    finish_reason: dict | None = None
    raw: dict = field(default_factory=dict)  # the meta_info as received (hidden_states etc.)

    @property
    def speculative(self) -> bool:
        return bool(self.spec_verify_ct)


def _pick(meta: dict, name: str):
    for key in (name, *_ALIASES.get(name, ())):
        if meta.get(key) is not None:
            return meta[key]
    return None


def _as(value, kind):
    """`value` as int or float when it is a JSON number of that kind (2.0 counts as 2), else None."""
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value != value:  # value != value: NaN
        return None
    if kind is int and value != int(value):  # 2.5 is not a count
        return None
    return kind(value)


def parse_meta(meta: dict | None) -> GenerateMeta:
    """Typed meta_info; a missing or malformed field is None."""
    meta = meta if isinstance(meta, dict) else {}
    hist = _pick(meta, "spec_correct_drafts_histogram")
    hist = [int(v) for v in hist] if isinstance(hist, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in hist) else None
    finish = meta.get("finish_reason")
    return GenerateMeta(
        prompt_tokens=_as(meta.get("prompt_tokens"), int),
        completion_tokens=_as(meta.get("completion_tokens"), int),
        e2e_latency=_as(meta.get("e2e_latency"), float),
        spec_verify_ct=_as(meta.get("spec_verify_ct"), int),
        spec_accept_length=_as(meta.get("spec_accept_length"), float),
        spec_accept_rate=_as(meta.get("spec_accept_rate"), float),
        spec_num_correct_drafts=_as(_pick(meta, "spec_num_correct_drafts"), int),
        spec_num_proposed_drafts=_as(_pick(meta, "spec_num_proposed_drafts"), int),
        spec_correct_drafts_histogram=hist,
        finish_reason=finish if isinstance(finish, dict) else None,
        raw=meta,
    )


def served_tau(metas: Sequence[GenerateMeta]) -> float:
    """tau pooled over the speculative requests (draftlab.metrics.pooled_tau); nan if none."""
    from draftlab.metrics import pooled_tau  # imports torch: only when needed

    spec = [m for m in metas if m.speculative and m.completion_tokens is not None]
    return pooled_tau([m.completion_tokens for m in spec], [m.spec_verify_ct for m in spec])


def pooled_accept_rate(metas: Sequence[GenerateMeta]) -> float:
    """Accepted drafts / proposed drafts pooled over requests, from SGLang's counts; nan if none."""
    spec = [m for m in metas if m.spec_num_correct_drafts is not None and m.spec_num_proposed_drafts]
    proposed = sum(m.spec_num_proposed_drafts for m in spec)
    return sum(m.spec_num_correct_drafts for m in spec) / proposed if proposed else float("nan")


def flags_from_server_info(info: dict) -> SpecFlags:
    """The flags a running server reports in /server_info (its resolved server_args)."""
    return SpecFlags(
        algorithm=info.get("speculative_algorithm"),  # None: no speculation
        num_steps=info.get("speculative_num_steps"),
        topk=info.get("speculative_eagle_topk"),
        num_draft_tokens=info.get("speculative_num_draft_tokens"),
        max_running_requests=info.get("max_running_requests"),
        page_size=info.get("page_size"),
        attention_backend=info.get("attention_backend"),
    )


def server_accept_length(info: dict) -> float | None:
    """internal_states[0].avg_spec_accept_length of /server_info (the server's running tau)."""
    states = info.get("internal_states")
    if isinstance(states, list) and states and isinstance(states[0], dict):
        return _as(states[0].get("avg_spec_accept_length"), float)
    return None


# ---------------------------------------------------------------------------------------------
# (d) the client

CONNECT_TIMEOUT_S = 5.0  # a server that does not accept a connection in 5 s is not there


def _is_loopback(url: str) -> bool:
    return urlparse(url).hostname in ("127.0.0.1", "localhost", "::1")


class Client:
    """SGLang native API client; one instance per server. Use as a context manager."""

    def __init__(self, base_url: str, timeout_s: float = 600.0):
        self.url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        # trust_env=False on loopback: an HTTP proxy from the environment must not see local traffic
        self._http = httpx.Client(timeout=httpx.Timeout(timeout_s, connect=CONNECT_TIMEOUT_S),
                                  trust_env=not _is_loopback(self.url))

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def _request(self, method: str, path: str, **kw) -> httpx.Response:
        try:
            return self._http.request(method, self.url + path, **kw)
        except httpx.TimeoutException:
            raise UserError(f"{self.url}{path}: no answer within {self.timeout_s:g} s (bench.request_timeout_s)") from None
        except httpx.HTTPError as e:
            raise UserError(f"{self.url}{path}: {type(e).__name__}: {e}") from None

    def health(self) -> bool:
        """True when GET /health answers 200; False when it answers otherwise or not at all."""
        try:
            return self._http.get(self.url + "/health", timeout=CONNECT_TIMEOUT_S).status_code == 200
        except httpx.HTTPError:
            return False

    def server_info(self) -> dict:
        """GET /server_info (older SGLang: /get_server_info)."""
        r = self._request("GET", "/server_info")
        if r.status_code == 404:
            r = self._request("GET", "/get_server_info")
        return self._json(r, "/server_info")

    def generate(self, prompt: str | Sequence[int], sampling_params: dict | None = None, **body) -> tuple[str, GenerateMeta]:
        """POST /generate for one prompt (text, or token ids); returns (text, meta)."""
        key = "text" if isinstance(prompt, str) else "input_ids"
        payload = {key: prompt if isinstance(prompt, str) else [int(t) for t in prompt],
                   "sampling_params": sampling_params or {}, **body}
        out = self._json(self._request("POST", "/generate", json=payload), "/generate")
        if not isinstance(out, dict) or "text" not in out:
            raise UserError(f"{self.url}/generate: not an SGLang /generate answer: {str(out)[:200]}")
        return out["text"], parse_meta(out.get("meta_info"))

    def _json(self, r: httpx.Response, path: str):
        if r.status_code != 200:
            raise UserError(f"{self.url}{path}: HTTP {r.status_code}: {_error_message(r)}")
        try:
            return r.json()
        except ValueError:
            raise UserError(f"{self.url}{path}: answer is not JSON: {r.text[:200]!r}") from None


def _error_message(r: httpx.Response) -> str:
    """The message of an SGLang or reference-server error body, else the start of the body."""
    try:
        body = r.json()
    except ValueError:
        return r.text[:200]
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if body.get("message"):
            return str(body["message"])
    return str(body)[:200]
