#!/usr/bin/env python3
"""This project's EAGLE-3 trainer against SpecForge's, on one GPU box: the same 8B-cost target,
data, capture layers and budget; both drafts served by the same SGLang, paired.

    python tools/peers_h200.py --work WORK --results RESULTS [--deadline-s 6000]              # full
    python tools/peers_h200.py --work WORK --results RESULTS --size small --deadline-s 1620   # a 30-minute job
    python tools/peers_report.py RESULTS reports/peers            # the table and plots (no GPU)

Needs one GPU box with SGLang 0.5.14 and SpecForge 0.2.0 installed (SpecForge pins torch 2.11,
transformers 5.8.1, sglang 0.5.14), run from the repository root. Steps, in order; each is
skipped when its output exists (re-run the same command to resume), and --deadline-s stops
starting a step that would not finish in time (expected seconds in EXPECT_S):

 ours        tools/gpu_8b.py with configs/gpu-8b.yaml plus train.features offline: the twin, a
             baseline SGLang server, synthesis, extraction with the states stored, our training,
             export, the bench stage (served and offline tau at 5-1-6). --work may name an
             existing gpu_8b work dir whose features are offline; it is reused.
 ours_train  our train stage again on the same stored states, alone on the GPU, watched from
             outside like SpecForge's (wall time, tokens/s, peak GPU memory, eval accuracy over time)
 convert     tools/specforge_offline.py: the same states, loss mask, draft vocabulary, draft size,
             epochs, batch, max length and TTT length; SpecForge's own learning rate (1e-4, its
             TrainingConfig default)
 sf_train    `specforge train --config run.yaml` (its --plan printed first), watched the same way;
             its console lines "step N: {...}" give samples/s, train and eval accuracy
 sf_export   `specforge export --to sglang ...`
 check       `python -m draftlab.check draft` on both drafts (the layers SGLang feeds, d2t, shapes)
 offline     our offline run (the bench stage's in-process decode, spec flags 5-1-6) on both drafts
 serve       one baseline SGLang server; tools/serve_8b_twin.py per configuration for each draft
             against it, same server flags, same prompts: served tau and bs=1 speedup

Everything lands in RESULTS/peers.json (rewritten atomically after every step): versions, the
mode and every size, every flag and config key each trainer ran with, per-step argv, exit code and
seconds, and the figures.

--size full (the default, for long allocations): 4,800 prompts, the steps above in that order,
configurations 3-1-4, 5-1-6, 6-8-32, 5-4-8. About 80 GPU minutes on one H200 from an empty disk
(the pipeline ~25 with its bench stage, our offline training and SpecForge's ~12 each, serving
4 configurations x 2 drafts ~16; EXPECT_S["full"], the deadline's upper bounds, sums to 92); less
with --work reused.

--size small (a 30-minute job on a fresh machine, where nothing persists between jobs): the same
comparison on less data. Both trainers still get exactly the same rows, draft size, epochs, batch,
max length, TTT length and capture layers; only prompts.num_prompts shrinks (4,800 -> 1,200: ~1,080
train rows, 3 x 68 = 204 optimizer steps at batch 16). Changed besides: the pipeline runs without
its bench stage (the serve and offline steps below measure both drafts the same way), the offline
run uses 32 prompts (+2 warm-up), ours_train runs last and only if time is left (until then our
trainer's figures come from the pipeline's train stage: its log's rate line and epoch evals, its
seconds from timings.json, eval times spread over the stage's seconds by epoch, peak memory not
measured), and the order puts serving after both trainings, so a short deadline cuts serving
configurations, never training. Estimated seconds on one H200, from reports/gpu-8b's timings
(EXPECT_S["small"]):

 ours         600  twin 16, baseline server 135 (cold kernel cache), prompts 2, synthesis of ~90k
                   answer tokens at ~3,100 tok/s 40, extraction of ~115k tokens with the states
                   stored at ~2,800 tok/s 65 (target load included), standardize 6, training 204
                   steps at ~1.2 steps/s 210 (start-up and 3 evals included), export 9, stage
                   start-ups ~60, margin ~55
 convert       90  ~3.7 GB of states rewritten in SpecForge's format (not yet timed)
 sf_train     240  its --plan ~30 + training budgeted equal to ours, 210 (SpecForge's rate not yet timed)
 sf_export     60
 check         60  both drafts
 serve        450  baseline server 90 (kernel cache warm) + 3-1-4 and 5-1-6 x 2 drafts x 90 (server
                   start 60-70 + 32 paired prompts ~15)
              ----
             1500  = 25 minutes: the whole comparison at 3-1-4 and 5-1-6
 serve +180 6-8-32 for both drafts, if 180 s are left (a configuration is served for both or neither)
 offline      120  both drafts' offline tau at 5-1-6, if time is left
 ours_train   210  our trainer watched from outside (peak memory, eval times), if time is left

With --deadline-s 1620 (27 minutes; leave the job's own start-up and copy-out the rest) a run
from an empty disk is expected to reach 6-8-32; re-run the same command in a later job (with the
same WORK, if the disk persists) to do what was skipped.
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

STEPS = ["ours", "ours_train", "convert", "sf_train", "sf_export", "check", "offline", "serve"]
DRAFTS = ["ours", "specforge"]
# Expected seconds on one H200 per size (the deadline skips a step that would not fit). The pipeline
# with stored states: extract at ~2,800 tok/s, training at ~1.2 steps/s (reports/gpu-8b: 807 steps
# at 4,800 prompts, 204 at 1,200); SpecForge's offline trainer not yet timed here (budgeted equal to
# ours); a served configuration ~60-70 s server start + ~15 s paired per draft. Step by step for
# small: the module docstring.
EXPECT_S = {
    "full": {"ours": 1800, "ours_train": 800, "convert": 300, "sf_train": 1200, "sf_export": 120, "check": 60,
             "offline": 150, "serve_start": 150, "serve_config": 120},
    "small": {"ours": 600, "ours_train": 210, "convert": 90, "sf_train": 240, "sf_export": 60, "check": 60,
              "offline": 120, "serve_start": 90, "serve_config": 90},
}
# What each size changes. order: the steps in the order they run (the deadline cuts from the end);
# params: merged over configs/gpu-8b.yaml (with the states stored); phases: tools/sglang_run.py's
# phases in the ours step (without "bench", the pipeline ends at export).
SIZES = {
    "full": {"order": ["ours", "ours_train", "convert", "sf_train", "sf_export", "check", "offline", "serve"],
             "params": {}, "phases": "pipeline,bench", "configs": "3-1-4,5-1-6,6-8-32,5-4-8"},
    "small": {"order": ["ours", "convert", "sf_train", "sf_export", "check", "serve", "offline", "ours_train"],
              "params": {"prompts": {"num_prompts": 1200}, "bench": {"num_prompts": 34}},
              "phases": "pipeline", "configs": "3-1-4,5-1-6,6-8-32"},
}
# The steps that make both drafts: the ours step's own deadline leaves them their time.
TRAINING_AFTER_OURS = ["convert", "sf_train", "sf_export", "check"]
SPECFORGE_LR = 1e-4  # SpecForge 0.2.0 config/schema.py TrainingConfig.learning_rate default
SPECFORGE_OVERRIDES = ["training.log_interval=10"]  # a console line every 10 steps (default 50); logging only
SGLANG_VERSION = "0.5.14"
MAX_RUNNING = 16
H200_BF16_FLOPS = 989e12  # dense bf16 tensor-core peak, FLOP/s (NVIDIA's figure)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", required=True, help="twin, pipeline work dir, SpecForge's files (WORK/specforge)")
    ap.add_argument("--results", required=True, help="peers.json, logs, per-draft serve JSON")
    ap.add_argument("--target", default="", help="a local model directory instead of building the twin")
    ap.add_argument("--deadline-s", type=float, default=float("inf"), help="seconds from the start for the whole run")
    ap.add_argument("--size", choices=sorted(SIZES), default="full",
                    help="full: 4,800 prompts, 4 served configurations (~80 GPU min); small: 1,200 prompts, no bench "
                         "stage, serving 3-1-4 and 5-1-6 then 6-8-32 if time (~25 GPU min)")
    ap.add_argument("--configs", default=None, help="served STEPS-TOPK-DRAFT_TOKENS, in order (default: the size's)")
    ap.add_argument("--num-prompts", type=int, default=32, help="paired prompts per configuration (bs=1)")
    ap.add_argument("--specforge", default="specforge", help="SpecForge's console script")
    ap.add_argument("--specforge-lr", type=float, default=SPECFORGE_LR)
    ap.add_argument("--specforge-ttt-length", type=int, default=None,
                    help="default: ours (train.ttt_steps), so both unroll the same steps; SpecForge's own default is 7")
    ap.add_argument("--skip", default="", help="comma-separated steps to skip: " + ", ".join(STEPS))
    return ap.parse_args(argv)


# ---------------------------------------------------------------------------------------------
# paths, budget, argv (no GPU needed; tested)

class Paths:
    def __init__(self, work: Path, results: Path, target: str = ""):
        self.work, self.results = Path(work), Path(results)
        self.pipeline = self.work / "pipeline"
        self.twin = Path(target) if target else self.work / "twin"
        self.features = self.pipeline / "data" / "features"
        self.prompts = self.pipeline / "data" / "prompts" / "eval.jsonl"
        self.draft = {"ours": self.pipeline / "models" / "draft", "specforge": self.work / "specforge" / "draft"}
        self.sf = self.work / "specforge"
        self.ours_train = self.work / "ours-train"
        self.pipeline_results = self.results / "ours" / "pipeline"  # the ours step's tools/sglang_run.py --results
        self.peers = self.results / "peers.json"


def merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def peers_params(size: str = "full") -> dict:
    """configs/gpu-8b.yaml with the states stored: SpecForge trains offline from them, and ours
    trains from the same files (online training would compute them and store none); then the size's
    changes (the amount of data only, never the training budget)."""
    gpu8b = yaml.safe_load((ROOT / "configs" / "gpu-8b.yaml").read_text())
    return merge(merge(gpu8b, {"train": {"features": "offline", "checkpoint_every": 0}}), SIZES[size]["params"])


def pipeline_params(paths: Paths, size: str = "full") -> dict:
    """The pipeline's params.yaml once it exists (what ran), else what it will be."""
    p = paths.pipeline / "params.yaml"
    return yaml.safe_load(p.read_text()) if p.exists() else merge(yaml.safe_load((ROOT / "params.yaml").read_text()), peers_params(size))


