"""The project's reference server: a local target behind SGLang's HTTP API, one request at a time.

    python -m draftlab.server --model-path models/tiny-target --port 30000 [--host 127.0.0.1]
        [--dtype auto] [--device auto] [--reasoning-parser deepseek-r1|qwen3]

Endpoints, in SGLang's shapes so one client talks to both:
  GET  /health                 200 once the model is loaded
  GET  /server_info            the launch settings (+ internal_states, as SGLang reports them)
  GET  /v1/models              the served model
  POST /generate               SGLang native: {"text" | "input_ids", "sampling_params", "rid"}; a batch
                               may give one sampling_params object per prompt (a list)
  POST /v1/chat/completions    OpenAI chat, non-streaming (reasoning_content with --reasoning-parser)
  GET|POST /flush_cache        drop the caches kept between requests (an NGRAM server's n-gram cache)

Malformed requests get a 400 naming the field and what it allows, in SGLang's error shapes
({"error": {"message": ...}} for /generate, OpenAI's {"object": "error", ...} for /v1/...), never
a 500: input_ids must be integers in [0, vocab_size), temperature finite >= 0, top_p in (0, 1],
top_k -1 or >= 1, and so on (`_sampling_params`, `Engine.check_request`). max_new_tokens (and the
chat max_tokens) follow SGLang's SamplingParams.verify: 0 is allowed and answers an empty
completion with finish_reason {"type": "length", "length": 0} (the engine is not called); a
negative value is a 400 "max_new_tokens must be at least 0, got N."; null or absent means the
default (128 for /generate, the context for chat).

Context length, as SGLang 0.5.14 validates it (TokenizerManager._validate_one_request): a prompt
that, with the draft tokens a speculative server reserves (max(topk * num_steps, num_draft_tokens)),
does not leave room for one token is a 400 "The input (N tokens) is longer than the model's context
length (C tokens)."; an explicit max_new_tokens (chat: max_tokens) that takes input + reserved +
max_new_tokens past the context is a 400 "Requested token count exceeds the model's maximum context
length of C tokens. ...". Without max_new_tokens nothing is checked beyond the prompt, and
generation stops at the context.

Request size: a body over --max-request-bytes (32 MiB by default) is a 413 before it is read
whole: at once when its Content-Length says so, else as soon as that much has arrived.

It is a reference, not a production server: requests are served one at a time (a lock). This
module is the HTTP side only: request parsing and validation, the reasoning parser, the CLI.
Decoding is draftlab.engine.runners's: everything here calls only `engine.generate(input_ids,
SamplingParams) -> Completion`, `engine.info()` and `engine.hidden_states(input_ids)`. The
speculative engine (draft proposes, target verifies) is chosen in `load_engine()` from SGLang's
flags (--speculative-algorithm EAGLE3 --speculative-draft-model-path ..., or NGRAM with
--speculative-num-draft-tokens and --speculative-ngram-max-bfs-breadth: drafts from a cache of
earlier text, draftlab.engine.ngram) and adds its counters to Completion.meta (SGLang's spec_verify_ct,
spec_accept_length). GET or POST /flush_cache empties what an engine keeps between requests (the
NGRAM cache), as SGLang's does.
"""
from __future__ import annotations

import argparse
import math
import sys
import threading
import time
import uuid

from draftlab.engine.runners import (
    DEFAULT_MAX_NEW_TOKENS,
    Completion,
    ContextLengthError,
    Engine,
    NgramEngine,
    SamplingParams,
    SpecEngine,
    short_repr,
)
from draftlab.errors import UserError
from draftlab.engine.text_limits import max_token_bytes, refuse_oversize
from draftlab.engine.flag_words import draft_error, flags_error, target_error

VERSION = "draftlab-reference"
MAX_REQUEST_BYTES = 32 << 20  # --max-request-bytes: 32 MiB holds a 128k-token prompt as input_ids ~40 times over

# SGLang's reasoning parsers for <think> models: (start, end, force_reasoning). force_reasoning
# means the text is reasoning until </think> even without a <think> (the DeepSeek-R1 template
# puts <think> in the prompt).
REASONING_PARSERS = {"deepseek-r1": ("<think>", "</think>", True), "qwen3": ("<think>", "</think>", False)}


