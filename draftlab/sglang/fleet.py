"""Several SGLang servers of one target, for throughput: planned, started together, stopped together.

A small target leaves one server's scheduler as the limit, not the GPU: SGLang spends a few ms of
host work per decode step whatever the batch, and a 135M model's forward takes about as long. Measured
on one H200 with SGLang 0.5.14 and SmolLM2-135M (greedy, up to 512 new tokens, ShareGPT first turns):
one server 18.7k tok/s, one server with --num-continuous-decode-steps 4 23.9k, three servers on the
one GPU (memory 0.25 each) 56.2k. So a small target gets several servers per GPU, each with its
share of the GPU's memory; a large one gets one per GPU.

    plan = plan_servers(per_gpu=3, gpus=["0"], mem_fraction=0.75)  # three servers on GPU 0, 0.25 each
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from draftlab.errors import UserError

# servers_per_gpu "auto": by the bytes of the target's weights on disk (bf16: 2 bytes per parameter).
# Under 2 GB (< ~1B parameters) the scheduler is the limit; up to 8 GB two servers still pay; above,
# one server fills the GPU.
AUTO_PER_GPU = ((2e9, 4), (8e9, 2))
DEFAULT_SHARED_MEM = 0.8  # GPU memory share of all the servers on one GPU when several share it and none is given


@dataclass(frozen=True)
class PlannedServer:
    gpu: str | None  # CUDA_VISIBLE_DEVICES for this server (None: leave the environment as it is)
    mem_fraction: float | None  # --mem-fraction-static (None: SGLang's own choice)


def visible_gpus() -> list[str]:
    """The GPUs this process may use, as CUDA_VISIBLE_DEVICES names them (empty on a CPU machine)."""
    named = os.environ.get("CUDA_VISIBLE_DEVICES")
    if named is not None:
        return [g.strip() for g in named.split(",") if g.strip() and g.strip() != "-1"]
    try:
        import torch

        return [str(i) for i in range(torch.cuda.device_count())]
    except Exception:  # noqa: BLE001 - no torch or no driver: no GPU to plan for
        return []


def weight_bytes(model_dir: str | Path) -> int:
    """Bytes of the target's weight files (safetensors, bin, gguf) in its folder; 0 when not a folder."""
    folder = Path(model_dir)
    if not folder.is_dir():
        return 0
    return sum(f.stat().st_size for f in folder.iterdir() if f.suffix in (".safetensors", ".bin", ".gguf") and f.is_file())


def servers_per_gpu(setting: int | str, model_dir: str | Path) -> int:
    """synth.servers_per_gpu: a number as given, or "auto" by the target's weight bytes (AUTO_PER_GPU)."""
    if setting != "auto":
        return int(setting)
    size = weight_bytes(model_dir)
    if size == 0:  # a hub id: its size is unknown here, so one server, as before this setting existed
        return 1
    return next((n for limit, n in AUTO_PER_GPU if size < limit), 1)


def plan_servers(per_gpu: int, gpus: list[str], mem_fraction: float | None) -> list[PlannedServer]:
    """One entry per server: `per_gpu` on each GPU of `gpus`, each with mem_fraction / per_gpu of it.

    On a machine without GPUs (`gpus` empty: the CPU stand-in of tests, or a server that finds its
    device itself) the servers are started with the environment as it is."""
    if per_gpu < 1:
        raise UserError(f"params.yaml: synth.servers_per_gpu must be at least 1, got {per_gpu}")
    share = mem_fraction if mem_fraction is not None else (DEFAULT_SHARED_MEM if per_gpu > 1 else None)
    each = round(share / per_gpu, 4) if share is not None else None
    if each is not None and each < 0.05:
        raise UserError(f"params.yaml: synth.mem_fraction_static {share} shared by {per_gpu} servers per GPU leaves each "
                        f"{each:.3f} of the GPU's memory, too little for weights and a KV cache; raise "
                        f"synth.mem_fraction_static or lower synth.servers_per_gpu")
    return [PlannedServer(gpu, each) for gpu in (gpus or [None]) for _ in range(per_gpu)]


def server_env(planned: PlannedServer, base: dict | None = None) -> dict | None:
    """The environment of one planned server: CUDA_VISIBLE_DEVICES pinned to its GPU."""
    if planned.gpu is None:
        return None if base is None else dict(base)
    env = dict(os.environ if base is None else base)
    env["CUDA_VISIBLE_DEVICES"] = planned.gpu
    return env
