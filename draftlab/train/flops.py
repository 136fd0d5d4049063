"""FLOPs of one training step, counted from the shapes, and the rate and MFU they give.

What is counted (multiply-add = 2 FLOPs; useful work only: real tokens at their real lengths,
never padding, so padding shows up as a lower MFU):
  target    online mode: the decoder forward (no grad) of every real token, per layer
            2 x (q, k, v, o, gate, up, down weights) + causal attention 4 x heads x head_dim x
            (t + 1) at position t; in both modes the soft labels' projection onto the full vocab,
            2 x hidden x vocab per token (draftlab.train.objective.target_labels).
  draft     forward x 3 (forward + backward; the convention, though fc needs no input gradient):
            fc 2 x (k x H_t) x H per token, once; per TTT step i: the one decoder layer,
            2 x (q, k, v, o over the 2H input, MLP) per token, attention 4 x heads x head_dim x
            (t + 1 + i) at position t (the causal step-0 keys plus the i diagonal ones), and the
            draft-vocab head 2 x H x V_d per scored row (only those rows are projected).
MFU = counted FLOPs / seconds / the GPU's peak dense bf16 FLOP/s (PEAK_BF16 by device name, or
DRAFTLAB_PEAK_FLOPS); None on a CPU or an unknown GPU.
"""
from __future__ import annotations

import os
import time

import torch

# Dense bf16 peak FLOP/s from the datasheets (no sparsity), matched against the CUDA device name.
PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12}
PEAK_ENV = "DRAFTLAB_PEAK_FLOPS"  # e.g. 989e12: overrides the table (another GPU, a PCIe part, a measured ceiling)


def peak_flops(device) -> float | None:
    """Peak dense bf16 FLOP/s of `device`: DRAFTLAB_PEAK_FLOPS if set, else the table by name; None on CPU."""
    if os.environ.get(PEAK_ENV):
        try:
            return float(os.environ[PEAK_ENV])
        except ValueError:
            from draftlab.errors import UserError

            raise UserError(f"{PEAK_ENV}={os.environ[PEAK_ENV]!r} is not a number of FLOP/s (e.g. 989e12)") from None
    device = torch.device(device)
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16.items() if k in name), None)


