#!/usr/bin/env python3
"""Which physical layers real SGLang feeds an EAGLE-3 draft, family by family, with live parity.

    python tools/families_h200.py --results runs/families --deadline-s 1500
    python tools/families_report.py runs/families/families.json reports/families

Run on a GPU box with SGLang installed (README.md, "SGLang on a GPU machine"), from the
repository root. For each family (--families; default Llama, Qwen3 dense, Qwen3-MoE,
DeepSeek-V3, Kimi-K2.5, gpt-oss) it builds a tiny random target (tools/micro_targets.py) and,
per capture layout (LAYOUTS):
 1. plan     the project's own rules (draftlab.sglang.layers) for that layout, architecture and
             the installed SGLang: a layout they refuse (the embedding output where that release
             crashes on it) is recorded with the refusal, and decoder layer 0's output is tried
             in its place (FALLBACK)
 2. pipeline dvc.yaml's stages prompts .. export on the CPU (tools/sglang_run.py, phase
             pipeline) with small sizes (ROW_PARAMS): ~1 minute per row; rows run --jobs at a time
 3. parity   an EAGLE3 server of the target and the exported draft with
             --enable-return-hidden-states, then the check stage with live parity against it
             (tools/sglang_run.py, phase parity): which target layer each slot SGLang feeds
             really is, and its relative error against the training features
 4. probe    a refused layout is served anyway, once its fallback row has a draft: that draft with
             the ids the refused layout would get, so the server itself shows the refusal's reason
             (a crash confirms it; a served answer means the rule is stricter than the release)
Server start-up is the cost: the servers run without CUDA graphs (--disable-cuda-graph) and
with --mem-fraction-static 0.15, so a row takes about 40 s of GPU time and all of them fit in
about 8-10 minutes; the results say so (settings.server_args).

RESULTS/families.json is rewritten (atomically) after every row: per row the ids exported, the
physical layers the rules predict, the physical layers SGLang fed (live parity), the relative
errors, the server's first error lines when it failed (and RESULTS/rows/<row>/server-tail.log),
versions and seconds. A re-run with the same --results skips the rows already measured, refused
or not served; --deadline-s skips a row that would not finish in time (EXPECT_S), to be run
by the next invocation. --backend reference runs the same flow against the project's reference
server on a CPU (a dry run of the driver; the report then says no SGLang ran).
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import re
import sys
import time
import types
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

import micro_targets  # noqa: E402
from draftlab.errors import UserError  # noqa: E402
from draftlab.sglang import layers as rules  # noqa: E402

FAMILY_ORDER = ["llama", "qwen3", "qwen3-moe", "deepseek-v3", "kimi-k2.5", "gpt-oss"]
# Two layouts per family (user layer numbers: k = output of decoder layer k; `embedding` =
# physical 0). [1, 3, 5] is physical [2, 4, 6]; for DeepSeek it needs the +1 mode (a first id 1).
LAYOUTS = [[1, 3, 5], ["embedding", 3, 5]]
FALLBACK = [0, 3, 6]  # where the embedding is refused: decoder layer 0's output and the last capturable one
FALLBACK_DEEPSEEK = [2, 4, 6]  # DeepSeek cannot take physical 1 first (0.5.13+); ids as-is [3, 5, 7]
# Small sizes: 64 prompts, 48-token answers, one epoch. The draft learns little; parity does not need it to.
SERVER_ARGS = ["--sampling-backend", "pytorch", "--grammar-backend", "none", "--mem-fraction-static", "0.15",
               "--disable-cuda-graph"]
ROW_PARAMS = {
    "target": {"device": "cpu"},  # the pipeline's stages on the CPU; the GPU is the servers'
    "prompts": {"num_prompts": 64, "eval_fraction": 0.125},
    "synth": {"max_new_tokens": 48},
    "standardize": {"draft_vocab_size": 128},
    "train": {"epochs": 1, "device": "cpu", "checkpoint_every": 0},
    "bench": {"extra_server_args": SERVER_ARGS, "max_running_requests": 4, "startup_timeout_s": 240.0,
              "request_timeout_s": 120.0},
    "check": {"live_parity_samples": 4, "fail_on_error": False},
}
# Expected seconds per row (the deadline skips a row that would not fit): the pipeline on a
# 16-core CPU, and a server start without CUDA graphs plus the check stage.
EXPECT_S = {"pipeline": 90, "parity": 75}
NO_MATCH = 4  # x the parity tolerance: a slot whose nearest layer is further off matches no layer
FINISHED = ("measured", "not served", "refused")  # a re-run skips these; failed and skipped rows run again
ERROR_LINE = re.compile(r"(Error|Exception|error:|Traceback|not supported|RuntimeError|ValueError)")


def _sglang_run():
    spec = importlib.util.spec_from_file_location("sglang_run", ROOT / "tools" / "sglang_run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def layout_text(layout) -> str:
    return "[" + ", ".join(str(k) for k in layout) + "]"


def row_id(family: str, layout) -> str:
    return f"{family} {layout_text(layout)}"


def slug(rid: str) -> str:
    return re.sub(r"[^a-z0-9.]+", "-", rid.lower()).strip("-")


def plan(families: list[str], sglang_version: str) -> list[dict]:
    """The rows to run, in order: per family LAYOUTS, a refused one recorded with the rules' own
    message and followed by the fallback layout."""
    rows = []
    for name in families:
        fam = micro_targets.family(name)
        layouts = list(LAYOUTS)
        for layout in list(layouts):
            row = {"id": row_id(name, layout), "family": name, "label": fam.label, "architecture": fam.architecture,
                   "layout": layout, "sglang_version": sglang_version}
            try:
                physical = rules.physical_from_spec(layout, fam.architecture, micro_targets.NUM_LAYERS)
                rules.validate_capture(fam.architecture, micro_targets.NUM_LAYERS, physical, sglang_version)
                row.update(status="planned", trained_physical=physical,
                           ids_expected=rules.ids_for_physical(fam.architecture, micro_targets.NUM_LAYERS, physical, sglang_version))
            except UserError as e:
                row.update(status="refused", refusal=str(e), source="read from source (the project's rules)")
                fallback = FALLBACK_DEEPSEEK if rules.family(fam.architecture) == "deepseek" else FALLBACK
                if fallback not in layouts:
                    layouts.append(fallback)
                probe = probe_ids(fam.architecture, layout)
                if probe is not None:  # served anyway, from the fallback row's draft (Families.probe)
                    row.update(probe_ids=probe, probe_from=row_id(name, fallback))
            rows.append(row)
        for layout in layouts[len(LAYOUTS):]:  # the fallbacks, validated the same way
            physical = rules.physical_from_spec(layout, fam.architecture, micro_targets.NUM_LAYERS)
            rows.append({"id": row_id(name, layout), "family": name, "label": fam.label, "architecture": fam.architecture,
                         "layout": layout, "sglang_version": sglang_version, "status": "planned", "trained_physical": physical,
                         "ids_expected": rules.ids_for_physical(fam.architecture, micro_targets.NUM_LAYERS, physical, sglang_version)})
    return rows


def probe_ids(architecture: str, layout) -> list[int] | None:
    """The ids a refused layout would be exported with by the newest release the rules know: what a
    user who ignored the refusal would serve. None where no release takes the layout."""
    try:
        physical = rules.physical_from_spec(layout, architecture, micro_targets.NUM_LAYERS)
        return rules.ids_for_physical(architecture, micro_targets.NUM_LAYERS, physical, rules.VERIFIED_VERSIONS[-1])
    except UserError:
        return None


def with_ids(draft: Path, out: Path, ids: list[int]) -> Path:
    """A copy of an exported draft whose config asks SGLang for `ids` (weights linked, not copied);
    the project's own layers block is dropped, so the check reads it as any SGLang checkpoint."""
    out.mkdir(parents=True, exist_ok=True)
    for f in draft.iterdir():
        if f.name != "config.json" and not (out / f.name).exists():
            (out / f.name).symlink_to(f.resolve())
    config = json.loads((draft / "config.json").read_text())
    config.pop("draftlab", None)
    config.setdefault("eagle_config", {})["eagle_aux_hidden_state_layer_ids"] = list(ids)
    (out / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    return out


def physical_of(name):
    """A parity slot's best match ("physical 4", "final") as the physical index 4, or as it is."""
    return int(name.split()[1]) if isinstance(name, str) and name.startswith("physical ") else name


def probe_outcome(parity: dict | None, error: list[str] | None) -> str:
    """A refused layout served anyway: 'crashed' (the refusal is confirmed), 'fed [...]' (SGLang took
    it: the rule is stricter than the release), or 'no answer'."""
    if error:
        return "crashed: " + error[-1][:200]
    slots = (parity or {}).get("slots") or []
    if not slots:
        return "no answer: " + str(((parity or {}).get("error") or {}).get("message", "no slots"))[:200]
    fed = [physical_of(s["best_match"]) for s in slots]
    return f"served, fed {fed}"


def row_params(target_link: str, layout, sglang_version: str) -> dict:
    """The params override of one row (merged over params.yaml and tools/sglang_run.py's GPU overrides)."""
    return {**ROW_PARAMS, "target": {**ROW_PARAMS["target"], "model": target_link},
            "capture": {"layers": list(layout)}, "export": {"sglang_version": sglang_version}}


def todo(rows: list[dict], done: dict) -> list[dict]:
    """Rows still to run: planned and not finished by an earlier invocation."""
    return [r for r in rows if r["status"] == "planned" and done.get(r["id"], {}).get("status") not in FINISHED]


def fits(left_s: float, *steps: str) -> tuple[bool, str]:
    need = sum(EXPECT_S[s] for s in steps)
    return left_s >= need, f"skipped: {need} s expected ({' + '.join(steps)}), {max(0, left_s):.0f} s left"


def error_lines(log_text: str, n: int = 6) -> list[str]:
    """The server's first error lines, and its last exception line (the reason it stopped)."""
    lines = [x.strip() for x in log_text.splitlines() if ERROR_LINE.search(x) and x.strip()]
    first = list(dict.fromkeys(lines))[:n]
    last = [x for x in lines if re.match(r"^\w+(Error|Exception)\b", x)][-1:]
    return first + [x for x in last if x not in first]


def parity_of(check: dict) -> dict:
    """From the check stage's report: the ids exported, the layers the rules predict, the layers
    live parity says SGLang fed (the reference state each slot matches best), the errors."""
    settings, parity = check.get("settings") or {}, check.get("parity") or {}
    slots = parity.get("slots") or []

    fed = [physical_of(s["best_match"]) for s in slots]
    rel = [s["rel_err"] for s in slots]
    best = [s.get("best_rel_err") for s in slots]
    return {"ids_exported": settings.get("eagle_aux_hidden_state_layer_ids"), "predicted_physical": settings.get("sglang_captures"),
            "fed_physical": fed or None, "rel_err": rel or None, "max_rel_err": max(rel) if rel else None,
            "best_rel_err": best if slots and None not in best else None,
            # candidates beyond the stored slots and the final state: the target was loaded and every layer compared
            "every_layer_compared": bool(slots) and len(slots[0].get("candidates", {})) > len(slots) + 1,
            "parity_tokens": parity.get("tokens"), "parity_error": parity.get("error"),
            "findings": [f["name"] for f in check.get("findings", []) if f.get("severity") != "ok-info"]}


def verdict(row: dict, rtol: float) -> str:
    if row["status"] == "refused":
        probe = row.get("probe") or {}
        if "outcome" not in probe:
            return "refused by the project's rules"
        if probe["outcome"].startswith("crashed"):
            return "refused by the project's rules; served anyway, SGLang " + probe["outcome"]
        return "refused by the project's rules, but SGLang " + probe["outcome"]
    if row["status"] == "not served":
        return "not served: " + (row.get("error_lines") or ["(no error line in the log)"])[-1][:200]
    if row["status"] != "measured":
        return row["status"]
    if row.get("fed_physical") is None:
        return "no live parity: " + str((row.get("parity_error") or {}).get("message", "no slots"))[:200]
    unmatched = [i for i, e in enumerate(row.get("best_rel_err") or []) if e > NO_MATCH * rtol]
    if unmatched:  # the nearest layer is no match: the slot holds a state the target never computes at a boundary
        i = unmatched[0]
        return (f"slot {i} matches no layer (nearest physical {row['fed_physical'][i]} at rel err {row['best_rel_err'][i]:.2f}; "
                f"rel err {row['rel_err'][i]:.1f} against the trained physical {row['trained_physical'][i]})")
    if row["fed_physical"] != row["trained_physical"]:
        return f"fed {row['fed_physical']}, trained {row['trained_physical']}"
    return "parity clean" if row["max_rel_err"] <= rtol else f"right layers, rel err {row['max_rel_err']:.3f} > {rtol}"


class Families:
    def __init__(self, args):
        self.args, self.t0 = args, time.monotonic()
        self.results = Path(args.results).resolve()
        self.path = self.results / "families.json"
        self.record = json.loads(self.path.read_text()) if self.path.exists() else {"rows": {}}
        self.sglang_run = _sglang_run()

    def left(self) -> float:
        return self.args.deadline_s - (time.monotonic() - self.t0)

    def save(self, row: dict | None = None) -> None:
        if row is not None:
            self.record["rows"][row["id"]] = row
            print(f"[families {time.monotonic() - self.t0:5.0f}s] {row['id']}: {row['status']} {row.get('verdict', '')}", flush=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.record, indent=1, default=str) + "\n")
        os.replace(tmp, self.path)

    def driver(self, row: dict, target: dict):
        """tools/sglang_run.py's Driver for this row's directory; for Kimi-K2.5 the servers start
        from the KimiK25 checkpoint while the stages load its DeepSeek-V3 language model."""
        rdir = self.results / "rows" / slug(row["id"])
        params = rdir / "params-override.yaml"
        rdir.mkdir(parents=True, exist_ok=True)
        params.write_text(yaml.safe_dump(row_params(f"models/{Path(target['pipeline']).name}", row["layout"],
                                                     row["sglang_version"]), sort_keys=False))
        args = argparse.Namespace(results=str(rdir), work="", target=str(target["pipeline"]), params=str(params),
                                  backend=self.args.backend, time_limit_s=float("inf"), quick=False, steps="", faults="", pack="")
        serve = Path(target["serve"]) if target["serve"] != target["pipeline"] else None
        return _row_driver(self.sglang_run.Driver)(args, serve)

    def pipeline(self, row: dict, target: dict) -> dict:
        ok, why = fits(self.left(), "pipeline", "parity")
        if not ok:
            return {"status": "skipped", "skipped": why}
        t = time.monotonic()
        try:
            d = self.driver(row, target)
            d.phase_pipeline()
            return {"status": "trained", "pipeline_s": round(time.monotonic() - t, 1)}
        except Exception as e:  # noqa: BLE001  one row's failure is recorded, the others go on
            return {"status": "failed", "stage": "pipeline", "error_lines": str(e).splitlines()[-8:],
                    "pipeline_s": round(time.monotonic() - t, 1)}

    def parity(self, row: dict, target: dict) -> dict:
        ok, why = fits(self.left(), "parity")
        if not ok:
            return {"status": "skipped", "skipped": why}
        d, t = self.driver(row, target), time.monotonic()
        log = d.logs / "server-parity.log"
        out = {}
        try:
            d.phase_parity()
            check = json.loads((d.work / "reports" / "check.json").read_text())
            out.update(status="measured", **parity_of(check))
        except Exception as e:  # noqa: BLE001  a server that does not start is a finding, not a crash
            text = log.read_text(errors="replace") if log.exists() else ""
            started = "The server is fired up" in text or (d.work / "reports" / "check.json").exists()
            out.update(status="failed" if started else "not served", error_lines=error_lines(text) or str(e).splitlines()[-4:])
        out["parity_s"] = round(time.monotonic() - t, 1)
        if log.exists():  # kept per row: the server's own account, also a parser fixture
            tail = log.read_text(errors="replace").splitlines()[-80:]
            (d.results / "server-tail.log").write_text("\n".join(tail) + "\n")
            out["server_log_tail"] = os.path.relpath(d.results / "server-tail.log", self.results)
        sample = d.results / "hidden_states_response.json"
        if sample.exists():
            out["hidden_states_response"] = os.path.relpath(sample, self.results)
        return out

    def probe(self, refused: dict, fallback: dict, target: dict) -> dict:
        """Serve a refused layout anyway, to see the refusal's reason on the server itself: the
        fallback row's draft with the ids the refused layout would get (probe_ids), an EAGLE3 server
        with hidden states, and live parity against the target run here (every layer compared)."""
        from draftlab.check.external import check_external

        ok, why = fits(self.left(), "parity")
        if not ok:
            return {"skipped": why}
        d, t = self.driver(fallback, target), time.monotonic()
        if not (d.work / "models" / "draft" / "config.json").exists():
            return {"skipped": f"{fallback['id']} has no exported draft"}
        rdir = self.results / "rows" / slug(refused["id"])
        draft = with_ids(d.work / "models" / "draft", rdir / "draft-probe", refused["probe_ids"])
        log = rdir / "server-probe.log"
        p = d.params(d.work)
        p = types.SimpleNamespace(**{**vars(p), "bench": dataclasses.replace(p.bench, startup_timeout_s=150.0)})
        flags, _ = d.flags_for(p)
        out = {"ids": refused["probe_ids"], "draft_from": fallback["id"]}
        parity, error = None, None
        try:
            with d.server(p, draft, flags, log, hidden=True) as url:
                verdict_ = check_external(draft, str(target["pipeline"]), refused["sglang_version"], server=url, samples=2,
                                          rtol=self.rtol(), timeout_s=60.0)
                parity = verdict_.parity
        except Exception as e:  # noqa: BLE001  the crash is what is measured
            text = log.read_text(errors="replace") if log.exists() else ""
            error = error_lines(text) or str(e).splitlines()[-4:]
        if parity is not None:
            out["fed_rel_err"] = [s.get("rel_err") for s in parity.get("slots") or []]
        out.update(outcome=probe_outcome(parity, error), error_lines=error, seconds=round(time.monotonic() - t, 1))
        if log.exists():
            (rdir / "server-probe-tail.log").write_text("\n".join(log.read_text(errors="replace").splitlines()[-80:]) + "\n")
            out["server_log_tail"] = os.path.relpath(rdir / "server-probe-tail.log", self.results)
        return out

    def run_probes(self, rows: list[dict], done_row: dict, targets: dict) -> None:
        """After a fallback row has its draft: the refused rows that probe from it."""
        if done_row["status"] == "skipped" or done_row.get("stage") == "pipeline":
            return  # no draft to serve
        for r in rows:
            rec = self.record["rows"].get(r["id"], {})
            if r.get("probe_from") == done_row["id"] and "outcome" not in (rec.get("probe") or {}):
                row = {**r, **{k: v for k, v in rec.items() if k != "probe"}, "probe": self.probe(r, done_row, targets[r["family"]])}
                if self.args.backend == "sglang" and "outcome" in row["probe"]:
                    row["probe_source"] = "served anyway on real SGLang " + r["sglang_version"]
                row["verdict"] = verdict(row, self.rtol())
                self.save(row)

    def reread(self) -> int:
        """Re-derive each measured row's parity fields and verdict from its check stage report (no server)."""
        for rid, row in self.record["rows"].items():
            check = self.results / "rows" / slug(rid) / "work" / "reports" / "check.json"
            if row.get("status") == "measured" and check.exists():
                row.update(parity_of(json.loads(check.read_text())))
            row["verdict"] = verdict(row, self.record.get("settings", {}).get("rtol", self.rtol()))
        self.save()
        return 0

    def run(self) -> int:
        families = [f for f in self.args.families.split(",") if f]
        for f in families:
            micro_targets.family(f)  # an unknown name stops here, before any work
        versions = versions_here(self.args.backend)
        version = versions.get("sglang") or self.args.sglang_version
        self.record.update(versions=versions, settings={"backend": self.args.backend, "server_args": SERVER_ARGS,
                                                        "cuda_graphs": "off (--disable-cuda-graph): start-up time, not speed, is measured",
                                                        "row_params": ROW_PARAMS, "rtol": self.rtol(), "num_layers": micro_targets.NUM_LAYERS})
        rows = plan(families, version)
        for r in rows:
            if r["status"] == "refused" and self.record["rows"].get(r["id"], {}).get("status") != "refused":
                self.save({**r, "verdict": verdict(r, self.rtol())})
        self.save()
        targets = {f: micro_targets.build(f, self.results / "targets" / f) for f in families}
        work = todo(rows, self.record["rows"])
        with ThreadPoolExecutor(max_workers=self.args.jobs) as pool:
            trained = [pool.submit(self.pipeline, r, targets[r["family"]]) for r in work]
            for row, future in zip(work, trained):
                t = time.monotonic()
                got = future.result()
                row = {**row, **got, "target": {k: targets[row["family"]][k] for k in ("seed", "weights_sha256")}}
                if got["status"] == "trained":
                    row.update(self.parity(row, targets[row["family"]]))
                row["seconds"] = round(row.get("pipeline_s", 0) + row.get("parity_s", 0), 1)
                row["waited_s"] = round(time.monotonic() - t, 1)
                row["source"] = ("measured on real SGLang " + version) if self.args.backend == "sglang" else "reference server (no SGLang)"
                row["verdict"] = verdict(row, self.rtol())
                self.save(row)
                if self.args.probe:
                    self.run_probes(rows, row, targets)
        if self.args.probe:  # fallbacks finished by an earlier invocation whose probes did not run
            ran = {r["id"] for r in work}
            for r in rows:
                if r["id"] not in ran and self.record["rows"].get(r["id"], {}).get("status") in ("measured", "not served"):
                    self.run_probes(rows, self.record["rows"][r["id"]], targets)
        self.record["wall_s"] = round(time.monotonic() - self.t0, 1)
        self.save()
        return 0

    def rtol(self) -> float:
        return yaml.safe_load((ROOT / "params.yaml").read_text())["check"]["parity_rtol"]


