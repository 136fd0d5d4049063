"""Talk to a running server over SGLang's native API: /generate (and its meta_info), /health,
/server_info.

    with Client("http://127.0.0.1:30000") as client:
        text, meta = client.generate("Hello", {"max_new_tokens": 64, "temperature": 0})

The same client benchmarks a launched SGLang, a server the user already runs, and the project's
reference server (draftlab/engine/server.py). Fields come and go across SGLang releases, so a missing
field is None, never an error. Source of the meta_info spec fields (sgl-project/sglang): the
tokenizer manager's `_calculate_spec_decoding_metrics` (python/sglang/srt/managers/
tokenizer_manager.py), whose names changed: spec_accept_token_num -> spec_accepted_drafts ->
spec_num_correct_drafts, and spec_accept_histogram -> spec_correct_drafts_histogram.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence
from urllib.parse import urlparse

import httpx

from draftlab.errors import UserError
from draftlab.sglang.flags import SpecFlags
# ---------------------------------------------------------------------------------------------
# /generate meta_info

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
    """The flags a running server reports in /server_info (its resolved server_args); the n-gram
    settings only for an NGRAM server (SGLang reports their defaults whatever the algorithm)."""
    ngram = info.get("speculative_algorithm") == "NGRAM"
    return SpecFlags(
        algorithm=info.get("speculative_algorithm"),  # None: no speculation
        num_steps=info.get("speculative_num_steps"),
        topk=info.get("speculative_eagle_topk"),
        num_draft_tokens=info.get("speculative_num_draft_tokens"),
        max_running_requests=info.get("max_running_requests"),
        page_size=info.get("page_size"),
        attention_backend=info.get("attention_backend"),
        ngram_min_bfs_breadth=info.get("speculative_ngram_min_bfs_breadth") if ngram else None,
        ngram_max_bfs_breadth=info.get("speculative_ngram_max_bfs_breadth") if ngram else None,
        ngram_max_trie_depth=info.get("speculative_ngram_max_trie_depth") if ngram else None,
    )


def server_accept_length(info: dict) -> float | None:
    """internal_states[0].avg_spec_accept_length of /server_info (the server's running tau)."""
    states = info.get("internal_states")
    if isinstance(states, list) and states and isinstance(states[0], dict):
        return _as(states[0].get("avg_spec_accept_length"), float)
    return None


# ---------------------------------------------------------------------------------------------
# the client

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

    def flush_cache(self, timeout_s: float = 30.0) -> None:
        """POST /flush_cache: the server drops its caches once idle (waiting up to timeout_s). On an
        NGRAM server this empties the n-gram cache (SGLang 0.5.14: Scheduler.flush_cache ->
        NGRAMWorker.clear_cache_pool -> NgramCorpus.reset; the reference server likewise). UserError
        when the server refuses (requests still running after timeout_s)."""
        r = self._request("POST", f"/flush_cache?timeout={timeout_s:g}")
        if r.status_code != 200:
            raise UserError(f"{self.url}/flush_cache: HTTP {r.status_code}: {_error_message(r)}")

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
