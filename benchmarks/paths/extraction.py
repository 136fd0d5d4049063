"""Extraction: the target forward with hooks (draftlab.features.extract.capture) and the extract stage's own
extract_shard, in tokens/s against the compute floor.

Method: the 8B-shaped target (random weights, built on the device) on batches of about
`extract_tokens` tokens at each sequence length T; 1 warm-up, then the mean of `extract_iters`.
- Compute floor: tokens/s = measured matmul rate / (2 x decoder parameters): capture runs the base
  model (no lm_head) and the embedding is a lookup. `fraction_incl_attention` adds 4 x T x H FLOPs
  per layer per token (QK^T and PV, counted non-causal).
- Bytes stored per token: (k + 1) x H x 2 (k aux layers and the final hidden, bf16); the write
  bandwidth needed is that times the measured tokens/s. `d2h`: one batch's captured layers copied
  to pageable host memory, as the stage did before its copies overlapped the next forward.
- `stage_*`: draftlab.features.extract.extract_shard itself over a shard of 4 batches of the same size, host
  copies included (on CUDA each batch's copy to pinned memory runs on a side stream while the next
  batch's forward runs); `stage_vs_capture` = its tokens/s over the capture-only rate.
"""
from __future__ import annotations

import time

import torch

from benchmarks.paths.common import free, matmul_rate, param_counts, peak_gb, record, reset_peak, sync, timed


def capture_run(model, ids, mask, physical, dev, iters: int):
    """(seconds of each timed capture, the last capture's aux layers and final hidden)."""
    from draftlab.features.extract import capture

    got = {}

    def run():
        got["aux"], got["final"] = capture(model, ids, mask, physical)

    times = timed(run, dev, 1, iters)
    return times, got["aux"], got["final"]


def stage_seconds(model, rows, physical, batch: int, dev) -> float:
    """One synchronised extract_shard over `rows` (after one warm-up shard)."""
    from draftlab.features.extract import extract_shard

    return timed(lambda: extract_shard(model, rows, physical, batch, torch.bfloat16, dev), dev, 1, 1)[0]


def extraction(P, model) -> None:
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
        times, aux, final = capture_run(model, ids, mask, P["physical"], dev, P["extract_iters"])
        t = sum(times) / len(times)
        tok_s = B * T / t
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
        # Every captured tensor to pageable host memory, serially (the stage's path before its copies overlapped).
        t0 = time.perf_counter()
        host = [aux[i].to("cpu", torch.bfloat16) for i in P["physical"]] + [final.to("cpu", torch.bfloat16)]
        sync(dev)
        d2h = time.perf_counter() - t0
        nbytes = sum(x.numel() * x.element_size() for x in host)
        record(S, f"{p}_d2h_s", d2h, "s (captured layers to pageable host memory)")
        record(S, f"{p}_d2h_gbs", nbytes / d2h / 1e9, "GB/s")
        del aux, final, host, ids, mask
        free(dev)
        # The stage's own path: extract_shard over a shard of 4 batches, host copies included.
        rows = [(torch.randint(0, c.vocab_size, (T,), generator=g).tolist(), [True] * T) for _ in range(4 * B)]
        stage_tok_s = len(rows) * T / stage_seconds(model, rows, P["physical"], B, dev)
        record(S, f"{p}_stage_tokens_per_s", stage_tok_s, "tok/s (extract_shard: forward + host copies, 4 batches)")
        record(S, f"{p}_stage_fraction_of_floor", stage_tok_s / floor)
        record(S, f"{p}_stage_vs_capture", stage_tok_s / tok_s, "(1.0 = the host copies cost nothing)")
        del rows
        free(dev)
