"""The target's attention in this process: SDPA without its cuDNN backend on CUDA.

cuDNN builds a plan per input shape, and the host pays for it: the GPU waits meanwhile. Every
in-process use of the target changes shapes all the time:
- decoding: the KV length grows by one each step. On an H200 (torch 2.11) an 8B target's decode
  took 81 ms per token with SDPA free to pick cuDNN on new lengths, 25 ms on lengths seen
  before, and 24 ms without cuDNN (reports/perf/);
- capture (extract, online training, eval): each batch of sequences is padded to its own longest.
  In the train stage at SmolLM2's shape on one H100, the target's 80 attention calls a step spent
  109 ms of host time in cuDNN's forward, with the GPU busy 65% of the step
  (reports/real-workload/, DRAFTLAB_TRAIN_PROFILE).
Flash and memory-efficient attention have no per-shape cost.
"""
from __future__ import annotations

import contextlib

import torch

AVOID_CUDNN_ATTENTION = True  # benchmarks/paths/cudnn.py turns it off to measure the difference


def attention_kernels(device):
    """A context in which SDPA may pick flash, memory-efficient or math attention, never cuDNN, on
    CUDA (a no-op elsewhere, or with AVOID_CUDNN_ATTENTION off)."""
    if not AVOID_CUDNN_ATTENTION or torch.device(device).type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])