def parse_reasoning(text: str, parser: str) -> tuple[str | None, str]:
    """(reasoning_content, content) as SGLang's reasoning parser splits a completion."""
    start, end, force = REASONING_PARSERS[parser]
    if not (force or start in text):
        return None, text
    while text.startswith(start):
        text = text[len(start):]
    if end not in text:  # cut short while reasoning
        return text, ""
    reasoning, content = text.split(end, 1)
    return reasoning, content.strip()


# ---------------------------------------------------------------------------------------------
# HTTP


def build_app(engine, served_model_name: str, server_args: dict, reasoning_parser: str | None = None):
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, Response

    app = FastAPI(title="draftlab reference server")
    app.add_middleware(BodyLimit, max_bytes=server_args.get("max_request_bytes") or MAX_REQUEST_BYTES)
    token_bytes = max_token_bytes(engine.tokenizer)  # bounds a text's tokens before it is tokenized (draftlab.engine.text_limits)
    lock = threading.Lock()  # one request at a time: sync endpoints run in a thread pool

    def run(input_ids: list[int], sampling: SamplingParams, rid: str | None, hidden: bool = False) -> dict:
        t0 = time.perf_counter()
        with lock:
            if sampling.max_new_tokens == 0:  # SGLang allows 0: nothing is generated
                completion = Completion([], "", {"type": "length", "length": 0})
            else:
                completion = engine.generate(input_ids, sampling)
            extra = {"hidden_states": engine.hidden_states(input_ids)} if hidden else {}
        return {
            "text": completion.text,
            "output_ids": completion.output_ids,
            "meta_info": {
                "id": rid or uuid.uuid4().hex,
                "finish_reason": completion.finish_reason,
                "prompt_tokens": len(input_ids),
                "completion_tokens": len(completion.output_ids),
                "cached_tokens": 0,
                "e2e_latency": time.perf_counter() - t0,  # seconds, queueing for the lock included
                **completion.meta,
                **extra,
            },
        }

    def bad_request(message: str, openai: bool = False, status: int = 400):
        body = {"object": "error", "message": message, "type": "BadRequestError", "code": status} if openai else {"error": {"message": message}}
        return JSONResponse(body, status_code=status)

    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException

    @app.exception_handler(HTTPException)
    def http_error(request, exc):
        """fastapi's own refusals (a body that is not UTF-8, an unknown path) in the endpoint's shape."""
        if exc.status_code == 400:
            return bad_request(f"the request body must be a JSON object ({exc.detail})", request.url.path.startswith("/v1/"))
        response = bad_request(str(exc.detail), request.url.path.startswith("/v1/"), exc.status_code)
        response.headers.update(exc.headers or {})  # e.g. a 405's Allow
        return response

    @app.exception_handler(RequestValidationError)
    def invalid_body(request, exc):
        """A body that is not a JSON object (bad JSON, a list, nothing): a 400 in the endpoint's shape."""
        detail = "; ".join(str(e.get("msg", e)) for e in exc.errors()[:3]) or "invalid"
        return bad_request(f"the request body must be a JSON object ({detail})", openai=request.url.path.startswith("/v1/"))

    @app.get("/health")
    def health():
        return Response(status_code=200)

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    def flush_cache():
        """As SGLang's: drop the caches kept between requests (an NGRAM server's n-gram cache)."""
        with lock:  # once no request runs, as SGLang flushes only when idle
            engine.flush()
        return Response("Cache flushed.\n", status_code=200)

    @app.get("/server_info")
    def server_info():
        info = engine.info()
        # SGLang reports its running accept length inside internal_states[0]; so does this server.
        return {**server_args, **info, "internal_states": [{"avg_spec_accept_length": info.get("avg_spec_accept_length")}],
                "version": VERSION}

    @app.get("/v1/models")
    def models():
        return {
            "object": "list",
            "data": [{"id": served_model_name, "object": "model", "created": int(time.time()), "owned_by": "sglang",
                      "root": server_args.get("model_path"), "max_model_len": engine.info()["context_length"]}],
        }

    @app.post("/generate")
    def generate(body: dict):
        try:
            raw = body.get("sampling_params")
            if not isinstance(raw, list):  # one object for every prompt: its faults named before the prompts'
                _sampling_params(_object(raw, "sampling_params"))
            if body.get("stream") not in (None, False):
                raise ValueError(f"stream must be false: the reference server does not stream, got {short_repr(body['stream'])}.")
            prompts, batch = _prompts(body, engine, token_bytes)
            raws = _batch_sampling(raw, len(prompts), batch)
            samplings = [_sampling_params(r) for r in raws]
            for p, r, sp in zip(prompts, raws, samplings):
                if r.get("max_new_tokens") is not None:  # SGLang checks input + max_new_tokens only when the request gives it
                    engine.check_total(len(p), sp.max_new_tokens)
            rids = _rids(body.get("rid"), len(prompts), batch)
            hidden = _bool(body.get("return_hidden_states"), "return_hidden_states", False)
            if hidden and not server_args.get("enable_return_hidden_states"):
                raise ValueError("return_hidden_states needs a server started with --enable-return-hidden-states")
            outs = [run(p, sp, r, hidden) for p, sp, r in zip(prompts, samplings, rids)]
        except (ValueError, TypeError) as e:
            return bad_request(str(e))
        return outs if batch else outs[0]

    @app.post("/v1/chat/completions")
    def chat(body: dict):
        try:
            if body.get("stream") not in (None, False):
                raise ValueError(f"stream must be false: the reference server does not stream, got {short_repr(body['stream'])}.")
            n = body.get("n")
            if n is not None and (isinstance(n, bool) or n != 1):
                raise ValueError(f"n must be 1: the reference server returns one choice, got {short_repr(n)}.")
            messages = _messages(body.get("messages"))
            separate = _bool(body.get("separate_reasoning"), "separate_reasoning", True)
            max_key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
            max_tokens = body.get(max_key)
            sampling = _sampling_params({
                "max_new_tokens": max_tokens,
                "temperature": body.get("temperature"),
                "top_p": body.get("top_p"),
                "top_k": body.get("top_k"),
                "sampling_seed": body.get("seed"),
                "stop": body.get("stop"),
                "stop_token_ids": body.get("stop_token_ids"),
                "ignore_eos": body.get("ignore_eos"),
            }, names={"max_new_tokens": max_key, "sampling_seed": "seed"})
            limit = server_args.get("context_length")
            if max_tokens and limit and max_tokens > limit:  # SGLang's OpenAIServingChat._validate_request, its words
                raise ContextLengthError(f"max_completion_tokens is too large: {max_tokens}.This model supports at most "
                                         f"{limit} completion tokens.")
            if max_tokens is None:
                sampling.max_new_tokens = engine.info()["context_length"]
            refuse_oversize("\n".join(m["content"] for m in messages), engine.tokenizer, engine.context_length, token_bytes,
                            "the messages' content")
            try:
                input_ids = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
            except Exception as e:  # a template's own rejection (jinja2 raise_exception, a key it needs)
                raise ValueError(f"messages: the chat template rejected them: {type(e).__name__}: {e}") from e
            engine.check_request(list(input_ids), "the templated prompt")
            if max_tokens is not None:
                engine.check_total(len(input_ids), max_tokens)
            out = run(input_ids, sampling, None)
        except ContextLengthError as e:  # SGLang's own message, as it answers it
            return bad_request(str(e), openai=True)
        except (KeyError, ValueError, TypeError) as e:
            return bad_request(f"{type(e).__name__}: {e}", openai=True)
        meta = out["meta_info"]
        content, reasoning = out["text"], None
        if reasoning_parser and separate:
            reasoning, content = parse_reasoning(content, reasoning_parser)
        finish = meta["finish_reason"]
        return {
            "id": meta["id"],
            "object": "chat.completion",
            "created": int(time.time()),
            "model": served_model_name,
            "choices": [{
                "index": 0,
                "message": {"role": "assistant", "content": content, "reasoning_content": reasoning},
                "finish_reason": finish["type"],
                "matched_stop": finish.get("matched"),
            }],
            "usage": {"prompt_tokens": meta["prompt_tokens"], "completion_tokens": meta["completion_tokens"],
                      "total_tokens": meta["prompt_tokens"] + meta["completion_tokens"]},
        }

    return app


