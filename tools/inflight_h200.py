#!/usr/bin/env python3
"""Requests in flight on one GPU: what speculation gains at 4, 8 and 16 concurrent requests, with
SGLang's prefill CUDA graph on (its default) or off, and what each new request costs the server.

    python tools/inflight_h200.py --work WORK --results RESULTS [--prefill-cuda-graph on] [--deadline-s 1000]

Run on a GPU box with SGLang installed, from the repository root, after `dvc repro` (it needs the
default pipeline's draft, models/draft). It builds the 8B-cost twin of the embedded target and that
draft inflated to the twin's width (tools/make_twin.py), then runs tools/serve_8b_twin.py on the
eval prompts of configs/gpu-8b.yaml's prompt set (the bench stage's batches there: bench.warmup
rows skipped, bench.num_prompts per batch):

  - bs=1, paired request by request, for every configuration of --configs;
  - 4, 8 and 16 in flight for those of --inflight-configs: one uncounted batch per server, then
    --repeats ABBA pairs of whole batches;
  - the prefill probe: prompt-only requests (max_new_tokens 1) at 1, 4, 8 and 16 in flight on
    every server, the server's time per admitted request.

RESULTS gets sweep.json (the sweep's results), decode-*.log (the Decode lines of each server's
SGLang log: its own time per round at n running requests) and tails/ (each server log's last lines).
`python tools/same_batches_report.py RESULTS reports/gpu-8b/run/bench.json OUT` makes the report.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))


def gpu_prompt_settings() -> dict:
    """prompts.* and bench.warmup/num_prompts of params.yaml with configs/gpu-8b.yaml merged over them."""
    base = yaml.safe_load((ROOT / "params.yaml").read_text())
    over = yaml.safe_load((ROOT / "configs" / "gpu-8b.yaml").read_text())
    prompts = {**base["prompts"], **over.get("prompts", {})}
    bench = {**base["bench"], **over.get("bench", {})}
    return {"num_prompts": int(prompts["num_prompts"]), "seed": int(prompts["seed"]),
            "eval_fraction": float(prompts["eval_fraction"]), "warmup": int(bench["warmup"]),
            "batch": int(bench["num_prompts"])}


def write_eval_prompts(path: Path, settings: dict) -> int:
    """The eval split of the GPU prompt set, as the prompts stage writes it (same generator, seed, split)."""
    from draftlab import prompts

    rows = prompts.builtin_prompts(settings["num_prompts"], settings["seed"]).rows
    _, evals = prompts.split(rows, settings["eval_fraction"])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in evals))
    return len(evals)


def decode_lines(log: Path, out: Path) -> None:
    """Only SGLang's 'Decode batch' lines of a server log (the report reads its rounds from them)."""
    if log.exists():
        out.write_text("".join(line for line in log.read_text(errors="replace").splitlines(keepends=True)
                               if "Decode batch" in line))


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", required=True, help="twin, inflated draft, server logs (about 15 GB)")
    ap.add_argument("--results", required=True, help="sweep.json, decode-*.log, inflight.log")
    ap.add_argument("--small-draft", default=str(ROOT / "models" / "draft"), help="the default pipeline's draft")
    ap.add_argument("--prefill-cuda-graph", choices=("on", "off"), default="on")
    ap.add_argument("--configs", default="5-1-6,6-8-32,7-1-8,3-1-4,5-4-8",
                    help="in this order; 5-1-6 is the bench stage's configuration (spec.* of configs/gpu-8b.yaml)")
    ap.add_argument("--inflight-configs", default="5-1-6,6-8-32,7-1-8")
    ap.add_argument("--repeats", type=int, default=4, help="counted ABBA batch pairs per concurrency")
    ap.add_argument("--deadline-s", type=float, default=1000.0)
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    t0 = time.monotonic()
    work, results = Path(args.work).resolve(), Path(args.results).resolve()
    results.mkdir(parents=True, exist_ok=True)
    if not (Path(args.small_draft) / "config.json").exists():
        raise SystemExit(f"error: {args.small_draft} has no config.json: run `dvc repro` first (it trains the default draft)")
    settings = gpu_prompt_settings()
    eval_path = work / "eval.jsonl"
    n_eval = write_eval_prompts(eval_path, settings)
    print(f"eval prompts: {n_eval} of {settings['num_prompts']} -> {eval_path}", flush=True)
    import serve_8b_twin

    argv = ["--small", str(ROOT / "models" / "tiny-target"), "--small-draft", args.small_draft,
            "--work-dir", str(work), "--prompts", str(eval_path), "--out", str(results / "sweep.json"),
            "--mirror", str(work / "sweep.json"),
            "--num-prompts", "32", "--prompt-offset", str(settings["warmup"]),
            "--concurrency-prompts", str(settings["batch"]), "--configs", args.configs,
            "--concurrency", "4,8,16", "--concurrency-configs", args.inflight_configs,
            "--concurrency-repeats", str(args.repeats), "--prefill-cuda-graph", args.prefill_cuda_graph,
            "--prefill-probe", "--mem-fraction-static", "0.4", "--max-running-requests", "16",
            "--deadline-s", str(max(0.0, args.deadline_s - (time.monotonic() - t0)))]
    try:
        try:
            serve_8b_twin.main(argv)
        except Exception as e:  # noqa: BLE001  (a failed start with the graph on must not lose the run)
            done = json.loads((results / "sweep.json").read_text()) if (results / "sweep.json").exists() else {}
            if args.prefill_cuda_graph == "off" or any("speedup" in c for c in done.get("configs", {}).values()):
                raise
            print(f"the run with the prefill CUDA graph on failed before any measurement ({type(e).__name__}: {e}); "
                  "again with it off", flush=True)
            (work / "sweep.json").unlink(missing_ok=True)
            (results / "sweep.json").unlink(missing_ok=True)
            argv[argv.index("--prefill-cuda-graph") + 1] = "off"
            argv[argv.index("--deadline-s") + 1] = str(max(0.0, args.deadline_s - (time.monotonic() - t0)))
            serve_8b_twin.main(argv)
    finally:
        logs = work / "logs"
        decode_lines(logs / "baseline.log", results / "decode-baseline.log")
        for log in sorted(logs.glob("spec-*.log")):
            decode_lines(log, results / f"decode-{log.stem}.log")
        for log in sorted(logs.glob("*.log")):  # the last lines of each server log, for a failed start
            tail = log.read_text(errors="replace").splitlines()[-40:]
            (results / "tails").mkdir(exist_ok=True)
            (results / "tails" / log.name).write_text("\n".join(tail) + "\n")
        print(f"inflight: {time.monotonic() - t0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
