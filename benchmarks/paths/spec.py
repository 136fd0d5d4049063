"""The speculative engine on the 8B-shaped target: baseline decode against the bandwidth floor,
and speculation with drafts that are always right (oracle) or never right (null).

Method: batch 1, greedy, ignore_eos, a random `spec_prompt`-token prompt, `spec_new` new tokens.
- `baseline_generate` after a warm-up; decode tokens/s excludes the prefill. Bandwidth floor =
  measured copy bandwidth / bytes read per decode step (all weights but the embedding).
- Oracle / null drafts: `ScriptedDraft` over the baseline's output (what `draftlab.engine.speculative.oracle_draft`
  / `null_draft` build, made once instead of re-running the baseline for each); `generate` with
  topk 1, num_draft_tokens = num_steps + 1 for each num_steps in `spec_steps`. speedup = tokens/s /
  baseline tokens/s (whole requests). Overhead per step = (request time - prefill) / verify steps
  - a pure target forward of num_steps + 1 tokens on a cached prompt (synchronised, median of 5).
- The random target is made greedy-stable first (`stabilize`: embedding ~ N(0, 4^2), lm_head tied
  to it), so the oracle built from the baseline stays right at every verify width; shapes and
  compute are unchanged.
"""
from __future__ import annotations

import time

import torch

from benchmarks.paths.common import copy_rate, decode_bytes, record, sync


def stabilize(model, scale: float = 4.0) -> None:
    """Make a random target's greedy choice robust to bf16 rounding (same shapes, same compute).

    Random weights give near-tied logits over 128k tokens, so a 1-token forward and an
    (n+1)-token verify forward disagree on the argmax and an oracle built from the baseline's
    output stops being right after a few tokens. With the embedding scaled up and the lm_head
    tied to it, each position's own token wins by a wide margin: greedy decoding repeats the
    last token, identically at any verify width.
    """
    with torch.no_grad():
        emb = model.get_input_embeddings().weight
        emb.normal_(0.0, scale)
        model.lm_head.weight.copy_(emb)


@torch.inference_mode()
def forward_costs(model, prompt: list[int], widths, dev, repeats: int = 5) -> dict:
    """Median seconds of one synchronised target forward of w tokens on a cached prompt."""
    import statistics

    from draftlab.engine.speculative import new_cache, target_forward

    ids = torch.tensor([prompt], device=dev)
    cache = new_cache(model)
    target_forward(model, ids, cache)
    n = cache.get_seq_length()
    out = {}
    for w in widths:
        x = torch.tensor([prompt[-1:] * w], device=dev)
        times = []
        for _ in range(repeats + 1):
            sync(dev)
            t0 = time.perf_counter()
            target_forward(model, x, cache, logits_to_keep=1)
            sync(dev)
            times.append(time.perf_counter() - t0)
            cache.crop(-(cache.get_seq_length() - n))  # negative: drop the w new tokens
        out[w] = statistics.median(times[1:])
    return out


def spec(P, model) -> None:
    from draftlab.engine import speculative
    from tests.support.drafts import ScriptedDraft

    dev, S = P["device"], "spec"
    step_bytes = decode_bytes(model)  # every weight once except the embedding (one row)
    bw = copy_rate(P)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(10, model.config.vocab_size, (P["spec_prompt"],), generator=g).tolist()
    new = P["spec_new"]
    if P.get("stable_greedy"):
        stabilize(model)
        record(S, "stable_greedy", 1)
    speculative.baseline_generate(model, prompt, 8, ignore_eos=True)  # warm-up
    base = speculative.baseline_generate(model, prompt, new, ignore_eos=True)
    decode_s = (base.total_s - base.prefill_s) / max(1, len(base.output_ids) - 1)
    floor = bw / step_bytes
    record(S, "prompt_tokens", len(prompt))
    record(S, "new_tokens", new)
    record(S, "decode_bytes_per_token", step_bytes, "B")
    record(S, "baseline_tokens_per_s", base.tokens_per_s, "tok/s (whole request)")
    record(S, "baseline_decode_tokens_per_s", 1 / decode_s, "tok/s (decode steps only)")
    record(S, "baseline_step_ms", decode_s * 1e3, "ms")
    record(S, "bandwidth_floor_tokens_per_s", floor, "tok/s (weight bytes / measured copy bandwidth)")
    record(S, "baseline_fraction_of_floor", (1 / decode_s) / floor)
    # Pure target forward of w tokens on a cached prompt (the verify cost without the engine),
    # synchronised (draftlab.bench.servers.measure_costs stops its clock before the GPU has finished).
    widths = sorted({1} | {n + 1 for n in P["spec_steps"]})
    costs = {"verify_s": forward_costs(model, prompt, widths, dev)}
    for w, s in costs["verify_s"].items():
        record(S, f"target_forward_w{w}_ms", s * 1e3, "ms")
    # The oracle and null drafts are exactly what draftlab.engine.speculative.oracle_draft / draftlab.engine.speculative.null_draft build, made
    # once from the baseline's output (each of those calls re-runs the baseline decode).
    ref = list(prompt) + base.output_ids
    for steps in P["spec_steps"]:
        for name, draft in (("oracle", ScriptedDraft(ref, model.config.vocab_size)),
                            ("null", ScriptedDraft(ref, model.config.vocab_size, never=True))):
            r = speculative.generate(model, draft, prompt, num_steps=steps, topk=1, num_draft_tokens=steps + 1, max_new_tokens=new,
                                     ignore_eos=True, physical_layers=P["physical"])
            if r.output_ids != base.output_ids:
                record(S, f"{name}_s{steps}_output_mismatch", 1)
            per_step = (r.total_s - r.prefill_s) / max(1, r.spec_verify_ct)
            fwd = costs["verify_s"].get(steps + 1, float("nan"))
            p = f"{name}_s{steps}"
            record(S, f"{p}_tokens_per_s", r.tokens_per_s, "tok/s")
            record(S, f"{p}_speedup", r.tokens_per_s / base.tokens_per_s, "x")
            record(S, f"{p}_tau", r.tau)
            record(S, f"{p}_verify_ct", r.spec_verify_ct)
            record(S, f"{p}_step_ms", per_step * 1e3, "ms per verify step")
            record(S, f"{p}_draft_ms_per_step", r.draft_s / max(1, r.spec_verify_ct) * 1e3, "ms")
            record(S, f"{p}_verify_ms_per_step", r.verify_s / max(1, r.spec_verify_ct) * 1e3, "ms")
            record(S, f"{p}_overhead_ms_per_step", (per_step - fwd) * 1e3, "ms (step - pure target forward)")
