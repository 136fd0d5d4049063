"""Stage bench: the exported draft served against a no-speculation baseline, plus the offline run.

    python -m stages.bench --draft models/draft --prompts data/prompts --out reports/bench --metrics reports/bench.json
Reads params sections: target, spec, bench, and export.sglang_version (whose rules apply).

One client for every backend: `reference` starts the project's own server (CPU or GPU),
`sglang` launches `python -m sglang.launch_server`, `url` measures a server already running.
Before anything starts, the flags SGLang would really run are computed (draftlab.sglang.flags);
with spec.on_adjust: error a request SGLang would silently change stops here.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import platform
from pathlib import Path

import torch

from draftlab import bench
from draftlab import lifecycle, server
from draftlab.cli import run_stage
from draftlab.errors import UserError
from draftlab.sglang.checkpoint import load_exported
from draftlab.fsutil import atomic_write_json, atomic_write_text
from draftlab.manifest import build_manifest, read_manifest, with_lineage, write_manifest
from draftlab.params import as_dict, load_params
from draftlab.sglang.launch import launch_argv, read_log, serve
from draftlab.sglang.client import Client, flags_from_server_info, server_accept_length
from draftlab.sglang.launch import free_port as sglang_free_port
from draftlab.sglang.flags import SPEC_KEYS, SpecFlags, requested_from_params, resolve
from draftlab.sglang.layers import captured_physical
from draftlab.target import load_config, load_target, load_tokenizer, resolve_device, target_info


def read_eval_prompts(prompts: Path, n: int) -> list[dict]:
    path = prompts / "eval.jsonl"
    if not path.exists():
        raise UserError(f"{path} not found; run the prompts stage first (dvc repro prompts)")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not rows:
        raise UserError(f"{path}: no eval prompts; raise prompts.eval_fraction")
    return rows[:n]


def start(backend: str, bp, tp, draft: Path, flags, version: str, log: Path, speculative: bool,
          hidden: bool = False, port: int | None = None):
    """Context manager yielding the base URL of a started (or given) server.

    hidden: start it with --enable-return-hidden-states (live parity). port: None = bench.port
    for SGLang, a free one for the reference server.
    """
    if backend == "url":
        if not bp.url:
            raise UserError("bench.backend is 'url' but bench.url is empty; give the base URL of a running server")
        return _given(bp.url)
    port = port or (bp.port if backend == "sglang" else lifecycle.free_port())
    if backend == "sglang":
        argv = launch_argv(tp.model, port, draft_model=str(draft), flags=flags, baseline=not speculative,
                           tp_size=bp.tp_size, dtype=bp.dtype, extra_args=bp.extra_server_args, return_hidden_states=hidden)
        return _url(serve(argv, log, bp.startup_timeout_s), port)
    spec = {}
    if speculative:
        spec = {"speculative_algorithm": flags.algorithm, "speculative_draft_model_path": str(draft),
                "speculative_num_steps": flags.num_steps, "speculative_eagle_topk": flags.topk,
                "speculative_num_draft_tokens": flags.num_draft_tokens, "sglang_version": version}
    argv = server.launch_command(tp.model, port, dtype=tp.dtype, device=tp.device, log_level="warning",
                                 enable_return_hidden_states=hidden, **spec)
    return _url(lifecycle.serve(argv, f"http://127.0.0.1:{port}", log, startup_timeout_s=bp.startup_timeout_s), port)


class _given:
    def __init__(self, url):
        self.url = url

    def __enter__(self):
        return self.url

    def __exit__(self, *exc):
        return False


class _url:
    def __init__(self, cm, port):
        self.cm, self.port = cm, port

    def __enter__(self):
        self.cm.__enter__()
        return f"http://127.0.0.1:{self.port}"

    def __exit__(self, *exc):
        return self.cm.__exit__(*exc)


def measure(urls: dict[str, str], bp, prompts: list[list[int]], sampling: dict, warmup: int) -> dict[str, dict]:
    """Figures per server. With several servers up, requests alternate prompt by prompt, so a
    change in the machine's load hits both modes alike and their ratio stays fair."""
    clients = {mode: Client(url, bp.request_timeout_s) for mode, url in urls.items()}
    try:
        for c in clients.values():
            bench.run_requests(c, prompts[:warmup], sampling)  # compile/caches warm; not counted
        records = {mode: [] for mode in clients}
        wall = dict.fromkeys(clients, 0.0)
        for p in prompts[warmup:]:
            for mode, c in clients.items():
                recs, w = bench.run_requests(c, [p], sampling)
                records[mode] += recs
                wall[mode] += w
        out = {}
        for mode, c in clients.items():
            sweep = []
            for n in bp.concurrency:
                if n > 1:
                    recs, w = bench.run_requests(c, prompts[warmup:], sampling, n)
                    sweep.append({"concurrency": n, **bench.speed(recs, w)})
            metas = [r["meta"] for r in records[mode]]
            info = c.server_info()
            out[mode] = {"speed": bench.speed(records[mode], wall[mode]), "spec": bench.spec_figures(metas), "sweep": sweep,
                         "server_accept_length": server_accept_length(info),
                         "server_flags": flags_from_server_info(info), "metas": [m.raw for m in metas]}
        return out
    finally:
        for c in clients.values():
            c.close()