def budget(paths: Paths, ttt_override: int | None = None, size: str = "full") -> dict:
    """The training budget both trainers get: from the pipeline's params.yaml once it exists."""
    t = pipeline_params(paths, size)["train"]
    return {"epochs": t["epochs"], "batch_size": t["batch_size"], "max_length": t["max_length"],
            "ttt_steps": ttt_override or t["ttt_steps"], "our_lr": t["lr"], "features": t["features"]}


def sizes(paths: Paths, size: str, args) -> dict:
    """The mode and every size of the run, for peers.json and the report."""
    params = pipeline_params(paths, size)
    tokens, seqs = token_counts(paths)
    return {"mode": size, "num_prompts": params["prompts"]["num_prompts"], "eval_fraction": params["prompts"]["eval_fraction"],
            "synth_max_new_tokens": params["synth"]["max_new_tokens"], "capture_layers": params["capture"]["layers"],
            "train_sequences": seqs, "train_tokens_per_epoch": tokens, "bench_stage": "bench" in SIZES[size]["phases"],
            "offline_prompts": params["bench"]["num_prompts"] - params["bench"]["warmup"],
            "served_prompts": args.num_prompts, "served_max_new_tokens": 128,
            "order": SIZES[size]["order"], "expected_s": EXPECT_S[size],
            "size_asked": {"num_prompts": peers_params(size)["prompts"]["num_prompts"]}}


