#!/usr/bin/env python3
"""The comparison with SpecForge as a report: RESULTS/peers.json (tools/peers_h200.py) ->
OUT/README.md (the mode, full or small, and its sizes; method, versions, one table), OUT/results.json, OUT/served.png (served tau and
bs=1 speedup by configuration, both drafts) and OUT/accuracy.png (step-1 eval accuracy over
training time, both trainers).

    python tools/peers_report.py RESULTS reports/peers [--target-acc 0.9]

Time to accuracy: seconds from the trainer's start to its first eval whose step-1 top-1
accuracy reaches the threshold (default: the lower of the two final accuracies, so both reach
it); both trainers evaluate once per epoch, so it is known to an epoch. No GPU needed.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

from peers_h200 import DRAFTS, time_to_acc

LABEL = {"ours": "draftlab", "specforge": "SpecForge"}


def fmt(v, spec=".2f", unit="") -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:{spec}}{unit}"


def table(peers: dict, threshold: float | None) -> tuple[list[str], dict]:
    configs = peers.get("flags", {}).get("configs", [])
    served, train = peers.get("served", {}), peers.get("train", {})
    head = (["draft", "trainer"] + [f"tau {c}" for c in configs] + [f"speedup {c}" for c in configs]
            + ["train tokens/s", "MFU", "peak memory", f"time to acc {fmt(threshold, '.3f')}", "offline tau 5-1-6"])
    rows, figures = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)], {}
    for d in DRAFTS:
        s, t = served.get(d, {}), train.get(d, {})
        tta = time_to_acc(t.get("evals", []), threshold) if threshold is not None else None
        off = (peers.get("offline", {}).get(d) or {}).get("tau")
        fig = {"served_tau": {c: s.get(c, {}).get("served_tau") for c in configs},
               "speedup": {c: s.get(c, {}).get("speedup") for c in configs},
               "train_tokens_per_s": t.get("tokens_per_s"), "mfu": t.get("mfu"), "peak_memory_mib": t.get("peak_memory_mib"),
               "time_to_acc_s": tta, "offline_tau": off, "final_acc_1": t.get("final_acc_1")}
        figures[d] = fig
        cells = ([f"{LABEL[d]} draft", LABEL[d]] + [fmt(fig["served_tau"][c]) for c in configs]
                 + [fmt(fig["speedup"][c], ".2f", "x") for c in configs]
                 + [fmt(fig["train_tokens_per_s"], ",.0f"), fmt(fig["mfu"], ".1%"),
                    fmt(None if fig["peak_memory_mib"] is None else fig["peak_memory_mib"] / 1024, ".1f", " GiB"),
                    fmt(tta, ".0f", " s"), fmt(off)])
        rows.append("| " + " | ".join(cells) + " |")
    return rows, figures


def plots(peers: dict, out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = peers.get("flags", {}).get("configs", [])
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, title in ((axes[0], "served_tau", "served tau"), (axes[1], "speedup", "bs=1 speedup (x)")):
        for i, d in enumerate(DRAFTS):
            vals = [(peers.get("served", {}).get(d, {}).get(c) or {}).get(key) for c in configs]
            ax.bar([j + (i - 0.5) * 0.38 for j in range(len(configs))], [v or 0 for v in vals], 0.38, label=LABEL[d])
        ax.set_xticks(range(len(configs)), configs)
        ax.set_xlabel("STEPS-TOPK-DRAFT_TOKENS")
        ax.set_title(title)
        ax.legend()
    fig.tight_layout()
    fig.savefig(out / "served.png", dpi=110)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(6, 4))
    for d in DRAFTS:
        ev = (peers.get("train", {}).get(d) or {}).get("evals") or []
        ev = [e for e in ev if e.get("t_s") is not None and e.get("acc_1") is not None]
        ax.plot([e["t_s"] for e in ev], [e["acc_1"] for e in ev], "o-", label=LABEL[d])
    ax.set_xlabel("seconds since the trainer started")
    ax.set_ylabel("step-1 eval accuracy")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "accuracy.png", dpi=110)
    plt.close(fig)
    return ["served.png", "accuracy.png"]


def mode_lines(peers: dict) -> list[str]:
    """The run's mode and sizes, what the deadline skipped, and where our trainer's figures come from."""
    z, f = peers.get("sizes", {}), peers.get("flags", {})
    mode = z.get("mode") or f.get("size") or "full"
    n = lambda v: "-" if v is None else f"{v:,}"
    out = [f"**Mode: {mode}** (`--size {mode}`"
           + ("; the full mode, `--size full`, uses 4,800 prompts and serves 3-1-4, 5-1-6, 6-8-32, 5-4-8)." if mode != "full" else ")."),
           "",
           "| size | value |", "|---|---|",
           f"| prompts (train + eval) | {n(z.get('num_prompts'))} |",
           f"| train sequences, both trainers | {n(z.get('train_sequences'))} |",
           f"| real train tokens per epoch | {n(z.get('train_tokens_per_epoch'))} |",
           f"| capture layers | {z.get('capture_layers', '-')} |",
           f"| offline-run prompts | {n(z.get('offline_prompts'))} |",
           f"| served prompts per configuration (paired, bs=1) | {n(z.get('served_prompts', f.get('num_prompts')))} |",
           f"| configurations planned | {', '.join(f.get('configs', [])) or '-'} |",
           f"| pipeline bench stage | {'run' if z.get('bench_stage', True) else 'not run (the serve and offline steps measure both drafts)'} |"]
    skipped = [f"{k} ({v['skipped']})" for k, v in peers.get("steps", {}).items() if isinstance(v, dict) and v.get("skipped")]
    cut = peers.get("steps", {}).get("serve", {}).get("skipped_configs", [])
    if skipped or cut:
        out += ["", "Skipped for time: " + "; ".join(skipped + [f"served configuration {c}" for c in cut if c not in " ".join(skipped)]) + "."]
    src = (peers.get("train", {}).get("ours") or {}).get("source")
    if src:
        out += ["", f"Our trainer's figures: {src}."]
    return out


def report(results: Path, out: Path, target_acc: float | None = None) -> dict:
    peers = json.loads((results / "peers.json" if results.is_dir() else results).read_text())
    finals = [(peers.get("train", {}).get(d) or {}).get("final_acc_1") for d in DRAFTS]
    threshold = target_acc if target_acc is not None else (min(finals) if all(f is not None for f in finals) else None)
    rows, figures = table(peers, threshold)
    out.mkdir(parents=True, exist_ok=True)
    images = plots(peers, out)
    f, v = peers.get("flags", {}), peers.get("versions", {})
    b = f.get("budget", {})
    verdict = []
    for c in f.get("configs", []):
        ours, theirs = figures["ours"]["served_tau"].get(c), figures["specforge"]["served_tau"].get(c)
        if ours is not None and theirs is not None:
            verdict.append(f"- {c}: served tau {ours:.2f} (draftlab) vs {theirs:.2f} (SpecForge): "
                           + ("ours >= SpecForge's" if ours >= theirs else "**ours is lower: to be explained**"))
    text = "\n".join([
        "# This project's EAGLE-3 trainer against SpecForge's, on one GPU",
        "",
        *mode_lines(peers),
        "",
        (f"Made by `python tools/peers_h200.py` and `python tools/peers_report.py`. Versions: SpecForge {v.get('specforge')}, "
         f"SGLang {v.get('sglang')}, torch {v.get('torch')}, transformers {v.get('transformers')}; GPU {v.get('gpu')}."),
        "",
        "## Method",
        "",
        "- Target: the 8B-cost twin (`tools/make_twin.py`). Data: the pipeline's synthesized conversations, its stored",
        "  states of the same capture layers, loss mask and draft vocabulary; SpecForge reads them in its offline format",
        "  (`tools/specforge_offline.py`) and trains with its own `specforge train` and `specforge export --to sglang`.",
        (f"- Budget, both: {b.get('epochs')} epochs, batch {b.get('batch_size')}, max length {b.get('max_length')}, "
         f"TTT {b.get('ttt_steps')} steps, the same draft size. Learning rate: ours {b.get('our_lr')}, SpecForge "
         f"{f.get('specforge_learning_rate')} ({f.get('specforge_learning_rate_source')}). SpecForge overrides: "
         f"`{' '.join(f.get('specforge_overrides', []))}`."),
        (f"- Serving: one baseline SGLang server; each draft's EAGLE3 server beside it with the same flags, "
         f"{f.get('num_prompts')} prompts paired one at a time, greedy, {f.get('max_new_tokens')} new tokens at most."),
        "- Training throughput: each trainer alone on the GPU, from the same stored states; tokens/s are real tokens",
        "  (ours: its printed rate over optimizer steps; SpecForge: its logged samples/s times the mean sequence length);",
        "  peak memory polled from nvidia-smi; MFU counts the draft's own FLOPs only.",
        "",
        "## Result",
        "",
        *rows,
        "",
        *verdict,
        "",
        *[f"![{i}]({i})" for i in images],
        "",
    ])
    (out / "README.md").write_text(text)
    summary = {"versions": v, "flags": f, "threshold_acc_1": threshold, "figures": figures}
    (out / "results.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", type=Path, help="RESULTS (or its peers.json)")
    ap.add_argument("out", type=Path)
    ap.add_argument("--target-acc", type=float, default=None)
    a = ap.parse_args(argv)
    report(a.results, a.out, a.target_acc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
