"""The project's reference server: a local target behind SGLang's HTTP API, one request at a time.

    python -m draftlab.server --model-path models/tiny-target --port 30000 [--host 127.0.0.1]
        [--dtype auto] [--device auto] [--reasoning-parser deepseek-r1|qwen3]

Endpoints, in SGLang's shapes so one client talks to both:
  GET  /health                 200 once the model is loaded
  GET  /server_info            the launch settings (+ internal_states, as SGLang reports them)
  GET  /v1/models              the served model
  POST /generate               SGLang native: {"text" | "input_ids", "sampling_params", "rid"}
  POST /v1/chat/completions    OpenAI chat, non-streaming (reasoning_content with --reasoning-parser)

It is a reference, not a production server: requests are served one at a time (a lock), with
a plain KV-cache decode loop in `Engine.generate`. Greedy output equals transformers'
`model.generate(do_sample=False)` token for token.

Seam for speculative decoding: everything HTTP-side calls only `engine.generate(input_ids,
SamplingParams) -> Completion` and `engine.info()`. A speculative engine (draft proposes,
target verifies) implements the same two methods, adds its counters to Completion.meta
(SGLang's spec_verify_ct, spec_accept_length) and is chosen in `load_engine()` from SGLang's
flags (--speculative-algorithm EAGLE3 --speculative-draft-model-path ...).
"""
from __future__ import annotations

import argparse
import inspect
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field

import torch

from draftlab.errors import UserError

VERSION = "draftlab-reference"
DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's /generate default when sampling_params has none

# SGLang's reasoning parsers for <think> models: (start, end, force_reasoning). force_reasoning
# means the text is reasoning until </think> even without a <think> (the DeepSeek-R1 template
# puts <think> in the prompt).
REASONING_PARSERS = {"deepseek-r1": ("<think>", "</think>", True), "qwen3": ("<think>", "</think>", False)}


@dataclass
class SamplingParams:
    """SGLang's sampling_params (the subset we serve). temperature 0 = greedy."""

    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 = all tokens
    seed: int | None = None  # SGLang: sampling_seed; OpenAI: seed
    stop: list[str] = field(default_factory=list)  # stop strings, cut from the text
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False  # keep generating past EOS (fixed-length benchmarks)


@dataclass
class Completion:
    output_ids: list[int]  # generated tokens, the stop token included (as SGLang counts them)
    text: str  # decoded without special tokens, cut at a matched stop string
    finish_reason: dict  # SGLang: {"type": "stop", "matched": id|str} or {"type": "length", "length": n}
    meta: dict = field(default_factory=dict)  # extra meta_info (speculative counters)


class Engine:
    """Plain autoregressive decoding of a transformers causal LM with a KV cache."""

    def __init__(self, model, tokenizer, device: str, context_length: int | None = None):
        self.model, self.tokenizer, self.device = model, tokenizer, device
        cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.context_length = context_length or getattr(cfg, "max_position_embeddings", None) or tokenizer.model_max_length
        # transformers 5 renamed the KV-cache argument `past_key_values` to `cache`
        self._cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        eos = model.generation_config.eos_token_id
        eos = eos if isinstance(eos, list) else [eos]
        self.eos_ids = {i for i in [*eos, tokenizer.eos_token_id] if i is not None}

    def info(self) -> dict:
        return {"context_length": self.context_length, "speculative_algorithm": None}

    @torch.inference_mode()
    def generate(self, input_ids: list[int], sp: SamplingParams) -> Completion:
        if len(input_ids) >= self.context_length:
            raise ValueError(
                f"The input ({len(input_ids)} tokens) is longer than the model's context length ({self.context_length} tokens)."
            )
        max_new = min(sp.max_new_tokens, self.context_length - len(input_ids))
        stop_ids = set(sp.stop_token_ids) | (set() if sp.ignore_eos else self.eos_ids)
        gen = torch.Generator(device=self.device)
        gen.manual_seed(sp.seed if sp.seed is not None else int(torch.randint(2**62, ())))
        out_ids: list[int] = []
        finish = {"type": "length", "length": max_new}
        x, past, cut = torch.tensor([input_ids], device=self.device), None, None
        for _ in range(max_new):
            # logits_to_keep=1 and float32 logits: the exact computation transformers' generate runs
            out = self.model(input_ids=x, use_cache=True, logits_to_keep=1, **{self._cache_arg: past})
            past = getattr(out, self._cache_arg)
            tok = _pick(out.logits[0, -1].float(), sp, gen)
            out_ids.append(tok)
            if tok in stop_ids:
                finish = {"type": "stop", "matched": tok}
                break
            if sp.stop:
                text = self.decode(out_ids)
                hits = [(text.find(s), s) for s in sp.stop if s and s in text]
                if hits:
                    cut, matched = min(hits)
                    finish = {"type": "stop", "matched": matched}
                    break
            x = torch.tensor([[tok]], device=self.device)
        text = self.decode(out_ids)
        return Completion(out_ids, text[:cut] if cut is not None else text, finish)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


