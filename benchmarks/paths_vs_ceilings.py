"""Measure draftlab's GPU paths against the machine's own ceilings (one run, one JSON).

    python benchmarks/paths_vs_ceilings.py --out DIR            # on a GPU: Llama-3.1-8B-shaped target, random weights
    python benchmarks/paths_vs_ceilings.py --quick --out DIR    # on a CPU: tiny shapes, a few iterations (the test)

Sections, each in its own try/except, each in its own module of benchmarks/paths/ with its method;
DIR/results.json is rewritten after every figure:
  ceilings        bf16 matmul rate and device copy bandwidth                        (perf/ceilings.py)
  extraction      draftlab.features.extract.capture and extract_shard: tokens/s vs the compute floor (perf/extraction.py)
  decode_profile  one decode step, host vs GPU; the cuDNN A/B; soft labels fp32 vs bf16 (perf/decode.py, cudnn.py)
  decode_graph    decode over a static KV cache, eager and as a CUDA graph          (perf/graph.py)
  spec            draftlab.engine.speculative: baseline decode vs the bandwidth floor; oracle / null drafts (perf/spec.py)
  training        one draftlab.train.objective.TTT optimizer step (labels + forward + backward + AdamW): MFU (perf/training.py);
                  --train-modes eager,stage also times the train stage's GPU setup (FlexAttention, compiled)
  embedded        models/tiny-target with models/draft: tau and speedup on held-out prompts (perf/embedded.py)
DIR/notes.md states the method and the FLOP / byte formulas (tools/templates/perf_notes.md filled in).
"""
from __future__ import annotations

import argparse
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.paths import common  # noqa: E402
from benchmarks.paths.ceilings import ceilings  # noqa: E402
from benchmarks.paths.common import RESULTS, build_target, free, log, plan, record, save  # noqa: E402
from benchmarks.paths.decode import decode_profile  # noqa: E402
from benchmarks.paths.embedded import embedded  # noqa: E402
from benchmarks.paths.extraction import extraction  # noqa: E402
from benchmarks.paths.graph import decode_graph  # noqa: E402
from benchmarks.paths.spec import spec  # noqa: E402
from benchmarks.paths.training import training  # noqa: E402

NOTES = ROOT / "benchmarks" / "templates" / "perf_notes.md"  # str.format fields from the plan


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true", help="CPU, tiny shapes, few iterations")
    ap.add_argument("--sections", default="ceilings,extraction,decode_profile,spec,decode_graph,training,embedded")
    ap.add_argument("--train-modes", default="eager", help="training section: eager (the TTT attention written out, nothing "
                    "compiled), stage (what the train stage runs on a GPU: FlexAttention, the layer and loss compiled), or both: eager,stage")
    args = ap.parse_args(argv)
    out = Path(args.out)
    P = plan(args.quick)
    P["train_modes"] = args.train_modes.split(",")
    if P["device"] == "cuda" and not torch.cuda.is_available():
        log("no CUDA device: use --quick on the CPU")
        return 2
    if P["device"] == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # the code's own default, measured as it runs
    common.set_out(out)
    RESULTS["meta"] = {"mode": "quick" if args.quick else "full", "machine": common.machine(),
                       "command": common.command_line(None if argv is None else [sys.argv[0], *argv])}
    save()
    (out / "notes.md").write_text(NOTES.read_text().format(
        mode="--quick, CPU, tiny shapes" if args.quick else "full, GPU", machine=RESULTS["meta"]["machine"],
        n=P["matmul_n"], warm=P["mm_warm"], iters=P["mm_iters"], copy_mb=P["copy_mb"], physical=P["physical"],
        tok=P["extract_tokens"], eiters=P["extract_iters"], V=P["train_vocab"], Vd=P["train_draft_vocab"],
        steps=P["ttt_steps"], titers=P["train_iters"], new=P["spec_new"], plen=P["spec_prompt"],
        spec_steps=P["spec_steps"], eprompts=P["embedded_prompts"], enew=P["embedded_new"], pbatch=P["profile_batch"],
        dnew=P["decode_new"], gnew=P["graph_new"]))
    log(f"paths_vs_ceilings: {RESULTS['meta']['mode']} on {RESULTS['meta']['machine']}")
    wanted = args.sections.split(",")
    t_all = time.perf_counter()

    def section(name, fn, *a):
        if name not in wanted:
            return
        t0 = time.perf_counter()
        log(f"== {name}")
        try:
            fn(*a)
        except Exception as e:  # noqa: BLE001 - one section failing must not lose the others
            record(name, "error", f"{type(e).__name__}: {e}"[:500])
            traceback.print_exc()
        record(name, "section_s", time.perf_counter() - t0, "s")
        free(P["device"])

    section("ceilings", ceilings, P)
    model = None
    if {"extraction", "spec", "decode_profile", "decode_graph"} & set(wanted):
        try:
            t0 = time.perf_counter()
            model = build_target(P)
            record("meta", "target_build_s", time.perf_counter() - t0, "s")
        except Exception as e:  # noqa: BLE001
            record("meta", "target_error", f"{type(e).__name__}: {e}"[:500])
            traceback.print_exc()
    if model is not None:
        section("extraction", extraction, P, model)
        section("decode_profile", decode_profile, P, model)
        section("decode_graph", decode_graph, P, model)  # before spec, which rescales the embedding
        section("spec", spec, P, model)
        del model
        free(P["device"])
    section("training", training, P)
    section("embedded", embedded, P)
    record("meta", "total_s", time.perf_counter() - t_all, "s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
