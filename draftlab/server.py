"""The project's reference server: a local target behind SGLang's HTTP API, one request at a time.

    python -m draftlab.server --model-path models/tiny-target --port 30000 [--host 127.0.0.1]
        [--dtype auto] [--device auto] [--reasoning-parser deepseek-r1|qwen3]

Endpoints, in SGLang's shapes so one client talks to both:
  GET  /health                 200 once the model is loaded
  GET  /server_info            the launch settings (+ internal_states, as SGLang reports them)
  GET  /v1/models              the served model
  POST /generate               SGLang native: {"text" | "input_ids", "sampling_params", "rid"}
  POST /v1/chat/completions    OpenAI chat, non-streaming (reasoning_content with --reasoning-parser)

It is a reference, not a production server: requests are served one at a time (a lock). This
module is the HTTP side only: request parsing and validation, the reasoning parser, the CLI.
Decoding is draftlab.engine's: everything here calls only `engine.generate(input_ids,
SamplingParams) -> Completion`, `engine.info()` and `engine.hidden_states(input_ids)`. The
speculative engine (draft proposes, target verifies) is chosen in `load_engine()` from SGLang's
flags (--speculative-algorithm EAGLE3 --speculative-draft-model-path ...) and adds its counters
to Completion.meta (SGLang's spec_verify_ct, spec_accept_length).
"""
from __future__ import annotations

import argparse
import sys
import threading
import time
import uuid

from draftlab.engine import DEFAULT_MAX_NEW_TOKENS, Engine, SamplingParams, SpecEngine
from draftlab.errors import UserError

VERSION = "draftlab-reference"

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
    lock = threading.Lock()  # one request at a time: sync endpoints run in a thread pool

    def run(input_ids: list[int], sampling: SamplingParams, rid: str | None, hidden: bool = False) -> dict:
        t0 = time.perf_counter()
        with lock:
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

    def bad_request(message: str, openai: bool = False):
        body = {"object": "error", "message": message, "type": "BadRequestError", "code": 400} if openai else {"error": {"message": message}}
        return JSONResponse(body, status_code=400)

    @app.get("/health")
    def health():
        return Response(status_code=200)

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
            sampling = _sampling_params(body.get("sampling_params") or {})
            text, ids = body.get("text"), body.get("input_ids")
            if (text is None) == (ids is None):
                raise ValueError("give exactly one of 'text' and 'input_ids'")
            batch = isinstance(text, list) or (isinstance(ids, list) and ids and isinstance(ids[0], list))
            prompts = (text if batch else [text]) if text is not None else (ids if batch else [ids])
            prompts = [engine.tokenizer(p, add_special_tokens=True)["input_ids"] if isinstance(p, str) else [int(t) for t in p] for p in prompts]
            rids = body.get("rid")
            rids = rids if isinstance(rids, list) else [rids] * len(prompts)
            hidden = bool(body.get("return_hidden_states", False))
            if hidden and not server_args.get("enable_return_hidden_states"):
                raise ValueError("return_hidden_states needs a server started with --enable-return-hidden-states")
            outs = [run(p, sampling, r, hidden) for p, r in zip(prompts, rids)]
        except (ValueError, TypeError) as e:
            return bad_request(str(e))
        return outs if batch else outs[0]

    @app.post("/v1/chat/completions")
    def chat(body: dict):
        try:
            if body.get("stream"):
                raise ValueError("stream=true is not supported by the reference server")
            if body.get("n", 1) != 1:
                raise ValueError("only n=1 is supported")
            messages = [{**m, "content": _text_content(m.get("content"))} for m in body["messages"]]
            input_ids = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
            max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or engine.info()["context_length"]
            sampling = _sampling_params({
                "max_new_tokens": max_tokens,
                "temperature": body.get("temperature", 1.0),
                "top_p": body.get("top_p", 1.0),
                "top_k": body.get("top_k", -1),
                "sampling_seed": body.get("seed"),
                "stop": body.get("stop"),
                "stop_token_ids": body.get("stop_token_ids"),
                "ignore_eos": body.get("ignore_eos", False),
            })
            out = run(input_ids, sampling, None)
        except (KeyError, ValueError, TypeError) as e:
            return bad_request(f"{type(e).__name__}: {e}", openai=True)
        meta = out["meta_info"]
        content, reasoning = out["text"], None
        if reasoning_parser and body.get("separate_reasoning", True):
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