class BodyLimit:
    """ASGI middleware: a request body over `max_bytes` is a 413 before it is read whole. A
    Content-Length over the limit is refused before one byte of the body is read; a body without
    one (chunked) as soon as what has arrived passes the limit. Only the refused request's
    connection is closed (uvicorn does, its body unread); the server goes on."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.strip().isdigit() and int(length) > self.max_bytes:
            return await self.refuse(scope, send, f"{int(length)} bytes")
        seen, started, refused = 0, False, False

        async def limited_receive():
            nonlocal seen, refused
            if refused:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes and not started:
                    # Answer now; the app sees a client gone (fastapi's body reader would turn an
                    # exception raised here into its own 400) and what it answers is dropped.
                    refused = True
                    await self.refuse(scope, send, f"{seen} bytes received so far")
                    return {"type": "http.disconnect"}
            return message

        async def watched_send(message):
            nonlocal started
            if refused:
                return
            started = started or message["type"] == "http.response.start"
            await send(message)

        await self.app(scope, limited_receive, watched_send)

    async def refuse(self, scope, send, size: str) -> None:
        from fastapi.responses import JSONResponse

        message = (f"the request body ({size}) is larger than this server's limit of {self.max_bytes} bytes "
                   f"(--max-request-bytes)")
        openai = scope.get("path", "").startswith("/v1/")
        body = {"object": "error", "message": message, "type": "BadRequestError", "code": 413} if openai else {"error": {"message": message}}
        await JSONResponse(body, status_code=413, headers={"connection": "close"})(scope, _no_body, send)


async def _no_body():
    return {"type": "http.disconnect"}


# Request validation: each raises ValueError with a message that names the field and what it
# allows (the endpoint turns it into a 400). Where SGLang's SamplingParams.verify has a message for
# the same check, the message is SGLang's.


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _batch_sampling(raw, n: int, batch: bool) -> list[dict]:
    """Each prompt's sampling_params object: one object for every prompt, or (a batch, as SGLang takes
    it) a list of one object per prompt."""
    if not isinstance(raw, list):
        return [_object(raw, "sampling_params")] * n
    if not batch or len(raw) != n:
        raise ValueError(f"sampling_params as a list needs a batch of as many prompts: got {len(raw)} for "
                         f"{n if batch else 'a single'} prompt{'s' if batch else ''}.")
    return [_object(r, f"sampling_params[{i}]") for i, r in enumerate(raw)]


def _object(v, field: str) -> dict:
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise ValueError(f"{field} must be a JSON object, got {type(v).__name__} {short_repr(v)}.")
    return v


def _bool(v, field: str, default: bool) -> bool:
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ValueError(f"{field} must be true or false, got {short_repr(v)}.")
    return v


def _number(v, field: str, default: float) -> float:
    if v is None:
        return default
    if not _is_number(v):
        raise ValueError(f"{field} must be a number, got {short_repr(v)}.")
    return float(v)


def _sampling_params(raw: dict, names: dict | None = None) -> SamplingParams:
    """SGLang's sampling_params, checked as SamplingParams.verify checks them; null means the
    default, as in SGLang. `names`: the request's own name for a key (the chat body's max_tokens, seed)."""
    name = lambda key: (names or {}).get(key, key)

    max_new = raw.get("max_new_tokens")
    if max_new is None:
        max_new = DEFAULT_MAX_NEW_TOKENS
    elif not _is_int(max_new):
        raise ValueError(f"{name('max_new_tokens')} must be an integer >= 0, got {short_repr(max_new)}.")
    elif max_new < 0:
        raise ValueError(f"{name('max_new_tokens')} must be at least 0, got {max_new}.")

    temperature = _number(raw.get("temperature"), name("temperature"), 1.0)
    if not math.isfinite(temperature) or temperature < 0.0:
        raise ValueError(f"{name('temperature')} must be a non-negative finite number, got {raw.get('temperature')}.")
    top_p = _number(raw.get("top_p"), name("top_p"), 1.0)
    if not 0.0 < top_p <= 1.0:  # NaN fails this too
        raise ValueError(f"{name('top_p')} must be in (0, 1], got {raw.get('top_p')}.")
    top_k = raw.get("top_k")
    if top_k is None:
        top_k = -1
    elif not _is_int(top_k) or not (top_k == -1 or top_k >= 1):
        raise ValueError(f"{name('top_k')} must be -1 (disable) or at least 1, got {short_repr(top_k)}.")

    seed = raw.get("sampling_seed")
    if seed is not None and (not _is_int(seed) or not -(2**63) <= seed < 2**64):
        raise ValueError(f"{name('sampling_seed')} must be an integer in [-2**63, 2**64), got {short_repr(seed)}.")

    stop = raw.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    elif not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise ValueError(f"{name('stop')} must be a string or a list of strings, got {short_repr(stop)}.")

    stop_ids = raw.get("stop_token_ids")
    if stop_ids is None:
        stop_ids = []
    elif not (isinstance(stop_ids, list) and all(_is_int(t) for t in stop_ids)):
        raise ValueError(f"{name('stop_token_ids')} must be a list of integer token ids, got {short_repr(stop_ids)}.")

    return SamplingParams(
        max_new_tokens=max_new,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        seed=seed,
        stop=list(stop),
        stop_token_ids=list(stop_ids),
        ignore_eos=_bool(raw.get("ignore_eos"), name("ignore_eos"), False),
    )


def _prompts(body: dict, engine, token_bytes: int) -> tuple[list[list[int]], bool]:
    """/generate's prompts as token ids, each checked by the engine, and whether it is a batch; a text
    too long for the context is refused before it is tokenized (draftlab.engine.text_limits)."""
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise ValueError("give exactly one of 'text' and 'input_ids'")
    if text is not None:
        if isinstance(text, str):
            texts, batch = [text], False
        elif isinstance(text, list) and text and all(isinstance(t, str) for t in text):
            texts, batch = text, True
        else:
            raise ValueError(f"text must be a string or a non-empty list of strings, got {short_repr(text)}.")
        fields = ["text (tokenized)" if not batch else f"text[{i}] (tokenized)" for i in range(len(texts))]
        for t, field in zip(texts, fields):
            _unicode(t, field.split(" ")[0])
            refuse_oversize(t, engine.tokenizer, engine.context_length, token_bytes, field.split(" ")[0])
        prompts = [list(engine.tokenizer(t, add_special_tokens=True)["input_ids"]) for t in texts]
    else:
        batch = isinstance(ids, list) and bool(ids) and all(isinstance(p, list) for p in ids)
        prompts = ids if batch else [ids]
        fields = [f"input_ids[{i}]" for i in range(len(prompts))] if batch else ["input_ids"]
    for p, field in zip(prompts, fields):
        engine.check_request(p, field)
    return prompts, batch


def _unicode(text: str, field: str) -> str:
    """`text`, or ValueError when it holds a lone UTF-16 surrogate (JSON allows "\\ud800" alone; it is
    not Unicode text, and the tokenizer would refuse it in its own words)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{field} holds a lone UTF-16 surrogate ({text[e.start]!a}) at character {e.start}: not Unicode text; "
                         "send each surrogate pair whole, or the character itself.") from None
    return text


