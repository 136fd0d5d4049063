"""Where a baseline decode step's time goes (section decode_profile).

Method: the 8B-shaped target, batch 1, a random prompt of `spec_prompt` tokens prefilled into the
engine's cache (draftlab.engine.speculative.new_cache / target_forward), then 12 one-token steps of which
the first 2 warm up. Per step: host time until the forward call returns, GPU time (CUDA events
around the forward) and wall time until the next token is on the host. Then 3 steps under
torch.profiler; its tables go to the log. The section goes on with the cuDNN A/B (benchmarks.paths.cudnn)
and the soft labels' cost in fp32 and bf16 (benchmarks.paths.training.labels_cost).
"""
from __future__ import annotations

import time

import torch

from benchmarks.paths.common import log, record, sync
from benchmarks.paths.cudnn import engine_decode_ab
from benchmarks.paths.training import labels_cost


@torch.inference_mode()
def decode_profile(P, model) -> None:
    from draftlab.engine.speculative import new_cache, target_forward

    dev, S = P["device"], "decode_profile"
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(10, model.config.vocab_size, (1, P["spec_prompt"]), generator=g).to(dev)
    cache = new_cache(model)
    logits = target_forward(model, prompt, cache, logits_to_keep=1)
    record(S, "prefill_logits_finite", float(torch.isfinite(logits).float().mean()))
    x = prompt[:, -1:]
    host, wall, gpu = [], [], []
    for i in range(12):
        sync(dev)
        t0 = time.perf_counter()
        if dev == "cuda":
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
        logits = target_forward(model, x, cache, logits_to_keep=1)
        t1 = time.perf_counter()
        if dev == "cuda":
            e1.record()
        tok = int(torch.argmax(logits[0, -1]))
        t2 = time.perf_counter()
        if i >= 2:
            host.append(t1 - t0)
            wall.append(t2 - t0)
            gpu.append(e0.elapsed_time(e1) / 1e3 if dev == "cuda" else t1 - t0)
        x = torch.tensor([[tok]], device=dev)
    record(S, "logits_finite", float(torch.isfinite(logits).float().mean()))
    record(S, "decode_host_ms", sum(host) / len(host) * 1e3, "ms (forward call returns)")
    record(S, "decode_gpu_ms", sum(gpu) / len(gpu) * 1e3, "ms (CUDA events around the forward)")
    record(S, "decode_wall_ms", sum(wall) / len(wall) * 1e3, "ms (to the token on the host)")
    try:
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev == "cuda" else [])
        with profile(activities=acts) as prof:
            for _ in range(3):
                logits = target_forward(model, x, cache, logits_to_keep=1)
                x = torch.argmax(logits[:, -1:], -1)
            sync(dev)
        sort = "cuda_time_total" if dev == "cuda" else "cpu_time_total"
        log(prof.key_averages().table(sort_by="cpu_time_total", row_limit=15))
        log(prof.key_averages().table(sort_by=sort, row_limit=10))
    except Exception as e:  # noqa: BLE001
        record(S, "profiler_error", f"{type(e).__name__}: {e}"[:300])
    engine_decode_ab(P, model, prompt[0].tolist(), S)
    labels_cost(P, model, S)
