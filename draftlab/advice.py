"""The offline isolation run, the measured costs, and the advice drawn from them.

The bench stage's second opinion on a served draft: the same exported draft decoded in-process
(draftlab.spec_engine, no server), the seconds a target forward and a draft step take on this
machine, and from those and the measured a_i the predicted tau and speedup of other chain lengths.
"""
from __future__ import annotations

import statistics
import time

import torch

from draftlab import spec_engine
from draftlab.draft import KVCache
from draftlab.extract import AuxCapture
from draftlab.metrics import chain_tau, conditional_acceptance, pooled_tau


def offline_run(target, draft, prompts: list[list[int]], flags, physical: list[int], max_new_tokens: int,
                eos: set[int], ignore_eos: bool) -> dict:
    """Every prompt decoded in-process by spec_engine with the served flags: pooled tau, a_i, speed."""
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
            cache = spec_engine.new_cache(target)
            spec_engine.target_forward(target, ids, cache)
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            spec_engine.target_forward(target, torch.tensor([prompt[-1:] * w], device=device), cache)
            if device.type == "cuda":  # kernels run asynchronously: wait before reading the clock
                torch.cuda.synchronize()
            forward.t = time.perf_counter() - t0
        times = []
        for _ in range(repeats):
            forward()
            times.append(forward.t)
        verify[w] = statistics.median(times)
    with AuxCapture(target, physical) as cap:
        spec_engine.target_forward(target, ids, spec_engine.new_cache(target))
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