class SpecEngine(Engine):
    """EAGLE-3 speculative decoding (draftlab.spec_engine) behind the same interface.

    The draft is loaded from the EXPORTED directory with the project's loader, and the target
    layers it is fed are the ones SGLang `sglang_version` would capture for that config: a
    miswired export misbehaves here exactly as it would in SGLang.
    """

    def __init__(self, model, tokenizer, device, context_length, draft_path: str, num_steps: int, topk: int,
                 num_draft_tokens: int, sglang_version: str):
        super().__init__(model, tokenizer, device, context_length)
        from draftlab.sglang.checkpoint import load_exported
        from draftlab.sglang.layers import captured_physical

        embed = model.get_input_embeddings().weight
        self.draft, config = load_exported(draft_path, embed=embed, dtype=embed.dtype, as_sglang=True)
        self.draft.to(device)
        cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        self.physical = captured_physical(model.config.architectures[0], cfg.num_hidden_layers, ids, sglang_version)
        want = self.draft.fc.weight.shape[1] // cfg.hidden_size
        if len(self.physical) != want:  # SGLang fails on the fc width at the first request
            raise UserError(f"{draft_path}: fc takes {want} target layers but SGLang {sglang_version} would capture "
                            f"{len(self.physical)} (physical {self.physical}) for eagle_config ids {ids}")
        self.flags = {"speculative_algorithm": "EAGLE3", "speculative_num_steps": num_steps,
                      "speculative_eagle_topk": topk, "speculative_num_draft_tokens": num_draft_tokens}
        self.totals = {"completion_tokens": 0, "verify_ct": 0}

    def info(self) -> dict:
        from draftlab.metrics import pooled_tau

        t = self.totals
        avg = pooled_tau([t["completion_tokens"]], [t["verify_ct"]]) if t["verify_ct"] else None
        return {"context_length": self.context_length, **self.flags, "capture_physical_layers": self.physical,
                "avg_spec_accept_length": avg}

    @torch.inference_mode()
    def generate(self, input_ids: list[int], sp: SamplingParams) -> Completion:
        from draftlab import spec_engine

        if len(input_ids) >= self.context_length:
            raise ValueError(f"The input ({len(input_ids)} tokens) is longer than the model's context length ({self.context_length} tokens).")
        if sp.stop:
            raise ValueError("stop strings are not supported with speculative decoding by the reference server")
        # Drafts run up to num_steps positions past the output: keep them inside the context.
        max_new = min(sp.max_new_tokens, self.context_length - len(input_ids) - self.flags["speculative_num_steps"] - 1)
        gen = torch.Generator(device=self.device)
        gen.manual_seed(sp.seed if sp.seed is not None else int(torch.randint(2**62, ())))
        stop_ids = set(sp.stop_token_ids) | self.eos_ids
        r = spec_engine.generate(
            self.model, self.draft, input_ids, num_steps=self.flags["speculative_num_steps"],
            topk=self.flags["speculative_eagle_topk"], num_draft_tokens=self.flags["speculative_num_draft_tokens"],
            max_new_tokens=max(1, max_new), temperature=sp.temperature, top_k=sp.top_k, top_p=sp.top_p,
            eos_token_id=stop_ids, ignore_eos=sp.ignore_eos, physical_layers=self.physical, generator=gen,
        )
        self.totals["completion_tokens"] += len(r.output_ids)
        self.totals["verify_ct"] += r.spec_verify_ct
        correct = sum(a * n for a, n in enumerate(r.accept_hist))
        proposed = r.spec_verify_ct * self.flags["speculative_num_steps"]
        meta = {
            **r.meta(),
            "spec_num_correct_drafts": correct,
            "spec_num_proposed_drafts": proposed,
            "spec_accept_rate": correct / proposed if proposed else 0.0,
            "spec_correct_drafts_histogram": list(r.accept_hist),
            # per depth i+1: steps that reached it with a draft there, and of those how many accepted it
            "spec_proposed_per_depth": list(r.proposed),
            "spec_accepted_per_depth": list(r.accepted),
        }
        if not r.spec_verify_ct:  # one token from the prefill alone: no verify step, tau undefined (JSON has no NaN)
            meta["spec_accept_length"] = None
        return Completion(r.output_ids, self.decode(r.output_ids), r.finish_reason, meta)


