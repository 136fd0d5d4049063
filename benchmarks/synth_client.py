"""How many conversation turns a second the openai synthesis client can drive, servers aside.

    python benchmarks/synth_client.py [--servers 4] [--concurrency 1024] [--latency-s 1.0]
        [--conversations 3000] [--turns 3] [--answer-words 300] [--tokenizer PATH_OR_HUB_ID]
        [--workers-per-client N] [--profile]
    python benchmarks/synth_client.py --quick      # a few seconds, the defaults scaled down

The synthesize stage's openai/sglang backend (draftlab.data.synth.OpenAIBackend) keeps
`synth.concurrency` conversations in flight over several servers. When the client itself is
slow, the servers sit idle between requests and synthesis runs below the GPU's pace: with one
HTTP client for 1,024 requests in flight, httpx's pool spent 85% of the client's time scanning
its connections, and 4 SGLang servers of SmolLM2 on one H200 gave 15.5k tok/s.

Method. `--servers` stand-in OpenAI servers (plain asyncio, one process each) answer every chat
completion after `--latency-s` seconds with the same `--answer-words`-word answer, as a GPU server
answers a batch member after its decode time. The client answers `--conversations` synthetic
conversations of `--turns` user turns each, every turn asked after the previous answer, exactly
as the stage does (context check included: it renders and tokenizes each conversation so far
with `--tokenizer`'s chat template; the default is a small byte-level tokenizer built here).
Printed: turns a second, the bound `concurrency / latency` that an ideal client reaches, the
share of that bound reached, and tok/s at the answer's word count (a word is about a token).
`--workers-per-client 1024` puts every request on one HTTP client, as before.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def stand_in(port: int, latency_s: float, answer_words: int) -> None:
    """One stand-in server: /v1/models and /v1/chat/completions, HTTP/1.1 keep-alive."""
    answer = "Sure. " + "word " * answer_words
    body = json.dumps({"id": "c", "object": "chat.completion", "choices": [
        {"index": 0, "message": {"role": "assistant", "content": answer}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 0, "completion_tokens": answer_words, "total_tokens": answer_words}}).encode()
    models = json.dumps({"object": "list", "data": [{"id": "stand-in", "object": "model"}]}).encode()

    async def handle(reader, writer):
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError, ValueError):
            while line := await reader.readline():
                path, length = line.split(b" ")[1], 0
                while (header := await reader.readline()) not in (b"\r\n", b""):
                    name, _, value = header.partition(b":")
                    length = int(value) if name.strip().lower() == b"content-length" else length
                await reader.readexactly(length)
                out = models if path.endswith(b"/models") else body
                if out is body:
                    await asyncio.sleep(latency_s)
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                             % (len(out), out))
                await writer.drain()
        writer.close()

    async def serve():
        server = await asyncio.start_server(handle, "127.0.0.1", port, backlog=8192)
        async with server:
            await server.serve_forever()

    asyncio.run(serve())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_up(port: int, timeout_s: float = 30.0) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
            return
        time.sleep(0.05)
    raise SystemExit(f"stand-in server on port {port} did not come up in {timeout_s:g} s")


def tokenizer(name: str | None):
    if name:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(name)
    sys.path.insert(0, str(ROOT / "tools"))
    from micro_targets import make_tokenizer

    return make_tokenizer(model_max_length=10**6)  # no warning for long conversations: the benchmark's are


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--servers", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=1024, help="conversations in flight (synth.concurrency)")
    ap.add_argument("--latency-s", type=float, default=1.0, help="seconds a stand-in server takes per answer")
    ap.add_argument("--conversations", type=int, default=3000)
    ap.add_argument("--turns", type=int, default=3, help="user turns per conversation")
    ap.add_argument("--answer-words", type=int, default=300)
    ap.add_argument("--tokenizer", help="a tokenizer folder or hub id with a chat template (default: a small one built here)")
    ap.add_argument("--workers-per-client", type=int, help="conversations per HTTP client (default: the stage's)")
    ap.add_argument("--profile", action="store_true", help="print the client's top functions (cProfile; slows it)")
    ap.add_argument("--quick", action="store_true", help="2 servers, 64 in flight, 0.2 s latency, 300 conversations")
    ap.add_argument("--out", help="also write the figures to this JSON file")
    args = ap.parse_args()
    if args.quick:
        args.servers, args.concurrency, args.latency_s, args.conversations = 2, 64, 0.2, 300
    if args.servers < 1 or args.concurrency < 1 or args.conversations < 1 or args.turns < 1 or args.latency_s < 0:
        raise SystemExit("--servers, --concurrency, --conversations and --turns must be >= 1, --latency-s >= 0")

    from draftlab.data import synth
    from draftlab.params import SynthParams

    if args.workers_per_client:
        synth.WORKERS_PER_CLIENT = args.workers_per_client
    ports = [free_port() for _ in range(args.servers)]
    code = "import sys; sys.path.insert(0, sys.argv[1]); from synth_client import stand_in; stand_in(int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4]))"
    procs = [subprocess.Popen([sys.executable, "-c", code, str(Path(__file__).parent), str(p), str(args.latency_s),
                               str(args.answer_words)]) for p in ports]
    try:
        for p in ports:
            wait_up(p)
        params = SynthParams(base_url="", model_name="stand-in", api_key_env="SYNTH_API_KEY", max_new_tokens=args.answer_words + 1,
                             temperature=0.0, top_p=1.0, seed=0, batch_size=1, concurrency=args.concurrency, timeout_s=600.0,
                             max_retries=2, retry_backoff_s=0.5, server_args=[], startup_timeout_s=1.0, backend="openai",
                             reasoning="keep")
        tok = tokenizer(args.tokenizer)
        backend = synth.OpenAIBackend(tok, params, context_length=10**9, base_urls=[f"http://127.0.0.1:{p}/v1" for p in ports])
        rows = [{"id": f"c{i}", "messages": [{"role": "user", "content": f"Question {i}: " + "tell me more " * 20}],
                 "next_turns": ["And then? " * 15] * (args.turns - 1)} for i in range(args.conversations)]
        results = []
        profiler = None
        if args.profile:
            import cProfile

            profiler = cProfile.Profile()
            profiler.enable()
        t0 = time.perf_counter()
        backend.answer(rows, lambda row, reply, err: results.append((reply, err)))
        seconds = time.perf_counter() - t0
        if profiler:
            import pstats

            profiler.disable()
            pstats.Stats(profiler).sort_stats("tottime").print_stats(15)
    finally:
        for p in procs:
            p.terminate()
    turns = sum(len(r.answers) for r, _ in results if r)
    errors = [e for _, e in results if e]
    bound = args.concurrency / args.latency_s if args.latency_s else float("inf")
    rate = turns / seconds
    print(f"clients of {synth.WORKERS_PER_CLIENT} conversations, {args.concurrency} in flight over {args.servers} stand-in "
          f"servers answering in {args.latency_s:g} s:")
    print(f"  {turns:,} turns of {args.conversations:,} conversations in {seconds:.1f} s: {rate:,.0f} turns/s "
          f"({rate / bound:.0%} of the ideal {bound:,.0f}), {rate * args.answer_words:,.0f} tok/s at {args.answer_words} "
          f"tokens an answer; requests per server {backend.info['requests_per_server']}; errors {len(errors)}"
          + (f" (first: {errors[0]})" if errors else ""))
    if args.out:
        Path(args.out).write_text(json.dumps({
            "workers_per_client": synth.WORKERS_PER_CLIENT, "concurrency": args.concurrency, "servers": args.servers,
            "latency_s": args.latency_s, "conversations": args.conversations, "turns": turns, "errors": len(errors),
            "seconds": round(seconds, 3), "turns_per_s": round(rate, 1), "ideal_turns_per_s": bound,
            "requests_per_server": backend.info["requests_per_server"]}, indent=1) + "\n")


if __name__ == "__main__":
    main()