def _sampling_params(raw: dict) -> SamplingParams:
    stop = raw.get("stop") or []
    return SamplingParams(
        max_new_tokens=int(raw.get("max_new_tokens") or DEFAULT_MAX_NEW_TOKENS),
        temperature=float(raw.get("temperature", 1.0)),
        top_p=float(raw.get("top_p", 1.0)),
        top_k=int(raw.get("top_k", -1)),
        seed=None if raw.get("sampling_seed") is None else int(raw["sampling_seed"]),
        stop=[stop] if isinstance(stop, str) else list(stop),
        stop_token_ids=[int(t) for t in raw.get("stop_token_ids") or []],
        ignore_eos=bool(raw.get("ignore_eos", False)),
    )


def _text_content(content) -> str:
    """OpenAI message content: a string, or a list of {"type": "text", "text": ...} parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(p["text"] for p in content)
    raise ValueError("message content must be a string or a list of text parts")


# ---------------------------------------------------------------------------------------------


def load_engine(args) -> Engine:
    """The engine the flags ask for (draftlab.engine): plain, or EAGLE3 with SGLang's flag rules applied."""
    from draftlab.params import TargetParams
    from draftlab.target import load_target, resolve_device

    device = resolve_device(args.device)
    dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if device == "cuda" else "float32")
    target_params = TargetParams(model=args.model_path, revision=args.revision, dtype=dtype, device=device)
    model, tokenizer = load_target(target_params, device)
    if args.speculative_algorithm is None:
        return Engine(model, tokenizer, device, args.context_length)
    if args.speculative_algorithm != "EAGLE3":
        raise UserError(f"--speculative-algorithm {args.speculative_algorithm}: the reference server runs EAGLE3 only")
    if not args.speculative_draft_model_path:
        raise UserError("EAGLE3 needs --speculative-draft-model-path")
    apply_sglang_rules(args, model.config.architectures[0])
    return SpecEngine(model, tokenizer, device, args.context_length, args.speculative_draft_model_path, args.speculative_num_steps,
                      args.speculative_eagle_topk, args.speculative_num_draft_tokens, args.sglang_version)


def apply_sglang_rules(args, target_architecture: str) -> None:
    """Fill and adjust the speculative flags in `args` as SGLang `args.sglang_version` does at start-up,
    printing SGLang's own warning for each change, so that logs, /server_info and the engine agree
    with what a real SGLang would run (draftlab.sglang.flags holds the rules)."""
    from draftlab.sglang.flags import SpecFlags, resolve

    res = resolve(SpecFlags(args.speculative_algorithm, args.speculative_num_steps, args.speculative_eagle_topk,
                            args.speculative_num_draft_tokens), target_architecture, args.sglang_version)
    if res.errors:
        raise UserError("; ".join(str(f) for f in res.errors))
    for f in res.findings:
        if f.sglang_message:
            print(f"WARNING {f.sglang_message}", flush=True)
    eff = res.effective
    args.speculative_num_steps, args.speculative_eagle_topk, args.speculative_num_draft_tokens = eff.num_steps, eff.topk, eff.num_draft_tokens


def launch_command(model_path: str, port: int, host: str = "127.0.0.1", **flags) -> list[str]:
    """argv that starts this server; `flags` become --kebab-case options (None values omitted).

    For draftlab.lifecycle.serve: serve(launch_command(m, port), f"http://127.0.0.1:{port}", log).
    """
    argv = [sys.executable, "-m", "draftlab.server", "--model-path", str(model_path), "--port", str(port), "--host", host]
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
    ap.add_argument("--speculative-algorithm", default=None, choices=["EAGLE3", "EAGLE"])
    ap.add_argument("--speculative-draft-model-path", default=None, help="an exported draft directory")
    ap.add_argument("--speculative-num-steps", type=int, default=None)
    ap.add_argument("--speculative-eagle-topk", type=int, default=None)
    ap.add_argument("--speculative-num-draft-tokens", type=int, default=None)
    ap.add_argument("--sglang-version", default="0.5.14", help="whose layer-capture rule to apply to the draft's eagle_config")
    ap.add_argument("--enable-return-hidden-states", action="store_true")
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