def served_flags(flags: SpecFlags) -> dict | None:
    """The flags the speculative server reports in /server_info; None when it reports none of them."""
    d = dataclasses.asdict(flags)
    return d if any(d[k] is not None for k in SPEC_KEYS) else None


def write_plots(out: Path, report: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    served = report["spec"].get("acceptance") or []
    offline = report["offline"]["acceptance"]
    lines = ["position,served,offline"] + [f"{i + 1},{served[i] if i < len(served) else ''},{offline[i]}" for i in range(len(offline))]
    atomic_write_text(out / "acceptance.csv", "\n".join(lines) + "\n")
    hist = report["spec"].get("accept_hist") or []
    atomic_write_text(out / "accept_hist.csv", "accepted_drafts,steps\n" + "".join(f"{i},{n}\n" for i, n in enumerate(hist)))
    speeds = [("baseline", (report["baseline"] or {}).get("tokens_per_s")), ("speculative", report["spec"]["tokens_per_s"])]
    atomic_write_text(out / "tokens_per_s.csv", "mode,tokens_per_s\n" + "".join(f"{m},{s['median']:.2f}\n" for m, s in speeds if s))
    fig, ax = plt.subplots(1, 3, figsize=(13, 3.6))
    x = range(1, len(offline) + 1)
    ax[0].bar([i - 0.2 for i in x], served + [0] * (len(offline) - len(served)), 0.4, label="served")
    ax[0].bar([i + 0.2 for i in x], offline, 0.4, label="offline")
    ax[0].set(title="per-position acceptance a_i", xlabel="draft position", ylim=(0, 1.05))
    ax[0].legend()
    ax[1].bar(range(len(hist)), hist)
    ax[1].set(title="accepted drafts per verify step", xlabel="drafts accepted", ylabel="steps")
    names = [m for m, s in speeds if s]
    ax[2].bar(names, [s["median"] for _, s in speeds if s], yerr=[[s["median"] - s["p10"] for _, s in speeds if s], [s["p90"] - s["median"] for _, s in speeds if s]])
    ax[2].set(title=f"tokens/s (speedup {report['speedup']:.2f}x)" if report["speedup"] else "tokens/s", ylabel="tokens/s per request")
    fig.tight_layout()
    fig.savefig(out / "bench.png", dpi=110)
    plt.close(fig)


def main(draft: Path, prompts: Path, out: Path, metrics: Path) -> None:
    params = load_params(["target", "spec", "bench", "export"])
    tp, sp, bp = params.target, params.spec, params.bench
    version = params.export.sglang_version
    export_manifest = read_manifest(draft)
    config = json.loads((draft / "config.json").read_text())
    device = resolve_device(tp.device)
    # The config and tokenizer only: the weights load after every server has stopped, so that a
    # GPU holds one copy of the target at a time (SGLang sizes its KV pool from free memory).
    tok = load_tokenizer(tp.model, tp.revision)
    info = target_info(load_config(tp), tp)
    requested = requested_from_params(sp, bp)
    res = resolve(requested, info["architecture"], version, draft_architecture=(config.get("architectures") or [None])[0],
                  draft_context_length=config.get("max_position_embeddings"),
                  target_context_length=info["max_position_embeddings"], max_concurrency=max(bp.concurrency))
    if bp.backend == "url":
        # The server already runs with whatever flags it was given: measure it and report, refuse nothing.
        for f in res.errors + res.adjustments:
            print(f"bench: warning: {f}")
        if bp.server_log and not Path(bp.server_log).exists():
            raise UserError(f"bench.server_log: {bp.server_log} not found; give the log file of the server at {bp.url}, or \"\"")
    else:
        res.enforce(sp.on_adjust)  # before anything starts
    flags = res.effective
    if bp.backend == "reference" and (flags.algorithm != "EAGLE3" or flags.topk is None):
        raise UserError(f"the reference backend runs EAGLE3 with explicit num_steps/topk; got {dataclasses.asdict(flags)}")
    rows = read_eval_prompts(prompts, bp.num_prompts + bp.warmup)
    if len(rows) <= bp.warmup:
        raise UserError(f"{prompts / 'eval.jsonl'} has {len(rows)} prompts, not more than bench.warmup={bp.warmup}")
    ids = bench.render_prompts(tok, rows)
    sampling = {"max_new_tokens": bp.max_new_tokens, "temperature": 0.0, "ignore_eos": bp.ignore_eos}
    inputs = {"export": export_manifest["config_hash"], "prompts": read_manifest(prompts)["config_hash"]}
    used = as_dict(params)
    used["export"] = {"sglang_version": version}  # the one export key bench reads (as dvc.yaml lists it)
    manifest = build_manifest("bench", used, inputs, __file__)
    out.mkdir(parents=True, exist_ok=True)

    # Baseline and speculation: same prompts and lengths, same run; every server stopped after.
    log = out / "server-spec.log"
    base_log = out / "server-baseline.log"
    print(f"bench: speculative server {flags.algorithm} steps={flags.num_steps} topk={flags.topk} draft_tokens={flags.num_draft_tokens}")
    if bp.backend == "reference" or (bp.backend == "sglang" and bp.side_by_side):
        # Both servers up at once: requests alternate between them, so a change in the machine's
        # load hits both alike (SGLang: the second server sizes its KV pool from what the first left).
        print("bench: and a baseline server (no speculation); requests alternate between the two")
        spec_port = sglang_free_port() if bp.backend == "sglang" else None  # the baseline has bench.port
        with start(bp.backend, bp, tp, draft, flags, version, base_log, speculative=False) as base_url, \
             start(bp.backend, bp, tp, draft, flags, version, log, speculative=True, port=spec_port) as url:
            got = measure({"baseline": base_url, "speculative": url}, bp, ids, sampling, bp.warmup)
        baseline, spec = got["baseline"], got["speculative"]
    else:
        # One server at a time (bench.side_by_side: false), baseline first.
        baseline = None
        if bp.backend != "url":
            with start(bp.backend, bp, tp, draft, flags, version, base_log, speculative=False) as base_url:
                baseline = measure({"baseline": base_url}, bp, ids, sampling, bp.warmup)["baseline"]
        with start(bp.backend, bp, tp, draft, flags, version, log, speculative=True) as url:
            spec = measure({"speculative": url}, bp, ids, sampling, bp.warmup)["speculative"]
    if not spec["spec"]:
        raise UserError(f"the server at {url} returned no speculative counters (spec_verify_ct): is it running with speculation?")
    if bp.backend == "url" and bp.server_log:
        log = Path(bp.server_log)  # the running server's own log, read like a launched one's
    server_log = read_log(log) if log.exists() else None

    # The offline isolation run: the same exported draft in-process, fed as the exported config says.
    target, _ = load_target(tp, device)
    embed = target.get_input_embeddings().weight
    d, _ = load_exported(draft, embed=embed, dtype=embed.dtype, as_sglang=True)  # as served, faults included
    d.to(device)
    ids_cfg = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    physical = captured_physical(info["architecture"], info["num_layers"], ids_cfg, version)
    eos = {target.generation_config.eos_token_id, tok.eos_token_id} - {None}
    print("bench: offline run (in-process, no server)")
    offline = bench.offline_run(target, d, ids[bp.warmup:], flags, physical, bp.max_new_tokens, eos, bp.ignore_eos)
    costs = bench.measure_costs(target, d, ids[bp.warmup], physical)
    acceptance = spec["spec"]["acceptance"] or offline["acceptance"]
    advice = bench.advise(acceptance, costs)
    best = max(advice, key=lambda r: r["predicted_speedup"])
    ran = next((r for r in advice if r["num_steps"] == flags.num_steps and flags.topk == 1), None)

    speedup = spec["speed"]["median"] / baseline["speed"]["median"] if baseline else None
    report = {
        "backend": bp.backend,
        "sglang_version": version,
        "target": {k: info[k] for k in ("model", "revision", "architecture", "num_layers", "hidden_size", "vocab_size", "max_position_embeddings")},
        "draft_dir": str(draft),
        "flags": {**res.as_dict(), "served": served_flags(spec["server_flags"]),
                  "adjustments": [dataclasses.asdict(f) for f in res.adjustments], "on_adjust": sp.on_adjust},
        "baseline": {"tokens_per_s": baseline["speed"]} if baseline else None,
        "spec": {**spec["spec"], "tokens_per_s": spec["speed"]},
        "offline": {k: offline[k] for k in ("tau", "acceptance", "tokens_per_s")},
        "speedup": speedup,
        "server_accept_length": spec["server_accept_length"],
        "server_log": str(log) if log.exists() else None,
        "log_accept_len": [d.accept_len for d in server_log.decode if d.accept_len is not None] if server_log else [],
        "log_adjustments": [dataclasses.asdict(a) for a in server_log.adjustments] if server_log else [],
        "sweep": {"baseline": baseline["sweep"] if baseline else [], "speculative": spec["sweep"]},
        "costs": {"baseline_step_ms": 1e3 * costs["baseline_step_s"], "draft_step_ms": 1e3 * costs["draft_step_s"],
                  "verify_ms_by_width": {str(w): 1e3 * s for w, s in costs["verify_s"].items()}},
        "advice": {"candidates": advice, "recommended": best,
                   "predicted_vs_measured": {"predicted_tau": ran["predicted_tau"], "measured_tau": spec["spec"]["tau"],
                                             "predicted_speedup": ran["predicted_speedup"], "measured_speedup": speedup} if ran else None},
        "hardware": {"device": device, "cpu": platform.processor() or platform.machine(), "torch_threads": torch.get_num_threads(),
                     "gpu": torch.cuda.get_device_name(0) if device == "cuda" else None},
    }
    atomic_write_text(out / "requests.jsonl", "".join(json.dumps({"mode": m, "meta": x}) + "\n" for m, src in (("baseline", baseline), ("speculative", spec)) if src for x in src["metas"]))
    write_plots(out, report)
    key = {"backend": bp.backend, "num_steps": flags.num_steps, "topk": flags.topk, "num_draft_tokens": flags.num_draft_tokens,
           "capture_physical_layers": physical, "target": tp.model, "sglang_version": version}
    figures = {"tau": report["spec"]["tau"], "offline_tau": offline["tau"], "speedup": speedup,
               "tokens_per_s": spec["speed"]["median"], "baseline_tokens_per_s": baseline["speed"]["median"] if baseline else None,
               "accept_rate": report["spec"]["accept_rate"]}
    manifest["info"] = {"figures": figures, "flags": report["flags"]}
    write_manifest(out, manifest)
    atomic_write_json(metrics, with_lineage({**figures, **report}, manifest, key))
    sp_txt = f"{speedup:.2f}x" if speedup else "n/a"
    print(f"bench: tau {report['spec']['tau']:.2f} served, {offline['tau']:.2f} offline; "
          f"{spec['speed']['median']:.1f} tok/s vs {baseline['speed']['median'] if baseline else float('nan'):.1f} baseline "
          f"(speedup {sp_txt}); recommended num_steps={best['num_steps']} (predicted {best['predicted_speedup']:.2f}x) -> {metrics}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--draft", type=Path, default=Path("models/draft"))
    ap.add_argument("--prompts", type=Path, default=Path("data/prompts"))
    ap.add_argument("--out", type=Path, default=Path("reports/bench"))
    ap.add_argument("--metrics", type=Path, default=Path("reports/bench.json"))
    a = ap.parse_args()
    run_stage(main, a.draft, a.prompts, a.out, a.metrics)
