#!/usr/bin/env python3
"""The whole pipeline at 8B cost on one GPU with SGLang, then the measurements a deployer needs.

    python tools/gpu_8b.py --work WORK --results RESULTS [--deadline-s 1500]

Run on a GPU box with SGLang installed (README, "SGLang on a GPU machine"), from the repository
root. In order, each step skipped when its output exists (re-run the same command to resume):

 1. twin      tools/make_twin.py: the Llama-3.1-8B body computing the embedded target's function
              (WORK/twin, 14 GB bf16; --target DIR uses that model instead)
 2. server    an SGLang server of the target, no speculation (CUDA graphs on). It answers the
              synthesize stage and is the baseline of the configuration sweep.
 3. pipeline  dvc.yaml's stages prompts .. export with params.yaml + configs/gpu-8b.yaml
              (tools/sglang_run.py --phases pipeline,bench): synthesis through that server
              (synth.backend openai), extraction and training on the GPU at the target's width,
              export, and the bench stage (SGLang, side by side, concurrency 1/4/8/16)
 4. sweep     tools/serve_8b_twin.py with the trained draft: bs=1 paired speedup per
              configuration, paired concurrency for those named in --concurrency-configs; then the
              advice fitted on the measured rounds (draftlab.served_fits.advise_served) and its pick
 5. parity    the check stage with live parity against an EAGLE3 server with
              --enable-return-hidden-states (tools/sglang_run.py --phases parity)

Everything lands under RESULTS (logs, reports, the sweep JSON); RESULTS/run.json says what ran,
for how long, and what was skipped for time. --deadline-s stops starting steps that would not
finish in time (their expected durations are in the script below, measured on an H200).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from draftlab.sglang.flags import SpecFlags  # noqa: E402
from draftlab.sglang.launch import free_port, launch_argv, serve  # noqa: E402

CONFIG = ROOT / "configs" / "gpu-8b.yaml"
# The sweep's server flags: the same as the bench stage's (configs/gpu-8b.yaml), so the persistent
# baseline and every EAGLE3 server differ only in speculation.
SERVER_ARGS = ["--sampling-backend", "pytorch", "--grammar-backend", "none", "--disable-piecewise-cuda-graph"]
MEM_FRACTION = "0.28"  # three servers of a 14 GB target fit on one 141 GB GPU (baseline + bench's two)
MAX_RUNNING = 16
# The persistent baseline also answers the synthesize stage (synth.concurrency 48 in configs/gpu-8b.yaml):
# 48 requests in flight; its CUDA graphs then cover batches up to 48, the sweep uses those up to 16.
BASELINE_MAX_RUNNING = 48
# Expected seconds per step on one H200 (the deadline logic skips a step that would not fit).
# Measured (reports/gpu-8b/run/pipeline.json, 4,800 prompts, online training): the pipeline phase
# 796 s (bench stage 339 s of it); sweep configurations 70-90 s each, 60 s more for 4/8/16 in
# flight (2 repeats; ~25 s per further repeat); parity 172 s.
EXPECT_S = {"pipeline": 900, "sweep_config": 110, "sweep_concurrency": 110, "parity": 180}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", required=True, help="twin, pipeline work dir (data/, models/), server logs")
    ap.add_argument("--results", required=True, help="what to keep: logs, reports, sweep JSON, run.json")
    ap.add_argument("--target", default="", help="a local model directory instead of building the twin")
    ap.add_argument("--small", default=str(ROOT / "models" / "tiny-target"), help="the model the twin inflates")
    ap.add_argument("--configs", default="6-8-32,3-1-4,7-1-8,5-4-8",
                    help="sweep configurations STEPS-TOPK-DRAFT_TOKENS, in the order they run (the bench stage measures "
                         "spec.* = 5-1-6); then the one the served-round advice picks, if it is not among them")
    ap.add_argument("--concurrency-configs", default="6-8-32,advised",
                    help="sweep configurations that also get concurrency 4/8/16 ('advised': the advice's pick)")
    ap.add_argument("--deadline-s", type=float, default=float("inf"), help="seconds from the start for the whole run")
    ap.add_argument("--concurrency-prompts", type=int, default=None,
                    help="prompts per batch with requests in flight (default: bench.num_prompts, the bench stage's batch)")
    ap.add_argument("--concurrency-repeats", type=int, default=4,
                    help="counted batches per server at each concurrency in the sweep (two repeats of 64-prompt batches "
                         "differed by up to 32%% in speedup on one H200: reports/gpu-8b/same-batches)")
    ap.add_argument("--parity-reserve-s", type=float, default=EXPECT_S["parity"] + 30,
                    help="seconds the sweep leaves for parity after it (0: parity runs only if time is left)")
    ap.add_argument("--skip", default="", help="comma-separated steps to skip: pipeline, sweep, parity")
    ap.add_argument("--summary", default="", help="only write this JSON: what RESULTS and WORK hold so far (no GPU needed)")
    return ap.parse_args(argv)


class Run:
    def __init__(self, args):
        self.args, self.t0 = args, time.monotonic()
        self.work, self.results = Path(args.work).resolve(), Path(args.results).resolve()
        self.results.mkdir(parents=True, exist_ok=True)
        self.record_path = self.results / "run.json"
        self.record = json.loads(self.record_path.read_text()) if self.record_path.exists() else {"steps": {}}
        self.skip = set(filter(None, args.skip.split(",")))

    def left(self) -> float:
        return self.args.deadline_s - (time.monotonic() - self.t0)

    def note(self, step: str, **what) -> None:
        self.record["steps"].setdefault(step, {}).update(what)
        tmp = self.record_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.record, indent=1))
        tmp.replace(self.record_path)
        print(f"[gpu_8b {time.monotonic() - self.t0:5.0f}s] {step}: {what}", flush=True)

    def call(self, step: str, argv: list[str]) -> int:
        t = time.monotonic()
        log = self.results / "logs" / f"{step}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "w") as f:
            rc = subprocess.run(argv, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT).returncode
        self.note(step, rc=rc, seconds=round(time.monotonic() - t, 1), log=os.path.relpath(log, self.results))
        if rc:
            print("".join(log.read_text(errors="replace").splitlines(keepends=True)[-30:]), flush=True)
        return rc

    def fits(self, step: str, need_s: float) -> bool:
        if self.left() >= need_s:
            return True
        self.note(step, skipped=f"{need_s:.0f} s expected, {self.left():.0f} s left")
        return False


def build_twin(run: Run) -> Path:
    if run.args.target:
        return Path(run.args.target).resolve()
    twin = run.work / "twin"
    if not (twin / "config.json").exists():
        t = time.monotonic()
        sys.path.insert(0, str(ROOT / "tools"))
        import make_twin

        shape = make_twin.SHAPES["llama-3.1-8b"]
        make_twin.make_twin(Path(run.args.small), twin, shape, "llama-3.1-8b", "bfloat16")
        run.note("twin", seconds=round(time.monotonic() - t, 1))
    return twin


def run_params(run: Run, base_url: str) -> Path:
    """configs/gpu-8b.yaml with synthesis pointed at the running server."""
    params = yaml.safe_load(CONFIG.read_text())
    params["synth"]["base_url"] = f"{base_url}/v1"
    path = run.results / "params-gpu-8b.yaml"
    path.write_text(yaml.safe_dump(params, sort_keys=False))
    return path


def bench_prompts() -> tuple[int, int]:
    """(bench.warmup, bench.num_prompts) of params.yaml + configs/gpu-8b.yaml: the sweep measures
    the same eval prompts (tools/serve_8b_twin.py --prompt-offset, --concurrency-prompts)."""
    bench = {**yaml.safe_load((ROOT / "params.yaml").read_text())["bench"], **yaml.safe_load(CONFIG.read_text()).get("bench", {})}
    return int(bench["warmup"]), int(bench["num_prompts"])


def epoch_lines(train_log: Path) -> list[dict]:
    """The train stage's per-epoch eval lines ("epoch 3: eval loss 0.69, accept [...], tau_pred 5.18")."""
    import re

    out = []
    for line in train_log.read_text(errors="replace").replace("\r", "\n").splitlines():
        m = re.match(r"epoch (\d+): eval loss ([\d.]+), accept \[([^\]]*)\], tau_pred ([\d.]+)", line)
        if m:
            out.append({"epoch": int(m[1]), "eval_loss": float(m[2]), "accept": [float(x) for x in m[3].split(",")],
                        "tau_pred": float(m[4])})
    return out


