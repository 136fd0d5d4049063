"""The benchmark's measurements: one client for every server, the offline run, costs and advice.

Figures (DESIGN.md section 9, formulas in draftlab.metrics):
  tokens/s per request  = completion tokens / client-side wall time of the request
  served tau            = sum completion tokens / sum spec_verify_ct over the measured requests
  a_i                   = P(draft i accepted | drafts 1..i-1 accepted), pooled over requests
  speedup               = median tokens/s with speculation / median tokens/s of the baseline
"""
from __future__ import annotations

import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from draftlab.metrics import chain_tau, conditional_acceptance, pooled_tau
from draftlab.sglang.client import Client, GenerateMeta


def render_prompts(tok, rows: list[dict]) -> list[list[int]]:
    """Token ids of each prompt as the chat template renders it for generation.

    The client sends ids, not text, so every server sees exactly the same tokens.
    """
    return [tok.apply_chat_template(r["messages"], add_generation_prompt=True, tokenize=True, return_dict=False) for r in rows]


def run_requests(client: Client, prompts: list[list[int]], sampling: dict, concurrency: int = 1) -> tuple[list[dict], float]:
    """Send every prompt; returns per-request records and the wall time of the whole batch (s)."""

    def one(ids):
        t0 = time.perf_counter()
        _, meta = client.generate(ids, sampling)
        return {"seconds": time.perf_counter() - t0, "meta": meta}

    t0 = time.perf_counter()
    if concurrency <= 1:
        records = [one(p) for p in prompts]
    else:
        with ThreadPoolExecutor(concurrency) as pool:
            records = list(pool.map(one, prompts))
    return records, time.perf_counter() - t0


def speed(records: list[dict], wall_s: float) -> dict:
    """Per-request tokens/s (median and spread) and the batch's total throughput."""
    rates = sorted(r["meta"].completion_tokens / r["seconds"] for r in records)
    q = statistics.quantiles(rates, n=10) if len(rates) > 1 else [rates[0]] * 9
    tokens = sum(r["meta"].completion_tokens for r in records)
    return {"median": statistics.median(rates), "p10": q[0], "p90": q[-1], "throughput": tokens / wall_s,
            "requests": len(records), "completion_tokens": tokens}


def acceptance_from_hist(hist: list[int]) -> list[float]:
    """a_i from an accepted-drafts histogram (hist[a] = steps that kept a drafts)."""
    reached = [sum(hist[i:]) for i in range(1, len(hist))]  # steps that accepted >= i drafts
    return conditional_acceptance(reached, [sum(hist[i - 1:]) for i in range(1, len(hist))])


def spec_figures(metas: list[GenerateMeta]) -> dict:
    """Pooled speculative figures from /generate meta_info, SGLang's fields first."""
    spec = [m for m in metas if m.speculative]
    if not spec:
        return {}
    tau = pooled_tau([m.completion_tokens for m in spec], [m.spec_verify_ct for m in spec])
    hist = None
    if all(m.spec_correct_drafts_histogram for m in spec):
        width = max(len(m.spec_correct_drafts_histogram) for m in spec)
        hist = [sum(m.spec_correct_drafts_histogram[i] if i < len(m.spec_correct_drafts_histogram) else 0 for m in spec) for i in range(width)]
    # Exact per-depth counts when the server gives them (the reference server does); else the histogram.
    if all("spec_proposed_per_depth" in m.raw for m in spec):
        proposed = [sum(x) for x in zip(*(m.raw["spec_proposed_per_depth"] for m in spec))]
        accepted = [sum(x) for x in zip(*(m.raw["spec_accepted_per_depth"] for m in spec))]
        acceptance = conditional_acceptance(accepted, proposed)
    else:
        acceptance = acceptance_from_hist(hist) if hist else None
    correct = sum(m.spec_num_correct_drafts or 0 for m in spec)
    proposed_total = sum(m.spec_num_proposed_drafts or 0 for m in spec)
    return {
        "tau": tau,
        "accept_rate": correct / proposed_total if proposed_total else None,
        "acceptance": acceptance,
        "accept_hist": hist,
        "verify_ct": sum(m.spec_verify_ct for m in spec),
        "completion_tokens": sum(m.completion_tokens for m in spec),
    }


