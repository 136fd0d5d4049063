"""Measure draftlab's GPU paths against the machine's own ceilings (one run, one JSON).

    python tools/perf_h200.py --out DIR            # on the GPU: Llama-3.1-8B-shaped target, random weights
    python tools/perf_h200.py --quick --out DIR    # on the CPU: tiny shapes, a few iterations (the test)

Sections, each in its own try/except; DIR/results.json is rewritten after every figure:
  ceilings    bf16 matmul rate (n^3, mean of 10 after 3 warm-ups) and device copy bandwidth
  extraction  draftlab.extract.capture at two sequence lengths: tokens/s vs the compute floor
  spec        draftlab.spec_engine: baseline decode vs the bandwidth floor; oracle / null drafts
  training    one draftlab.train.TTT optimizer step (labels + forward + backward + AdamW): MFU
  embedded    models/tiny-target with models/draft: tau and speedup on held-out prompts
DIR/notes.md states the method and the FLOP / byte formulas.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RESULTS: dict = {}
OUT: Path = Path(".")


def log(msg: str) -> None:
    print(msg, flush=True)


def save() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    tmp = OUT / "results.json.tmp"
    tmp.write_text(json.dumps(RESULTS, indent=2, default=float))
    tmp.replace(OUT / "results.json")


def record(section: str, key: str, value, unit: str = "") -> None:
    RESULTS.setdefault(section, {})[key] = value
    shown = f"{value:.4g}" if isinstance(value, float) else value
    log(f"[{section}] {key} = {shown} {unit}".rstrip())
    save()


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device, warmup: int, iters: int) -> list[float]:
    """Wall seconds of each of `iters` calls after `warmup` calls, synchronised."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return times


def reset_peak(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak_gb(device) -> float:
    if torch.device(device).type == "cuda":
        return torch.cuda.max_memory_allocated() / 1e9
    return 0.0


def free(device) -> None:
    import gc

    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------
# Shapes


def plan(quick: bool) -> dict:
    if quick:
        return dict(
            device="cpu", dtype=torch.float32, matmul_n=256, copy_mb=16, mm_warm=1, mm_iters=3,
            target=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=512, max_position_embeddings=512),
            physical=[0, 1, 2], extract_lengths=[16, 32], extract_tokens=64, extract_iters=1,
            train_vocab=512, train_draft_vocab=128, train_seq=32, train_batches=[1], train_iters=1, ttt_steps=3,
            spec_prompt=8, spec_new=12, spec_steps=[1, 3], embedded_prompts=2, embedded_new=8, stable_greedy=True,
            decode_new=6, graph_new=8, profile_batch=1,
        )
    return dict(
        device="cuda", dtype=torch.bfloat16, matmul_n=8192, copy_mb=4096, mm_warm=3, mm_iters=10,
        target=dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                    num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192),
        physical=[2, 16, 29], extract_lengths=[512, 2048], extract_tokens=16384, extract_iters=3,
        train_vocab=128256, train_draft_vocab=32000, train_seq=2048, train_batches=[1, 2, 4], train_iters=4, ttt_steps=7,
        spec_prompt=64, spec_new=128, spec_steps=[1, 3, 5, 7], embedded_prompts=16, embedded_new=128, stable_greedy=True,
        decode_new=64, graph_new=128, profile_batch=2,
    )


# ---------------------------------------------------------------------------------------------
# 1. Ceilings


def ceilings(P) -> None:
    dev, S = P["device"], "ceilings"
    n = P["matmul_n"]
    dt = torch.bfloat16
    a = torch.randn(n, n, device=dev, dtype=dt)
    b = torch.randn(n, n, device=dev, dtype=dt)
    c = torch.empty(n, n, device=dev, dtype=dt)
    times = timed(lambda: torch.matmul(a, b, out=c), dev, P["mm_warm"], P["mm_iters"])
    mean = sum(times) / len(times)
    record(S, "matmul_n", n)
    record(S, "matmul_mean_s", mean, "s")
    record(S, "matmul_tflops", 2 * n**3 / mean / 1e12, "TFLOP/s (bf16, mean)")
    record(S, "matmul_tflops_best", 2 * n**3 / min(times) / 1e12, "TFLOP/s (bf16, best)")
    del a, b, c
    nbytes = P["copy_mb"] * 2**20
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev).random_(0, 255)
    dst = torch.empty_like(src)
    times = timed(lambda: dst.copy_(src), dev, P["mm_warm"], P["mm_iters"])
    mean = sum(times) / len(times)
    record(S, "copy_bytes", nbytes)
    record(S, "copy_gbs", 2 * nbytes / mean / 1e9, "GB/s (read + written, mean)")
    record(S, "copy_gbs_best", 2 * nbytes / min(times) / 1e9, "GB/s (best)")
    del src, dst
    free(dev)


def matmul_rate(P) -> float:
    """FLOP/s used as the compute ceiling: the measured mean, or the datasheet's if it failed."""
    r = RESULTS.get("ceilings", {}).get("matmul_tflops")
    return (r if r else (989.0 if P["device"] == "cuda" else 0.1)) * 1e12