def train_rate(train_log: Path) -> dict | None:
    """Median step rate and tokens/s (padded tokens, as the progress bar shows them) of the train stage."""
    import re
    import statistics

    text = train_log.read_text(errors="replace").replace("\r", "\n")
    steps = [float(x) for x in re.findall(r"([\d.]+)step/s", text)]
    toks = [float(x) for x in re.findall(r"tok_s=(\d+)", text)]
    last = re.findall(r"(\d+)/(\d+) \[", text)
    if not steps:
        return None
    return {"steps_per_s": statistics.median(steps), "tokens_per_s": statistics.median(toks) if toks else None,
            "last_step": int(last[-1][0]) if last else None, "total_steps": int(last[-1][1]) if last else None}


def summary(run: Run) -> dict:
    """What the run holds so far, from its manifests, logs and timings (for reports/gpu-8b/)."""
    import statistics
    from collections import defaultdict

    from draftlab.sglang.launch import read_log

    work = run.work / "pipeline"
    out = {"run": run.record, "stage_seconds": {}, "manifests": {}}
    timings = run.results / "pipeline" / "timings.json"
    if timings.exists():
        out["stage_seconds"] = json.loads(timings.read_text())
    for name in ("prompts", "synth", "hidden", "features"):
        path = work / "data" / name / "manifest.json"
        if path.exists():
            info = json.loads(path.read_text()).get("info") or {}
            out["manifests"][name] = {k: v for k, v in info.items() if k not in ("files", "target", "norms")}
            if str(info.get("served_model", "")).startswith("/"):  # SGLang names a local model by its path
                out["manifests"][name]["served_model"] = Path(info["served_model"]).name
    logs = run.results / "pipeline" / "logs"
    if (logs / "train.log").exists():
        out["train_epochs"] = epoch_lines(logs / "train.log")
        out["train_rate"] = train_rate(logs / "train.log")
    base_log = run.results / "logs" / "server-baseline.log"
    if base_log.exists():  # SGLang's own decode rate by batch size, while it answered the synthesize stage
        by = defaultdict(list)
        for d in read_log(base_log).decode:
            if d.gen_throughput:
                by[d.running_req].append(d.gen_throughput)
        out["baseline_decode_tokens_per_s"] = {str(k): {"median": statistics.median(v), "lines": len(v)} for k, v in sorted(by.items())}
    for name in ("bench.json", "check.json", "train/metrics.json"):
        path = work / "reports" / name
        if path.exists():
            out[name] = json.loads(path.read_text())
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    run = Run(args)
    if args.summary:  # the report names the run's folders WORK and RESULTS, not this machine's paths
        text = json.dumps(summary(run), indent=1).replace(str(run.work), "WORK").replace(str(run.results), "RESULTS")
        Path(args.summary).write_text(text + "\n")
        return 0
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    twin = build_twin(run)
    sglang_run = [sys.executable, str(ROOT / "tools" / "sglang_run.py"), "--results", str(run.results / "pipeline"),
                  "--work", str(run.work / "pipeline"), "--target", str(twin)]
    flags = SpecFlags(algorithm=None, max_running_requests=BASELINE_MAX_RUNNING, attention_backend="triton")
    port = free_port()
    argv_base = launch_argv(str(twin), port, baseline=True, flags=flags, dtype="bfloat16",
                            extra_args=SERVER_ARGS + ["--mem-fraction-static", MEM_FRACTION])
    base_log = run.results / "logs" / "server-baseline.log"
    base_log.parent.mkdir(parents=True, exist_ok=True)
    t = time.monotonic()
    with serve(argv_base, base_log, 600) as srv:
        run.note("server", startup_s=round(time.monotonic() - t, 1), url=srv.url)
        params = run_params(run, srv.url)
        if "pipeline" not in run.skip and run.fits("pipeline", 300):
            rc = run.call("pipeline", sglang_run + ["--params", str(params), "--phases", "pipeline,bench",
                                                    "--time-limit-s", str(max(60, run.left() - 60))])
            if rc and not (run.work / "pipeline" / "models" / "draft" / "config.json").exists():
                return rc  # no exported draft: nothing below can run (a failed bench stage leaves one)
        draft = run.work / "pipeline" / "models" / "draft"
        configs = args.configs.split(",")
        conc = set(args.concurrency_configs.split(",")) - {"advised"}
        need = len(configs) * EXPECT_S["sweep_config"] + len(conc) * EXPECT_S["sweep_concurrency"]
        if "sweep" not in run.skip and (draft / "config.json").exists() and run.fits("sweep", EXPECT_S["sweep_config"] + 30):
            warmup, num_prompts = bench_prompts()
            run.call("sweep", [sys.executable, str(ROOT / "tools" / "serve_8b_twin.py"), "--work-dir", str(run.work / "sweep"),
                               "--twin", str(twin), "--draft", str(draft), "--baseline-url", srv.url, "--baseline-log", str(base_log),
                               "--prompts", str(run.work / "pipeline" / "data" / "prompts" / "eval.jsonl"),
                               "--configs", args.configs, "--concurrency", "4,8,16", "--concurrency-configs", args.concurrency_configs,
                               "--concurrency-prompts", str(args.concurrency_prompts or num_prompts),
                               "--concurrency-repeats", str(args.concurrency_repeats),
                               "--prompt-offset", str(warmup),
                               "--advise-from", str(run.work / "pipeline" / "reports" / "bench.json"),
                               "--mem-fraction-static", MEM_FRACTION, "--max-running-requests", str(MAX_RUNNING),
                               "--port", str(free_port()), "--out", str(run.results / "sweep.json"),
                               "--mirror", str(run.work / "sweep.json"),
                               # what is left once parity has had its time
                               "--deadline-s", str(max(0, run.left() - args.parity_reserve_s))])
            run.note("sweep", planned_s=need)
    if "parity" not in run.skip and (run.work / "pipeline" / "models" / "draft").exists() and run.fits("parity", EXPECT_S["parity"]):
        run.call("parity", sglang_run + ["--params", str(params), "--phases", "parity"])
    run.note("done", wall_s=round(time.monotonic() - run.t0, 1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
