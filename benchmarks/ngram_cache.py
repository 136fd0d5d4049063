"""N-gram lookup (NGRAM) on first passes only: does /flush_cache make a repeat look like a first pass?

    python benchmarks/ngram_cache.py --model MODEL --backend sglang [--prompts mt-bench|FILE.jsonl] [--num 40]
        [--max-new-tokens 256] [--draft-tokens 12] [--breadth 10] [--dtype bfloat16] [--attention-backend triton]
        [--server-arg=--mem-fraction-static=0.3 ...]
    python benchmarks/ngram_cache.py --quick     # the embedded target on the reference server, a CPU, about a minute

An NGRAM server drafts from a cache of the text it has seen, shared by every request. A second pass
over the same prompts finds its own first answers there: SGLang 0.5.14 served tau 4.06 on such a
repeat against 2.06 on the first pass. The bench empties the caches before each measured pass
(POST /flush_cache, draftlab.bench.servers.measure with fresh=True); this measures whether that
works on the server at hand.

Method. One baseline server (no speculation), then one NGRAM server of the same target, up side by
side, greedy, one request at a time, the first turn of each prompt rendered with the target's chat
template:
  pass A  every prompt on the NGRAM server and on the baseline, alternating (the first pass)
  pass B  the same prompts again on the NGRAM server, nothing emptied (its cache holds pass A)
  pass C  POST /flush_cache, then the same prompts a third time
Printed per pass: tau (completion tokens / verify steps, pooled; draftlab.metrics), the median
tokens/s per request and, for pass A, the speedup over the baseline (ratio of medians, the same
run), with the histogram of tokens accepted per verify step. The verdict: pass C within 5% of pass A
means the flush empties the n-gram cache; pass B well above A means a bench without it measures
the cache's memory.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from contextlib import ExitStack
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from draftlab import lifecycle  # noqa: E402
from draftlab.bench.prompts import mt_bench_path, read_conversations  # noqa: E402
from draftlab.metrics import pooled_tau  # noqa: E402
from draftlab.sglang.client import Client  # noqa: E402
from draftlab.sglang.flags import SpecFlags  # noqa: E402
from draftlab.sglang.launch import free_port, launch_argv  # noqa: E402

SAME = 0.05  # pass C within 5% of pass A: the flush emptied the cache


def first_turns(prompts: str, num: int, tokenizer) -> list[list[int]]:
    """Token ids of the first turn of up to `num` conversations, in the chat template."""
    path = mt_bench_path() if prompts == "mt-bench" else Path(prompts)
    convs = read_conversations(path)[:num]
    return [tokenizer.apply_chat_template(c.turns[0], add_generation_prompt=True, tokenize=True, return_dict=False) for c in convs]


def server_argv(backend: str, model: str, port: int, ngram: SpecFlags | None, extra: list[str], dtype: str = "auto",
                attention_backend: str | None = None) -> list[str]:
    if backend == "sglang":
        flags = ngram or SpecFlags(algorithm=None)
        flags = SpecFlags(**{**flags.__dict__, "attention_backend": attention_backend})
        return launch_argv(model, port, flags=flags, baseline=ngram is None, extra_args=extra, dtype=dtype,
                           extra_key="--server-arg")
    argv = [sys.executable, "-m", "draftlab.engine.server", "--model-path", model, "--port", str(port)]
    if ngram is not None:
        argv += ["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", str(ngram.num_draft_tokens),
                 "--speculative-ngram-max-bfs-breadth", str(ngram.ngram_max_bfs_breadth)]
    return argv + extra


def one_pass(client: Client, ids: list[list[int]], sampling: dict, other: Client | None = None) -> dict:
    """Every prompt once, bs=1; with `other`, each prompt on it right after (alternating)."""
    rows, others = [], []
    for p in ids:
        for c, out in ((client, rows), (other, others)):
            if c is None:
                continue
            t0 = time.perf_counter()
            _, meta = c.generate(p, sampling)
            out.append((meta, time.perf_counter() - t0))
    return {"spec": figures(rows), "baseline": figures(others) if other else None}


def figures(rows: list) -> dict:
    metas = [m for m, _ in rows]
    out = {"requests": len(rows), "tokens_per_s_median": statistics.median(m.completion_tokens / s for m, s in rows)}
    spec = [m for m in metas if m.spec_verify_ct]
    if spec:
        out["tau"] = pooled_tau([m.completion_tokens for m in spec], [m.spec_verify_ct for m in spec])
        hist = [0] * 32
        for m in spec:
            for i, n in enumerate(m.spec_correct_drafts_histogram or []):
                if i < len(hist):
                    hist[i] += n
        out["accepted_per_step_histogram"] = hist[:max((i + 1 for i, n in enumerate(hist) if n), default=0)]
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=str(ROOT / "models" / "tiny-target"))
    ap.add_argument("--backend", choices=["sglang", "reference"], default="reference")
    ap.add_argument("--prompts", default="mt-bench", help="mt-bench, or a .jsonl of chat rows / MT-bench rows")
    ap.add_argument("--num", type=int, default=40, help="conversations (their first turns)")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--draft-tokens", type=int, default=12)
    ap.add_argument("--breadth", type=int, default=10, help="--speculative-ngram-max-bfs-breadth")
    ap.add_argument("--server-arg", action="append", default=[], help="one extra server argument (repeatable), e.g. "
                    "--server-arg=--mem-fraction-static=0.3")
    ap.add_argument("--dtype", default="auto", help="sglang: --dtype of both servers")
    ap.add_argument("--attention-backend", default=None, help="sglang: --attention-backend of both servers")
    ap.add_argument("--startup-timeout", type=float, default=600.0)
    ap.add_argument("--logs", type=Path, default=Path("ngram-cache-logs"))
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--quick", action="store_true", help="the embedded target, 8 of the test fixture's MT-bench rows, 32 tokens")
    a = ap.parse_args(argv)
    if a.quick:
        a.prompts, a.num, a.max_new_tokens = str(ROOT / "tests" / "fixtures" / "bench_prompts" / "mt_bench_small.jsonl"), 8, 32
    from transformers import AutoTokenizer

    ids = first_turns(a.prompts, a.num, AutoTokenizer.from_pretrained(a.model))
    extra = [x for arg in a.server_arg for x in arg.split("=", 1)]
    ngram = SpecFlags(algorithm="NGRAM", num_draft_tokens=a.draft_tokens, ngram_max_bfs_breadth=a.breadth)
    sampling = {"temperature": 0.0, "max_new_tokens": a.max_new_tokens, "ignore_eos": False}
    a.logs.mkdir(parents=True, exist_ok=True)
    with ExitStack() as stack:  # one after the other: SGLang's second server sizes its pool from what the first left
        urls = []
        for name, flags in (("baseline", None), ("ngram", ngram)):
            argv_ = server_argv(a.backend, a.model, free_port(), flags, extra, a.dtype, a.attention_backend)
            port = argv_[argv_.index("--port") + 1]
            stack.enter_context(lifecycle.serve(argv_, f"http://127.0.0.1:{port}", a.logs / f"{name}.log",
                                                startup_timeout_s=a.startup_timeout))
            urls.append(f"http://127.0.0.1:{port}")
        base, spec = (stack.enter_context(Client(u)) for u in urls)
        for c in (base, spec):  # warm-up on a prompt that is not measured, then nothing kept
            c.generate(ids[-1], {**sampling, "max_new_tokens": 8})
        spec.flush_cache()
        passes = {"A first pass": one_pass(spec, ids, sampling, base)}
        passes["B repeat, cache kept"] = one_pass(spec, ids, sampling)
        spec.flush_cache()
        passes["C repeat after /flush_cache"] = one_pass(spec, ids, sampling)
    a_, b_, c_ = (p["spec"]["tau"] for p in passes.values())
    first = passes["A first pass"]
    result = {"backend": a.backend, "model": a.model, "prompts": a.prompts, "conversations": len(ids),
              "max_new_tokens": a.max_new_tokens, "draft_tokens": a.draft_tokens, "max_bfs_breadth": a.breadth,
              "passes": passes, "speedup_first_pass": first["spec"]["tokens_per_s_median"] / first["baseline"]["tokens_per_s_median"],
              "flush_empties_cache": abs(c_ - a_) <= SAME * a_, "repeat_without_flush_over_first": b_ / a_}
    print(f"NGRAM ({a.draft_tokens} draft tokens, breadth <= {a.breadth}) on {len(ids)} first turns of {a.prompts}, "
          f"{a.max_new_tokens} new tokens, {a.backend}:")
    for name, p in passes.items():
        s = p["spec"]
        print(f"  {name:28s} tau {s['tau']:.3f}  {s['tokens_per_s_median']:8.1f} tok/s  accepted per step {s['accepted_per_step_histogram']}")
    print(f"  baseline                     {first['baseline']['tokens_per_s_median']:8.1f} tok/s; first-pass speedup "
          f"{result['speedup_first_pass']:.2f}x")
    print(f"  flush empties the cache: {'yes' if result['flush_empties_cache'] else 'NO'} (C/A {c_ / a_:.3f}); "
          f"a repeat without it serves {b_ / a_:.2f}x the first pass's tau")
    if a.json:
        a.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
