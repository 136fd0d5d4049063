"""Where the time of one speculative round goes: the reference engine (draftlab.engine.speculative) on
the pipeline's own target, draft and eval prompts, in-process, one thread.

    PYTHONPATH=. python benchmarks/round_profile.py --root . --out reports/profile/after.json
    python benchmarks/round_profile.py --root ../other-checkout --out reports/profile/before.json   # another checkout's models

Method. The engine's step functions are wrapped by timers (module attributes of spec_engine and
methods of the loaded draft and of AuxCapture), without touching the algorithm: each wrapped call
is charged its own time less that of the wrapped calls inside it, so the components add up.
What no wrapper covers (the round loop, emitting tokens, counting) is `python`. Prompts alternate
baseline / speculative decoding, so a change in the machine's load hits both; the speedup is the
ratio of the summed decode times (prefill included). --threads 1 as the bench's servers run.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import time
from collections import defaultdict
from pathlib import Path

import torch

LABELS = {  # wrapped callable -> component
    "target_forward": "target_verify",
    "verify_tree": "verify_mask",
    "accept_path": "accept_sampling",
    "keep_kv": "kv_rollback",
    "draft_tree": "draft_tree_python",
    "draft_chain": "draft_tree_python",
    "step": "draft_steps",
    "logits": "draft_head",
    "to_target": "draft_head",
    "project": "draft_extend",
    "take": "capture_concat",
}


class Timers:
    """Exclusive wall time per component: a wrapped call minus the wrapped calls it makes."""

    def __init__(self):
        self.secs, self.calls, self.stack, self.in_tree = defaultdict(float), defaultdict(int), [], False
        self.prefill = True  # until the draft's prefill step ends: the target prefill, then the draft prefill

    def wrap(self, name, fn):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            label = LABELS[name]
            if name == "step" and not self.in_tree:
                label = "draft_extend"  # a draft forward outside the tree search: the extend
            if self.prefill:
                label = "target_prefill" if name == "target_forward" else "draft_prefill"
            if name in ("draft_tree", "draft_chain"):
                self.in_tree = True
            self.stack.append(0.0)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                dt = time.perf_counter() - t0
                inner = self.stack.pop()
                self.secs[label] += dt - inner
                self.calls[label] += 1
                if self.stack:
                    self.stack[-1] += dt
                if name in ("draft_tree", "draft_chain"):
                    self.in_tree = False
                if name == "step" and self.prefill:
                    self.prefill = False
        return timed


def main(root: Path, out: Path, num_prompts: int, max_new_tokens: int, num_steps: int, threads: int) -> dict:
    torch.set_num_threads(threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from draftlab.bench import servers
    from draftlab.features import extract
    from draftlab.engine import speculative as spec_engine
    from draftlab.sglang.checkpoint import load_exported, read_exported

    target = AutoModelForCausalLM.from_pretrained(root / "models/tiny-target", dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(root / "models/tiny-target")
    exported = read_exported(root / "models/draft")
    embed = target.get_input_embeddings().weight
    draft, _ = load_exported(exported.path, embed=embed, dtype=embed.dtype, as_sglang=True)
    physical = exported.served_physical("LlamaForCausalLM", target.config.num_hidden_layers, "0.5.14")
    prompts = servers.render_prompts(tok, servers.read_eval_prompts(root / "data/prompts", num_prompts + 2))
    eos = {target.generation_config.eos_token_id, tok.eos_token_id} - {None}
    kw = dict(num_steps=num_steps, topk=1, num_draft_tokens=num_steps + 1, max_new_tokens=max_new_tokens, eos_token_id=eos,
              physical_layers=physical)

    for p in prompts[:2]:  # warm-up
        spec_engine.baseline_generate(target, p, max_new_tokens, eos_token_id=eos)
        spec_engine.generate(target, draft, p, **kw)

    timers = Timers()
    originals = {n: getattr(spec_engine, n) for n in ("target_forward", "verify_tree", "accept_path", "keep_kv", "draft_tree", "draft_chain")
                 if hasattr(spec_engine, n)}  # draft_chain: not in older engines
    draft_originals = {n: getattr(draft, n) for n in ("step", "logits", "to_target", "project")}
    take = extract.AuxCapture.take
    base_s = spec_s = 0.0
    base_tokens = spec_tokens = rounds = 0
    outputs_equal = True
    for p in prompts[2:]:
        b = spec_engine.baseline_generate(target, p, max_new_tokens, eos_token_id=eos)
        base_s, base_tokens = base_s + b.total_s, base_tokens + len(b.output_ids)
        for n, fn in originals.items():
            setattr(spec_engine, n, timers.wrap(n, fn))
        for n, fn in draft_originals.items():
            setattr(draft, n, timers.wrap(n, fn))
        extract.AuxCapture.take = timers.wrap("take", take)
        try:
            timers.prefill = True
            r = spec_engine.generate(target, draft, p, **kw)
        finally:
            for n, fn in originals.items():
                setattr(spec_engine, n, fn)
            for n in draft_originals:
                delattr(draft, n)
            extract.AuxCapture.take = take
        spec_s, spec_tokens, rounds = spec_s + r.total_s, spec_tokens + len(r.output_ids), rounds + r.spec_verify_ct
        outputs_equal &= r.output_ids == b.output_ids
    secs = dict(timers.secs)
    prefill_s = secs.pop("target_prefill") + secs.pop("draft_prefill")  # once per request, not per round
    spec_decode_s = spec_s - prefill_s
    secs["python"] = spec_decode_s - sum(secs.values())
    per_round = {k: 1e3 * v / rounds for k, v in sorted(secs.items(), key=lambda kv: -kv[1])}
    report = {
        "method": __doc__.split("Method. ")[1].strip(),
        "settings": {"target": "models/tiny-target", "draft": "models/draft", "num_steps": num_steps, "topk": 1,
                     "max_new_tokens": max_new_tokens, "prompts": num_prompts, "threads": threads,
                     "load_average": os.getloadavg()},
        "tau": spec_tokens / rounds,
        "rounds": rounds,
        "round_ms": 1e3 * spec_decode_s / rounds,
        "prefill_ms_per_request": 1e3 * prefill_s / len(prompts[2:]),
        "per_round_ms": per_round,
        "share": {k: v / (1e3 * spec_decode_s / rounds) for k, v in per_round.items()},
        "baseline_ms_per_token": 1e3 * base_s / base_tokens,
        "speedup_in_process": (spec_tokens / spec_s) / (base_tokens / base_s),
        "greedy_outputs_equal": outputs_equal,
        "note": "per_round_ms: the prefills (target and draft, once per request) excluded; python: the round loop outside every wrapped call",
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", type=Path, default=Path("."), help="a checkout whose models/ and data/prompts exist (dvc repro ran)")
    ap.add_argument("--out", type=Path, default=Path("reports/profile/round.json"))
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--num-steps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    rep = main(a.root, a.out, a.prompts, a.max_new_tokens, a.num_steps, a.threads)
    print(f"round {rep['round_ms']:.2f} ms, tau {rep['tau']:.2f}, baseline {rep['baseline_ms_per_token']:.2f} ms/token, "
          f"in-process speedup {rep['speedup_in_process']:.2f}x, outputs equal: {rep['greedy_outputs_equal']}")
    for k, v in rep["per_round_ms"].items():
        print(f"  {k:18s} {v:6.3f} ms  {100 * rep['share'][k]:5.1f}%")