def expected(step: str, size: str = "full") -> float:
    """Seconds a step is expected to take (serve: the baseline server and one configuration, both drafts)."""
    e = EXPECT_S[size]
    return e["serve_start"] + len(DRAFTS) * e["serve_config"] if step == "serve" else e[step]


def ours_reserve(size: str = "full") -> float:
    """Seconds the ours step leaves after itself: the training steps that make SpecForge's draft."""
    return sum(EXPECT_S[size][s] for s in TRAINING_AFTER_OURS)


def step_argv(name: str, paths: Paths, args, b: dict, draft: str = "") -> list[str]:
    """The command of one step (or of one draft's part of it), as run."""
    py, sf = sys.executable, paths.sf
    if name == "ours":
        return [py, str(ROOT / "tools" / "peers_h200.py"), "gpu-8b", str(paths.results / "params-peers.yaml"),
                "--phases", SIZES[getattr(args, "size", "full")]["phases"], "--",
                "--work", str(paths.work), "--results", str(paths.results / "ours"), "--skip", "sweep,parity"] + \
               (["--target", str(paths.twin)] if args.target else [])
    if name == "ours_train":
        o = paths.ours_train
        return [py, "-m", "stages.train", "--features", "data/features", "--out", str(o / "ckpt"),
                "--reports", str(o / "reports"), "--resume-dir", str(o / "resume")]
    if name == "convert":
        return [py, str(ROOT / "tools" / "specforge_offline.py"), "--features", str(paths.features),
                "--draft", str(paths.draft["ours"]), "--target", str(paths.twin), "--out", str(sf),
                "--epochs", str(b["epochs"]), "--batch-size", str(b["batch_size"]), "--lr", str(args.specforge_lr),
                "--max-length", str(b["max_length"]), "--ttt-length", str(b["ttt_steps"])]
    if name == "sf_plan":
        return [args.specforge, "train", "--config", str(sf / "run.yaml"), "--plan", *SPECFORGE_OVERRIDES]
    if name == "sf_train":
        return [args.specforge, "train", "--config", str(sf / "run.yaml"), *SPECFORGE_OVERRIDES]
    if name == "sf_export":
        return [args.specforge, "export", "--to", "sglang", "--checkpoint", str(sf / "output"),
                "--draft-config", str(sf / "draft_config.json"), "--vocab-mapping", str(sf / "vocab_mapping.pt"),
                "--output-dir", str(paths.draft["specforge"])]
    if name == "check":
        return [py, "-m", "draftlab.check", "draft", str(paths.draft[draft]), "--target", str(paths.twin),
                "--sglang-version", SGLANG_VERSION, "--features", str(paths.features),
                "--json", str(paths.results / f"check-{draft}.json")]
    if name == "offline":
        return [py, str(ROOT / "tools" / "peers_h200.py"), "offline-run", "--draft", str(paths.draft[draft]),
                "--out", str(paths.results / f"offline-{draft}.json")]
    raise KeyError(name)


def serve_argv(paths: Paths, args, draft: str, config: str, base_url: str, base_log: Path, port: int, deadline_s: float) -> list[str]:
    from gpu_8b import MEM_FRACTION

    return [sys.executable, str(ROOT / "tools" / "serve_8b_twin.py"), "--work-dir", str(paths.work / f"serve-{draft}"),
            "--twin", str(paths.twin), "--draft", str(paths.draft[draft]), "--baseline-url", base_url,
            "--baseline-log", str(base_log), "--prompts", str(paths.prompts), "--num-prompts", str(args.num_prompts),
            "--max-new-tokens", "128", "--configs", config, "--mem-fraction-static", MEM_FRACTION,
            "--max-running-requests", str(MAX_RUNNING), "--port", str(port),
            "--out", str(paths.results / f"serve-{draft}.json"), "--mirror", str(paths.work / f"serve-{draft}.json"),
            "--deadline-s", str(max(0.0, deadline_s))]


