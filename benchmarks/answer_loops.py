"""How much of a target's greedy answers is a loop, by position: the share of answer tokens that
close an n-gram already seen earlier in the same answer (n = 8 tokens, draftlab.data.loops), per
block of positions.

    python benchmarks/answer_loops.py TARGET_DIR PROMPTS.jsonl [--prompts 8] [--max-new-tokens 512] [--out FILE]

A small model decoding greedily often falls into a cycle; a draft predicts a cycle almost perfectly.
When synthesis writes longer answers than the bench asks for, the eval split's teacher-forced
acceptance then counts tails that serving never reaches. This measures that share directly.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from draftlab import jsonl
from draftlab.data.loops import LOOP_NGRAM, loop_flags

BLOCK = 128  # positions per block


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("target", type=Path)
    ap.add_argument("prompts", type=Path, help="a prompts-stage jsonl (eval.jsonl)")
    ap.add_argument("--prompts", dest="n", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=512)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    tok = AutoTokenizer.from_pretrained(args.target)
    model = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
    blocks: dict[int, list[int]] = {}
    capped = 0
    for _, row in list(jsonl.read(args.prompts, "a prompts-stage file"))[: args.n]:
        text = tok.apply_chat_template(row["messages"], add_generation_prompt=True, tokenize=False)
        ids = tok(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False)[0, ids.shape[1]:].tolist()
        capped += len(out) >= args.max_new_tokens
        for t, f in enumerate(loop_flags(out)):
            b = blocks.setdefault(t // BLOCK, [0, 0])
            b[0] += f
            b[1] += 1
    res = {"prompts": args.n, "capped": capped, "ngram": LOOP_NGRAM,
           "loop_share_by_block": {f"{k * BLOCK}-{(k + 1) * BLOCK - 1}": round(v[0] / v[1], 3) for k, v in sorted(blocks.items())},
           "tokens_by_block": {f"{k * BLOCK}-{(k + 1) * BLOCK - 1}": v[1] for k, v in sorted(blocks.items())}}
    print(json.dumps(res, indent=1))
    if args.out:
        args.out.write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