def copy_rate(P) -> float:
    r = RESULTS.get("ceilings", {}).get("copy_gbs")
    return (r if r else (4800.0 if P["device"] == "cuda" else 10.0)) * 1e9


# ---------------------------------------------------------------------------------------------
# The 8B-shaped target (random weights, built on the device)


def build_target(P):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**P["target"], rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)
    old = torch.get_default_dtype()
    torch.set_default_dtype(P["dtype"])
    try:
        with torch.device(P["device"]):
            torch.manual_seed(0)
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(old)
    model.to(P["dtype"]).eval()
    model.generation_config.eos_token_id = None
    return model


def param_counts(model) -> dict:
    embed = model.get_input_embeddings().weight.numel()
    head = model.lm_head.weight.numel()
    total = sum(p.numel() for p in model.parameters())
    return {"total": total, "embed": embed, "lm_head": head, "decoder": total - embed - head}


# ---------------------------------------------------------------------------------------------
# 2. Extraction


def extraction(P, model) -> None:
    from draftlab.extract import capture

    dev, S = P["device"], "extraction"
    counts = param_counts(model)
    c = model.config
    H, L = c.hidden_size, c.num_hidden_layers
    k = len(P["physical"])
    rate = matmul_rate(P)
    record(S, "physical", P["physical"])
    record(S, "decoder_params", counts["decoder"])
    record(S, "weight_bytes", sum(p.numel() * p.element_size() for p in model.parameters()))
    for T in P["extract_lengths"]:
        B = max(1, P["extract_tokens"] // T)
        g = torch.Generator(device="cpu").manual_seed(T)
        ids = torch.randint(0, c.vocab_size, (B, T), generator=g).to(dev)
        mask = torch.ones(B, T, dtype=torch.long, device=dev)
        reset_peak(dev)
        got = {}

        def run():
            got["aux"], got["final"] = capture(model, ids, mask, P["physical"])

        times = timed(run, dev, 1, P["extract_iters"])
        t = sum(times) / len(times)
        tok_s = B * T / t
        # Compute floor: 2 x decoder parameters FLOPs per token (no lm_head: capture runs the base
        # model; the embedding is a lookup) at the measured matmul rate. Attention adds
        # 4 * T * H per layer per token (QK^T and PV, non-causal count) on top; reported apart.
        flop_tok = 2 * counts["decoder"]
        attn_tok = 4 * T * H * L
        floor = rate / flop_tok
        stored = (k + 1) * H * 2  # bytes per token kept: k aux layers + the final hidden, bf16
        p = f"T{T}"
        record(S, f"{p}_batch", B)
        record(S, f"{p}_s_per_batch", t, "s")
        record(S, f"{p}_tokens_per_s", tok_s, "tok/s")
        record(S, f"{p}_floor_tokens_per_s", floor, "tok/s (2 x params at the measured matmul rate)")
        record(S, f"{p}_fraction_of_floor", tok_s / floor)
        record(S, f"{p}_fraction_incl_attention", tok_s * (flop_tok + attn_tok) / rate)
        record(S, f"{p}_peak_mem_gb", peak_gb(dev), "GB")
        record(S, f"{p}_bytes_per_token_stored", stored, "B")
        record(S, f"{p}_store_write_gbs", tok_s * stored / 1e9, "GB/s needed to keep up")
        # What extract_shard does next: every captured tensor to host memory (pageable).
        aux, final = got.pop("aux"), got.pop("final")
        t0 = time.perf_counter()
        host = [aux[i].to("cpu", torch.bfloat16) for i in P["physical"]] + [final.to("cpu", torch.bfloat16)]
        sync(dev)
        d2h = time.perf_counter() - t0
        nbytes = sum(x.numel() * x.element_size() for x in host)
        record(S, f"{p}_d2h_s", d2h, "s (captured layers to pageable host memory)")
        record(S, f"{p}_d2h_gbs", nbytes / d2h / 1e9, "GB/s")
        del aux, final, host, ids, mask
        free(dev)
        # The stage's own path: extract_shard over a shard of 4 batches, host copies included
        # (they overlap the next batch's forward on a GPU), into the shard's host tensors.
        from draftlab.extract import extract_shard

        rows = [(torch.randint(0, c.vocab_size, (T,), generator=g).tolist(), [True] * T) for _ in range(4 * B)]
        times = timed(lambda: extract_shard(model, rows, P["physical"], B, torch.bfloat16, dev), dev, 1, 1)
        stage_tok_s = len(rows) * T / times[0]
        record(S, f"{p}_stage_tokens_per_s", stage_tok_s, "tok/s (extract_shard: forward + host copies, 4 batches)")
        record(S, f"{p}_stage_fraction_of_floor", stage_tok_s / floor)
        record(S, f"{p}_stage_vs_capture", stage_tok_s / tok_s, "(1.0 = the host copies cost nothing)")
        del rows
        free(dev)


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

    from draftlab.spec_engine import new_cache, target_forward

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


@torch.inference_mode()
def decode_profile(P, model) -> None:
    """Where a baseline decode step's time goes: host launch vs GPU, and the top operators."""
    from draftlab.spec_engine import new_cache, target_forward

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
    # The engine's decode with SDPA's cuDNN backend allowed (the old behaviour) and avoided (now).
    # cuDNN keeps a plan per shape, so the order matters: allowed on KV lengths it has not seen
    # ("cold", what a fresh process decoding new lengths pays), the same lengths again ("warm"),
    # then avoided on the same lengths.
    from draftlab import spec_engine

    plist = prompt[0].tolist()
    per = {}
    for name, avoid in (("cold", False), ("warm", False), ("avoided", True)):
        spec_engine.AVOID_CUDNN_ATTENTION = avoid
        r = spec_engine.baseline_generate(model, plist, P["decode_new"], ignore_eos=True)
        per[name] = (r.total_s - r.prefill_s) / max(1, len(r.output_ids) - 1)
        record(S, f"engine_decode_ms_cudnn_{name}", per[name] * 1e3, f"ms per token (baseline_generate, {P['decode_new']} tokens)")
    spec_engine.AVOID_CUDNN_ATTENTION = True
    record(S, "engine_decode_cudnn_cold_ratio", per["cold"] / per["avoided"], "(cuDNN allowed, new lengths / avoided)")
    # The soft labels in bf16 instead of fp32 (train.target_labels' cost on one 2048-token batch).
    H, V = model.config.hidden_size, model.config.vocab_size
    rows = torch.randn(P["train_seq"], H, device=dev)
    head = model.lm_head.weight
    for name, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        r, h = rows.to(dt), head.to(dt)
        t = timed(lambda: (r @ h.T).argmax(-1), dev, 1, 3)
        record(S, f"labels_{name}_ms", sum(t) / len(t) * 1e3, f"ms ({P['train_seq']} rows x {V} vocab)")
        del r, h
    free(dev)


# ---------------------------------------------------------------------------------------------
# 4. The speculative engine on the 8B-shaped target


def spec(P, model) -> None:
    from draftlab import spec_engine
    from tests.support.drafts import ScriptedDraft

    dev, S = P["device"], "spec"
    counts = param_counts(model)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    # A decode step reads every weight once except the embedding (one row).
    step_bytes = weight_bytes - counts["embed"] * next(model.parameters()).element_size()
    bw = copy_rate(P)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(10, model.config.vocab_size, (P["spec_prompt"],), generator=g).tolist()
    new = P["spec_new"]
    if P.get("stable_greedy"):
        stabilize(model)
        record(S, "stable_greedy", 1)
    spec_engine.baseline_generate(model, prompt, 8, ignore_eos=True)  # warm-up
    base = spec_engine.baseline_generate(model, prompt, new, ignore_eos=True)
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
    # synchronised (draftlab.bench.measure_costs stops its clock before the GPU has finished).
    widths = sorted({1} | {n + 1 for n in P["spec_steps"]})
    costs = {"verify_s": forward_costs(model, prompt, widths, dev)}
    for w, s in costs["verify_s"].items():
        record(S, f"target_forward_w{w}_ms", s * 1e3, "ms")
    # The oracle and null drafts are exactly what spec_engine.oracle_draft / spec_engine.null_draft build, made
    # once from the baseline's output (each of those calls re-runs the baseline decode).
    ref = list(prompt) + base.output_ids
    for steps in P["spec_steps"]:
        for name, draft in (("oracle", ScriptedDraft(ref, model.config.vocab_size)),
                            ("null", ScriptedDraft(ref, model.config.vocab_size, never=True))):
            r = spec_engine.generate(model, draft, prompt, num_steps=steps, topk=1, num_draft_tokens=steps + 1, max_new_tokens=new,
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


# ---------------------------------------------------------------------------------------------
# 3. Draft training step


def train_flops(cfg, B: int, T: int, steps: int, scored: list[int], V: int) -> dict:
    """FLOPs of one optimizer step, counted from the shapes (see notes.md)."""
    H, I, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    nh, nkv, Vd, k = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.draft_vocab_size, cfg.num_aux_layers
    p_fc = k * H * H
    p_attn = 2 * H * nh * hd + 2 * (2 * H * nkv * hd) + nh * hd * H
    p_mlp = 3 * H * I
    p_head = H * Vd
    rows = B * T
    fwd_layer = steps * rows * (2 * (p_attn + p_mlp) + 4 * T * nh * hd)
    fwd_head = sum(2 * p_head * n for n in scored)
    fwd_fc = 2 * p_fc * rows
    labels = 2 * H * V * rows  # no_grad: forward only
    model = 3 * (fwd_layer + fwd_head + fwd_fc)
    return {"model_flops": model, "label_flops": labels, "total_flops": model + labels,
            "params": {"fc": p_fc, "attn": p_attn, "mlp": p_mlp, "lm_head": p_head}}


def training(P) -> None:
    from draftlab.draft import DraftConfig
    from draftlab.train import TTT, init_draft, labels_dtype, new_optimizer, step_token_counts, target_labels

    dev, S = P["device"], "training"
    device = torch.device(dev)
    t = P["target"]
    facts = {**t, "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "head_dim": t["hidden_size"] // t["num_attention_heads"]}
    facts["vocab_size"] = P["train_vocab"]
    cfg = DraftConfig.from_target(facts, 3, P["train_draft_vocab"])
    V, Vd, H = P["train_vocab"], P["train_draft_vocab"], cfg.hidden_size
    g = torch.Generator().manual_seed(0)
    kept = torch.randperm(V, generator=g)[:Vd].sort().values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[kept] = True
    d2t = kept - torch.arange(Vd)
    with torch.device(dev):
        embed = torch.randn(V, H) * 0.02
        head = torch.randn(V, H) * 0.02
        draft = init_draft(cfg, embed, head, d2t.to(dev), t2d.to(dev), seed=0)
    draft.to(device).train()
    autocast = device.type == "cuda"
    steps = P["ttt_steps"]
    ttt = TTT(draft, steps, 0.8)
    params = [p for p in draft.parameters() if p.requires_grad]
    opt = new_optimizer(params, 1e-4, 0.0, device)  # what train.fit uses (fused AdamW on CUDA)
    record(S, "draft_params", sum(p.numel() for p in params))
    record(S, "ttt_steps", steps)
    record(S, "autocast_bf16", autocast)
    for B in P["train_batches"]:
        T = P["train_seq"]
        p = f"B{B}"
        try:
            ids = torch.randint(0, V, (B, T), device=dev)
            loss_mask = torch.ones(B, T, dtype=torch.bool, device=dev)
            loss_mask[:, : T // 8] = False  # a prompt: not scored, as in real data
            batch = {"input_ids": ids, "loss_mask": loss_mask,
                     "aux_hidden": torch.randn(B, T, 3 * H, device=dev), "final_hidden": torch.randn(B, T, H, device=dev)}
            counts = step_token_counts(loss_mask, steps, 1)
            split = {"labels": 0.0, "fwd_bwd": 0.0, "opt": 0.0}

            def one(acc: bool):
                t0 = time.perf_counter()
                labels = target_labels(batch["final_hidden"], head, draft.d2t, dtype=labels_dtype(autocast))
                sync(dev)
                t1 = time.perf_counter()
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
                    loss, _ = ttt(batch, labels, counts)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                sync(dev)
                t2 = time.perf_counter()
                torch.nn.utils.clip_grad_norm_(params, 0.5)
                opt.step()
                sync(dev)
                t3 = time.perf_counter()
                if acc:
                    split["labels"] += t1 - t0
                    split["fwd_bwd"] += t2 - t1
                    split["opt"] += t3 - t2

            reset_peak(dev)
            one(False)
            one(False)
            iters = P["train_iters"]
            t0 = time.perf_counter()
            for _ in range(iters):
                one(True)
            step_s = (time.perf_counter() - t0) / iters
            f = train_flops(cfg, B, T, steps, [int(x) for x in counts.tolist()], V)
            rate = matmul_rate(P)
            record(S, f"{p}_seq", T)
            record(S, f"{p}_step_s", step_s, "s per optimizer step")
            record(S, f"{p}_tokens_per_s", B * T / step_s, "tok/s")
            record(S, f"{p}_labels_s", split["labels"] / iters, f"s (target_labels over the full vocab, {labels_dtype(autocast)})")
            record(S, f"{p}_fwd_bwd_s", split["fwd_bwd"] / iters, "s")
            record(S, f"{p}_optimizer_s", split["opt"] / iters, "s (clip + AdamW)")
            record(S, f"{p}_model_flops", float(f["model_flops"]))
            record(S, f"{p}_label_flops", float(f["label_flops"]))
            record(S, f"{p}_mfu", f["total_flops"] / step_s / rate, "(all counted FLOPs / step time / measured matmul rate)")
            record(S, f"{p}_mfu_fwd_bwd_only", f["model_flops"] / (split["fwd_bwd"] / iters) / rate,
                   "(draft FLOPs / forward+backward time)")
            record(S, f"{p}_peak_mem_gb", peak_gb(dev), "GB")
            RESULTS[S]["flop_params"] = f["params"]
            if B == P["profile_batch"]:
                profile_step(S, p, lambda: one(False), dev)
        except Exception as e:  # noqa: BLE001 - keep the other batch size
            record(S, f"{p}_error", f"{type(e).__name__}: {e}"[:500])
            traceback.print_exc()
        finally:
            batch = None
            opt.zero_grad(set_to_none=True)
            free(dev)


GEMM_OPS = {"aten::mm", "aten::bmm", "aten::addmm", "aten::baddbmm", "aten::_scaled_mm"}


def profile_step(S: str, p: str, fn, dev) -> None:
    """Where one training step's device time goes: the GEMM share and the top operators (self time)."""
    try:
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.device(dev).type == "cuda" else [])
        with profile(activities=acts) as prof:
            fn()
            sync(dev)

        def self_us(e):
            for name in ("self_device_time_total", "self_cuda_time_total", "self_cpu_time_total"):
                v = getattr(e, name, None)
                if v:
                    return float(v)
            return 0.0

        from torch.autograd import DeviceType

        avgs = prof.key_averages()
        # Kernels appear twice: as their own rows (device type CUDA) and inside the self device time
        # of the operator that launched them. The total counts kernel rows; shares count operators.
        kernels = [e for e in avgs if e.device_type == DeviceType.CUDA]
        ops = sorted(((e.key, self_us(e)) for e in avgs if e.device_type == DeviceType.CPU), key=lambda x: -x[1])
        total = sum(self_us(e) for e in kernels) if kernels else sum(t for _, t in ops)
        gemm = sum(t for k, t in ops if k in GEMM_OPS)
        record(S, f"{p}_profiled_device_ms", total / 1e3, "ms (device time of one step's kernels)")
        record(S, f"{p}_gemm_share", gemm / total if total else float("nan"), "(matrix-multiply operators' share of it)")
        RESULTS[S][f"{p}_top_ops_ms"] = [[k, round(t / 1e3, 3)] for k, t in ops[:12]]
        save()
        log(prof.key_averages().table(sort_by="self_cuda_time_total" if torch.device(dev).type == "cuda" else "self_cpu_time_total",
                                      row_limit=15))
    except Exception as e:  # noqa: BLE001
        record(S, f"{p}_profiler_error", f"{type(e).__name__}: {e}"[:300])


# ---------------------------------------------------------------------------------------------
# 4b. Decode over a static KV cache, eager and as a CUDA graph (what the engine leaves on the table)


class StaticDecode:
    """Greedy 1-token decode of a transformers Llama over a preallocated KV cache.

    Every tensor a step touches has a fixed address and the step never asks the host anything,
    so it can be captured once as a CUDA graph and replayed per token, as SGLang serves. The
    weights and layer modules are the model's own; only the cache and the loop are new. This
    measures what the engine's eager transformers decode leaves on the table; it is not the engine.
    """

    def __init__(self, model, max_len: int):
        c = model.config
        self.model, self.max_len = model, max_len
        self.nh, self.nkv = c.num_attention_heads, c.num_key_value_heads
        self.hd = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        dev, dt = model.device, model.dtype
        self.k = torch.zeros(c.num_hidden_layers, 1, self.nkv, max_len, self.hd, dtype=dt, device=dev)
        self.v = torch.zeros_like(self.k)
        self.pos = torch.zeros(1, dtype=torch.long, device=dev)
        self.tok = torch.zeros(1, 1, dtype=torch.long, device=dev)
        self.logits = torch.zeros(1, c.vocab_size, dtype=torch.float32, device=dev)
        self.slots = torch.arange(max_len, device=dev)
        self.graph = None

    @torch.inference_mode()
    def prefill(self, prompt: list[int]) -> int:
        from draftlab.spec_engine import new_cache, target_forward

        cache = new_cache(self.model)
        logits = target_forward(self.model, torch.tensor([prompt], device=self.model.device), cache, logits_to_keep=1)
        n = len(prompt)
        for i, layer in enumerate(cache.layers):
            self.k[i, :, :, :n] = layer.keys
            self.v[i, :, :, :n] = layer.values
        self.pos.fill_(n)
        self.tok.copy_(logits[:, -1].argmax(-1).view(1, 1))
        return int(self.tok)

    @torch.inference_mode()
    def step(self) -> None:
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        base = self.model.model
        x = base.embed_tokens(self.tok)
        cos, sin = base.rotary_emb(x, self.pos.view(1, 1))
        mask = (self.slots <= self.pos).view(1, 1, 1, -1)
        g = self.nh // self.nkv
        for i, layer in enumerate(base.layers):
            at = layer.self_attn
            h = layer.input_layernorm(x)
            q = at.q_proj(h).view(1, 1, self.nh, self.hd).transpose(1, 2)
            k = at.k_proj(h).view(1, 1, self.nkv, self.hd).transpose(1, 2)
            v = at.v_proj(h).view(1, 1, self.nkv, self.hd).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            self.k[i].index_copy_(2, self.pos, k)
            self.v[i].index_copy_(2, self.pos, v)
            o = F.scaled_dot_product_attention(q, self.k[i].repeat_interleave(g, 1), self.v[i].repeat_interleave(g, 1), attn_mask=mask)
            x = x + at.o_proj(o.transpose(1, 2).reshape(1, 1, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        self.logits.copy_(self.model.lm_head(base.norm(x))[:, -1].float())
        self.tok.copy_(self.logits.argmax(-1).view(1, 1))
        self.pos.add_(1)

    def capture(self) -> None:
        """Record one step as a CUDA graph (after warm-up steps on a side stream, then undone)."""
        state = (self.k, self.v, self.pos, self.tok, self.logits)
        saved = [t.clone() for t in state]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self.step()
        torch.cuda.current_stream().wait_stream(side)
        for t, s in zip(state, saved):
            t.copy_(s)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.step()

    def decode(self, n: int) -> list[int]:
        out = []
        for _ in range(n):
            self.graph.replay() if self.graph is not None else self.step()
            out.append(int(self.tok))  # the token on the host every step, as a real decode loop needs it
        return out


def decode_graph(P, model) -> None:
    from draftlab import spec_engine

    dev, S = P["device"], "decode_graph"
    counts = param_counts(model)
    step_bytes = sum(p.numel() * p.element_size() for p in model.parameters()) - counts["embed"] * next(model.parameters()).element_size()
    floor = copy_rate(P) / step_bytes
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(10, model.config.vocab_size, (P["spec_prompt"],), generator=g).tolist()
    new = P["graph_new"]
    ref = spec_engine.baseline_generate(model, prompt, new + 1, ignore_eos=True)
    sd = StaticDecode(model, -(-(len(prompt) + new + 8) // 64) * 64)  # slots in whole 64s: aligned for the attention kernels
    with spec_engine.attention_kernels(dev), torch.inference_mode():
        # The same computation as the engine: logits of the static step against the engine's own
        # forward, fed the same tokens, for a few steps.
        x = sd.prefill(prompt)
        cache = spec_engine.new_cache(model)
        spec_engine.target_forward(model, torch.tensor([prompt], device=dev), cache)
        err = 0.0
        for _ in range(4):
            want = spec_engine.target_forward(model, torch.tensor([[x]], device=dev), cache, logits_to_keep=1)[0, -1].float()
            sd.tok.fill_(x)
            sd.step()
            err = max(err, float((sd.logits[0] - want).norm() / want.norm()))
            x = int(want.argmax())
        record(S, "eager_logits_rel_err", err, "(static step vs the engine's forward, 4 steps, max)")
        modes = ["eager"] + (["graph"] if dev == "cuda" else [])
        for mode in modes:
            first = sd.prefill(prompt)
            if mode == "graph":
                t0 = time.perf_counter()
                sd.capture()
                record(S, "capture_s", time.perf_counter() - t0, "s")
                first = sd.prefill(prompt)  # the cache as it was before the warm-up
            sync(dev)
            t0 = time.perf_counter()
            toks = sd.decode(new)
            sync(dev)
            ms = (time.perf_counter() - t0) / new * 1e3
            record(S, f"{mode}_matches_engine", int([first] + toks == ref.output_ids), "(same tokens as baseline_generate)")
            record(S, f"{mode}_ms_per_token", ms, "ms")
            record(S, f"{mode}_tokens_per_s", 1e3 / ms, "tok/s")
            record(S, f"{mode}_fraction_of_floor", (1e3 / ms) / floor, f"(floor {floor:.1f} tok/s)")
    record(S, "engine_ms_per_token", (ref.total_s - ref.prefill_s) / max(1, len(ref.output_ids) - 1) * 1e3, "ms (baseline_generate, same prompt)")


# ---------------------------------------------------------------------------------------------
# 5. The embedded default


def embedded(P) -> None:
    from transformers import AutoModelForCausalLM

    from draftlab import spec_engine
    from draftlab.bench import render_prompts
    from draftlab.sglang.checkpoint import load_exported
    from draftlab.target import load_tokenizer
    from draftlab.tasks import generate as make_tasks

    dev, S = P["device"], "embedded"
    tdir, ddir = ROOT / "models/tiny-target", ROOT / "models/draft"
    if not (ddir / "config.json").exists():
        record(S, "skipped", 1)
        record(S, "note", "models/draft is absent in this working tree (DVC output): nothing measured")
        return
    record(S, "skipped", 0)
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    target = AutoModelForCausalLM.from_pretrained(str(tdir), dtype=dtype).to(dev).eval()
    tok = load_tokenizer(str(tdir))
    embed = target.get_input_embeddings().weight
    draft, config = load_exported(ddir, embed=embed, dtype=embed.dtype)
    draft.to(dev)
    physical = config["draftlab"]["physical_layers"]
    problems = make_tasks(P["embedded_prompts"], seed=5, split="heldout")
    prompts = render_prompts(tok, [{"messages": [{"role": "user", "content": p.prompt}]} for p in problems])
    eos = {target.generation_config.eos_token_id, tok.eos_token_id} - {None}
    eos = {e for x in eos for e in (x if isinstance(x, (list, tuple)) else [x])}
    new = P["embedded_new"]
    steps = 5
    record(S, "target_dtype", str(dtype))
    record(S, "physical", physical)
    record(S, "num_steps", steps)
    record(S, "prompts", len(prompts))
    spec_engine.baseline_generate(target, prompts[0], 8, eos_token_id=eos)  # warm-ups
    spec_engine.generate(target, draft, prompts[0], num_steps=steps, topk=1, num_draft_tokens=steps + 1, max_new_tokens=8,
                eos_token_id=eos, physical_layers=physical)
    bt = bs = 0.0
    bn = sn = ver = 0
    same = 0
    for p in prompts:
        b = spec_engine.baseline_generate(target, p, new, eos_token_id=eos)
        r = spec_engine.generate(target, draft, p, num_steps=steps, topk=1, num_draft_tokens=steps + 1, max_new_tokens=new,
                        eos_token_id=eos, physical_layers=physical)
        bt, bn = bt + b.total_s, bn + len(b.output_ids)
        bs, sn, ver = bs + r.total_s, sn + len(r.output_ids), ver + r.spec_verify_ct
        same += r.output_ids == b.output_ids
    record(S, "baseline_tokens_per_s", bn / bt, "tok/s")
    record(S, "spec_tokens_per_s", sn / bs, "tok/s")
    record(S, "tau", sn / max(1, ver))
    record(S, "speedup", (sn / bs) / (bn / bt), "x")
    record(S, "outputs_equal_baseline", same)
    del target, draft
    free(dev)


# ---------------------------------------------------------------------------------------------


NOTES = """# draftlab GPU measurements: method

Produced by `tools/perf_h200.py` ({mode}). Figures: results.json (same directory).

Machine: {machine}

## Ceilings
- bf16 matmul: C = A @ B with n = {n} (2 n^3 FLOP), {warm} warm-ups then {iters} timed calls, each synchronised;
  the **mean** is the compute ceiling used everywhere below (the best call is reported too).
- Copy bandwidth: `dst.copy_(src)` of {copy_mb} MiB, bytes read + written (2 x size) / mean time.

## Extraction (Llama-3.1-8B shape, random weights, bf16, built on the device)
- `draftlab.extract.capture(model, ids, mask, physical={physical})` on batches of ~{tok} tokens at each length
  (1 warm-up, then the mean of {eiters}).
- Compute floor: tokens/s = matmul rate / (2 x decoder parameters) (embedding is a lookup; capture runs
  the base model, no lm_head). `fraction_incl_attention` adds 4 x T x H FLOPs per layer per token.
- Bytes stored per token: (k + 1) x H x 2 (k aux layers and the final hidden, bf16); the write bandwidth
  is that times the measured tokens/s. `d2h` times the copy of one batch's captured layers to pageable host
  memory. `stage_*`: `draftlab.extract.extract_shard` itself (what the extract stage runs) over a shard of 4 batches
  of the same size, host copies included: on CUDA each batch's copy to pinned memory runs on a side stream while
  the next batch's forward runs; `stage_vs_capture` = its tokens/s over the capture-only rate.

## Training step (draft of the same target: H 4096, target vocab {V}, draft vocab {Vd}, 3 aux layers)
- One optimizer step of `draftlab.train`: `target_labels` (full vocab, bf16 on CUDA as `train.fit` runs it) + `TTT`
  forward ({steps} steps, bf16 autocast) + backward + grad clip + AdamW (`train.new_optimizer`: fused on CUDA);
  random aux/final hidden states; loss mask False on the first 1/8 of each sequence (a prompt). 2 warm-up steps,
  then the mean of {titers}. One step at batch {pbatch} under torch.profiler: `gemm_share` = self device time of the
  matrix-multiply operators (aten::mm, bmm, addmm, baddbmm) / self device time of all operators; `top_ops_ms` lists
  the 12 largest.
- FLOPs counted per optimizer step (B sequences of T tokens, N_i = rows scored at TTT step i):
  - per token per TTT step, forward: 2 x (q,k,v,o + MLP params) + attention 4 x T x (heads x head_dim)
    (q: 2H -> heads x hd, k,v: 2H -> kv_heads x hd, o: heads x hd -> H; MLP 3 x H x I)
  - lm_head over the draft vocab: 2 x H x Vd per **scored** row (TTT only evaluates those rows)
  - fc: 2 x (3H x H) per token, once (step 0)
  - training = 3 x forward (forward + backward); soft labels 2 x H x V per token, once (no grad)
  - MFU = counted FLOPs / step time / measured matmul rate.

## Speculative engine (same 8B-shaped target, bf16, batch 1, greedy, ignore_eos)
- `baseline_generate` of {new} new tokens on a random {plen}-token prompt (after a warm-up);
  decode tokens/s excludes the prefill. Bandwidth floor = measured copy bandwidth / bytes read per decode step
  (all weights but the embedding).
- Oracle / null drafts: `ScriptedDraft` over the baseline's output (what `oracle_draft` /
  `null_draft` build; made once instead of re-running the baseline per call); `generate` with topk 1,
  num_draft_tokens = num_steps + 1, num_steps in {spec_steps}. speedup = tokens/s / baseline tokens/s
  (whole requests). Overhead per step = (request time - prefill) / verify steps - pure target forward of
  num_steps + 1 tokens on a cached prompt (synchronised, median of 5).
- The random target is made greedy-stable for this section (embedding ~ N(0, 4^2), lm_head tied to it), so the
  oracle built from the baseline stays right at every verify width; shapes and compute are unchanged.

## Decode profile
- One decode step of the 8B-shaped target: host time until the forward call returns, GPU time (CUDA events),
  wall time to the token; torch.profiler tables in log.txt. Soft labels fp32 vs bf16 on one 2048-row batch.
- `engine_decode_ms_cudnn_*`: `baseline_generate` ({dnew} tokens, ms per decode token without the prefill) with SDPA's
  cuDNN backend allowed on KV lengths it has not seen in this process (cold), allowed again on the same lengths (warm:
  cuDNN keeps a plan per shape), and avoided (`spec_engine.AVOID_CUDNN_ATTENTION`, the engine's default).

## Decode over a static KV cache (`decode_graph`)
- `StaticDecode`: the model's own modules and weights over a preallocated KV cache ({gnew} greedy tokens after a
  {plen}-token prompt). Checked first: its logits against the engine's forward fed the same tokens (4 steps, max
  relative error). Then timed eagerly and, on CUDA, as one captured CUDA graph replayed per token (the token read on
  the host every step). Fraction of floor as for the baseline decode. Runs before `spec` rescales the embedding.

## Embedded default
- models/tiny-target with the exported models/draft (if present), num_steps 5, topk 1, {eprompts} held-out prompts
  (`tasks.generate(n, seed=5, split="heldout")`, chat template), max_new_tokens {enew}, EOS honoured.
  tau = output tokens / verify steps (pooled); speedup = pooled tokens/s ratio.
"""


def machine() -> str:
    s = f"python {platform.python_version()}, torch {torch.__version__}"
    try:
        import transformers

        s += f", transformers {transformers.__version__}"
    except Exception:  # noqa: BLE001
        pass
    if torch.cuda.is_available():
        s += f", {torch.cuda.get_device_name(0)} ({torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB)"
    else:
        s += f", CPU only ({os.cpu_count()} cores)"
    return s


def main(argv=None) -> int:
    global OUT
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true", help="CPU, tiny shapes, few iterations")
    ap.add_argument("--sections", default="ceilings,extraction,decode_profile,spec,decode_graph,training,embedded")
    args = ap.parse_args(argv)
    OUT = Path(args.out)
    P = plan(args.quick)
    if P["device"] == "cuda" and not torch.cuda.is_available():
        log("no CUDA device: use --quick on the CPU")
        return 2
    if P["device"] == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # the code's own default, measured as it runs
    RESULTS.clear()
    RESULTS["meta"] = {"mode": "quick" if args.quick else "full", "machine": machine(),
                       "command": " ".join([os.path.basename(sys.executable)] + sys.argv)}
    save()
    (OUT / "notes.md").write_text(NOTES.format(
        mode="--quick, CPU, tiny shapes" if args.quick else "full, GPU", machine=RESULTS["meta"]["machine"],
        n=P["matmul_n"], warm=P["mm_warm"], iters=P["mm_iters"], copy_mb=P["copy_mb"], physical=P["physical"],
        tok=P["extract_tokens"], eiters=P["extract_iters"], V=P["train_vocab"], Vd=P["train_draft_vocab"],
        steps=P["ttt_steps"], titers=P["train_iters"], new=P["spec_new"], plen=P["spec_prompt"],
        spec_steps=P["spec_steps"], eprompts=P["embedded_prompts"], enew=P["embedded_new"], pbatch=P["profile_batch"],
        dnew=P["decode_new"], gnew=P["graph_new"]))
    log(f"perf_h200: {RESULTS['meta']['mode']} on {RESULTS['meta']['machine']}")
    wanted = args.sections.split(",")
    t_all = time.perf_counter()

    def section(name, fn, *a):
        if name not in wanted:
            return
        t0 = time.perf_counter()
        log(f"== {name}")
        try:
            fn(*a)
        except Exception as e:  # noqa: BLE001 - one section failing must not lose the others
            record(name, "error", f"{type(e).__name__}: {e}"[:500])
            traceback.print_exc()
        record(name, "section_s", time.perf_counter() - t0, "s")
        free(P["device"])

    section("ceilings", ceilings, P)
    model = None
    if {"extraction", "spec", "decode_profile", "decode_graph"} & set(wanted):
        try:
            t0 = time.perf_counter()
            model = build_target(P)
            record("meta", "target_build_s", time.perf_counter() - t0, "s")
        except Exception as e:  # noqa: BLE001
            record("meta", "target_error", f"{type(e).__name__}: {e}"[:500])
            traceback.print_exc()
    if model is not None:
        section("extraction", extraction, P, model)
        section("decode_profile", decode_profile, P, model)
        section("decode_graph", decode_graph, P, model)  # before spec, which rescales the embedding
        section("spec", spec, P, model)
        del model
        free(P["device"])
    section("training", training, P)
    section("embedded", embedded, P)
    record("meta", "total_s", time.perf_counter() - t_all, "s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
