"""The machine's own ceilings, measured in the same run as everything they are compared with.

Method: bf16 matmul C = A @ B of n x n (2 n^3 FLOP), warm-ups then timed calls, each synchronised;
the **mean** is the compute ceiling (the best call is reported too). Copy bandwidth: `dst.copy_(src)`
of a uint8 buffer, bytes read + written (2 x size) / mean time. Every fraction of a floor in the
other sections divides by these (common.matmul_rate, common.copy_rate).
"""
from __future__ import annotations

import torch

from benchmarks.paths.common import free, record, timed


def matmul_times(n: int, dev, warmup: int, iters: int) -> list[float]:
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    c = torch.empty(n, n, device=dev, dtype=torch.bfloat16)
    return timed(lambda: torch.matmul(a, b, out=c), dev, warmup, iters)


def copy_times(nbytes: int, dev, warmup: int, iters: int) -> list[float]:
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev).random_(0, 255)
    dst = torch.empty_like(src)
    return timed(lambda: dst.copy_(src), dev, warmup, iters)


def ceilings(P) -> None:
    dev, S = P["device"], "ceilings"
    n = P["matmul_n"]
    times = matmul_times(n, dev, P["mm_warm"], P["mm_iters"])
    mean = sum(times) / len(times)
    record(S, "matmul_n", n)
    record(S, "matmul_mean_s", mean, "s")
    record(S, "matmul_tflops", 2 * n**3 / mean / 1e12, "TFLOP/s (bf16, mean)")
    record(S, "matmul_tflops_best", 2 * n**3 / min(times) / 1e12, "TFLOP/s (bf16, best)")
    free(dev)
    nbytes = P["copy_mb"] * 2**20
    times = copy_times(nbytes, dev, P["mm_warm"], P["mm_iters"])
    mean = sum(times) / len(times)
    record(S, "copy_bytes", nbytes)
    record(S, "copy_gbs", 2 * nbytes / mean / 1e9, "GB/s (read + written, mean)")
    record(S, "copy_gbs_best", 2 * nbytes / min(times) / 1e9, "GB/s (best)")
    free(dev)
