"""The device of each process: params' device resolved, and under torchrun this process's GPU
(or its share of the cores); rank, world size, sums over all processes.

One process per GPU (`torchrun --nproc-per-node N -m stages.train ...` or `-m stages.extract`);
NCCL on CUDA, gloo on CPUs. Launched without torchrun, everything here is a no-op for one process.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from draftlab.errors import UserError


def cpu_threads() -> int:
    """Torch threads for CPU work: DRAFTLAB_THREADS, else half the cores (1 on a 2-core machine).

    Measured on a 2-core machine with other work running: greedy generation of the tiny target
    ran at 1588 tok/s with 1 thread and 94 tok/s with 2 (OpenMP threads spin against each other
    and everything else). One thread per two cores keeps that cliff away.
    """
    env = os.environ.get("DRAFTLAB_THREADS")
    if env:
        return max(1, int(env))
    return max(1, (os.cpu_count() or 2) // 2)


def resolve_device(device: str, key: str = "target.device") -> str:
    """params' device ("auto", "cuda", "cpu") -> the one to use; on a CPU, sets the torch threads.
    `key` names the params key in the error."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise UserError(f"{key} is 'cuda' but no CUDA device is visible; set it to 'auto' or 'cpu'")
    if device == "cpu":
        torch.set_num_threads(cpu_threads())
    return device


def setup_distributed(device_type: str) -> tuple[int, int]:
    """(rank, world size); joins the torchrun process group when launched by torchrun."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device_type == "cuda" else "gloo")
    return (dist.get_rank(), world) if world > 1 else (0, 1)


def local_device(device: str) -> str:
    """This process's device: "cuda" -> "cuda:LOCAL_RANK" (cuda:0 alone); on a CPU, the torch
    threads split between the processes of this host (unchanged alone)."""
    if device == "cuda":
        index = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(index)
        return f"cuda:{index}"
    if device == "cpu":
        per = max(1, torch.get_num_threads() // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        torch.set_num_threads(per)  # several processes share the cores: never oversubscribe
    return device


@dataclass(frozen=True)
class RankLayout:
    """Where one process sits when the world is cut into data-parallel groups of tensor-parallel ranks."""

    dp_rank: int  # which share of the rows this process's group takes
    dp_size: int  # how many groups share the rows
    tp_rank: int  # this process's place inside its group; only tp_rank 0 writes
    tp_ranks: tuple[int, ...]  # the world ranks of this process's group

    @property
    def writes(self) -> bool:
        return self.tp_rank == 0


def rank_layout(world: int, tp_size: int, rank: int) -> RankLayout:
    """DP x TP over `world` ranks: consecutive ranks form one TP group, as SpecForge and SGLang's
    own initialize_model_parallel lay them out (the ranks of one group are then on one host)."""
    if tp_size < 1:
        raise UserError(f"extract.tp_size must be >= 1, got {tp_size}")
    if world % tp_size:
        raise UserError(f"extract.tp_size {tp_size} does not divide the {world} processes launched; "
                        f"launch a multiple of {tp_size} (torchrun --nproc-per-node) or change extract.tp_size")
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} outside a world of {world}")
    group = rank // tp_size
    return RankLayout(group, world // tp_size, rank % tp_size, tuple(range(group * tp_size, (group + 1) * tp_size)))


def all_sum(values: list[float], device: str, world: int) -> list[float]:
    """Element-wise sum over all processes (the values themselves for one process)."""
    if world == 1:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.tolist()


def finish(world: int) -> None:
    """Wait for every process, then leave the group."""
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()