def _rids(rid, n: int, batch: bool) -> list:
    if rid is None:
        return [None] * n
    if isinstance(rid, str):
        return [rid] * n
    if batch and isinstance(rid, list) and len(rid) == n and all(r is None or isinstance(r, str) for r in rid):
        return rid
    want = f"a list of {n} strings (one per prompt)" if batch else "a string"
    raise ValueError(f"rid must be {want}, got {short_repr(rid)}.")


CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


def _messages(messages) -> list[dict]:
    """OpenAI chat messages, checked: a non-empty list of {"role", "content"} objects."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"messages must be a non-empty list of {{'role', 'content'}} objects, got {short_repr(messages)}.")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"messages[{i}] must be an object with 'role' and 'content', got {short_repr(m)}.")
        if m.get("role") not in CHAT_ROLES:
            raise ValueError(f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, got {short_repr(m.get('role'))}.")
        if "reasoning_content" in m and not isinstance(m["reasoning_content"], str):
            raise ValueError(f"messages[{i}].reasoning_content must be a string, got {short_repr(m['reasoning_content'])}.")
        try:
            content = _unicode(_text_content(m.get("content")), "content")
        except ValueError as e:
            raise ValueError(f"messages[{i}].{e}") from None
        out.append({**m, "content": content})
    return out


def _text_content(content) -> str:
    """OpenAI message content: a string, or a list of {"type": "text", "text": ...} parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise ValueError(f"content must be a string or a list of {{'type': 'text', 'text': str}} parts, got {short_repr(content)}.")


