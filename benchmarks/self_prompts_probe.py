"""What a target writes when it is given only its chat template's user prefix (self prompts,
draftlab/data/self_prompts.py), before any GPU time is spent on them.

    python benchmarks/self_prompts_probe.py TARGET_DIR [--count 128] [--max-new-tokens 256]
        [--temperature 1.0] [--seed 0] [--batch-size 32] [--source PROMPTS.jsonl] [--out FILE]

Method: the stage's own in-process path (self_prompts.write_hf), on whatever device torch picks.
It prints the share of turns kept (closed with the end-of-turn token), cut (not closed within
--max-new-tokens), empty and written as an answer (the target's reasoning markup); distinct kept turns; the kept turns' length in target tokens
(quartiles); how many open like a question or a request; tokens/s; and the first kept turns
as written. With --source (a prompts-stage jsonl), the same length quartiles of its first turns
beside them: whether the target's own prompts look like the source's.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from draftlab import jsonl
from draftlab.data import self_prompts

ASKS = re.compile(r"^\s*(what|how|why|who|when|where|which|can|could|would|should|is|are|do|does|write|explain|"
                  r"describe|give|list|tell|create|generate|help|please|i )", re.IGNORECASE)


def quartiles(lengths: list[int]) -> list[float] | None:
    return [round(q, 1) for q in statistics.quantiles(lengths, n=4)] if len(lengths) >= 2 else None


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("target", type=Path)
    ap.add_argument("--count", type=int, default=128)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--source", type=Path, default=None, help="a prompts-stage jsonl to compare lengths with")
    ap.add_argument("--show", type=int, default=8, help="kept turns printed as written")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tok = AutoTokenizer.from_pretrained(args.target)
    model = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32 if device == "cpu" else torch.bfloat16)
    model = model.to(device).eval()
    settings = SimpleNamespace(count=args.count, temperature=args.temperature, top_p=args.top_p,
                               max_new_tokens=args.max_new_tokens, seed=args.seed, batch_size=args.batch_size)
    start = time.perf_counter()
    got = self_prompts.write_hf(model, tok, settings, device)
    seconds = time.perf_counter() - start
    lengths = [len(tok(t, add_special_tokens=False)["input_ids"]) for t in got.texts]
    res = {"target": args.target.name, "device": device, "count": args.count, "max_new_tokens": args.max_new_tokens,
           "temperature": args.temperature, "kept": len(got.texts), "left_out": got.left_out,
           "distinct_kept": len(set(got.texts)), "asks_share": round(sum(bool(ASKS.match(t)) for t in got.texts) / max(len(got.texts), 1), 3),
           "kept_tokens_quartiles": quartiles(lengths), "completion_tokens": got.completion_tokens,
           "seconds": round(seconds, 1), "tokens_per_s": round(got.completion_tokens / seconds, 1),
           "first_kept": got.texts[: args.show]}
    if args.source:
        firsts = [row["messages"][-1]["content"] for _, row in jsonl.read(args.source, "a prompts-stage file")]
        res["source_first_turn_tokens_quartiles"] = quartiles(
            [len(ids) for ids in tok(firsts[:2000], add_special_tokens=False)["input_ids"]])
    print(json.dumps(res, indent=1, ensure_ascii=False))
    if args.out:
        args.out.write_text(json.dumps(res, indent=1, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
