"""Training-time test attention as one FlexAttention call per step: no [T, T] scores in memory.

TTTCache's pattern (draftlab.train.draft) at step i over rows of width T: the query at row t sees
the step-0 keys of rows 0..t of its own sequence, and the step-j key of row t itself for j = 1..i.
Here the keys of steps 0..i are laid end to end, [B, n_kv, (i+1)*T, hd], and a block mask says
which the query may see:

    kv < T:   kv <= t and seq[kv] == seq[t]      (step 0: block-diagonal causal)
    kv >= T:  kv % T == t                        (steps 1..i: the row's own position)

FlexAttention skips the 128 x 128 tiles the mask leaves empty, so a step costs the causal part
plus one tile per 128 rows for each later step, computed in fused kernels that never write the
scores out: at 8 rows of 4096 tokens and 9 heads, the eager path's scores are 1.2G elements per
step (2.4 GB in bf16), written, masked, concatenated and softmaxed, then kept for backward.

FlexAttention runs fast only compiled, and computes gradients on CUDA only; the eager TTTCache
path stays the reference (CPU training, tests) and gives the same outputs (tests/test_ttt_flex.py).
"""
from __future__ import annotations

import functools

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention


TILE = 128  # FlexAttention's block (query and key rows per tile), the default on every device


@functools.cache
def _compiled():
    """flex_attention and create_block_mask under torch.compile, made once per process. dynamic:
    packed rows change width from batch to batch and the keys grow with every step, so one graph
    serves every shape instead of a recompile per shape."""
    return torch.compile(flex_attention, dynamic=True), torch.compile(create_block_mask, dynamic=True)


def ttt_block_mask(seq_ids: torch.Tensor | None, batch: int, rows: int, steps_seen: int, device, compiled: bool):
    """The block mask of step `steps_seen - 1`: queries [B, T] over the keys of `steps_seen` steps.
    seq_ids [B, T] (packed rows; -1 on padding, which attends to padding before it) or None (one
    sequence per row)."""
    # The row width as a tensor, not a Python int: a compiled mask function would otherwise be
    # specialized (and recompiled) for every width packed batches come in.
    T = torch.tensor(rows, device=device)

    def mask_mod(b, h, q, kv):
        pos = kv % T
        first = (kv < T) & (kv <= q)
        if seq_ids is not None:
            first = first & (seq_ids[b, q] == seq_ids[b, pos])
        return first | ((kv >= T) & (pos == q))

    make = _compiled()[1] if compiled else create_block_mask
    return make(mask_mod, batch, None, rows, steps_seen * rows, device=device, BLOCK_SIZE=TILE)


def extend_block_mask(first: BlockMask, rows: int, steps_seen: int) -> BlockMask | None:
    """The block mask of `steps_seen` steps from step 0's (`first`, made by ttt_block_mask with
    steps_seen 1), without evaluating the mask again: the mask function does not depend on the
    number of steps, and each later step adds one diagonal block per query block (query block i sees
    key block j * rows / size + i of step j, in part). Building each step's mask whole evaluates
    every (query, key) pair of its keys: 28 rows x rows passes over the 7 steps of a batch, which
    took 15% of a training step's GPU time at SmolLM2's shape on an H100. None where a step's keys do
    not start on a block boundary (rows not a multiple of the block size; TTTCache pads its rows to
    whole tiles, so they do): build it whole then."""
    q_size, kv_size = first.BLOCK_SIZE
    if q_size != kv_size or rows % kv_size or first.kv_num_blocks is None:
        return None
    later = steps_seen - 1
    B, H, q_blocks = first.kv_num_blocks.shape
    step_blocks, device = rows // kv_size, first.kv_num_blocks.device
    width = steps_seen * step_blocks

    def widen(indices):  # [B, H, q_blocks, step_blocks] -> [B, H, q_blocks, width], the rest 0 (unread)
        out = torch.zeros(B, H, q_blocks, width, dtype=indices.dtype, device=device)
        out[..., :indices.shape[-1]] = indices
        return out

    indices = widen(first.kv_indices)
    blocks = (torch.arange(1, steps_seen, device=device)[None, :] * step_blocks
              + torch.arange(q_blocks, device=device)[:, None])  # [q_blocks, later]: step j's block of query block i
    slots = first.kv_num_blocks[..., None].long() + torch.arange(later, device=device)  # after step 0's blocks
    indices.scatter_(-1, slots, blocks.expand(B, H, q_blocks, later).to(indices.dtype))
    full = first.full_kv_num_blocks is not None
    return BlockMask.from_kv_blocks(first.kv_num_blocks + later, indices,
                                    first.full_kv_num_blocks if full else None,
                                    widen(first.full_kv_indices) if full else None,
                                    BLOCK_SIZE=first.BLOCK_SIZE, mask_mod=first.mask_mod, seq_lengths=(rows, steps_seen * rows))


def flex_kernel(compiled: bool):
    """The flex_attention to call: compiled or not. Looked up once per batch, outside any compiled
    graph (a graph that traced the cached lookup would trace past its cache)."""
    return _compiled()[0] if compiled else flex_attention


def ttt_flex_attend(q, keys: list, values: list, block_mask, kernel):
    """Attention of q [B, h, T, hd] over the keys/values of every step so far (each [B, n_kv, T, hd])."""
    k = torch.cat(keys, dim=2) if len(keys) > 1 else keys[0]
    v = torch.cat(values, dim=2) if len(values) > 1 else values[0]
    return kernel(q, k, v, block_mask=block_mask, enable_gqa=q.shape[1] != k.shape[1])