def served_done(paths: Paths, draft: str, config: str) -> bool:
    p = paths.results / f"serve-{draft}.json"
    return p.exists() and "speedup" in json.loads(p.read_text()).get("configs", {}).get(config, {})


def is_done(name: str, paths: Paths, record: dict) -> bool:
    """A step is done when its outputs exist (or, for a measurement, its record says it ran clean)."""
    ran = record.get("steps", {}).get(name, {})
    if name == "ours":
        return (paths.draft["ours"] / "config.json").exists() and any((paths.features / "train").glob("shard-*.safetensors"))
    if name in ("ours_train", "sf_train"):
        return ran.get("rc") == 0
    if name == "convert":
        return (paths.sf / "run.yaml").exists()
    if name == "sf_export":
        return (paths.draft["specforge"] / "config.json").exists() and (paths.draft["specforge"] / "model.safetensors").exists()
    if name in ("check", "offline"):
        return all((paths.results / f"{name}-{d}.json").exists() for d in DRAFTS)
    if name == "serve":
        return all(served_done(paths, d, c) for c in record.get("flags", {}).get("configs", []) for d in DRAFTS)
    raise KeyError(name)


# ---------------------------------------------------------------------------------------------
# logs and GPU memory (no GPU needed; tested)

STEP_LINE = re.compile(r"^step (\d+): (\{.*\})\s*$")  # SpecForge training/assembly.py _logger: print(f"step {step}: {printable}")
EPOCH_LINE = re.compile(r"epoch (\d+): eval loss ([\d.]+), accept \[([^\]]*)\], tau_pred ([\d.]+)")  # our stages/train
RATE_LINE = re.compile(r"train: features (\w+): (\d+) training tokens at ([\d.]+) tokens/s")  # our stages/train


def literal_dict(text: str) -> dict | None:
    """A printed Python dict of floats and float lists; nan/inf as SpecForge's float() prints them."""
    try:
        return ast.literal_eval(re.sub(r"\b(nan|inf)\b", "None", text))
    except (ValueError, SyntaxError):
        return None


def parse_specforge(lines: list[tuple[float, str]]) -> dict:
    """(seconds since start, line) -> train windows and evals. Train lines carry acc_0.., loss and
    perf/* (controller.py _fit); eval lines eval/avg_acc (position-0 accuracy), eval/per_position_acc
    and eval/simulated_acc_len = a0 + a0*a1 + ... (eval/evaluator.py), so predicted tau = 1 + that."""
    train, evals = [], []
    for t, line in lines:
        m = STEP_LINE.match(line.strip())
        d = literal_dict(m[2]) if m else None
        if not d:
            continue
        if "eval/avg_acc" in d:
            sim = d.get("eval/simulated_acc_len")
            evals.append({"t_s": t, "step": int(m[1]), "acc_1": d["eval/avg_acc"], "loss": d.get("eval/avg_loss"),
                          "per_position_acc": d.get("eval/per_position_acc"), "tau_pred": None if sim is None else 1 + sim})
        elif "perf/global_samples_per_second" in d:
            train.append({"t_s": t, "step": int(m[1]), "acc_1": d.get("acc_0"), "loss": d.get("loss"),
                          "samples_per_s": d["perf/global_samples_per_second"], "step_time_s": d.get("perf/optimizer_step_time_s")})
    return {"train": train, "evals": evals}


def parse_ours(lines: list[tuple[float, str]]) -> dict:
    """Our train stage's epoch eval lines (accept[0] = step-1 top-1 accuracy, as SpecForge's
    eval/avg_acc) and its closing rate line (real tokens over optimizer-step time, no eval)."""
    evals, rate = [], {}
    for t, line in lines:
        if m := EPOCH_LINE.search(line):
            acc = [float(x) for x in m[3].split(",")]
            evals.append({"t_s": t, "epoch": int(m[1]), "acc_1": acc[0], "loss": float(m[2]), "per_position_acc": acc,
                          "tau_pred": float(m[4])})
        if m := RATE_LINE.search(line):
            rate = {"features": m[1], "train_tokens": int(m[2]), "tokens_per_s": float(m[3])}
    return {"evals": evals, **rate}


def time_to_acc(evals: list[dict], threshold: float) -> float | None:
    """Seconds since the trainer started at the first eval whose step-1 accuracy reaches threshold."""
    return next((e["t_s"] for e in evals if e["acc_1"] is not None and e["acc_1"] >= threshold), None)


def parse_compute_apps(text: str) -> dict[int, float]:
    """`nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits` -> {pid: MiB}."""
    out = {}
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit():
            try:
                out[int(parts[0])] = float(parts[1])
            except ValueError:
                pass  # "[N/A]" where the driver hides per-process memory
    return out


