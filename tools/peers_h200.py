#!/usr/bin/env python3
"""This project's EAGLE-3 trainer against SpecForge's, on one GPU box: the same 8B-cost target,
data, capture layers and budget; both drafts served by the same SGLang, paired.

    python tools/peers_h200.py --work WORK --results RESULTS [--deadline-s 6000]
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

Everything lands in RESULTS/peers.json (rewritten atomically after every step): versions, every
flag and config key each trainer ran with, per-step argv, exit code and seconds, and the figures.
About 80 GPU minutes on one H200 from an empty disk (our offline training and SpecForge's ~12 min
each, the pipeline ~25, serving 4 configurations x 2 drafts ~16); less with --work reused.
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
# Expected seconds on one H200 (the deadline skips a step that would not fit). The pipeline with
# stored states: extract at ~2,800 tok/s, training at ~1.2 steps/s over 807 steps (reports/gpu-8b);
# SpecForge's offline trainer not yet timed here; a served configuration ~110 s per draft.
EXPECT_S = {"ours": 1800, "ours_train": 800, "convert": 300, "sf_train": 1200, "sf_export": 120, "check": 60,
            "offline": 150, "serve_start": 150, "serve_config": 120}
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
    ap.add_argument("--configs", default="3-1-4,5-1-6,6-8-32,5-4-8", help="served STEPS-TOPK-DRAFT_TOKENS, in order")
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
        self.peers = self.results / "peers.json"


def merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def peers_params() -> dict:
    """configs/gpu-8b.yaml with the states stored: SpecForge trains offline from them, and ours
    trains from the same files (online training would compute them and store none)."""
    gpu8b = yaml.safe_load((ROOT / "configs" / "gpu-8b.yaml").read_text())
    return merge(gpu8b, {"train": {"features": "offline", "checkpoint_every": 0}})


def budget(paths: Paths, ttt_override: int | None = None) -> dict:
    """The training budget both trainers get: from the pipeline's params.yaml once it exists."""
    p = paths.pipeline / "params.yaml"
    params = yaml.safe_load(p.read_text()) if p.exists() else merge(yaml.safe_load((ROOT / "params.yaml").read_text()), peers_params())
    t = params["train"]
    return {"epochs": t["epochs"], "batch_size": t["batch_size"], "max_length": t["max_length"],
            "ttt_steps": ttt_override or t["ttt_steps"], "our_lr": t["lr"], "features": t["features"]}


