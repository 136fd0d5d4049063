"""Where an SGLang server's start-up went, read from its log: launch to a healthy /health, cut at
the lines SGLang 0.5.x writes on the way.

A server of a 135M target takes minutes to start on a fresh machine, and a profile starts
servers twice (synthesize, bench): start-up can cost more than the work. SGLang stamps every log
line with the local time to the second ("[2026-12-06 05:46:31 TP0] Load weight begin. ..."), so
the phases come out to about a second. A phase whose closing line is missing (another SGLang
version, the project's reference server) is counted in the next phase.
"""
from __future__ import annotations

import re
import time
from pathlib import Path

# (phase, the log line that ends it), in the order SGLang writes them: a line's opening words, or
# a pattern. A speculative server loads its draft and captures the draft's graphs after the
# target's: that lands in cuda_graphs, which ends at the last capture. "health" ends at our first
# 200 from /health. Where this process did its own work while the servers started (the bench's
# offline run) and polled /health only after it, the time from the server's last line to that
# first poll is "this_process_busy": the server was ready, the caller was not.
CAPTURE_END = re.compile(r"^Capture .* end\. elapsed=([0-9.]+) s")
PHASES = (
    ("imports", None),  # to the first stamped line: the interpreter starting, SGLang's imports (torch, triton, flashinfer)
    ("init", "Load weight begin"),  # server arguments, the scheduler's process, torch.distributed
    ("weights", "Load weight end"),
    ("kv_pool", "Memory pool end"),
    ("cuda_graphs", CAPTURE_END),  # also compiles the attention backend's kernels on a cold cache
    ("warmup", "The server is fired up"),  # the HTTP server and SGLang's own warm-up request
)
LINE = re.compile(r"^\[(\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2})(?:\.(\d+))?[^\]]*\] (.*)$")


def stamped_lines(text: str) -> list[tuple[float, str]]:
    """(epoch seconds, message) of every line with SGLang's time stamp (local time)."""
    out = []
    for line in text.splitlines():
        m = LINE.match(line)
        if m:
            stamp = time.mktime(time.strptime(m.group(1), "%Y-%m-%d %H:%M:%S"))
            out.append((stamp + (float("0." + m.group(2)) if m.group(2) else 0.0), m.group(3)))
    return out


def phases(log_text: str, launched: float, healthy_at: float, polled_from: float | None = None) -> dict:
    """{"total_s", "ready_s", "phases_s": {phase: seconds}, "cuda_graph_capture_s"} of one start-up.
    The phases sum to total_s; each boundary is clamped between the one before and healthy_at.
    ready_s: launch to SGLang's "fired up" line (None where the log has none); polled_from: when
    the caller began to poll /health (its own work before that is this_process_busy)."""
    lines = stamped_lines(log_text)
    captures = [(i, float(m.group(1))) for i, (_, msg) in enumerate(lines) if (m := CAPTURE_END.match(msg))]
    out, at, seen = {}, launched, 0  # at: when the last phase found ended; seen: the index of its line

    def span(a: float, b: float) -> float:
        """b - a to 0.1 s, each end rounded from the launch first: the phases then sum to total_s exactly."""
        return round(round(b - launched, 1) - round(a - launched, 1), 1)

    for name, ends in PHASES:
        if ends is None:
            j = 0 if lines else None
        elif ends is CAPTURE_END:
            j = captures[-1][0] if captures and captures[-1][0] >= seen else None
        else:  # by order in the log: stamps to the second cannot order lines of one second
            j = next((k for k in range(seen, len(lines)) if lines[k][1].startswith(ends)), None)
        if j is not None:  # else this phase's time is counted in the next one found
            t = min(max(lines[j][0], at), healthy_at)
            out[name], at, seen = span(at, t), t, j
    ready = at if "warmup" in out else None
    if polled_from is not None and polled_from > at:
        t = min(polled_from, healthy_at)
        out["this_process_busy"], at = span(at, t), t
    out["health"] = span(at, healthy_at)
    return {"total_s": round(healthy_at - launched, 1), "ready_s": round(ready - launched, 1) if ready is not None else None,
            "phases_s": out,
            "cuda_graph_capture_s": round(sum(s for _, s in captures), 1) if captures else None}


def server_startup(srv) -> dict | None:
    """`phases` of a started lifecycle.Server (from its log), or None when its times are not known."""
    if srv.launched is None or srv.healthy_at is None:
        return None
    try:
        text = Path(srv.log_path).read_text(encoding="utf-8", errors="replace")
    except OSError:
        text = ""
    return phases(text, srv.launched, srv.healthy_at, srv.polled_from)


def summary(startups: list[dict | None]) -> str:
    """One line: the slowest start-up and where it went, e.g. "4 servers up in 95-170 s; the slowest:
    imports 52 s, init 30 s, ..."; where this process was busy past their readiness, when they were
    ready by their logs too ("3 servers up in 171-173 s, ready by their logs in 65-77 s"); "" when
    none is known."""
    known = [s for s in startups if s]
    if not known:
        return ""
    slow = max(known, key=lambda s: s["total_s"])
    totals = sorted(s["total_s"] for s in known)
    span = _span(totals)
    parts = ", ".join(f"{k.replace('_', ' ')} {v:.0f} s" for k, v in slow["phases_s"].items())
    head = f"{len(known)} server{'s' if len(known) > 1 else ''} up in {span} s"
    if any(s["phases_s"].get("this_process_busy") for s in known) and all(s.get("ready_s") is not None for s in known):
        ready = sorted(s["ready_s"] for s in known)
        head += f", ready by their logs in {_span(ready)} s"
    if len(slow["phases_s"]) == 1:  # no SGLang milestones in the log
        return head
    return f"{head}; {'the slowest' if len(known) > 1 else 'its start-up'}: {parts}"


def announce(who: str, startups) -> None:
    """Print `summary` of `startups` (an iterable of start-ups or None) as "{who}: ...", when any is known."""
    if line := summary(list(startups)):
        print(f"{who}: {line}")


def _span(sorted_seconds: list[float]) -> str:
    lo, hi = sorted_seconds[0], sorted_seconds[-1]
    return f"{lo:.0f}-{hi:.0f}" if round(lo) != round(hi) else f"{hi:.0f}"
