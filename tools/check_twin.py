"""Check that a twin (tools/make_twin.py) computes its small model's function: greedy tokens and logits.

Both models greedy-generate the same held-out prompts (draftlab.data.tasks, rendered with the chat
template); the report gives the share of prompts whose tokens are identical, where the others first
diverge, the largest logit difference on a prefill of prompt + answer, answer accuracy and time per
token of each. Exits 1 when the share of identical prompts is below --min-agree.

    python tools/check_twin.py --small models/tiny-target --twin TWIN_DIR --out twin-check.json   # GPU, bf16
    python tools/check_twin.py --small models/tiny-target --twin TWIN_DIR --device cpu --dtype float32 \\
        --num-prompts 4 --max-new-tokens 32
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, not installed
from draftlab.data import tasks  # noqa: E402
from draftlab.fsutil import atomic_write_json  # noqa: E402

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--small", default="models/tiny-target")
    p.add_argument("--twin", required=True, help="directory written by tools/make_twin.py")
    p.add_argument("--device", default="cuda", help="cuda, cuda:1, cpu, ...")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES), help="both models run in it")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=32, help="prompts per generate() call")
    p.add_argument("--seed", type=int, default=0, help="seed of the held-out prompts")
    p.add_argument("--min-agree", type=float, default=None,
                   help="least share of prompts with identical tokens (default 1.0 in float32, 0.95 otherwise)")
    p.add_argument("--out", default=None, help="JSON report")
    return p.parse_args(argv)


def load(path: str, dtype, device):
    # load on the CPU, then move: works without accelerate, on transformers 4 and 5
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True).to(device).eval()


def sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def generate(model, tok, texts, args) -> tuple[list[list[int]], float]:
    """Greedy continuations (up to and including EOS) and the wall-clock seconds they took."""
    warm = tok(texts[:1], return_tensors="pt", add_special_tokens=False).to(args.device)
    model.generate(**warm, max_new_tokens=2, do_sample=False, pad_token_id=tok.pad_token_id)  # CUDA start-up untimed
    sync(args.device)
    out, t0 = [], time.perf_counter()
    for i in range(0, len(texts), args.batch_size):
        enc = tok(texts[i:i + args.batch_size], return_tensors="pt", padding=True, add_special_tokens=False).to(args.device)
        gen = model.generate(**enc, max_new_tokens=args.max_new_tokens, do_sample=False,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        for row in gen[:, enc["input_ids"].shape[1]:].tolist():
            out.append(row[:row.index(tok.eos_token_id) + 1] if tok.eos_token_id in row else row)
    sync(args.device)
    return out, time.perf_counter() - t0


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Position of the first differing token (a length difference counts), None when identical."""
    n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return None if a == b else n


@torch.no_grad()
def prefill_diff(small, twin, tok, texts, args) -> dict:
    """Largest |logit difference| over every real position of prompt + answer, one batch."""
    enc = tok(texts[:args.batch_size], return_tensors="pt", padding=True, add_special_tokens=False).to(args.device)
    a, b = small(**enc).logits.float(), twin(**enc).logits.float()
    keep = enc["attention_mask"].bool()
    diff, scale = (a - b).abs()[keep].max().item(), a.abs()[keep].max().item()
    return {"max_abs_logit_diff": diff, "max_abs_logit": scale, "relative": diff / scale,
            "argmax_agree": (a.argmax(-1) == b.argmax(-1))[keep].float().mean().item(),
            "sequences": len(enc["input_ids"]), "positions": int(keep.sum())}


def check(args) -> dict:
    dtype = DTYPES[args.dtype]
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("check_twin: no CUDA device here; on a CPU pass --device cpu --dtype float32")
    min_agree = args.min_agree if args.min_agree is not None else (1.0 if dtype == torch.float32 else 0.95)
    tok = AutoTokenizer.from_pretrained(args.small, local_files_only=True)
    tok.padding_side = "left"  # generation continues from the right end of every row
    problems = tasks.generate(args.num_prompts, seed=args.seed, split="heldout")
    texts = [tok.apply_chat_template([{"role": "user", "content": p.prompt}], tokenize=False, add_generation_prompt=True)
             for p in problems]
    small = load(args.small, dtype, args.device)
    gen_s, sec_s = generate(small, tok, texts, args)
    twin = load(args.twin, dtype, args.device)
    gen_t, sec_t = generate(twin, tok, texts, args)
    div = [first_divergence(a, b) for a, b in zip(gen_s, gen_t)]
    full = [t + tok.decode(g) for t, g in zip(texts, gen_s)]  # prefill: prompt + the small model's answer
    agree = sum(d is None for d in div) / len(div)
    diverged = [d for d in div if d is not None]
    report = {
        "small": Path(args.small).name, "twin": Path(args.twin).name, "device": str(args.device),
        "hardware": torch.cuda.get_device_name(args.device) if torch.device(args.device).type == "cuda" else "cpu",
        "dtype": args.dtype, "num_prompts": len(texts), "max_new_tokens": args.max_new_tokens, "seed": args.seed,
        "prompts_identical": agree, "min_agree": min_agree, "passed": agree >= min_agree,
        "tokens_agree": sum(len(a) if d is None else d for a, d in zip(gen_s, div)) / sum(map(len, gen_s)),
        "first_divergence": div, "first_divergence_min": min(diverged) if diverged else None,
        "prefill": prefill_diff(small, twin, tok, full, args),
        "accuracy": {name: sum(tasks.check_answer(p, tok.decode(g)) for p, g in zip(problems, gen)) / len(gen)
                     for name, gen in (("small", gen_s), ("twin", gen_t))},
        "generated_tokens": {"small": sum(map(len, gen_s)), "twin": sum(map(len, gen_t))},
        "seconds": {"small": sec_s, "twin": sec_t},
        "parameters": {"small": sum(p.numel() for p in small.parameters()), "twin": sum(p.numel() for p in twin.parameters())},
    }
    return report


def main(argv=None) -> dict:
    args = parse_args(argv)
    report = check(args)
    if args.out:
        atomic_write_json(args.out, report)
    p = report["prefill"]
    print(f"identical prompts {report['prompts_identical']:.1%} (min {report['min_agree']:.0%}), tokens agree "
          f"{report['tokens_agree']:.1%}, first divergence {report['first_divergence_min']}, prefill max |dlogit| "
          f"{p['max_abs_logit_diff']:.3g} of max |logit| {p['max_abs_logit']:.3g}, seconds small/twin "
          f"{report['seconds']['small']:.1f}/{report['seconds']['twin']:.1f}")
    if not report["passed"]:
        raise SystemExit(1)
    return report


if __name__ == "__main__":
    main()