def aux_hidden_states(engine, input_ids: list[int]) -> list[list[float]]:
    """What `return_hidden_states` returns per prompt token, as SGLang does: for an EAGLE3 server
    the aux concatenation the draft is fed (k x hidden wide), else the final hidden state."""
    from draftlab.extract import decoder_layers
    from draftlab.extract import AuxCapture

    physical = getattr(engine, "physical", None) or [len(decoder_layers(engine.model)[1])]
    with torch.inference_mode(), AuxCapture(engine.model, physical) as cap:
        engine.model(input_ids=torch.tensor([input_ids], device=engine.device), use_cache=False)
        return cap.take()[0].float().cpu().tolist()


def _pick(logits: torch.Tensor, sp: SamplingParams, gen: torch.Generator) -> int:
    """Next token: argmax for temperature ~0, else temperature + top-k + top-p sampling."""
    if sp.temperature < 1e-5:  # SGLang treats this as greedy too
        return int(torch.argmax(logits))
    logits = logits / sp.temperature
    if 0 < sp.top_k < logits.numel():
        kth = torch.topk(logits, sp.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if sp.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        drop = (torch.cumsum(sorted_p, 0) - sorted_p) > sp.top_p  # keep the smallest set with mass >= top_p
        sorted_p[drop] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
    return int(torch.multinomial(probs, 1, generator=gen))


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

    def run(input_ids: list[int], sp: SamplingParams, rid: str | None, hidden: bool = False) -> dict:
        t0 = time.perf_counter()
        with lock:
            c = engine.generate(input_ids, sp)
            extra = {"hidden_states": aux_hidden_states(engine, input_ids)} if hidden else {}
        return {
            "text": c.text,
            "output_ids": c.output_ids,
            "meta_info": {
                "id": rid or uuid.uuid4().hex,
                "finish_reason": c.finish_reason,
                "prompt_tokens": len(input_ids),
                "completion_tokens": len(c.output_ids),
                "cached_tokens": 0,
                "e2e_latency": time.perf_counter() - t0,  # seconds, queueing for the lock included
                **c.meta,
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
            sp = _sampling_params(body.get("sampling_params") or {})
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
            outs = [run(p, sp, r, hidden) for p, r in zip(prompts, rids)]
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
            sp = _sampling_params({
                "max_new_tokens": max_tokens,
                "temperature": body.get("temperature", 1.0),
                "top_p": body.get("top_p", 1.0),
                "top_k": body.get("top_k", -1),
                "sampling_seed": body.get("seed"),
                "stop": body.get("stop"),
                "stop_token_ids": body.get("stop_token_ids"),
                "ignore_eos": body.get("ignore_eos", False),
            })
            out = run(input_ids, sp, None)
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
    """The engine the flags ask for. The speculative engine plugs in here."""
    from draftlab.params import TargetParams
    from draftlab.target import load_target, resolve_device

    device = resolve_device(args.device)
    dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if device == "cuda" else "float32")
    tp = TargetParams(model=args.model_path, revision=args.revision, dtype=dtype, device=device)
    model, tok = load_target(tp, device)
    if args.speculative_algorithm is None:
        return Engine(model, tok, device, args.context_length)
    if args.speculative_algorithm != "EAGLE3":
        raise UserError(f"--speculative-algorithm {args.speculative_algorithm}: the reference server runs EAGLE3 only")
    if not args.speculative_draft_model_path:
        raise UserError("EAGLE3 needs --speculative-draft-model-path")
    apply_sglang_rules(args, model.config.architectures[0])
    return SpecEngine(model, tok, device, args.context_length, args.speculative_draft_model_path, args.speculative_num_steps,
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
