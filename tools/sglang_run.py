#!/usr/bin/env python3
"""The pipeline's draft served by a real SGLang: bench, live parity, fault rehearsal, chain sweep.

Run it on a GPU machine where `pip install -e '.[gpu]'` installed SGLang (README.md, "SGLang on a
GPU machine", has the runbook, an offline install included), from the repository root:

    python tools/sglang_run.py --results runs/sglang                 # every phase, the default target
    python tools/sglang_run.py --results runs/sglang --phases sweep --steps 1,3,5,7
    python tools/sglang_run.py --results runs/sglang --target /models/my-llama --params my-overrides.yaml
    python tools/sglang_run.py --backend reference --quick --results runs/dry   # the same flow on a CPU

Every launch, request and check is the project's own code (the stages in dvc.yaml, the bench
stage's launch argv and measurement, draftlab.sglang's client and log parser, the check stage).
Phases, in order (--phases picks some):
  pipeline   dvc.yaml's stages prompts..export in the work dir (--work), whose params.yaml is the
             project's plus the GPU overrides below and --params: the draft the pipeline trains and exports
  bench      the bench stage, backend sglang: a baseline and an EAGLE3 server from launch_argv, side by side
  parity     an EAGLE3 server with --enable-return-hidden-states; the check stage with check.server_url
  faults     per fault of draftlab.faults: the miswired draft or flags served, a few requests
             (SGLang's symptom), the bench stage (backend url) and the check stage against it
  sweep      num_steps 1..7 (chain, CUDA graphs), each against a baseline server kept up alongside
  reference  the bench stage with the project's reference server on the same GPU, prompts and draft
Each phase writes under --results and leaves a done marker there: a re-run skips what is done
(it resumes after an interruption). With --time-limit-s it also stops before a unit of work that
would not fit in the time left (from the durations recorded in timings.json), so that a run can be
split over jobs of limited length; run the same command again to go on.

Outputs under --results: versions.json, timings.json, logs/ (one per stage run), the work dir's
reports/ (bench.json, check.json, bench/ with the server logs; reports/bench-reference/),
hidden_states_response.json (one raw /generate answer with hidden states), faults/<name>/summary.json
(and the fault's server.log and work/reports/), sweep/<num_steps>.json, sweep.csv, sweep.png.
--pack FILE.tar.gz writes all of it, without data or weights, after each phase.

Length: over 400 lines because the phases share one driver (results layout, done markers,
timings, server lifecycle); each phase is one method.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shlex
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from draftlab import jsonl, lifecycle  # noqa: E402
from draftlab.bench import measure, render_prompts, spec_figures, start  # noqa: E402  (the bench stage's own)
from draftlab.errors import UserError  # noqa: E402
from draftlab.faults import FAULTS, miswire  # noqa: E402
from draftlab.params import load_params  # noqa: E402
from draftlab.sglang.client import Client, flags_from_server_info  # noqa: E402
from draftlab.sglang.launch import read_log  # noqa: E402
from draftlab.sglang.launch import free_port as sglang_free_port  # noqa: E402
from draftlab.sglang.flags import SpecFlags, requested_from_params, resolve  # noqa: E402
from draftlab.target import load_tokenizer  # noqa: E402

PIPELINE = ["prompts", "synthesize", "extract", "standardize", "train", "export"]
SWEEP_STEPS = [1, 2, 3, 4, 5, 6, 7]

# The GPU overrides: everything in bf16 (what SGLang serves); triton attention, pytorch sampling and
# no grammar backend (no FlashAttention-3 or other optional kernels needed); CUDA-graph batch sizes
# and the KV pool kept small, so that a server of the tiny target starts in under a minute and two
# fit on one GPU. For a larger target, change them with --params.
SGLANG_PARAMS = {
    "target": {"dtype": "bfloat16"},
    "bench": {"backend": "sglang", "side_by_side": True, "dtype": "bfloat16", "attention_backend": "triton", "max_running_requests": 8,
              "extra_server_args": ["--sampling-backend", "pytorch", "--grammar-backend", "none",
                                    "--mem-fraction-static", "0.3", "--cuda-graph-max-bs", "8"],
              # Every start took 53-66 s on the H200 (2026-11-29): a server not up in 3 minutes is
              # not coming, and a request of 128 tokens takes under a second; fail early, not late.
              "startup_timeout_s": 180.0, "request_timeout_s": 90.0},
    "check": {"fail_on_error": False},
}
REFERENCE_PARAMS = {"bench": {"backend": "reference"}, "check": {"fail_on_error": False}}
# --quick: a small run that exercises every phase in minutes on a CPU
QUICK_PARAMS = {"prompts": {"num_prompts": 48, "eval_fraction": 0.25}, "synth": {"max_new_tokens": 96},
                "train": {"epochs": 1}, "bench": {"num_prompts": 3, "max_new_tokens": 24, "warmup": 1},
                "check": {"live_parity_samples": 2}}
FAULT_PROMPTS = 8  # bench prompts per fault: the symptom, not a speed figure


def merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


class Driver:
    def __init__(self, args):
        self.args = args
        self.results = Path(args.results).resolve()
        self.work = Path(args.work).resolve() if args.work else self.results / "work"
        self.logs = self.results / "logs"
        self.deadline = time.monotonic() + args.time_limit_s
        self.sglang = args.backend == "sglang"
        self.steps = [int(x) for x in getattr(args, "steps", "").split(",") if x] or SWEEP_STEPS
        # The target: a local model directory, linked into each work dir as models/<its name> (not the draft's).
        self.target = Path(args.target).resolve() if args.target else ROOT / "models" / "tiny-target"
        if not (self.target / "config.json").exists():
            raise UserError(f"--target {args.target}: no config.json there (a local model directory is needed)")
        self.overrides = merge(SGLANG_PARAMS if self.sglang else REFERENCE_PARAMS, QUICK_PARAMS if args.quick else {})
        self.target_link = self.target.name if self.target.name not in ("draft", "draft-ckpt") else f"target-{self.target.name}"
        self.overrides = merge(self.overrides, {"target": {"model": f"models/{self.target_link}"}})
        if args.params:  # the user's overrides, last
            self.overrides = merge(self.overrides, yaml.safe_load(Path(args.params).read_text()) or {})
        if self.sglang:  # the bench stage's baseline SGLang listens on bench.port: one that is free here
            self.overrides = merge(self.overrides, {"bench": {"port": sglang_free_port()}})
        self.timings_path = self.results / "timings.json"
        self.timings = json.loads(self.timings_path.read_text()) if self.timings_path.exists() else {}
        self._prompts = None
        # Every stage and server this run starts inherits these.
        os.environ.update(PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
                          PYTHONUNBUFFERED="1", NCCL_NVLS_ENABLE="0")

    # --- bookkeeping ------------------------------------------------------------------------

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def fits(self, unit: str, default_s: float) -> bool:
        need = self.timings.get(unit, default_s)
        if self.left() < need:
            print(f"[sglang_run] {unit}: {need:.0f} s expected, {self.left():.0f} s left: stopping here; "
                  "run the same command again to go on", flush=True)
            return False
        return True

    def took(self, unit: str, seconds: float) -> None:
        self.timings[unit] = round(seconds, 1)
        self.timings_path.write_text(json.dumps(self.timings, indent=1))

    def done(self, name: str) -> bool:
        return (self.results / "done" / name).exists()

    def mark(self, name: str) -> None:
        (self.results / "done").mkdir(parents=True, exist_ok=True)
        (self.results / "done" / name).write_text(time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))

    def write_params(self, work: Path, extra: dict | None = None) -> dict:
        base = yaml.safe_load((ROOT / "params.yaml").read_text())
        p = merge(merge(base, self.overrides), extra or {})
        work.mkdir(parents=True, exist_ok=True)
        (work / "params.yaml").write_text(yaml.safe_dump(p, sort_keys=False))
        return p

    def run(self, argv: list[str], cwd: Path, log_name: str) -> None:
        """A stage (or any project command) in `cwd`, output to logs/<log_name>.log; raises on failure."""
        self.logs.mkdir(parents=True, exist_ok=True)
        log = self.logs / f"{log_name}.log"
        t0 = time.monotonic()
        with open(log, "w") as f:
            shown = ["python" if a == sys.executable else a for a in argv]
            f.write("$ " + shlex.join(shown) + f"\n# cwd {os.path.relpath(cwd, self.results)} (of the results directory)\n")
            f.flush()
            rc = subprocess.run(argv, cwd=cwd, stdout=f, stderr=subprocess.STDOUT).returncode
        print(f"[sglang_run] {log_name}: rc {rc} in {time.monotonic() - t0:.0f} s", flush=True)
        if rc != 0:
            raise UserError(f"{log_name} failed (rc {rc}); last lines of {log}:\n{lifecycle.log_tail(log, 25)}")

    def stage(self, name: str, cwd: Path, log_name: str | None = None, replace: dict | None = None) -> None:
        cmd = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"][name]["cmd"]
        for old, new in (replace or {}).items():
            cmd = cmd.replace(old, new)
        argv = shlex.split(cmd)
        argv[0] = sys.executable if argv[0] == "python" else argv[0]
        self.run(argv, cwd, log_name or name)

    def link_target(self, work: Path) -> None:
        link = work / "models" / self.target_link
        link.parent.mkdir(parents=True, exist_ok=True)
        if not link.exists():
            link.symlink_to(self.target)

    # --- servers ------------------------------------------------------------------------------

    def params(self, work: Path):
        return load_params(["target", "spec", "bench", "export"], work / "params.yaml")

    def flags_for(self, p, **spec) -> tuple[SpecFlags, object]:
        """(flags the project would launch with, the Resolution) for params `p` with spec changes."""
        sp = dataclasses.replace(p.spec, **spec)
        config = json.loads((self.work / "models/draft/config.json").read_text())
        target_arch = json.loads((self.work / p.target.model / "config.json").read_text())["architectures"][0]
        res = resolve(requested_from_params(sp, p.bench), target_arch, p.export.sglang_version,
                      draft_architecture=config["architectures"][0], draft_context_length=config.get("max_position_embeddings"),
                      target_context_length=config.get("max_position_embeddings"), max_concurrency=max(p.bench.concurrency),
                      extra_server_args=p.bench.extra_server_args)
        return res.effective, res

    def server(self, p, draft: Path | None, flags: SpecFlags, log: Path, hidden: bool = False):
        """A started server (context manager yielding its URL), launched as the bench stage launches
        one: SGLang, or the reference server. draft None = a baseline server; `flags` still gives
        it the server-wide settings."""
        # Paths relative to this process's directory, which the server inherits (its logs then name no absolute path).
        tp = dataclasses.replace(p.target, model=os.path.relpath(self.work / p.target.model))
        draft = Path(os.path.relpath(draft)) if draft is not None else None
        port = sglang_free_port() if self.sglang else lifecycle.free_port()
        cm = start("sglang" if self.sglang else "reference", p.bench, tp, draft, flags, p.export.sglang_version, log,
                   speculative=draft is not None, hidden=hidden, port=port)
        return _Started(cm, self, log.stem)

    def prompts(self, n: int | None = None) -> list[list[int]]:
        """The first `n` eval prompts as token ids (the tokenizer is loaded once per run)."""
        if self._prompts is None:
            rows = [r for _, r in jsonl.read(self.work / "data/prompts/eval.jsonl", "re-run the prompts stage")]
            self._prompts = render_prompts(load_tokenizer(str(self.target)), rows)
        return self._prompts[:n]

    # --- phases -------------------------------------------------------------------------------

    def phase_pipeline(self) -> bool:
        self.write_params(self.work)
        self.link_target(self.work)
        for name in PIPELINE:
            if self.done(f"pipeline-{name}"):
                continue
            if not self.fits(f"stage-{name}", 90):
                return False
            t0 = time.monotonic()
            self.stage(name, self.work)
            self.took(f"stage-{name}", time.monotonic() - t0)
            self.mark(f"pipeline-{name}")
        return True

    def phase_bench(self) -> bool:
        if not self.fits("bench", 300):
            return False
        t0 = time.monotonic()
        self.write_params(self.work)
        self.stage("bench", self.work)
        self.took("bench", time.monotonic() - t0)
        return True

    def phase_parity(self) -> bool:
        if not self.fits("parity", 150):
            return False
        t0 = time.monotonic()
        p = self.params(self.work)
        flags, _ = self.flags_for(p)
        with self.server(p, self.work / "models/draft", flags, self.logs / "server-parity.log", hidden=True) as url:
            self.write_params(self.work, {"check": {"server_url": url}})
            try:
                self.stage("check", self.work)
                self.save_hidden_sample(url)
            finally:
                self.write_params(self.work)
        self.took("parity", time.monotonic() - t0)
        return True

    def save_hidden_sample(self, url: str) -> None:
        """One raw /generate answer with hidden states (a short prompt), kept as a parser fixture."""
        prompt = self.prompts(1)[0][:12]
        with Client(url, 120) as c:
            _, meta = c.generate(prompt, {"max_new_tokens": 2, "temperature": 0}, return_hidden_states=True)
        (self.results / "hidden_states_response.json").write_text(json.dumps({"input_ids": prompt, "response": {"meta_info": meta.raw}}))

    def phase_faults(self) -> bool:
        chosen = self.args.faults.split(",") if self.args.faults else list(FAULTS)
        unknown = sorted(set(chosen) - set(FAULTS))
        if unknown:
            raise UserError(f"--faults: unknown {', '.join(unknown)}; known: {', '.join(FAULTS)}")
        for fault in (FAULTS[name] for name in chosen):
            if self.done(f"fault-{fault.name}"):
                continue
            if not self.fits("fault", 120):
                return False
            t0 = time.monotonic()
            self.rehearse(fault)
            self.took("fault", time.monotonic() - t0)
            self.mark(f"fault-{fault.name}")
        return True

    def rehearse(self, fault) -> None:
        fdir = self.results / "faults" / fault.name
        fwork = fdir / "work"
        p = self.params(self.work)
        draft = miswire(self.work / "models/draft", fwork / "models/draft", fault)
        for sub in ("data", "reports/train"):
            link = fwork / sub
            link.parent.mkdir(parents=True, exist_ok=True)
            if not link.exists():
                link.symlink_to(self.work / sub)
        self.link_target(fwork)
        effective, res = self.flags_for(p, **{k: v for k, v in fault.spec.items() if k != "on_adjust"})
        flags = res.requested if fault.force_requested else effective
        log = fdir / "server.log"
        record = {"fault": fault.name, "what": fault.what, "launched_flags": dataclasses.asdict(flags), "expect": list(fault.expect)}
        prompts = self.prompts(FAULT_PROMPTS)
        t0 = time.monotonic()
        try:
            with self.server(p, draft, flags, log, hidden=True) as url:
                record.update(started=True, startup_s=round(time.monotonic() - t0, 1))
                with Client(url, p.bench.request_timeout_s) as c:
                    info = c.server_info()
                    metas = [c.generate(x, {"max_new_tokens": p.bench.max_new_tokens, "temperature": 0})[1] for x in prompts]
                record["server_flags"] = dataclasses.asdict(flags_from_server_info(info))
                record["served"] = {k: v for k, v in spec_figures(metas).items() if k in ("tau", "accept_rate", "acceptance", "accept_hist")}
                record["meta_info_sample"] = metas[0].raw
                self.write_params(fwork, {"spec": fault.spec, "bench": {"backend": "url", "url": url, "server_log": os.path.relpath(log, fwork),
                                                                       "num_prompts": FAULT_PROMPTS},
                                          "check": {"server_url": url}})
                try:
                    self.stage("bench", fwork, f"fault-{fault.name}-bench")
                    record["bench"] = "ok"
                except UserError as e:
                    record["bench"] = f"failed: {str(e).splitlines()[-1]}"
                self.check(fwork, fault, record)
        except UserError as e:
            if record.get("started"):  # it ran, then a request failed
                record["error"] = str(e)[-3000:]
            else:
                record.update(started=False, startup_error=str(e)[-3000:])
                # What the bench stage itself would have said before launching these flags.
                record["project_rules"] = [str(f) for f in res.errors + res.adjustments]
                self.write_params(fwork, {"spec": fault.spec, "check": {"server_url": ""}})
                self.check(fwork, fault, record)
        if log.exists():
            parsed = read_log(log)
            record["log_accept_len"] = [d.accept_len for d in parsed.decode if d.accept_len is not None]
            record["log_adjustments"] = [dataclasses.asdict(a) for a in parsed.adjustments]
            record["log_algorithm_lines"] = [ln.strip()[:300] for ln in log.read_text(errors="replace").splitlines()
                                             if "speculative_algorithm" in ln][:2]
        (fdir / "summary.json").write_text(json.dumps(record, indent=1, default=str))
        print(f"[sglang_run] fault {fault.name}: named={record.get('named')} served tau={record.get('served', {}).get('tau')}", flush=True)

    def check(self, fwork: Path, fault, record: dict) -> None:
        try:
            self.stage("check", fwork, f"fault-{fault.name}-check")
        except UserError as e:
            record["check"] = f"failed: {str(e).splitlines()[-1]}"
            return
        wiring = json.loads((fwork / "reports/check.json").read_text())
        found = [{"name": f["name"], "severity": f["severity"]} for f in wiring["findings"] if f["severity"] != "ok-info"]
        record["findings"] = found
        record["named"] = any(f["name"] in fault.expect for f in found)

    def phase_sweep(self) -> bool:
        """Each chain length against a baseline server that stays up alongside: requests alternate
        between the two, so every point's speedup is a paired ratio (the machine's load drifts)."""
        p = self.params(self.work)
        prompts = self.prompts(p.bench.num_prompts + p.bench.warmup)
        sampling = {"max_new_tokens": p.bench.max_new_tokens, "temperature": 0.0, "ignore_eos": p.bench.ignore_eos}

        out = self.results / "sweep"
        out.mkdir(parents=True, exist_ok=True)
        todo = [s for s in self.steps if not self.done(f"sweep-{s}")]
        if not todo or not self.fits("sweep-point", 90):
            return not todo
        with self.server(p, None, self.flags_for(p)[0], out / "server-baseline.log") as base_url:
            for point in todo:
                if not self.fits("sweep-point", 90):
                    return False
                t0 = time.monotonic()
                flags = self.flags_for(p, num_steps=point)[0]
                with self.server(p, self.work / "models/draft", flags, out / f"server-{point}.log") as url:
                    startup = time.monotonic() - t0
                    got = measure({"baseline": base_url, "speculative": url}, p.bench, prompts, sampling, p.bench.warmup)
                spec, base = got["speculative"], got["baseline"]
                fig = {"point": point, "flags": dataclasses.asdict(flags), "startup_s": round(startup, 1),
                       "tokens_per_s": spec["speed"]["median"], "baseline_tokens_per_s": base["speed"]["median"],
                       "speedup": spec["speed"]["median"] / base["speed"]["median"], "speed": spec["speed"],
                       "baseline_speed": base["speed"], "spec": spec["spec"] or None,
                       "log_graph": [d.graph for d in read_log(out / f"server-{point}.log").decode][:3]}
                (out / f"{point}.json").write_text(json.dumps(fig, indent=1))
                self.took("sweep-point", time.monotonic() - t0)
                self.mark(f"sweep-{point}")
                self.write_sweep(out)
        return True

    def write_sweep(self, out: Path) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        points = {f.stem: json.loads(f.read_text()) for f in out.glob("*.json")}
        base = points.get("baseline", {}).get("tokens_per_s")  # an unpaired baseline point (results of an earlier version of this tool)
        lines = ["num_steps,tau,tokens_per_s,speedup"]
        xs, taus, speedups = [], [], []
        for s in SWEEP_STEPS:
            f = points.get(str(s))
            if not f:
                continue
            tau = (f["spec"] or {}).get("tau")
            sp = f.get("speedup") or (f["tokens_per_s"] / base if base else None)
            lines.append(f"{s},{tau},{f['tokens_per_s']:.2f},{'' if sp is None else f'{sp:.3f}'}")
            xs.append(s), taus.append(tau), speedups.append(sp)
        (out / "sweep.csv").write_text("\n".join(lines) + "\n")
        if not xs:
            return
        fig, ax = plt.subplots(1, 2, figsize=(10, 3.6))
        ax[0].plot(xs, taus, "o-", label="served (SGLang meta_info)" if self.sglang else "served")
        train = self.work / "reports/train/metrics.json"
        if train.exists():  # what training predicted for each chain length it unrolled
            by = {int(k.split("_")[-1]): v for k, v in (json.loads(train.read_text()).get("tau_by_steps") or {}).items()}
            ax[0].plot(sorted(by), [by[k] for k in sorted(by)], "s--", label="train-predicted")
            ax[0].legend()
        ax[0].set(title="accept length tau", xlabel="num_steps (chain)", ylabel="tokens per verify")
        if any(x is not None for x in speedups):
            ax[1].plot(xs, speedups, "o-")
            ax[1].axhline(1.0, color="grey", lw=0.8)
        paired = "baseline" not in points
        ax[1].set(title="speedup vs a baseline served alongside (paired)" if paired else
                  f"speedup vs the no-speculation baseline ({base or float('nan'):.0f} tok/s)", xlabel="num_steps (chain)")
        fig.tight_layout()
        fig.savefig(out / "sweep.png", dpi=110)
        plt.close(fig)

    def phase_reference(self) -> bool:
        if not self.sglang:
            return True  # the bench phase already ran the reference backend
        if not self.fits("reference", 150):
            return False
        t0 = time.monotonic()
        self.write_params(self.work, {"bench": {"backend": "reference"}})
        try:
            self.stage("bench", self.work, "bench-reference", replace={"reports/bench": "reports/bench-reference"})
        finally:
            self.write_params(self.work)
        self.took("reference", time.monotonic() - t0)
        return True

    # --- results ------------------------------------------------------------------------------

    def pack(self) -> None:
        if not self.args.pack:
            return
        skip = {"data", "models", ".dvc", "__pycache__"}

        def keep(info: tarfile.TarInfo):
            parts = Path(info.name).parts
            if any(x in skip for x in parts) or info.name.endswith((".safetensors", ".pt")):
                return None
            return info

        dest = Path(self.args.pack)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_suffix(".tmp")
        with tarfile.open(tmp, "w:gz") as tar:
            tar.add(self.results, arcname=self.results.name, filter=keep)
            if not self.work.is_relative_to(self.results):  # a --work elsewhere: its reports and params go too
                tar.add(self.work, arcname=f"{self.results.name}/work", filter=keep)
        os.replace(tmp, dest)
        print(f"[sglang_run] packed {dest} ({dest.stat().st_size / 1e6:.1f} MB)", flush=True)


class _Started:
    """serve() context that yields the URL and records the start-up time."""

    def __init__(self, cm, driver: Driver, name: str):
        self.cm, self.driver, self.name = cm, driver, name

    def __enter__(self):
        t0 = time.monotonic()
        url = self.cm.__enter__()
        self.driver.took(f"startup-{self.name}", time.monotonic() - t0)
        return url

    def __exit__(self, *exc):
        return self.cm.__exit__(*exc)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", required=True, help="results directory (phase markers, logs, figures); re-use it to resume")
    ap.add_argument("--work", default="", help="where the pipeline runs: params.yaml, data/, models/, reports/ (default: RESULTS/work)")
    ap.add_argument("--target", default="", help="the target model, a local directory (default: the repository's models/tiny-target)")
    ap.add_argument("--params", default="", help="a YAML file of params merged over this tool's GPU overrides (e.g. bench.extra_server_args)")
    ap.add_argument("--backend", choices=["sglang", "reference"], default="sglang",
                    help="reference: the project's reference server instead of SGLang (the same flow without a GPU)")
    ap.add_argument("--time-limit-s", type=float, default=float("inf"),
                    help="seconds: stop before a unit of work that would end later than this (re-run to go on)")
    ap.add_argument("--quick", action="store_true", help="small sizes: the whole flow in minutes on a CPU")
    ap.add_argument("--phases", default="pipeline,bench,parity,faults,sweep,reference")
    ap.add_argument("--steps", default=",".join(map(str, SWEEP_STEPS)), help="sweep: the chain lengths (num_steps)")
    ap.add_argument("--faults", default="", help="comma-separated names from draftlab.faults (default: all)")
    ap.add_argument("--pack", default="", help="write the results (no data, no weights) to this .tar.gz after each phase")
    args = ap.parse_args()
    try:
        s = Driver(args)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    s.results.mkdir(parents=True, exist_ok=True)
    if s.sglang:
        try:
            import sglang
            import torch
            import transformers

            versions = {"sglang": sglang.__version__, "torch": torch.__version__, "transformers": transformers.__version__,
                        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
        except Exception as e:  # the servers' own logs will say more
            versions = {"error": f"{type(e).__name__}: {e}"}
        (s.results / "versions.json").write_text(json.dumps({**versions, "python": sys.version.split()[0]}))
        print(f"[sglang_run] {versions}", flush=True)
    if (s.work / "params.yaml").exists():
        s.write_params(s.work)  # this code's params (a key added since an earlier run included)
    status = 0
    for phase in args.phases.split(","):
        if s.done(phase) and phase not in ("faults", "sweep"):  # those two keep a marker per fault / point
            continue
        try:
            finished = getattr(s, f"phase_{phase}")()
        except UserError as e:
            print(f"[sglang_run] {phase} failed: {e}", flush=True)
            (s.results / f"{phase}.error.txt").write_text(str(e))
            status = 1
            finished = phase not in ("pipeline",)  # nothing else runs without the pipeline
            if not finished:
                s.pack()
                return status
        if not finished:
            break
        s.mark(phase)
        s.pack()
    s.pack()
    return status


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