def descendants(pid: int) -> set[int]:
    """pid and every process below it (SpecForge may start workers through torchrun)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue
    seen, todo = set(), [pid]
    while todo:
        p = todo.pop()
        if p not in seen:
            seen.add(p)
            todo += children.get(p, [])
    return seen


def smi(query: str) -> str:
    try:
        return subprocess.run(["nvidia-smi", query, "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=10, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""


def run_watched(argv: list[str], cwd: Path, log: Path, env: dict | None = None, poll_s: float = 1.0) -> dict:
    """Run a trainer, keep its log, timestamp its lines, poll its GPU memory from outside:
    the process tree's own MiB where nvidia-smi shows pids of this namespace, else the GPU's
    used MiB minus what was used before it started."""
    log.parent.mkdir(parents=True, exist_ok=True)
    before = max([float(x) for x in smi("--query-gpu=memory.used").split()] or [0.0])
    peak = {"process_mib": None, "gpu_used_mib": before}
    lines: list[tuple[float, str]] = []
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
                            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    stop = threading.Event()

    def poll():
        while not stop.wait(poll_s):
            apps, tree = parse_compute_apps(smi("--query-compute-apps=pid,used_memory")), descendants(proc.pid)
            mine = sum(v for p, v in apps.items() if p in tree)
            if mine:
                peak["process_mib"] = max(peak["process_mib"] or 0.0, mine)
            used = [float(x) for x in smi("--query-gpu=memory.used").split()]
            if used:
                peak["gpu_used_mib"] = max(peak["gpu_used_mib"], max(used))

    watcher = threading.Thread(target=poll, daemon=True)
    watcher.start()
    with open(log, "w") as f:
        f.write("$ " + " ".join(argv) + "\n")
        for line in proc.stdout:  # tqdm's \r refreshes arrive as one long line; fine for the regexes
            f.write(line)
            f.flush()
            if line.startswith(("step ", "epoch ", "train:")) or "epoch " in line:
                lines.append((round(time.monotonic() - t0, 2), line.rstrip("\n")))
    rc = proc.wait()
    stop.set()
    watcher.join(timeout=5)
    return {"rc": rc, "wall_s": round(time.monotonic() - t0, 1), "lines": lines,
            "peak_process_mib": peak["process_mib"], "peak_gpu_delta_mib": round(peak["gpu_used_mib"] - before, 1),
            "gpu_used_before_mib": before}


def draft_flops_per_token(cfg: dict, ttt: int) -> float:
    """Training FLOPs per token of the draft alone (3 x forward: 2 per weight, x3 with backward):
    fc once, then per TTT step the layer (q/k/v read 2H) and the draft-vocab head. Attention
    scores over <= 512 positions and the target's frozen head (soft labels) are left out, the same
    for both trainers, so the MFU ratio is the tokens/s ratio."""
    H, I = cfg["hidden_size"], cfg["intermediate_size"]
    nh, nkv = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    hd = cfg.get("head_dim") or H // nh
    k = len((cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or [0, 0, 0])
    fc = k * cfg.get("target_hidden_size", H) * H
    layer = 2 * H * (nh + 2 * nkv) * hd + nh * hd * H + 3 * H * I
    head = cfg.get("draft_vocab_size", cfg["vocab_size"]) * H
    return 6.0 * (fc + ttt * (layer + head))


def train_figures(run: dict, parsed: dict, trainer: str, tokens_per_epoch: int | None, sequences: int | None, epochs: int) -> dict:
    """One trainer's throughput, memory and accuracy-over-time figures."""
    out = {"wall_s": run["wall_s"], "rc": run["rc"], "peak_memory_mib": run["peak_process_mib"] or run["peak_gpu_delta_mib"],
           "peak_memory_source": "process tree (nvidia-smi compute apps)" if run["peak_process_mib"] else "GPU used minus before",
           "evals": parsed["evals"]}
    if tokens_per_epoch:
        out["tokens_per_s_wall"] = round(tokens_per_epoch * epochs / run["wall_s"], 1)  # start-up and evals included
    if trainer == "ours":
        out["tokens_per_s"] = parsed.get("tokens_per_s")
        out["tokens_per_s_basis"] = "our train stage: real tokens over optimizer-step time"
    elif parsed["train"] and tokens_per_epoch and sequences:
        # SpecForge logs samples/s per window; a sample is one sequence of tokens_per_epoch / sequences tokens
        sps = statistics.median(w["samples_per_s"] for w in parsed["train"][1:] or parsed["train"])
        out["tokens_per_s"] = round(sps * tokens_per_epoch / sequences, 1)
        out["tokens_per_s_basis"] = "median perf/global_samples_per_second x mean real tokens per sequence"
        out["train_windows"] = parsed["train"]
    if out["evals"]:
        out["final_acc_1"], out["final_tau_pred"] = out["evals"][-1]["acc_1"], out["evals"][-1]["tau_pred"]
    return out


# ---------------------------------------------------------------------------------------------
# the run