def _causal_pairs(lengths: list[int], extra: int = 0) -> int:
    """Sum over every position t of every sequence of (t + 1 + extra): the keys each query sees."""
    return sum(n * (n + 1) // 2 + extra * n for n in lengths)


def target_flops(cfg: dict, lengths: list[int], online: bool) -> float:
    """Forward FLOPs of the target on sequences of `lengths` (online) plus the soft labels' head.

    cfg: the target's facts (the features manifest's info.target or a transformers config dict):
    num_layers or num_hidden_layers, hidden_size, intermediate_size, num_attention_heads,
    num_key_value_heads, head_dim (default hidden / heads), vocab_size."""
    need = ["hidden_size", "vocab_size"] + (["num_attention_heads", "intermediate_size"] if online else [])
    if missing := [k for k in need if not cfg.get(k)] + ([] if not online or cfg.get("num_layers") or cfg.get("num_hidden_layers") else ["num_layers"]):
        raise ValueError(f"the target's facts lack {missing}: its FLOPs cannot be counted")
    H, V = cfg["hidden_size"], cfg["vocab_size"]
    tokens = sum(lengths)
    labels = 2 * H * V * tokens
    if not online:
        return float(labels)
    L = cfg.get("num_layers") or cfg["num_hidden_layers"]
    nh = cfg["num_attention_heads"]
    nkv = cfg.get("num_key_value_heads") or nh
    hd = cfg.get("head_dim") or H // nh
    weights = H * nh * hd + 2 * H * nkv * hd + nh * hd * H + 3 * H * cfg["intermediate_size"]
    return float(L * (2 * weights * tokens + 4 * nh * hd * _causal_pairs(lengths)) + labels)


def draft_flops(cfg, lengths: list[int], scored: list[int]) -> float:
    """Forward + backward (3 x forward) FLOPs of the TTT steps of a DraftConfig `cfg` on sequences
    of `lengths`; scored[i]: rows scored at TTT step i (len(scored) = the number of steps)."""
    H, nh, nkv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    tokens = sum(lengths)
    fc = 2 * cfg.num_aux_layers * cfg.target_hidden_size * H * tokens
    layer = 2 * H * nh * hd + 2 * (2 * H * nkv * hd) + nh * hd * H + 3 * H * cfg.intermediate_size  # q,k,v read 2H
    forward = fc
    for i, n in enumerate(scored):
        forward += 2 * layer * tokens + 4 * nh * hd * _causal_pairs(lengths, i) + 2 * H * cfg.draft_vocab_size * n
    return float(3 * forward)


class Meter:
    """Tokens, padding, FLOPs and seconds of the optimizer steps one process times (fit's `meter`).

    step(lengths, scored, seconds, world, slots): the lengths of the step's sequences over all
    processes, the scored rows per TTT step (global), this process's seconds for the step, and
    the token slots computed on (None: each process's share padded to its longest sequence;
    packed steps pass rows x width)."""

    def __init__(self, target_cfg: dict, draft_cfg, online: bool):
        self.target_cfg, self.draft_cfg, self.online = target_cfg, draft_cfg, online
        try:
            target_flops(target_cfg, [1], online)
            self.countable = True
        except ValueError:  # e.g. a mixture-of-experts target without one intermediate_size: no FLOPs, no MFU
            self.countable = False
        self.tokens = self.slots = self.steps = 0
        self.target = self.draft = self.seconds = 0.0
        self.by_states = {"computed": [0, 0, 0.0], "cached": [0, 0, 0.0]}  # steps, tokens, seconds: the target ran or not
        self.first_step_s = None  # the first timed step's seconds: torch.compile and every first use are paid there
        self.eval_s = {}  # epoch -> seconds its evaluation took (the first compiles for evaluation)
        # A resumed run: the counters of the runs before it come back from the checkpoint (load_state_dict),
        # so every figure covers the whole training. from_step: the first optimizer step they cover (0; a
        # resumed run's step where its checkpoint held no counters). wall_s: seconds since the first run began.
        self.from_step, self.wall_before, self.started = 0, 0.0, time.perf_counter()

    COUNTERS = ("tokens", "slots", "steps", "target", "draft", "seconds", "by_states", "first_step_s", "eval_s", "from_step")

    def wall_s(self) -> float:
        """Seconds of training so far, the runs before a resume included (their checkpoints' figure)."""
        return self.wall_before + time.perf_counter() - self.started

    def state_dict(self) -> dict:
        """The counters, for a training checkpoint (plain numbers, lists and dicts)."""
        return {**{k: getattr(self, k) for k in self.COUNTERS}, "wall_s": self.wall_s()}

    def resume(self, state: dict | None, step: int) -> None:
        """Go on from a checkpoint taken after `step` optimizer steps: its counters (`state`), or, from a
        checkpoint without them, counting from `step` (the figures then cover the steps from there)."""
        if state is None:
            self.from_step = step
            return
        for k in self.COUNTERS:
            setattr(self, k, state[k])
        self.wall_before, self.started = float(state["wall_s"]), time.perf_counter()

    def step(self, lengths: list[int], scored: list[float], seconds: float, world: int = 1, slots: int | None = None,
             target_ran: bool = True, target_lengths: list[int] | None = None) -> None:
        """target_ran: False for an online step whose states came from the state cache (no target forward).
        target_lengths: the sequences the target ran on where only some of the step's were (a partial
        state cache); None: all of `lengths`. The soft labels' head runs on every token either way."""
        self.steps += 1
        if self.first_step_s is None:
            self.first_step_s = seconds
        self.tokens += sum(lengths)
        if slots is None:
            slots = sum(len(lengths[r::world]) * max(lengths[r::world], default=0) for r in range(world))
        self.slots += slots
        if self.countable:
            self.target += target_flops(self.target_cfg, lengths, False)  # the soft labels' head
            if self.online and target_ran:  # the target's forward, on the sequences it ran on
                ran = lengths if target_lengths is None else target_lengths
                self.target += target_flops(self.target_cfg, ran, True) - target_flops(self.target_cfg, ran, False)
            self.draft += draft_flops(self.draft_cfg, lengths, [int(n) for n in scored])
        self.seconds += seconds
        got = self.by_states["computed" if target_ran else "cached"]
        got[0], got[1], got[2] = got[0] + 1, got[1] + sum(lengths), got[2] + seconds

    def evaluated(self, epoch: int, seconds: float) -> None:
        """The evaluation after `epoch` took `seconds` (not counted in the steps' rates)."""
        self.eval_s[str(epoch)] = round(seconds, 2)

    def summary(self, peak: float | None) -> dict:
        """Rates over the timed steps; MFU None without a peak (CPU)."""
        s = self.seconds or float("nan")
        flops = self.target + self.draft
        if not self.countable:
            flops = 0.0
        return {
            "steps": self.steps,
            "tokens": self.tokens,
            "tokens_per_s": round(self.tokens / s, 1) if self.seconds else None,
            "padding_share": round((self.slots - self.tokens) / self.slots, 4) if self.slots else 0.0,
            "target_flops_per_token": round(self.target / self.tokens) if flops and self.tokens else None,
            "draft_flops_per_token": round(self.draft / self.tokens) if flops and self.tokens else None,
            "target_flops_per_s": self.target / s if flops and self.seconds else None,
            "draft_flops_per_s": self.draft / s if flops and self.seconds else None,
            "target_flop_share": round(self.target / flops, 4) if flops else None,
            "peak_flops": peak,
            "mfu": round(flops / s / peak, 4) if flops and peak and self.seconds else None,
            "first_step_s": round(self.first_step_s, 2) if self.first_step_s is not None else None,
            "from_step": self.from_step,  # > 0: a resumed run whose checkpoint held no counters, counted from this step
            "eval_s_by_epoch": dict(self.eval_s),
            # online with train.state_cache: the steps whose states the target computed (the first epoch) apart
            # from those read back from the cache, each with its own rate; None where no step was cached.
            # "computed" is any step the target ran in: with a partial cache, most later steps too (the
            # target on the rows not kept), so its rate lies between a full target step's and a cached one's
            # and "cached" counts only the steps whose every row was kept
            "by_states": {k: {"steps": n, "tokens_per_s": round(t / sec, 1) if sec else None}
                          for k, (n, t, sec) in self.by_states.items()} if self.by_states["cached"][0] else None,
        }
