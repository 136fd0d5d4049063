"""A trace of a few of the train stage's own steps, summarized: where a slow step's time goes.

    DRAFTLAB_TRAIN_PROFILE=100 dvc repro --force train       # trace steps 100-102 (3 steps)
    DRAFTLAB_TRAIN_PROFILE=100:5 python -m stages.train ...   # steps 100-104

A benchmark's steps (benchmarks/train_throughput.py) can run faster than the stage's own: other
data, another target, a smaller state cache, nothing else on the host. This traces the stage
itself. torch.profiler starts once step N-1 has ended and stops after step N+COUNT-1, so the
traced steps are whole: making the batch (the target's forward when online), the draft's forward
and backward, the optimizer. The summary (reports/train/step-profile.json, and one printed line):
- the steps' wall time, and the GPU's busy share over it (draftlab.tracing.gpu_busy_share): well
  below 90%, the host, not the kernels, sets the pace;
- the operators with the most host time of their own (self CPU) and the kernels with the most GPU
  time, per traced step, so a host-bound step names what the host was doing.
Tracing slows the traced steps themselves (the profiler's own host work): compare the shares and
the operators, not the traced steps' wall time against untraced ones.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from draftlab.errors import UserError
from draftlab.tracing import gpu_busy_share

ENV = "DRAFTLAB_TRAIN_PROFILE"
DEFAULT_COUNT = 3


def requested(value: str | None = None) -> tuple[int, int] | None:
    """(first step, count) from DRAFTLAB_TRAIN_PROFILE ("N" or "N:COUNT", steps counted from 1);
    None where it is unset or empty."""
    value = os.environ.get(ENV, "") if value is None else value
    if not value.strip():
        return None
    first, _, count = value.strip().partition(":")
    try:
        out = int(first), int(count) if count else DEFAULT_COUNT
    except ValueError:
        out = None
    if out is None or out[0] < 1 or out[1] < 1:
        raise UserError(f"{ENV}={value!r}: give the first step to trace and, optionally, how many: N or N:COUNT "
                        f"(whole numbers from 1, e.g. {ENV}=100:3)")
    return out


class StepProfile:
    """Call step(0) before training and step(n) after optimizer step n (fit's on_step): traces steps
    first..first+count-1 and writes their summary to `out` as soon as they end (a run that fails later
    keeps it). fit reads a step's loss once the next step is queued, so the window runs from the host's
    queueing of step first+1 to the end of step first+count-1 on the GPU: `count` steps' worth of
    host and GPU time, shifted by one step's host work."""

    def __init__(self, first: int, count: int, device: torch.device, out: Path, top: int = 12):
        self.first, self.count, self.device, self.out, self.top = first, count, torch.device(device), Path(out), top
        self.prof = None
        self.started = self.wall = None
        self.seen = 0  # traced steps that have ended
        self.result: dict | None = None

    def step(self, n: int) -> None:
        if self.result is not None:
            return
        if self.prof is None:
            if n == self.first - 1:
                self._start()
            return
        self.seen = n - self.first + 1
        if self.seen == self.count:
            self._finish()

    def _finish(self) -> None:
        """Stop tracing, summarize the steps seen and write the summary."""
        from draftlab.fsutil import atomic_write_json

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.wall = time.perf_counter() - self.started
        self.prof.stop()
        self.result = self._summary()
        self.out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(self.out, self.result)

    def _start(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        self.prof = profile(activities=acts)
        self.prof.start()
        self.started = time.perf_counter()

    def _summary(self) -> dict:
        averages = self.prof.key_averages()
        steps = max(1, self.seen)
        per_step = steps * 1e3  # profiler times are in microseconds: ms per traced step

        def top(key: str) -> list[dict]:
            rows = sorted(averages, key=lambda e: getattr(e, key), reverse=True)[: self.top]
            return [{"name": e.key, "ms_per_step": round(getattr(e, key) / per_step, 2), "calls_per_step": round(e.count / steps, 1)}
                    for e in rows if getattr(e, key) > 0]

        busy = gpu_busy_share(self.prof.events())
        return {"steps": [self.first, self.first + steps - 1], "wall_s_per_step": round(self.wall / steps, 4),
                "gpu_busy_share": None if busy is None else round(busy, 4),
                "host_self_time": top("self_cpu_time_total"),
                "gpu_kernel_time": top("self_device_time_total") if self.device.type == "cuda" else []}

    def line(self) -> str:
        """One line for the stage's log."""
        r = self.result
        busy = "no GPU kernels traced" if r["gpu_busy_share"] is None else f"the GPU busy {r['gpu_busy_share']:.0%} of it"
        host = ", ".join(f"{e['name']} {e['ms_per_step']:.1f}" for e in r["host_self_time"][:4])
        return (f"train: steps {r['steps'][0]}-{r['steps'][1]} traced ({ENV}): {r['wall_s_per_step'] * 1e3:.0f} ms a step, {busy}; "
                f"most host time (ms a step): {host}")

    def close(self) -> dict | None:
        """The summary, or None where no traced step ran; a trace still running (the run ended first) is
        stopped, summarized over the steps it saw and written."""
        if self.result is None and self.prof is not None:
            if self.seen:
                self._finish()
            else:  # started after the run's last step: nothing to summarize
                self.prof.stop()
                self.prof = None
        return self.result
