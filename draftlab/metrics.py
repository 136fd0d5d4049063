"""Speculative-decoding metrics: one definition each (DESIGN.md section 9).

tau (accept length): generated tokens per target verify step, pooled over requests, the bonus
    token included; SGLang's `spec_accept_length` = completion_tokens / spec_verify_ct.
a_i (per-position acceptance): P(draft i accepted | drafts 1..i-1 accepted).
chain tau: 1 + sum_i prod_{j<=i} a_j, the expected tau of a topk=1 chain of len(a) drafts.
accept rate: accepted drafts / proposed drafts = (tau - 1) / num_steps for a chain. (SGLang's own
    "accept rate" changed meaning across releases: never compare with it.)
speedup: tokens/s with speculation / tokens/s of the same target without, same prompts, same run.
"""
from __future__ import annotations

from typing import Sequence

import torch


def chain_tau(acceptance: Sequence[float]) -> float:
    """Expected accept length of a chain whose draft i is accepted with conditional rate a_i."""
    tau, alive = 1.0, 1.0
    for a in acceptance:
        alive *= a
        tau += alive
    return tau


def pooled_tau(completion_tokens: Sequence[int], verify_steps: Sequence[int]) -> float:
    """tau pooled over requests (total tokens / total verify steps), as SGLang reports it."""
    steps = sum(verify_steps)
    return sum(completion_tokens) / steps if steps else float("nan")


def accept_rate(tau: float, num_steps: int) -> float:
    """Accepted drafts / proposed drafts of a chain of `num_steps` drafts per verify."""
    return (tau - 1.0) / num_steps


def speedup(tokens_per_s_spec: float, tokens_per_s_base: float) -> float:
    return tokens_per_s_spec / tokens_per_s_base


def leviathan_tokens(a: float, gamma: int) -> float:
    """Expected tokens per verify for i.i.d. acceptance a and gamma drafts (Leviathan et al.)."""
    if a >= 1.0:
        return gamma + 1.0
    return (1.0 - a ** (gamma + 1)) / (1.0 - a)


def leviathan_speedup(a: float, gamma: int, cost_ratio: float) -> float:
    """Leviathan et al.'s speedup; cost_ratio = draft step time / target step time."""
    return leviathan_tokens(a, gamma) / (gamma * cost_ratio + 1.0)


def acceptance_counts(correct: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Counts behind a_i from per-row, per-step outcomes of a chain.

    correct, valid: bool [K, N] (step i of the chain rooted at row n: draft top-1 == target top-1;
    the step is scored). Returns (accepted [K], reached [K]) with reached[i] = rows whose steps
    0..i are all valid and steps 0..i-1 all correct, accepted[i] = those also correct at step i.
    Counts (not rates) so they can be summed over batches and processes.
    """
    alive = torch.ones_like(correct[0])
    accepted, reached = [], []
    for i in range(correct.shape[0]):
        alive = alive & valid[i]
        reached.append(alive.sum())
        alive = alive & correct[i]
        accepted.append(alive.sum())
    return torch.stack(accepted), torch.stack(reached)


def conditional_acceptance(accepted: Sequence[float], reached: Sequence[float]) -> list[float]:
    """a_i = accepted_i / reached_i (0 where no row reached step i)."""
    return [float(a) / float(r) if r else 0.0 for a, r in zip(accepted, reached)]