def _row_driver(base):
    class RowDriver(base):
        def __init__(self, args, serve_target: Path | None):
            super().__init__(args)
            self.serve_target = serve_target

        def server(self, p, draft, flags, log, hidden=False):
            if self.serve_target is not None:  # start SGLang from the served checkpoint (Kimi-K2.5)
                link = self.work / "models" / f"serve-{self.serve_target.name}"
                if not link.exists():
                    link.symlink_to(self.serve_target)
                # p is the loaded params namespace (draftlab.params.load_params); its sections are dataclasses
                p = types.SimpleNamespace(**{**vars(p), "target": dataclasses.replace(p.target, model=f"models/{link.name}")})
            return super().server(p, draft, flags, log, hidden)

    return RowDriver


def versions_here(backend: str) -> dict:
    import platform

    import torch
    import transformers

    out = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__}
    if backend == "sglang":
        try:
            import sglang

            out["sglang"] = sglang.__version__
            out["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
        except Exception as e:  # the servers' logs will say more
            out["sglang_error"] = f"{type(e).__name__}: {e}"
    return out


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", required=True, help="families.json, the targets, one directory per row; re-use it to resume")
    ap.add_argument("--families", default=",".join(FAMILY_ORDER), help=f"comma-separated, from {', '.join(micro_targets.FAMILIES)}")
    ap.add_argument("--deadline-s", type=float, default=float("inf"), help="seconds from the start: rows that would end later are skipped")
    ap.add_argument("--jobs", type=int, default=3, help="rows whose CPU pipeline runs at once (the servers run one at a time)")
    ap.add_argument("--backend", choices=["sglang", "reference"], default="sglang",
                    help="reference: the project's reference server instead of SGLang (a CPU dry run of this driver)")
    ap.add_argument("--no-probe", dest="probe", action="store_false",
                    help="do not serve refused layouts anyway (by default each is served once, from its fallback row's draft)")
    ap.add_argument("--reread", action="store_true",
                    help="run nothing: re-derive the parity fields and verdicts of --results from each row's check report")
    ap.add_argument("--sglang-version", default="0.5.14", help="the rules' release when SGLang is not importable here")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    Path(args.results).mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("DRAFTLAB_THREADS", str(max(1, (os.cpu_count() or 2) // max(1, args.jobs))))
    try:
        families = Families(args)
        return families.reread() if args.reread else families.run()
    except (UserError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
