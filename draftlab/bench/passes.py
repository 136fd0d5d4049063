"""The bench's measured passes, written as each one ends: `passes.jsonl` beside the bench's report.

The report (bench.json, requests.jsonl) is written once, after every configuration is measured. A
bench stopped before that (Ctrl-C, a lost node, a job's time limit) still leaves here every pass it
finished, one line per (configuration, prompt set), and prints the same figures to its log:

    {"configuration": "3-1-4", "prompt_set": "heldout", "tau": 2.41, "speedup": 1.05,
     "tokens_per_s": 690.1, "baseline_tokens_per_s": 657.3,
     "by_concurrency": [{"concurrency": 8, "speedup": 0.93, "tau": 2.38}], "requests": 30}

tau: the speculative server's pooled tau at bs=1 (draftlab.metrics.pooled_tau); speedup: the median
per-request tokens/s against the baseline's (bs=1, the bench's headline); at n in flight, batch
throughput against the baseline's, pooled over the repeats (draftlab.bench.sweep's definitions).
"""
from __future__ import annotations

from pathlib import Path

from draftlab import jsonl

NAME = "passes.jsonl"


def start(out: Path) -> None:
    """A new bench: the last run's passes are not this one's."""
    (out / NAME).unlink(missing_ok=True)


def summary(configuration: str, prompt_set: str, baseline: dict | None, spec: dict) -> dict:
    """One pass's figures from draftlab.bench.servers.measure's per-mode results."""
    row = {"configuration": configuration, "prompt_set": prompt_set, "tau": spec["spec"].get("tau"),
           "tokens_per_s": spec["speed"]["median"], "requests": spec["speed"]["requests"],
           "baseline_tokens_per_s": baseline["speed"]["median"] if baseline else None,
           "speedup": spec["speed"]["median"] / baseline["speed"]["median"] if baseline else None}
    base_at = {r["concurrency"]: r for r in baseline["sweep"]} if baseline else {}
    row["by_concurrency"] = [{"concurrency": r["concurrency"], "tau": r.get("tau"),
                              "speedup": r["throughput"] / base_at[r["concurrency"]]["throughput"]
                              if r["concurrency"] in base_at else None} for r in spec["sweep"]]
    return row


def line(row: dict) -> str:
    """The pass as one log line: `3-1-4 heldout: tau 2.41, bs=1 1.05x, 8 in flight 0.93x (tau 2.38)`."""
    def x(v):
        return "-" if v is None else f"{v:.2f}x"
    parts = [f"tau {row['tau']:.3f}" if row["tau"] is not None else "no tau", f"bs=1 {x(row['speedup'])}"]
    parts += [f"{r['concurrency']} in flight {x(r['speedup'])}" + (f" (tau {r['tau']:.3f})" if r.get("tau") is not None else "")
              for r in row["by_concurrency"]]
    return f"{row['configuration']} {row['prompt_set']}: " + ", ".join(parts)


def record(out: Path, configuration: str, prompt_set: str, baseline: dict | None, spec: dict) -> dict:
    """Add one finished pass to out/passes.jsonl (the whole file rewritten atomically: a stop
    mid-write leaves the passes before it) and print it."""
    row = summary(configuration, prompt_set, baseline, spec)
    path = out / NAME
    rows = [r for _, r in jsonl.read(path, "delete it; the bench writes it anew")] if path.exists() else []
    jsonl.write(path, rows + [row])
    print(f"bench: measured {line(row)}")
    return row
