"""Where synthesis spends its time on a GPU: the synthesize stage's SGLang servers, profiled while they answer.

    python benchmarks/synth_profile.py [--conversations 2000] [--warmup-s 30] [--profile-steps 40]
        [--servers N] [--concurrency N] [--server-arg=--enable-mixed-chunk ...] [--traces-dir DIR] [--out FILE]
    python benchmarks/synth_profile.py --traces DIR [--out FILE]     # summarize traces already written

Run it from a project whose prompts stage has run (data/prompts), with params.yaml holding the profile's
target and synth sections (configs/real-gpu.yaml applied), on a machine with SGLang.

Method. The stage's own servers start (stages.synthesize.own_servers: synth.servers_per_gpu of them
on the GPU, their pools, synth.server_args, plus any --server-arg), and the stage's own client
(draftlab.data.synth.OpenAIBackend, synth.concurrency in flight) answers the first --conversations
conversations of data/prompts/train.jsonl, every turn, as the stage would. --warmup-s seconds in,
once the servers run full batches, every server is asked for a torch-profiler trace of its next
--profile-steps scheduler steps (SGLang's /start_profile, CPU and GPU activities). From the traces:
- the GPU's busy share: the union of every server's kernels over the window in which all of them
  were traced. Servers on one GPU take turns on it, so one server's trace alone says little;
- the kernels by time, in groups (attention, matrix products, element-wise and norms, sampling,
  copies, other), and the largest kernels by name;
- each server's forward passes a second (CUDA-graph launches are decode steps; prefills run eagerly).
Then the verdict: a GPU busy most of the window is limited by its kernels (the largest group is
named); one idle much of it is limited by the servers' host side (scheduling, request handling,
launches), which more servers, multi-step decode or a faster CPU address. The run's own tok/s over
the answering is printed beside it, so a lever tried with --server-arg is measured the same way.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import gzip
import json
import re
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from draftlab.tracing import union_us  # noqa: E402

BUSY_IS_GPU_BOUND = 0.85  # a GPU with kernels running this share of the window is the limit

# Kernel groups by name, first match wins (SGLang's triton attention kernels are _fwd_kernel*,
# FlashInfer's and FlashAttention's carry their library's name; cuBLAS's are nvjet/sm90_xmma/gemm).
GROUPS = [
    ("attention", re.compile(r"attn|attention|flash|fmha|sdpa|_fwd_kernel|_fwd_grouped_kernel|decode_kernel|merge_state", re.I)),
    ("matrix products", re.compile(r"gemm|gemv|nvjet|xmma|cutlass|cublas|matmul|splitk|sm90_|sm80_", re.I)),
    ("sampling", re.compile(r"argmax|sort|topk|top_k|multinomial|sampl|softmax", re.I)),
    ("element-wise and norms", re.compile(r"elementwise|vectorized|norm|silu|gelu|act_and_mul|rotary|rope|reduce|fused_add", re.I)),
    ("copies", re.compile(r"copy|memcpy|memset|cat|index|gather|scatter|fill", re.I)),
]


def kernel_group(name: str) -> str:
    return next((group for group, pattern in GROUPS if pattern.search(name)), "other")


def read_trace(path: Path) -> dict:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)


def trace_events(trace: dict) -> tuple[list[tuple[float, float, str]], int]:
    """(GPU kernels as (start us, end us, name) on one clock, CUDA-graph launches) of one trace.

    torch.profiler's event times are microseconds from the trace's baseTimeNanoseconds: adding it
    puts every server's trace on the same (wall) clock."""
    base = trace.get("baseTimeNanoseconds", 0) / 1e3
    kernels, graphs = [], 0
    for e in trace.get("traceEvents", []):
        if e.get("ph") != "X":
            continue
        if e.get("cat") == "kernel":
            start = float(e["ts"]) + base
            kernels.append((start, start + float(e.get("dur", 0.0)), e.get("name", "?")))
        elif e.get("cat") == "cuda_runtime" and e.get("name") == "cudaGraphLaunch":
            graphs += 1
    return sorted(kernels), graphs