# ---------------------------------------------------------------------------------------------


def load_engine(args) -> Engine:
    """The engine the flags ask for (draftlab.engine.runners): plain, or EAGLE3 with SGLang's flag rules applied."""
    from draftlab.params import TargetParams
    from draftlab.parallel import resolve_device
    from draftlab.target.load import load_target

    device = resolve_device(args.device)
    dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if device == "cuda" else "float32")
    target_params = TargetParams(model=args.model_path, revision=args.revision, dtype=dtype, device=device)
    try:
        model, tokenizer = load_target(target_params, device)
    except UserError as e:  # the loader speaks of params.yaml's target.*: say it with this server's flags
        raise UserError(target_error(str(e))) from None
    if args.speculative_algorithm is None:
        return Engine(model, tokenizer, device, args.context_length)
    if args.speculative_algorithm == "NGRAM":
        apply_sglang_rules(args, model.config.architectures[0])
        return NgramEngine(model, tokenizer, device, args.context_length, args.speculative_num_draft_tokens,
                           args.speculative_ngram_max_bfs_breadth, args.speculative_ngram_min_bfs_breadth,
                           args.speculative_ngram_max_trie_depth, args.speculative_num_steps)
    if args.speculative_algorithm != "EAGLE3":
        raise UserError(f"--speculative-algorithm {args.speculative_algorithm}: the reference server runs EAGLE3 and NGRAM only")
    if not args.speculative_draft_model_path:
        raise UserError("EAGLE3 needs --speculative-draft-model-path")
    try:
        apply_sglang_rules(args, model.config.architectures[0])
    except UserError as e:
        raise UserError(flags_error(str(e))) from None
    try:
        return SpecEngine(model, tokenizer, device, args.context_length, args.speculative_draft_model_path, args.speculative_num_steps,
                          args.speculative_eagle_topk, args.speculative_num_draft_tokens, args.sglang_version)
    except UserError as e:
        raise UserError(draft_error(args.speculative_draft_model_path, str(e))) from None


