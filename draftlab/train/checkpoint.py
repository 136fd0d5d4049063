"""Resuming training from a checkpoint, and keeping each configuration's checkpoint apart.

A checkpoint (draftlab.train.loop.fit writes it) holds the weights, the optimizer state, the position
in the epoch plans, the loss history and the stage manifest's identity (params, inputs, code,
packages) under the run's key. A run resumes only from its own key's checkpoint; one of another
configuration is kept beside, as `<name>.<its key>.pt`, never overwritten, and resumed when that
configuration runs again.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from draftlab.train.draft import Eagle3Draft


class OtherRun(Exception):
    """A checkpoint of another configuration (another run_key): its key, its step, what differs, and
    whether only the code or the package versions do (its params and inputs are this run's)."""

    def __init__(self, run_key: str, step, differences: list[str], code_only: bool):
        super().__init__(f"the checkpoint of another configuration ({'; '.join(differences)})")
        self.run_key, self.step, self.differences, self.code_only = run_key, step, differences, code_only


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def differences(saved: dict | None, current: dict | None) -> list[str]:
    """What differs between a checkpoint's identity and this run's (the stage manifest's hashed parts:
    params, inputs, code, packages), in words: each param and package by name, old -> new."""
    if not saved or not current:
        return ["not recorded: a checkpoint written before checkpoints named what they were trained with"]
    was, now = _flat(saved["params"]), _flat(current["params"])
    out = [f"{k} {was.get(k)!r} -> {now.get(k)!r}" for k in sorted(set(was) | set(now)) if was.get(k) != now.get(k)]
    out += [what for key, what in (("inputs", "the features or the target"), ("code", "the training code"))
            if saved.get(key) != current.get(key)]
    old, new = saved.get("packages") or {}, current.get("packages") or {}
    out += [f"{name} {old.get(name)} -> {new.get(name)}" for name in sorted(set(old) | set(new)) if old.get(name) != new.get(name)]
    return out or ["nothing named (the same params, inputs, code and packages under another key)"]


def restore(path: Path, run_key: str, draft: Eagle3Draft, opt, device, epoch_steps: list[int],
            identity: dict | None = None, across_code: bool = False):
    """(step, epoch, batch, history, running, meter, other) of the checkpoint at `path`, its weights and
    optimizer state loaded into `draft` and `opt` (meter: the Meter's counters, None in a checkpoint without
    them; other: what differs from `identity` when resumed across a code change, else None).
    Raises OtherRun for a checkpoint of another configuration (another run_key), unless `across_code`
    and only the code or the package versions differ from `identity` (the stage manifest's parts).
    Raises for a file that is not such a checkpoint (damaged, another format, out-of-range
    positions): fit() then starts over with a warning, as with a foreign one."""
    ckpt = torch.load(path, map_location=device, weights_only=True)
    if not isinstance(ckpt, dict) or "run_key" not in ckpt:
        raise ValueError(f"not a training checkpoint (a {type(ckpt).__name__} without run_key)")
    if ckpt["run_key"] != run_key:
        saved = ckpt.get("identity")
        code_only = bool(saved and identity) and all(saved.get(k) == identity.get(k) for k in ("params", "inputs"))
        if not (code_only and across_code):
            raise OtherRun(ckpt["run_key"], ckpt.get("step"), differences(saved, identity), code_only)
    step, epoch, batch, history, running = (ckpt.get(k) for k in ("step", "epoch", "batch", "history", "running"))
    epochs = len(epoch_steps)  # one plan per epoch
    ints = all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (step, epoch, batch))
    if not ints or epoch > epochs or batch > epoch_steps[min(epoch, epochs - 1)] or step > sum(epoch_steps):
        raise ValueError(f"position step={step!r} epoch={epoch!r} batch={batch!r} outside this run's {epochs} epochs "
                         f"of {sorted(set(epoch_steps))} steps")
    if not (isinstance(history, list) and all(isinstance(h, dict) for h in history) and isinstance(running, list)
            and len(running) == 2 and all(isinstance(x, (int, float)) for x in running)):
        raise ValueError("history or running loss of the wrong shape")
    meter = ckpt.get("meter")
    if meter is not None and not (isinstance(meter, dict) and "wall_s" in meter):
        raise ValueError("meter counters of the wrong shape")
    draft.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["optim"])
    other = differences(ckpt.get("identity"), identity) if ckpt["run_key"] != run_key else None  # across the code
    return step, epoch, batch, history, running, meter, other


def kept_aside(path: Path, run_key: str) -> Path:
    """Where a checkpoint of configuration `run_key` is kept while another runs: `<name>.<key>.pt`."""
    path = Path(path)
    return path.with_name(f"{path.stem}.{run_key[:12]}{path.suffix}")


def resume(resume_path: Path, run_key: str, draft: Eagle3Draft, opt, new_optimizer: Callable, device, epoch_steps: list[int],
           identity: dict | None, across_code: bool, rank: int, world: int):
    """(restore()'s record of the checkpoint this run resumes from, or None; the optimizer to train with).

    Tries `resume_path`, then this configuration's own checkpoint that a run of another set aside
    (kept_aside), which is moved back to the usual name. A checkpoint of another configuration is set
    aside under its key, never overwritten, so that configuration resumes from it when run again. An
    unreadable one is ignored with a warning: the draft and the optimizer then start fresh, since a
    checkpoint that failed halfway may have loaded some tensors."""
    kept = kept_aside(resume_path, run_key)
    if not (resume_path.exists() or kept.exists()):
        return None, opt
    fresh = {k: v.clone() for k, v in draft.state_dict().items()}
    for path in (resume_path, kept):
        if not path.exists():
            continue
        try:
            state = restore(path, run_key, draft, opt, device, epoch_steps, identity, across_code)
        except OtherRun as e:
            aside = kept_aside(path, e.run_key)
            if world > 1:
                dist.barrier()  # every process has read it before it moves
            if rank == 0:
                path.replace(aside)
                hint = (" Only the code or the package versions differ: DRAFTLAB_TRAIN_RESUME=across-code resumes from it "
                        "anyway (recorded in the draft's manifest)." if e.code_only else "")
                print(f"train: {path} holds step {e.step} of another configuration (what differs: "
                      f"{'; '.join(e.differences)}); kept as {aside}, and a run of that configuration resumes from it.{hint}",
                      flush=True)
            if world > 1:
                dist.barrier()
            continue
        except Exception as e:  # noqa: BLE001 - unreadable (damaged, edited, another format): start over
            draft.load_state_dict(fresh)
            opt = new_optimizer()
            if rank == 0:
                print(f"warning: ignoring the checkpoint {path}, training from the start: {e}", flush=True)
            continue
        if path == kept:
            if world > 1:
                dist.barrier()  # every process has read it before it moves
            if rank == 0:
                kept.replace(resume_path)  # saved to the usual name from here
        return state, opt
    return None, opt