def summarize(traces: list[Path], top: int = 12) -> dict:
    """The figures of the module's docstring from one trace file per server."""
    if not traces:
        raise SystemExit("no trace files (*.trace.json.gz) to summarize")
    servers, everything = [], []
    for path in traces:
        kernels, graphs = trace_events(read_trace(path))
        if not kernels:
            raise SystemExit(f"{path}: no GPU kernels in the trace; was it taken with the GPU activity?")
        lo, hi = kernels[0][0], max(k[1] for k in kernels)
        servers.append({"trace": path.name, "window_ms": (hi - lo) / 1e3, "graph_launches": graphs,
                        "graph_launches_per_s": graphs / ((hi - lo) / 1e6), "own_busy_share": union_us(kernels, lo, hi) / (hi - lo),
                        "_lo": lo, "_hi": hi})
        everything += kernels
    lo, hi = max(s.pop("_lo") for s in servers), min(s.pop("_hi") for s in servers)
    common = hi > lo
    if not common:  # the servers were traced one after another: the union over the whole span instead
        lo, hi = min(k[0] for k in everything), max(k[1] for k in everything)
    inside = [(max(a, lo), min(b, hi), n) for a, b, n in everything if b > lo and a < hi]
    busy = union_us(inside, lo, hi) / (hi - lo)
    by_group, by_name = collections.Counter(), collections.Counter()
    for a, b, name in inside:
        by_group[kernel_group(name)] += b - a
        by_name[name] += b - a
    kernel_us = sum(by_group.values())
    groups = {g: round(us / kernel_us, 4) for g, us in by_group.most_common()}
    largest = next(iter(groups))
    if busy >= BUSY_IS_GPU_BOUND:
        verdict = (f"the GPU: kernels run {busy:.0%} of the window; the largest group is {largest} "
                   f"({groups[largest]:.0%} of kernel time)")
    else:
        verdict = (f"the servers' host side: the GPU idles {1 - busy:.0%} of the window between kernels "
                   f"(scheduling, request handling, launches)")
    return {
        "servers": servers,
        "window_ms": (hi - lo) / 1e3,
        "window": "every server traced" if common else "the traces did not overlap: the span of all of them",
        "gpu_busy_share": round(busy, 4),
        "kernel_groups": groups,
        "top_kernels": [{"name": n[:90], "share": round(us / kernel_us, 4)} for n, us in by_name.most_common(top)],
        "verdict": verdict,
    }


def print_summary(s: dict) -> None:
    print(f"window {s['window_ms']:.1f} ms ({s['window']}); GPU busy {s['gpu_busy_share']:.1%} "
          f"(union of every server's kernels)")
    for srv in s["servers"]:
        print(f"  {srv['trace']}: {srv['window_ms']:.1f} ms traced, its kernels {srv['own_busy_share']:.1%} of it, "
              f"{srv['graph_launches_per_s']:.0f} CUDA-graph launches/s")
    print("kernel time by group: " + ", ".join(f"{g} {share:.1%}" for g, share in s["kernel_groups"].items()))
    for k in s["top_kernels"]:
        print(f"  {k['share']:6.1%}  {k['name']}")
    print(f"limit: {s['verdict']}")
    if "tokens_per_s" in s:
        print(f"answering: {s['completion_tokens']} tokens in {s['answer_s']:.1f} s: {s['tokens_per_s']:.0f} tok/s "
              f"over {s['servers_started']} server(s)")


def profile_servers(urls: list[str], steps: int, trace_dir: Path, timeout_s: float = 300.0, ask_timeout_s: float = 120.0,
                    logs: Path | None = None) -> list[Path]:
    """Ask every server (its /v1 URL) for a trace of its next `steps` steps, all at once (so that the
    windows overlap); the trace files once written. A server that does not take the request within
    ask_timeout_s runs no scheduler steps (SGLang acknowledges /start_profile from its scheduler):
    stopped with its name and log, not left waiting."""
    import httpx
    from concurrent.futures import ThreadPoolExecutor

    dirs = [trace_dir / f"server-{i}" for i in range(len(urls))]

    def ask(url: str, d: Path) -> None:
        d.mkdir(parents=True, exist_ok=True)
        r = httpx.post(f"{url.removesuffix('/v1')}/start_profile",
                       json={"output_dir": str(d), "num_steps": steps, "activities": ["CPU", "GPU"]},
                       timeout=ask_timeout_s, trust_env=False)
        r.raise_for_status()

    with ThreadPoolExecutor(max(1, len(urls))) as pool:
        asked = [pool.submit(ask, url, d) for url, d in zip(urls, dirs)]
        for i, (url, future) in enumerate(zip(urls, asked)):
            try:
                future.result()
            except httpx.TimeoutException:
                where = f" (its log: {logs / f'.sglang-server-{i}.log'})" if logs else ""
                raise SystemExit(f"server {i} at {url} did not take /start_profile within {ask_timeout_s:.0f} s: its scheduler "
                                 f"runs no steps, so it is not answering{where}") from None
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        found = [sorted(d.glob("*.trace.json*")) for d in dirs]
        if all(found):
            time.sleep(2.0)  # the exporter writes the file in one go; let it close
            return [f[-1] for f in found]
        time.sleep(1.0)
    raise SystemExit(f"no trace from {sum(not any(d.glob('*.trace.json*')) for d in dirs)} server(s) within {timeout_s:.0f} s")