def apply_sglang_rules(args, target_architecture: str) -> None:
    """Fill and adjust the speculative flags in `args` as SGLang `args.sglang_version` does at start-up,
    printing SGLang's own warning for each change, so that logs, /server_info and the engine agree
    with what a real SGLang would run (draftlab.sglang.flags holds the rules)."""
    from draftlab.sglang.flags import SpecFlags, resolve

    res = resolve(SpecFlags(args.speculative_algorithm, args.speculative_num_steps, args.speculative_eagle_topk,
                            args.speculative_num_draft_tokens, getattr(args, "max_running_requests", None),
                            ngram_min_bfs_breadth=getattr(args, "speculative_ngram_min_bfs_breadth", None),
                            ngram_max_bfs_breadth=getattr(args, "speculative_ngram_max_bfs_breadth", None),
                            ngram_max_trie_depth=getattr(args, "speculative_ngram_max_trie_depth", None)),
                  target_architecture, args.sglang_version)
    if res.errors:
        raise UserError("; ".join(str(f) for f in res.errors))
    for f in res.findings:
        if f.sglang_message:
            print(f"WARNING {f.sglang_message}", flush=True)
    eff = res.effective
    args.speculative_num_steps, args.speculative_eagle_topk, args.speculative_num_draft_tokens = eff.num_steps, eff.topk, eff.num_draft_tokens
    if eff.algorithm == "NGRAM":
        args.speculative_ngram_min_bfs_breadth = eff.ngram_min_bfs_breadth
        args.speculative_ngram_max_bfs_breadth = eff.ngram_max_bfs_breadth
        args.speculative_ngram_max_trie_depth = eff.ngram_max_trie_depth
    args.max_running_requests = eff.max_running_requests  # reported by /server_info, as SGLang does