def step_argv(name: str, paths: Paths, args, b: dict, draft: str = "") -> list[str]:
    """The command of one step (or of one draft's part of it), as run."""
    py, sf = sys.executable, paths.sf
    if name == "ours":
        return [py, str(ROOT / "tools" / "peers_h200.py"), "gpu-8b", str(paths.results / "params-peers.yaml"), "--",
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
        if self.left() < EXPECT_S[step]:
            self.note(step, skipped=f"{EXPECT_S[step]} s expected, {self.left():.0f} s left")
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


def watched_step(run: Run, step: str, trainer: str, argv: list[str], cwd: Path) -> None:
    b = run.record["flags"]["budget"]
    r = run_watched(argv, cwd, run.paths.results / "logs" / f"{step}.log", env=env_with_root())
    (run.paths.results / f"{step}-lines.json").write_text(json.dumps(r["lines"]))
    parsed = (parse_ours if trainer == "ours" else parse_specforge)(r["lines"])
    tokens, seqs = token_counts(run.paths)
    if trainer == "ours" and parsed.get("train_tokens"):
        tokens = parsed["train_tokens"] // b["epochs"]
    fig = train_figures(r, parsed, trainer, tokens, seqs, b["epochs"])
    cfg = run.paths.draft["ours"] / "config.json"  # both drafts have this size (convert copies it)
    if cfg.exists() and fig.get("tokens_per_s"):
        flops = draft_flops_per_token(json.loads(cfg.read_text()), b["ttt_steps"])
        fig["mfu"] = round(fig["tokens_per_s"] * flops / H200_BF16_FLOPS, 4)
        fig["mfu_basis"] = f"draft FLOPs/token {flops:.3g} (draft_flops_per_token) over {H200_BF16_FLOPS:.3g} FLOP/s"
    run.record.setdefault("train", {})[trainer] = fig
    run.note(step, argv=argv, rc=r["rc"], seconds=r["wall_s"])


def offline_main(argv=None) -> int:
    """`peers_h200.py offline-run --draft D --out J`, in the pipeline work dir: the bench stage's
    offline run (draftlab.advice.offline_run, the flags and prompts of its params) on any draft."""
    ap = argparse.ArgumentParser(prog="peers_h200.py offline-run")
    ap.add_argument("--draft", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    import dataclasses

    from draftlab import advice, bench_run
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
    res = advice.offline_run(target, draft, plan.prompt_ids[bp.warmup:], plan.flags, physical, bp.max_new_tokens, eos,
                             bp.ignore_eos, with_baseline=False)
    res.pop("outputs", None)
    res.pop("baseline_step_s", None)
    Path(a.out).write_text(json.dumps({"flags": dataclasses.asdict(plan.flags), "physical_layers": physical, **res}, indent=1))
    print(f"offline run: tau {res['tau']:.3f} at {plan.flags.num_steps}-{plan.flags.topk}-{plan.flags.num_draft_tokens}")
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["offline-run"]:
        return offline_main(argv[1:])
    if argv[:1] == ["gpu-8b"]:  # gpu_8b.py with the peers' params (its CONFIG) in place of configs/gpu-8b.yaml
        import gpu_8b

        gpu_8b.CONFIG = Path(argv[1])
        return gpu_8b.main(argv[3:])
    args = parse_args(argv)
    run = Run(args)
    paths = run.paths
    configs = [c for c in args.configs.split(",") if c]
    b = budget(paths, args.specforge_ttt_length)
    run.record.update(versions=versions(), flags={
        "budget": b, "configs": configs, "num_prompts": args.num_prompts, "max_new_tokens": 128,
        "specforge_learning_rate": args.specforge_lr,
        "specforge_learning_rate_source": "SpecForge 0.2.0 TrainingConfig.learning_rate default (config/schema.py)",
        "specforge_overrides": SPECFORGE_OVERRIDES, "pipeline_params": peers_params()})
    (paths.results / "params-peers.yaml").write_text(yaml.safe_dump(peers_params(), sort_keys=False))
    run.save()

    if run.todo("ours"):
        rc = run.call("ours", step_argv("ours", paths, args, b) + ["--deadline-s", str(max(60, run.left() - 1200))])
        if rc or not is_done("ours", paths, run.record):
            feats = "online features hold no states: give a fresh --work" if (paths.features / "train" / "tokens.safetensors").exists() else ""
            run.note("ours", error=f"no offline features and draft ({feats or 'see logs/ours.log'})")
            return rc or 1
    b = budget(paths, args.specforge_ttt_length)  # now from the pipeline's own params.yaml
    run.record["flags"]["budget"] = b
    if run.todo("ours_train"):
        shutil.rmtree(paths.ours_train, ignore_errors=True)  # one uninterrupted measurement, never a resumed one
        watched_step(run, "ours_train", "ours", step_argv("ours_train", paths, args, b), paths.pipeline)
    if run.todo("convert"):
        run.call("convert", step_argv("convert", paths, args, b))
    if (paths.sf / "run.yaml").exists():
        run.record["specforge_run_yaml"] = yaml.safe_load((paths.sf / "run.yaml").read_text())
    if run.todo("sf_train"):
        run.call("sf_train", step_argv("sf_plan", paths, args, b), log_name="sf_plan")
        watched_step(run, "sf_train", "specforge", step_argv("sf_train", paths, args, b), ROOT)
    if run.todo("sf_export"):
        run.call("sf_export", step_argv("sf_export", paths, args, b))
    for step in ("check", "offline"):
        if run.todo(step):
            for d in DRAFTS:
                if (paths.draft[d] / "config.json").exists():
                    run.call(step, step_argv(step, paths, args, b, d), cwd=paths.pipeline if step == "offline" else ROOT,
                             log_name=f"{step}-{d}")
    for d in DRAFTS:
        for step in ("check", "offline"):
            p = paths.results / f"{step}-{d}.json"
            if p.exists():
                run.record.setdefault(step, {})[d] = json.loads(p.read_text())
    run.save()
    if run.todo("serve"):
        serve_all(run, args, configs)
    run.note("done", wall_s=round(time.monotonic() - run.t0, 1))
    return 0


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
        for i, config in enumerate(configs):
            for d in (DRAFTS if i % 2 == 0 else DRAFTS[::-1]):
                if served_done(paths, d, config) or not (paths.draft[d] / "config.json").exists():
                    continue
                if run.left() < EXPECT_S["serve_config"]:
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