class Run:
    def __init__(self, args):
        self.args, self.t0 = args, time.monotonic()
        self.paths = Paths(Path(args.work).resolve(), Path(args.results).resolve(), args.target)
        self.paths.results.mkdir(parents=True, exist_ok=True)
        p = self.paths.peers
        self.record = json.loads(p.read_text()) if p.exists() else {"steps": {}}
        self.skip = set(filter(None, args.skip.split(",")))
        self.size = getattr(args, "size", "full")

    def left(self) -> float:
        return self.args.deadline_s - (time.monotonic() - self.t0)

    def save(self) -> None:
        tmp = self.paths.peers.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.record, indent=1, default=str) + "\n")
        tmp.replace(self.paths.peers)

    def note(self, step: str, **what) -> None:
        self.record["steps"].setdefault(step, {}).update(what)
        self.save()
        print(f"[peers {time.monotonic() - self.t0:5.0f}s] {step}: { {k: v for k, v in what.items() if k != 'argv'} }", flush=True)

    def todo(self, step: str) -> bool:
        """Run this step? Not when skipped, done, or when it would not finish before the deadline."""
        if step in self.skip:
            return False
        if is_done(step, self.paths, self.record):
            print(f"[peers] {step}: done already", flush=True)
            return False
        need = expected(step, self.size)
        if self.left() < need:
            self.note(step, skipped=f"{need:.0f} s expected, {self.left():.0f} s left")
            return False
        return True

    def call(self, step: str, argv: list[str], cwd: Path = ROOT, log_name: str = "") -> int:
        log = self.paths.results / "logs" / f"{log_name or step}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        t = time.monotonic()
        with open(log, "w") as f:
            f.write("$ " + " ".join(argv) + "\n")
            f.flush()
            rc = subprocess.run(argv, cwd=cwd, stdout=f, stderr=subprocess.STDOUT, env=env_with_root(), check=False).returncode
        self.record["steps"].setdefault(step, {}).setdefault("calls", {})[log_name or step] = {
            "argv": argv, "rc": rc, "seconds": round(time.monotonic() - t, 1), "log": os.path.relpath(log, self.paths.results)}
        self.note(step, rc=rc)
        return rc