def launch_command(model_path: str, port: int, host: str = "127.0.0.1", **flags) -> list[str]:
    """argv that starts this server; `flags` become --kebab-case options (None values omitted).

    For draftlab.lifecycle.serve: serve(launch_command(m, port), f"http://127.0.0.1:{port}", log).
    """
    argv = [sys.executable, "-m", "draftlab.engine.server", "--model-path", str(model_path), "--port", str(port), "--host", host]
    for name, value in flags.items():
        flag = f"--{name.replace('_', '-')}"
        if value is True:  # a switch
            argv.append(flag)
        elif value is not None and value is not False:
            argv += [flag, str(value)]
    return argv


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m draftlab.server", description="draftlab reference server (SGLang-compatible HTTP API)")
    ap.add_argument("--model-path", required=True, help="local directory or hub id of the target")
    ap.add_argument("--revision", default=None)
    ap.add_argument("--served-model-name", default=None, help="name in /v1/models (default: the model path)")
    ap.add_argument("--host", default="127.0.0.1", help="bind address; loopback by default (no auth here)")
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--context-length", type=int, default=None, help="default: the model's max_position_embeddings")
    ap.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS))
    ap.add_argument("--log-level", default="info")
    # Speculative decoding, with SGLang's flag names and meaning.
    ap.add_argument("--speculative-algorithm", default=None, choices=["EAGLE3", "EAGLE", "NGRAM"],
                    help="NGRAM: drafts looked up in a cache of earlier text (draftlab.engine.ngram), no draft model")
    ap.add_argument("--speculative-draft-model-path", default=None, help="an exported draft directory")
    ap.add_argument("--speculative-num-steps", type=int, default=None)
    ap.add_argument("--speculative-eagle-topk", type=int, default=None)
    ap.add_argument("--speculative-num-draft-tokens", type=int, default=None)
    ap.add_argument("--speculative-ngram-min-bfs-breadth", type=int, default=None, help="NGRAM: SGLang's default 1")
    ap.add_argument("--speculative-ngram-max-bfs-breadth", type=int, default=None,
                    help="NGRAM: the widest level of the draft tree (SGLang's default 10; topk is set to it)")
    ap.add_argument("--speculative-ngram-max-trie-depth", type=int, default=None,
                    help="NGRAM: the longest suffix matched, tokens (SGLang's default 18)")
    ap.add_argument("--sglang-version", default="0.5.14", help="whose layer-capture rule to apply to the draft's eagle_config")
    ap.add_argument("--max-running-requests", type=int, default=None,
                    help="SGLang's cap on requests in flight; unset with speculation, SGLang (and this server) sets 48")
    ap.add_argument("--enable-return-hidden-states", action="store_true")
    ap.add_argument("--max-request-bytes", type=int, default=MAX_REQUEST_BYTES,
                    help="largest request body served; a larger one is a 413 before it is read (default 32 MiB)")
    return ap.parse_args(argv)


def main(argv=None) -> None:
    import uvicorn

    args = parse_args(argv)
    try:
        engine = load_engine(args)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    name = args.served_model_name or args.model_path
    app = build_app(engine, name, vars(args), args.reasoning_parser)
    print(f"serving {args.model_path} on http://{args.host}:{args.port} (device {engine.device})", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False)


if __name__ == "__main__":
    main()
