"""One draft training step (draftlab.train.objective.TTT) in tokens/s and MFU, and where its time goes.

Method: the draft of the 8B-shaped target (H 4096, 3 aux layers, target vocab `train_vocab`, draft
vocab `train_draft_vocab`) on random aux/final hidden states, loss mask False on the first 1/8 of
each sequence (a prompt). One optimizer step = `target_labels` (full vocab, bf16 on CUDA as
`train.fit` runs it) + TTT forward (`ttt_steps` steps, bf16 autocast) + backward + grad clip +
AdamW (`train.new_optimizer`: fused on CUDA); 2 warm-up steps, then the mean of `train_iters`.
FLOPs are counted from the shapes (`train_flops`), per optimizer step of B sequences of T tokens
with N_i rows scored at TTT step i:
  - per token per TTT step, forward: 2 x (q,k,v,o + MLP params) + attention 4 x T x (heads x head_dim)
  - lm_head over the draft vocab: 2 x H x Vd per scored row (TTT only evaluates those rows)
  - fc: 2 x (3H x H) per token, once (step 0)
  - training = 3 x forward (forward + backward); soft labels 2 x H x V per token, once (no grad)
  - MFU = counted FLOPs / step time / measured matmul rate.
One step at batch `profile_batch` runs under torch.profiler (`profile_step`): `gemm_share` = self
GPU kernel time of the matrix-multiply operators / GPU kernel time of all the step's kernels.
`labels_cost` (reported in section decode_profile) times the soft labels' projection in fp32 and bf16.
"""
from __future__ import annotations

import time
import traceback

import torch

from benchmarks.paths.common import RESULTS, free, log, matmul_rate, peak_gb, record, reset_peak, save, sync, timed

GEMM_OPS = {"aten::mm", "aten::bmm", "aten::addmm", "aten::baddbmm", "aten::_scaled_mm"}


def train_flops(cfg, B: int, T: int, steps: int, scored: list[int], V: int) -> dict:
    """FLOPs of one optimizer step, counted from the shapes (see the module docstring)."""
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


MODES = ("eager", "stage")  # eager: the TTT attention written out, nothing compiled (the committed 8B figures);
# stage: what the train stage runs on a GPU (train.attention auto: FlexAttention; train.compile: the layer and loss compiled)


def training(P) -> None:
    """Every mode of P["train_modes"] on a draft of its own; keys B<batch>_* for eager, stage_B<batch>_* for stage."""
    modes = P.get("train_modes", ["eager"])
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise ValueError(f"train mode {unknown[0]!r}: one of {', '.join(MODES)}")
    for mode in modes:
        training_mode(P, mode)


def training_mode(P, mode: str) -> None:
    from draftlab.train.draft import DraftConfig
    from draftlab.train.loop import attention_kernel, init_draft, new_optimizer
    from draftlab.train.objective import TTT, labels_dtype, step_token_counts, target_labels

    dev, S = P["device"], "training"
    device = torch.device(dev)
    prefix = "" if mode == "eager" else f"{mode}_"
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
    if mode == "stage":  # as train.fit sets it up with train.compile on a GPU
        if device.type == "cuda":
            draft.midlayer.compile(dynamic=True)
        ttt = TTT(draft, steps, 0.8, attention_kernel("auto", device), device.type == "cuda", compile_loss=device.type == "cuda")
    else:
        ttt = TTT(draft, steps, 0.8)
    params = [p for p in draft.parameters() if p.requires_grad]
    opt = new_optimizer(params, 1e-4, 0.0, device)  # what train.fit uses (fused AdamW on CUDA)
    record(S, "draft_params", sum(p.numel() for p in params))
    record(S, "ttt_steps", steps)
    record(S, "autocast_bf16", autocast)
    for B in P["train_batches"]:
        T = P["train_seq"]
        p = f"{prefix}B{B}"
        try:
            ids = torch.randint(0, V, (B, T), device=dev)
            loss_mask = torch.ones(B, T, dtype=torch.bool, device=dev)
            loss_mask[:, : T // 8] = False  # a prompt: not scored, as in real data
            batch = {"input_ids": ids, "loss_mask": loss_mask,
                     "aux_hidden": torch.randn(B, T, 3 * H, device=dev), "final_hidden": torch.randn(B, T, H, device=dev)}
            counts = step_token_counts(batch, steps, 1)
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
            t_warm = time.perf_counter()
            one(False)
            one(False)
            record(S, f"{p}_warmup_s", time.perf_counter() - t_warm, "s (2 steps; compiling included in stage mode)")
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


def profile_step(S: str, p: str, fn, dev) -> None:
    """Where one training step's kernel time goes: the GEMM share and the top operators (self time)."""
    try:
        from torch.autograd import DeviceType
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

        avgs = prof.key_averages()
        # Kernels appear twice: as their own rows (device type CUDA) and inside the self GPU kernel time
        # of the operator that launched them. The total counts kernel rows; shares count operators.
        kernels = [e for e in avgs if e.device_type == DeviceType.CUDA]
        ops = sorted(((e.key, self_us(e)) for e in avgs if e.device_type == DeviceType.CPU), key=lambda x: -x[1])
        total = sum(self_us(e) for e in kernels) if kernels else sum(t for _, t in ops)
        gemm = sum(t for k, t in ops if k in GEMM_OPS)
        record(S, f"{p}_profiled_device_ms", total / 1e3, "ms (GPU kernel time of one step's kernels)")
        record(S, f"{p}_gemm_share", gemm / total if total else float("nan"), "(matrix-multiply operators' share of it)")
        RESULTS[S][f"{p}_top_ops_ms"] = [[k, round(t / 1e3, 3)] for k, t in ops[:12]]
        save()
        log(prof.key_averages().table(sort_by="self_cuda_time_total" if torch.device(dev).type == "cuda" else "self_cpu_time_total",
                                      row_limit=15))
    except Exception as e:  # noqa: BLE001
        record(S, f"{p}_profiler_error", f"{type(e).__name__}: {e}"[:300])


def labels_ms(rows, head, dtype, dev) -> list[float]:
    r, h = rows.to(dtype), head.to(dtype)
    return timed(lambda: (r @ h.T).argmax(-1), dev, 1, 3)


def labels_cost(P, model, S: str = "decode_profile") -> None:
    """The soft labels' projection (train.target_labels' cost) on one `train_seq`-row batch, fp32 vs bf16."""
    dev = P["device"]
    V = model.config.vocab_size
    rows = torch.randn(P["train_seq"], model.config.hidden_size, device=dev)
    for name, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        t = labels_ms(rows, model.lm_head.weight, dt, dev)
        record(S, f"labels_{name}_ms", sum(t) / len(t) * 1e3, f"ms ({P['train_seq']} rows x {V} vocab)")
    free(dev)
