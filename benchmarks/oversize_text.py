"""How fast the reference server refuses a prompt text too long for its context (draftlab.engine.text_limits),
against tokenizing the text whole as it did before, per text shape and context length.

    python benchmarks/oversize_text.py [--target models/tiny-target] [--mib 10] [--contexts 512,131072]

In process (fastapi's TestClient over build_app), so the figures are the server's own work: JSON
parsing, the bounds, and the tokenization they avoid. Prints one line per endpoint, shape and context.
"""
from __future__ import annotations

import argparse
import json
import random
import time

WORDS = ["alpha", "beta", "gamma", "12", "delta", "x", "foo", "bar", "ünï", "中文"]


def shapes(n_bytes: int) -> dict[str, str]:
    rng = random.Random(0)
    return {"words": " ".join(rng.choice(WORDS) for _ in range(n_bytes // 4))[:n_bytes], "one word": "a" * n_bytes,
            "spaces": " " * n_bytes}


def main() -> None:
    from fastapi.testclient import TestClient
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from draftlab.engine.runners import Engine
    from draftlab.engine.server import build_app

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="models/tiny-target")
    ap.add_argument("--mib", type=float, default=10.0, help="size of each text, MiB")
    ap.add_argument("--contexts", default="512,131072", help="context lengths to serve with, comma-separated")
    args = ap.parse_args()
    model, tok = AutoModelForCausalLM.from_pretrained(args.target), AutoTokenizer.from_pretrained(args.target)
    texts = shapes(int(args.mib * (1 << 20)))
    t0 = time.perf_counter()
    tok(texts["words"][: 1 << 20])["input_ids"]
    print(f"tokenizing 1 MiB of words whole: {time.perf_counter() - t0:.2f} s (the cost a refusal used to pay per MiB)")
    for context in (int(c) for c in args.contexts.split(",")):
        client = TestClient(build_app(Engine(model, tok, "cpu", context), "bench", {"model_path": args.target}))
        for shape, text in texts.items():
            for path, body in (("/generate", {"text": text}), ("/v1/chat/completions", {"messages": [{"role": "user", "content": text}]})):
                data = json.dumps(body)
                t0 = time.perf_counter()
                r = client.post(path, content=data, headers={"content-type": "application/json"})
                print(f"context {context:>9,}  {shape:<9} {path:<22} HTTP {r.status_code} in {time.perf_counter() - t0:6.2f} s")


if __name__ == "__main__":
    main()