# --- offline isolation run and costs: the same draft in-process, no server --------------------


def offline_run(target, draft, prompts: list[list[int]], flags, physical: list[int], max_new_tokens: int,
                eos: set[int], ignore_eos: bool) -> dict:
    from draftlab import spec_engine

    results = [
        spec_engine.generate(target, draft, p, num_steps=flags.num_steps, topk=flags.topk, num_draft_tokens=flags.num_draft_tokens,
                             max_new_tokens=max_new_tokens, eos_token_id=eos, ignore_eos=ignore_eos, physical_layers=physical)
        for p in prompts
    ]
    proposed = [sum(x) for x in zip(*(r.proposed for r in results))]
    accepted = [sum(x) for x in zip(*(r.accepted for r in results))]
    tokens = sum(len(r.output_ids) for r in results)
    return {
        "tau": pooled_tau([len(r.output_ids) for r in results], [r.spec_verify_ct for r in results]),
        "acceptance": conditional_acceptance(accepted, proposed),
        "tokens_per_s": tokens / sum(r.total_s for r in results),
        "draft_s": sum(r.draft_s for r in results),
        "verify_s": sum(r.verify_s for r in results),
        "verify_ct": sum(r.spec_verify_ct for r in results),
    }


@torch.inference_mode()
def measure_costs(target, draft, prompt: list[int], physical: list[int], widths=range(1, 9), repeats: int = 5) -> dict:
    """Seconds per target forward of `w` new tokens on a cached prompt, and per draft step.

    Median of `repeats` timings each: these are the terms of the speedup model below.
    """
    from draftlab.draft import KVCache
    from draftlab.extract import AuxCapture
    from draftlab.spec_engine import new_cache, target_forward

    device = next(target.parameters()).device
    ids = torch.tensor([prompt], device=device)

    def median_time(fn):
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    verify = {}
    for w in widths:
        def forward():
            cache = new_cache(target)
            target_forward(target, ids, cache)
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            target_forward(target, torch.tensor([prompt[-1:] * w], device=device), cache)
            if device.type == "cuda":  # kernels run asynchronously: wait before reading the clock
                torch.cuda.synchronize()
            forward.t = time.perf_counter() - t0
        times = []
        for _ in range(repeats):
            forward()
            times.append(forward.t)
        verify[w] = statistics.median(times)
    with AuxCapture(target, physical) as cap:
        target_forward(target, ids, new_cache(target))
        aux = cap.take()
    cache = KVCache()
    hidden = draft.project(aux)
    draft.step(ids[:, 1:], hidden[:, :-1], torch.arange(ids.shape[1] - 1, device=device)[None], cache)
    n = len(cache)

    def one_step():
        cache.crop(n)
        state = draft.step(ids[:, -1:], hidden[:, -1:], torch.tensor([[n]], device=device), cache)
        draft.logits(state).argmax(-1)

    return {"verify_s": verify, "draft_step_s": median_time(one_step), "baseline_step_s": verify[1]}


def advise(acceptance: list[float], costs: dict, max_steps: int = 8) -> list[dict]:
    """Predicted tau and speedup of chains of 1..max_steps drafts from measured a_i and costs.

    A step costs num_steps draft steps + one verify forward of num_steps + 1 tokens + one draft
    extend (about one draft step); it yields tau tokens where the baseline yields one per forward:
      speedup = tau * baseline_step / (num_steps * draft_step + verify(num_steps + 1) + draft_step)
    Depths beyond those measured reuse the last measured a_i (marked extrapolated).
    """
    rows = []
    verify = costs["verify_s"]
    for n in range(1, max_steps + 1):
        a = [acceptance[min(i, len(acceptance) - 1)] for i in range(n)] if acceptance else [0.0] * n
        tau = chain_tau(a)
        w = min(n + 1, max(verify))
        step = n * costs["draft_step_s"] + verify[w] + costs["draft_step_s"]
        rows.append({"num_steps": n, "topk": 1, "num_draft_tokens": n + 1, "predicted_tau": tau,
                     "predicted_speedup": tau * costs["baseline_step_s"] / step, "extrapolated": n > len(acceptance)})
    return rows