def live(args) -> dict:
    """Start the stage's servers, answer, trace every server mid-run: the summary plus the run's rate."""
    from draftlab.data import synth
    from draftlab.params import load_params
    from draftlab.errors import UserError
    from stages.synthesize import make_backend, own_servers

    params = load_params(["target", "synth"])
    target_params, synth_params = params.target, params.synth
    if synth_params.backend != "sglang":
        raise SystemExit(f"synth.backend is {synth_params.backend!r}: this benchmark starts SGLang servers (synth.backend sglang)")
    changes = {"server_args": list(synth_params.server_args) + list(args.server_arg)}
    if args.servers:
        changes["servers_per_gpu"] = args.servers
    if args.concurrency:
        changes["concurrency"] = args.concurrency
    synth_params = dataclasses.replace(synth_params, **changes)
    rows = synth.longest_first(synth.read_prompts(args.prompts / "train.jsonl")[: args.conversations])  # the stage's order
    trace_dir = Path(args.traces_dir or tempfile.mkdtemp(prefix="synth-traces-"))
    logs = Path(tempfile.mkdtemp(prefix="synth-servers-"))
    done = {"tokens": 0, "rows": 0, "errors": 0}

    def finished(_row, ans, err):
        done["rows"] += 1
        if ans is None:
            done["errors"] += 1
        else:
            done["tokens"] += ans.completion_tokens

    stopping = threading.Event()  # set once the servers are stopped on purpose (--stop-after-traces)

    def answer(backend):
        try:
            backend.answer(rows, finished)
        except UserError:  # the servers went away under the client: expected only when stopped on purpose
            if not stopping.is_set():
                raise

    with own_servers(target_params, synth_params, logs) as urls:
        backend = make_backend(target_params, synth_params, urls)
        t0 = time.perf_counter()
        worker = threading.Thread(target=answer, args=(backend,), daemon=True)
        worker.start()
        time.sleep(args.warmup_s)
        if not worker.is_alive():
            raise SystemExit(f"the {len(rows)} conversations were answered within --warmup-s {args.warmup_s}: "
                             "raise --conversations or lower --warmup-s")
        sent = sum(backend.sent.values())
        print(f"after {args.warmup_s:.0f} s: {done['rows']} conversations answered, {sent} requests sent; tracing "
              f"{len(urls)} server(s)", flush=True)
        if not sent:
            raise SystemExit(f"no request reached a server within --warmup-s {args.warmup_s}: the client did not start "
                             f"(the servers' logs: {logs})")
        traces = profile_servers(urls, args.profile_steps, trace_dir, logs=logs)
        if not args.stop_after_traces:
            worker.join()
        seconds = time.perf_counter() - t0  # with --stop-after-traces, the conversations finished so far
        stopping.set()
    summary = summarize(traces, args.top)
    summary.update(completion_tokens=done["tokens"], answer_s=round(seconds, 2), tokens_per_s=done["tokens"] / seconds,
                   conversations=done["rows"], errors=done["errors"], servers_started=len(urls),
                   server_args=synth_params.server_args, traces_dir=str(trace_dir), server_logs=str(logs),
                   note="the traced steps run slower than the rest (the profiler's own cost): tok/s is over the whole answering")
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--traces", type=Path, help="summarize the *.trace.json(.gz) files under this folder (one per server); start nothing")
    ap.add_argument("--prompts", type=Path, default=Path("data/prompts"), help="the prompts stage's folder")
    ap.add_argument("--conversations", type=int, default=2000, help="train conversations answered (every turn)")
    ap.add_argument("--warmup-s", type=float, default=30.0, help="seconds of answering before the traces start")
    ap.add_argument("--profile-steps", type=int, default=40, help="scheduler steps traced on every server")
    ap.add_argument("--servers", type=int, help="servers on the GPU (default: synth.servers_per_gpu)")
    ap.add_argument("--concurrency", type=int, help="conversations in flight over all servers (default: synth.concurrency); "
                    "with more --servers, raise it as much to keep each server as full")
    ap.add_argument("--server-arg", action="append", default=[], help="one more SGLang flag (repeat): --server-arg=--enable-mixed-chunk")
    ap.add_argument("--stop-after-traces", action="store_true",
                    help="stop the servers once traced, not after the last conversation (tok/s then counts the finished ones)")
    ap.add_argument("--traces-dir", help="where the servers write their traces (default: a new temporary folder)")
    ap.add_argument("--top", type=int, default=12, help="largest kernels listed")
    ap.add_argument("--out", type=Path, help="also write the figures to this JSON file")
    args = ap.parse_args()
    if args.traces:
        summary = summarize(sorted(args.traces.rglob("*.trace.json*")), args.top)
    else:
        summary = live(args)
    print_summary(summary)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