def env_with_root() -> dict:
    """Our stages run with the pipeline work dir as cwd; the project's packages come from here."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
            "PYTHONUNBUFFERED": "1"}


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ("specforge", "sglang", "torch", "transformers", "draftlab"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    out["gpu"] = smi("--query-gpu=name").strip() or None
    return out


def token_counts(paths: Paths) -> tuple[int | None, int | None]:
    """(real train tokens per epoch, train sequences) as written for SpecForge (cut at max_length)."""
    log = paths.results / "logs" / "convert.log"
    m = re.search(r"specforge_offline: (\d+) train and (\d+) eval tokens", log.read_text()) if log.exists() else None
    n = len(list((paths.sf / "hidden_states" / "train").glob("*.ckpt")))
    return (int(m[1]) if m else None), (n or None)


def pipeline_train_figures(paths: Paths, b: dict) -> dict | None:
    """Our trainer's figures from the pipeline's own train stage (the ours step), where ours_train
    has not run: the rate line and epoch evals of its log, its seconds from timings.json. The log
    has no per-line times: an epoch's eval time is the stage's seconds x epoch / epochs (start-up
    spread over the epochs). Peak memory is not measured (nobody watched the stage)."""
    log, timings = paths.pipeline_results / "logs" / "train.log", paths.pipeline_results / "timings.json"
    if not log.exists():
        return None
    seconds = json.loads(timings.read_text()).get("stage-train") if timings.exists() else None
    lines = log.read_text(errors="replace").replace("\r", "\n").splitlines()
    parsed = parse_ours([(0.0, line) for line in lines])
    for e in parsed["evals"]:
        e["t_s"] = round(seconds * e["epoch"] / b["epochs"], 1) if seconds else None
    tokens = parsed["train_tokens"] // b["epochs"] if parsed.get("train_tokens") else None
    fig = train_figures({"wall_s": seconds, "rc": 0, "peak_process_mib": None, "peak_gpu_delta_mib": None},
                        parsed, "ours", tokens if seconds else None, None, b["epochs"])
    fig["peak_memory_source"] = "not measured (the pipeline's train stage is not watched)"
    fig["source"] = ("the pipeline's train stage (ours step), not the ours_train run: tokens/s from its rate line, "
                     "eval times = the stage's seconds x epoch / epochs")
    add_mfu(paths, fig, b)
    return fig


def add_mfu(paths: Paths, fig: dict, b: dict) -> None:
    cfg = paths.draft["ours"] / "config.json"  # both drafts have this size (convert copies it)
    if cfg.exists() and fig.get("tokens_per_s"):
        flops = draft_flops_per_token(json.loads(cfg.read_text()), b["ttt_steps"])
        fig["mfu"] = round(fig["tokens_per_s"] * flops / H200_BF16_FLOPS, 4)
        fig["mfu_basis"] = f"draft FLOPs/token {flops:.3g} (draft_flops_per_token) over {H200_BF16_FLOPS:.3g} FLOP/s"


def watched_step(run: Run, step: str, trainer: str, argv: list[str], cwd: Path) -> None:
    b = run.record["flags"]["budget"]
    r = run_watched(argv, cwd, run.paths.results / "logs" / f"{step}.log", env=env_with_root())
    (run.paths.results / f"{step}-lines.json").write_text(json.dumps(r["lines"]))
    parsed = (parse_ours if trainer == "ours" else parse_specforge)(r["lines"])
    tokens, seqs = token_counts(run.paths)
    if trainer == "ours" and parsed.get("train_tokens"):
        tokens = parsed["train_tokens"] // b["epochs"]
    fig = train_figures(r, parsed, trainer, tokens, seqs, b["epochs"])
    fig["source"] = f"the {step} run, watched from outside"
    add_mfu(run.paths, fig, b)
    run.record.setdefault("train", {})[trainer] = fig
    run.note(step, argv=argv, rc=r["rc"], seconds=r["wall_s"])


def offline_main(argv=None) -> int:
    """`peers_h200.py offline-run --draft D --out J`, in the pipeline work dir: the bench stage's
    offline run (draftlab.cost_timing.offline_run, the flags and prompts of its params) on any draft."""
    ap = argparse.ArgumentParser(prog="peers_h200.py offline-run")
    ap.add_argument("--draft", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    import dataclasses

    from draftlab import bench_run, cost_timing
    from draftlab.params import load_params
    from draftlab.sglang.checkpoint import load_exported, read_exported
    from draftlab.target import load_target

    p = load_params(["target", "spec", "bench", "export"], "params.yaml")
    plan = bench_run.prepare(p.target, p.spec, p.bench, p.export.sglang_version, read_exported(a.draft), Path("data/prompts"))
    target, _ = load_target(plan.target_params, plan.device)
    embed = target.get_input_embeddings().weight
    draft, _ = load_exported(a.draft, embed=embed, dtype=embed.dtype, as_sglang=True)  # as SGLang serves it
    draft.to(plan.device)
    physical = plan.draft.served_physical(plan.target["architecture"], plan.target["num_layers"], plan.sglang_version)
    eos = {target.generation_config.eos_token_id, plan.tokenizer.eos_token_id} - {None}
    bp = plan.bench_params
    res = cost_timing.offline_run(target, draft, plan.prompt_ids[bp.warmup:], plan.flags, physical, bp.max_new_tokens, eos,
                                  bp.ignore_eos, with_baseline=False)
    res.pop("outputs", None)
    res.pop("baseline_step_s", None)
    Path(a.out).write_text(json.dumps({"flags": dataclasses.asdict(plan.flags), "physical_layers": physical, **res}, indent=1))
    print(f"offline run: tau {res['tau']:.3f} at {plan.flags.num_steps}-{plan.flags.topk}-{plan.flags.num_draft_tokens}")
    return 0


def gpu_8b_main(argv: list[str]) -> int:
    """`peers_h200.py gpu-8b PARAMS [--phases P] -- ARGS`: tools/gpu_8b.py with the peers' params
    (its CONFIG) in place of configs/gpu-8b.yaml, and tools/sglang_run.py's phases P in place of
    its pipeline,bench (the small size drops the bench stage)."""
    import gpu_8b

    sep = argv.index("--")
    head, rest = argv[:sep], argv[sep + 1:]
    gpu_8b.CONFIG = Path(head[0])
    phases = head[head.index("--phases") + 1] if "--phases" in head else "pipeline,bench"
    if phases != "pipeline,bench":
        call = gpu_8b.Run.call
        gpu_8b.Run.call = lambda self, step, a: call(self, step, [phases if x == "pipeline,bench" else x for x in a])
    return gpu_8b.main(rest)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["offline-run"]:
        return offline_main(argv[1:])
    if argv[:1] == ["gpu-8b"]:
        return gpu_8b_main(argv[1:])
    args = parse_args(argv)
    run = Run(args)
    paths, size = run.paths, run.size
    configs = [c for c in (args.configs or SIZES[size]["configs"]).split(",") if c]
    b = budget(paths, args.specforge_ttt_length, size)
    run.record.update(versions=versions(), flags={
        "size": size, "budget": b, "configs": configs, "num_prompts": args.num_prompts, "max_new_tokens": 128,
        "specforge_learning_rate": args.specforge_lr,
        "specforge_learning_rate_source": "SpecForge 0.2.0 TrainingConfig.learning_rate default (config/schema.py)",
        "specforge_overrides": SPECFORGE_OVERRIDES, "pipeline_params": peers_params(size)},
        sizes=sizes(paths, size, args))
    (paths.results / "params-peers.yaml").write_text(yaml.safe_dump(peers_params(size), sort_keys=False))
    run.save()
    for step in SIZES[size]["order"]:
        rc = STEP_RUNNERS[step](run, args, configs)
        if rc:
            return rc
        b = budget(paths, args.specforge_ttt_length, size)  # from the pipeline's own params.yaml once it exists
        run.record["flags"]["budget"] = b
        run.record["sizes"] = sizes(paths, size, args)
        if step == "ours" and "ours" not in run.record.get("train", {}) and (fig := pipeline_train_figures(paths, b)):
            run.record.setdefault("train", {})["ours"] = fig  # replaced by ours_train's if that runs later
        run.save()
    run.note("done", wall_s=round(time.monotonic() - run.t0, 1))
    return 0


def do_ours(run: Run, args, configs) -> int:
    paths = run.paths
    if run.todo("ours"):
        b = run.record["flags"]["budget"]
        rc = run.call("ours", step_argv("ours", paths, args, b) + ["--deadline-s", str(max(60, run.left() - ours_reserve(run.size)))])
        if rc or not is_done("ours", paths, run.record):
            feats = "online features hold no states: give a fresh --work" if (paths.features / "train" / "tokens.safetensors").exists() else ""
            run.note("ours", error=f"no offline features and draft ({feats or 'see logs/ours.log'})")
            return rc or 1
    return 0


def do_ours_train(run: Run, args, configs) -> int:
    if run.todo("ours_train"):
        paths = run.paths
        shutil.rmtree(paths.ours_train, ignore_errors=True)  # one uninterrupted measurement, never a resumed one
        watched_step(run, "ours_train", "ours", step_argv("ours_train", paths, args, run.record["flags"]["budget"]), paths.pipeline)
    return 0


def do_convert(run: Run, args, configs) -> int:
    paths = run.paths
    if run.todo("convert"):
        run.call("convert", step_argv("convert", paths, args, run.record["flags"]["budget"]))
    if (paths.sf / "run.yaml").exists():
        run.record["specforge_run_yaml"] = yaml.safe_load((paths.sf / "run.yaml").read_text())
    return 0


def do_sf_train(run: Run, args, configs) -> int:
    if run.todo("sf_train"):
        b = run.record["flags"]["budget"]
        run.call("sf_train", step_argv("sf_plan", run.paths, args, b), log_name="sf_plan")
        watched_step(run, "sf_train", "specforge", step_argv("sf_train", run.paths, args, b), ROOT)
    return 0


def do_sf_export(run: Run, args, configs) -> int:
    if run.todo("sf_export"):
        run.call("sf_export", step_argv("sf_export", run.paths, args, run.record["flags"]["budget"]))
    return 0


def per_draft(step: str):
    def do(run: Run, args, configs) -> int:
        paths = run.paths
        if run.todo(step):
            for d in DRAFTS:
                if (paths.draft[d] / "config.json").exists():
                    run.call(step, step_argv(step, paths, args, run.record["flags"]["budget"], d),
                             cwd=paths.pipeline if step == "offline" else ROOT, log_name=f"{step}-{d}")
        for d in DRAFTS:
            p = paths.results / f"{step}-{d}.json"
            if p.exists():
                run.record.setdefault(step, {})[d] = json.loads(p.read_text())
        return 0
    return do


def do_serve(run: Run, args, configs) -> int:
    if run.todo("serve"):
        serve_all(run, args, configs)
    return 0


STEP_RUNNERS = {"ours": do_ours, "ours_train": do_ours_train, "convert": do_convert, "sf_train": do_sf_train,
                "sf_export": do_sf_export, "check": per_draft("check"), "offline": per_draft("offline"), "serve": do_serve}
assert set(STEP_RUNNERS) == set(STEPS) and all(sorted(v["order"]) == sorted(STEPS) for v in SIZES.values())


def serve_todo(run: Run, configs: list[str]) -> list[tuple[str, str | None]]:
    """(config, draft) pairs to serve now, in order (drafts alternating by configuration, so that a
    drift over time does not favour one draft), or (config, None) for a configuration skipped for
    time: a configuration is served for both drafts or for neither, and the deadline cuts the last
    configurations first."""
    out, left, per = [], run.left(), EXPECT_S[run.size]["serve_config"]
    for i, config in enumerate(configs):
        todo = [d for d in (DRAFTS if i % 2 == 0 else DRAFTS[::-1])
                if not served_done(run.paths, d, config) and (run.paths.draft[d] / "config.json").exists()]
        if not todo:
            continue
        if left < per * len(todo):
            out.append((config, None))
            continue
        left -= per * len(todo)
        out += [(config, d) for d in todo]
    return out


def serve_all(run: Run, args, configs: list[str]) -> None:
    """One baseline server; per configuration, each draft beside it (order alternating by
    configuration, so that a drift over time does not favour one draft)."""
    from gpu_8b import MEM_FRACTION, SERVER_ARGS

    from draftlab.sglang.flags import SpecFlags
    from draftlab.sglang.launch import free_port, launch_argv, serve

    paths = run.paths
    flags = SpecFlags(algorithm=None, max_running_requests=MAX_RUNNING, attention_backend="triton")
    base_argv = launch_argv(str(paths.twin), free_port(), baseline=True, flags=flags, dtype="bfloat16",
                            extra_args=SERVER_ARGS + ["--mem-fraction-static", MEM_FRACTION])
    base_log = paths.results / "logs" / "server-baseline.log"
    run.record["flags"]["baseline_server_argv"] = base_argv
    with serve(base_argv, base_log, 600) as srv:
        for config, d in serve_todo(run, configs):  # planned once the baseline is up, with the time then left
            if d is None:
                cut = run.record["steps"].setdefault("serve", {}).setdefault("skipped_configs", [])
                cut += [config] if config not in cut else []
                run.note("serve", skipped=f"{config}: {run.left():.0f} s left, both drafts need "
                                          f"{EXPECT_S[run.size]['serve_config']} s each")
                continue
            if run.left() < EXPECT_S[run.size]["serve_config"]:  # slower than planned
                run.note("serve", skipped=f"{config} for {d}: {run.left():.0f} s left")
                continue
            run.call("serve", serve_argv(paths, args, d, config, srv.url, base_log, free_port(), run.left() - 10),
                     log_name=f"serve-{d}-{config}")
            collect_served(run)


def collect_served(run: Run) -> None:
    """The per-configuration figures of both drafts' serve JSON, into peers.json."""
    for d in DRAFTS:
        p = run.paths.results / f"serve-{d}.json"
        if not p.exists():
            continue
        got = json.loads(p.read_text())
        run.record.setdefault("served", {})[d] = {
            name: {k: c.get(k) for k in ("served_tau", "speedup", "greedy_identical", "skipped", "error")}
            | {"baseline_tokens_per_s": (c.get("baseline") or {}).get("tokens_per_s"),
               "spec_tokens_per_s": (c.get("spec") or {}).get("tokens_per_s")}
            for name, c in got.get("configs", {}).items()}
        run.record.setdefault("serve_method", got.get("method"))
    run.save()


if __name__ == "__main__":
    sys.exit(main())
