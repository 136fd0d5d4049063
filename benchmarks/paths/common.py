"""What every measurement shares: the results file, synchronised timing, the shapes, the target.

`record` writes each figure into results.json as soon as it is measured (one section failing must
not lose the others). `timed` synchronises the device around every call, so a figure is wall time
of finished work. `plan` gives the shapes: Llama-3.1-8B on a GPU, tiny ones on a CPU (--quick).
`build_target` makes that target on the device with random weights: nothing is downloaded.
"""
from __future__ import annotations

import gc
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]

RESULTS: dict = {}
_OUT: list[Path] = [Path(".")]


def set_out(out: Path) -> None:
    """Start a run: results go to out/results.json."""
    _OUT[0] = Path(out)
    RESULTS.clear()


def out_dir() -> Path:
    return _OUT[0]


def log(msg: str) -> None:
    print(msg, flush=True)


def save() -> None:
    out = out_dir()
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "results.json.tmp"
    tmp.write_text(json.dumps(RESULTS, indent=2, default=float))
    tmp.replace(out / "results.json")


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
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def plan(quick: bool) -> dict:
    """The shapes and iteration counts: the GPU run (8B-shaped) or --quick (a CPU, tiny shapes)."""
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


def build_target(P):
    """The plan's Llama target with random weights, built on the device in the plan's dtype."""
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


def decode_bytes(model) -> int:
    """Bytes a decode step reads: every weight once, except the embedding (one row)."""
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return weight_bytes - param_counts(model)["embed"] * next(model.parameters()).element_size()


def matmul_rate(P) -> float:
    """FLOP/s used as the compute ceiling: the measured mean, or the datasheet's if it failed."""
    r = RESULTS.get("ceilings", {}).get("matmul_tflops")
    return (r if r else (989.0 if P["device"] == "cuda" else 0.1)) * 1e12


def copy_rate(P) -> float:
    """Bytes/s used as the bandwidth ceiling: the measured copy rate, or the datasheet's if it failed."""
    r = RESULTS.get("ceilings", {}).get("copy_gbs")
    return (r if r else (4800.0 if P["device"] == "cuda" else 10.0)) * 1e9


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


def command_line(argv: list[str] | None = None) -> str:
    """The command as a user would type it from the repository root: no absolute paths of this machine."""
    def rel(arg: str) -> str:
        if not os.path.isabs(arg):
            return arg
        for base in (ROOT, Path.cwd()):
            try:
                return Path(arg).resolve().relative_to(base.resolve()).as_posix()
            except ValueError:
                continue
        return arg

    return " ".join([os.path.basename(sys.executable)] + [rel(a) for a in (sys.argv if argv is None else argv)])
