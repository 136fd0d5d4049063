"""Serve an 8B-cost twin with and without its EAGLE-3 draft on one GPU and measure what speculation gains.

The target is the twin of a small Llama (tools/make_twin.py: the Llama-3.1-8B body computing the
small model's function) and the draft is the small model's trained EAGLE-3 draft inflated to the
twin's width (make_twin.py --draft). Both are built here unless they exist already.

A baseline SGLang server (no speculation) starts first and stays up; then, for each speculative
configuration STEPS-TOPK-DRAFT_TOKENS, an EAGLE3 server starts beside it (one after the other:
each waits for /health) and the two are measured paired: one request at a time, alternating
baseline and speculative (ABBA order), the same prompts, greedy. Per configuration:

    speedup   = speculative tokens/s / baseline tokens/s, each pooled (total tokens / total seconds)
    served tau = sum completion_tokens / sum spec_verify_ct (SGLang's meta_info, pooled)
    identical  = share of prompts whose greedy text is the same on both servers

plus, optionally, throughput at higher concurrency (all prompts sent with N in flight, baseline
then speculative). The results JSON is rewritten after every configuration.

    python tools/serve_8b_twin.py --small models/tiny-target --small-draft models/draft \\
        --prompts data/prompts/eval.jsonl --work-dir /data/twin8b --out results.json \\
        --configs 3-1-4,5-1-6,7-1-8,5-4-8 --concurrency 4,8,16
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT))  # a checkout's draftlab, unless one is importable already (PYTHONPATH, installed)

ATTENTION_BACKEND = "triton"  # launch_argv passes it as --attention-backend (from SpecFlags)
SERVER_ARGS = ["--sampling-backend", "pytorch", "--grammar-backend", "none", "--disable-piecewise-cuda-graph"]
# SGLang's default is a prefill CUDA graph (piecewise, captured over a range of token counts): a
# prefill then costs a few graph replays rather than hundreds of eager kernel launches. Off, start-up
# is shorter, and every new request's prefill stalls the decode batch longer (about 25-35 ms per
# request for the 8B-cost twin, measured in reports/gpu-8b/same-batches).
NO_PREFILL_GRAPH = "--disable-piecewise-cuda-graph"


def server_args(prefill_graph: bool) -> list[str]:
    """The servers' common flags, with SGLang's prefill CUDA graph on (its default) or off."""
    return [a for a in SERVER_ARGS if not (prefill_graph and a == NO_PREFILL_GRAPH)]
NOMINAL_BANDWIDTH = 4.8e12  # H200 HBM3e, bytes/s (NVIDIA's figure)


# ---------------------------------------------------------------------------------------------
# arguments

def parse_config(text: str) -> tuple[int, int, int]:
    """'5-1-6' -> (num_steps, topk, num_draft_tokens); a chain needs draft tokens = steps + 1."""
    try:
        steps, topk, tokens = (int(x) for x in text.split("-"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: a configuration is STEPS-TOPK-DRAFT_TOKENS, e.g. 5-1-6") from None
    if min(steps, topk, tokens) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: every number must be >= 1")
    if topk == 1 and tokens != steps + 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a chain (topk 1) verifies steps + 1 = {steps + 1} tokens; "
                                         "SGLang would change it silently")
    if tokens > steps * topk + 1:
        raise argparse.ArgumentTypeError(f"{text!r}: {tokens} draft tokens exceed the tree's steps x topk + 1 = {steps * topk + 1}")
    return steps, topk, tokens


def prompt_windows(rows: list, offset: int, num_prompts: int, concurrency_prompts: int | None) -> tuple[list, list]:
    """(bs=1 prompts, concurrency prompts): eval rows from `offset` on. With offset = bench.warmup and
    concurrency_prompts = bench.num_prompts they are the very prompts the bench stage measured, so advice
    calibrated on the bench stage's batches is compared on the same batches (a batch's throughput depends
    on its prompts' output lengths: which ones are still running in its last wave)."""
    n_conc = concurrency_prompts or num_prompts
    window = rows[offset:offset + max(num_prompts, n_conc)]
    if len(window) < max(num_prompts, n_conc):
        raise SystemExit(f"error: --prompts has {len(rows)} rows; --prompt-offset {offset} + {max(num_prompts, n_conc)} prompts "
                         "needs more")
    return window[:num_prompts], window[:n_conc]


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()] if text else []


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", default="models/tiny-target", help="the small Llama the twin inflates")
    ap.add_argument("--small-draft", default="models/draft", help="its EAGLE-3 draft (SGLang layout)")
    ap.add_argument("--work-dir", required=True, help="where the twin, the inflated draft and the server logs go")
    ap.add_argument("--twin", default=None, help="an existing twin (default WORK_DIR/twin, built if missing)")
    ap.add_argument("--draft", default=None, help="an existing inflated draft (default WORK_DIR/draft, built if missing)")
    ap.add_argument("--prompts", default=None, help="a .jsonl of {'messages': [...]} rows (rendered with the chat template)")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--concurrency-prompts", type=int, default=None,
                    help="prompts per batch with requests in flight (default --num-prompts); more waves of the batch "
                         "are in steady state, fewer are its first prefills and its last stragglers")
    ap.add_argument("--prompt-offset", type=int, default=0,
                    help="eval rows to skip first: the bench stage's warm-up prompts (bench.warmup), so the batches are its")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--configs", type=lambda s: [parse_config(c) for c in s.split(",")],
                    default=[(3, 1, 4), (5, 1, 6), (7, 1, 8), (5, 4, 8)], help="STEPS-TOPK-DRAFT_TOKENS,...")
    ap.add_argument("--concurrency", type=int_list, default=[], help="extra concurrency levels, e.g. 4,8,16")
    ap.add_argument("--concurrency-repeats", type=int, default=2,
                    help="counted batches per server at each concurrency (ABBA pairs; each costs about one batch time per server)")
    ap.add_argument("--concurrency-configs", default="chains", help="'chains', 'all' or STEPS-TOPK-TOKENS,...: "
                    "the configurations that get the concurrency sweep")
    ap.add_argument("--prefill-cuda-graph", choices=("on", "off"), default="off",
                    help="on: SGLang's default prefill CUDA graph; off: eager prefill, a shorter start-up (default)")
    ap.add_argument("--prefill-probe", action="store_true",
                    help="also time prompt-only requests (max_new_tokens 1) at every concurrency on each server: what a "
                         "request costs the server besides its decode rounds")
    ap.add_argument("--mem-fraction-static", type=float, default=0.4, help="per server (two share the GPU)")
    ap.add_argument("--max-running-requests", type=int, default=16, help="both servers (also caps CUDA-graph batch sizes)")
    ap.add_argument("--port", type=int, default=31000, help="baseline port; the speculative server uses port + 1 (<= 55535)")
    ap.add_argument("--baseline-url", default=None, help="a baseline server of the same twin already running (same "
                    "server flags, no speculation): measure against it instead of starting one")
    ap.add_argument("--baseline-log", default=None, help="that server's log (its decode-rate lines go in the results)")
    ap.add_argument("--startup-timeout-s", type=float, default=600)
    ap.add_argument("--advise-from", default=None,
                    help="the bench stage's bench.json: after --configs, the advice is fitted on the rounds measured "
                         "(draftlab.served_fits.advise_served) and the configuration it picks is measured too")
    ap.add_argument("--advise-after", type=int, default=3,
                    help="with --advise-from: how many of --configs are measured before the advice picks (the rest after its pick)")
    ap.add_argument("--deadline-s", type=float, default=None,
                    help="stop starting configurations that would not finish within this many seconds of the start")
    ap.add_argument("--out", default=None, help="results JSON (required unless --build-only), rewritten after every configuration")
    ap.add_argument("--mirror", default=None, help="a second copy of the results JSON; configurations in it are skipped")
    ap.add_argument("--build-only", action="store_true", help="build the twin and the inflated draft, then stop")
    args = ap.parse_args(argv)
    if args.build_only:
        return args
    if args.prompts is None or args.out is None:
        ap.error("--prompts and --out are required (unless --build-only)")
    if args.port + 1 > 55535:
        ap.error("--port: SGLang derives a gRPC port as port + 10000, which must stay <= 65535; use a port <= 55534")
    return args


# ---------------------------------------------------------------------------------------------
# figures (no GPU needed)

def config_name(cfg) -> str:
    return "-".join(str(x) for x in cfg)


def pair_order(n: int) -> list[tuple[int, str]]:
    """(prompt index, mode) in ABBA order: baseline first on even prompts, speculative first on odd ones."""
    order = []
    for i in range(n):
        modes = ("baseline", "spec") if i % 2 == 0 else ("spec", "baseline")
        order += [(i, m) for m in modes]
    return order


def aggregate(records: list[dict]) -> dict:
    """Paired figures from records {'index', 'mode', 'seconds', 'text', 'meta'} (meta: a GenerateMeta)."""
    by = {m: [r for r in records if r["mode"] == m] for m in ("baseline", "spec")}
    out = {}
    for mode, rs in by.items():
        tokens, seconds = sum(r["meta"].completion_tokens for r in rs), sum(r["seconds"] for r in rs)
        server_s = sum(r["meta"].e2e_latency or 0.0 for r in rs)
        out[mode] = {"requests": len(rs), "completion_tokens": tokens, "seconds": seconds,
                     "tokens_per_s": tokens / seconds if seconds else float("nan"),
                     "server_tokens_per_s": tokens / server_s if server_s else None,
                     "median_request_tokens_per_s": statistics.median(r["meta"].completion_tokens / r["seconds"] for r in rs) if rs else None}
    spec = by["spec"]
    verify = sum(r["meta"].spec_verify_ct or 0 for r in spec)
    out["served_tau"] = out["spec"]["completion_tokens"] / verify if verify else float("nan")
    out["spec_verify_ct"] = verify
    correct = sum(r["meta"].spec_num_correct_drafts or 0 for r in spec)
    proposed = sum(r["meta"].spec_num_proposed_drafts or 0 for r in spec)
    out["accepted_drafts_per_proposed"] = correct / proposed if proposed else None
    out["speedup"] = out["spec"]["tokens_per_s"] / out["baseline"]["tokens_per_s"]
    # per request: prompt, mode, seconds, completion tokens, verify rounds (the served-round fit reads them)
    out["requests"] = [[r["index"], r["mode"], round(r["seconds"], 5), r["meta"].completion_tokens, r["meta"].spec_verify_ct or 0]
                       for r in records]
    texts = {m: {r["index"]: r["text"] for r in rs} for m, rs in by.items()}
    both = sorted(set(texts["baseline"]) & set(texts["spec"]))
    same = [i for i in both if texts["baseline"][i] == texts["spec"][i]]
    out["greedy_identical"] = len(same) / len(both) if both else float("nan")
    out["greedy_differs_at_prompts"] = [i for i in both if i not in same]
    # per-request speedup spread (same prompt, two servers)
    secs = {m: {r["index"]: r["seconds"] for r in rs} for m, rs in by.items()}
    toks = {m: {r["index"]: r["meta"].completion_tokens for r in rs} for m, rs in by.items()}
    ratios = sorted((toks["spec"][i] / secs["spec"][i]) / (toks["baseline"][i] / secs["baseline"][i]) for i in both)
    if ratios:
        out["per_prompt_speedup"] = {"median": statistics.median(ratios), "min": ratios[0], "max": ratios[-1]}
    return out


def split_for_advice(configs: list, todo: list, advise_after: int | None) -> tuple[list, list]:
    """(configurations to measure before the advice is fitted, those after its pick): the first
    `advise_after` of --configs come first (the fit needs a few, a tree among them, to tell a draft
    step from a verified token), so that the pick is measured before the time runs out. Without
    advice, everything is measured in order."""
    if advise_after is None:
        return list(todo), []
    head = set(configs[:advise_after])
    return [c for c in todo if c in head], [c for c in todo if c not in head]


def measured_rounds(configs: dict) -> dict:
    """{(steps, topk, tokens): served_fits.served_round} of every configuration whose paired requests were kept."""
    from draftlab.served_fits import served_round

    out = {}
    for entry in configs.values():
        rows = entry.get("requests")
        if not rows:
            continue
        base = [(tok, sec) for _, mode, sec, tok, _ in rows if mode == "baseline"]
        spec = [(tok, ver, sec) for _, mode, sec, tok, ver in rows if mode == "spec"]
        got = served_round(base, spec)
        if got:
            out[(entry["num_steps"], entry["topk"], entry["num_draft_tokens"])] = got
    return out


def served_advice(results: dict, bench: dict) -> dict:
    """served_fits.advise_served over the bench stage's candidates (their tau from the measured
    acceptance), with every served configuration's predicted and measured speedup side by side."""
    from draftlab.served_fits import advise_served

    rounds = measured_rounds(results["configs"])
    out = advise_served(bench["advice"]["candidates"], rounds)
    rows = {(c["num_steps"], c["topk"], c["num_draft_tokens"]): c for c in out["candidates"]}
    loo = {(h["num_steps"], h["topk"], h["num_draft_tokens"]): h for h in out["held_out"]}
    out["predicted_vs_measured"] = []
    for key, m in rounds.items():
        entry = results["configs"][config_name(key)]
        row, held = rows.get(key), loo.get(key)
        if row is None:
            continue
        out["predicted_vs_measured"].append({
            "config": config_name(key), "predicted_tau": row["predicted_tau"], "served_tau": m["served_tau"],
            "predicted_speedup": row["predicted_speedup"], "measured_speedup": entry["speedup"],
            "speedup_error": row["predicted_speedup"] / entry["speedup"] - 1.0,
            "held_out_speedup": held["predicted_speedup"] if held else None,
            "held_out_error": held["predicted_speedup"] / entry["speedup"] - 1.0 if held else None,
            "round_ms": 1e3 * m["round_s"]})
    return out


def bandwidth_floor(model_bytes: int, bandwidth: float) -> float:
    """Upper bound on bs=1 decode tokens/s when every weight byte is read once per token."""
    return bandwidth / model_bytes


def decode_rate_from_log(path, running_req: int = 1) -> dict | None:
    """Median of SGLang's own 'gen throughput' decode lines with that many running requests."""
    from draftlab.sglang.launch import read_log

    rates = [d.gen_throughput for d in read_log(path).decode
             if d.gen_throughput and d.running_req == running_req]
    return {"median": statistics.median(rates), "max": max(rates), "lines": len(rates)} if rates else None


def log_tail(path, n: int = 15) -> list[str]:
    try:
        return Path(path).read_text(errors="replace").splitlines()[-n:]
    except OSError:
        return []


# ---------------------------------------------------------------------------------------------
# GPU side

def load_tool(name: str):
    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parent / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def build(args) -> tuple[Path, Path, dict]:
    make_twin = load_tool("make_twin")
    work = Path(args.work_dir)
    twin, draft = Path(args.twin or work / "twin"), Path(args.draft or work / "draft")
    shape = make_twin.SHAPES["llama-3.1-8b"]
    t0 = time.perf_counter()
    if not (twin / "config.json").exists():
        make_twin.make_twin(Path(args.small), twin, shape, "llama-3.1-8b", "bfloat16")
    t1 = time.perf_counter()
    if not (draft / "config.json").exists():
        m = shape["num_hidden_layers"] // json.loads((Path(args.small) / "config.json").read_text())["num_hidden_layers"]
        make_twin.inflate_draft(Path(args.small_draft), draft, shape, m, "bfloat16")
    return twin, draft, {"twin_s": t1 - t0, "draft_s": time.perf_counter() - t1}


def measure_bandwidth(gib: float = 4.0) -> float | None:
    """Device memory bandwidth of a large copy (bytes read + written per second), or None without CUDA."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    n = int(gib * 2**30) // 2
    a = torch.empty(n, dtype=torch.bfloat16, device="cuda")
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    t0, reps = time.perf_counter(), 20
    for _ in range(reps):
        b.copy_(a)
    torch.cuda.synchronize()
    bw = 2 * a.nbytes * reps / (time.perf_counter() - t0)
    del a, b
    torch.cuda.empty_cache()
    return bw


def render(tok, rows) -> list[list[int]]:
    """Prompt token ids as the chat template renders them for generation (as draftlab.bench does)."""
    return [tok.apply_chat_template(r["messages"], add_generation_prompt=True, tokenize=True, return_dict=False) for r in rows]


def run_paired(base, spec, prompts, sampling) -> list[dict]:
    records = []
    for i, mode in pair_order(len(prompts)):
        client = base if mode == "baseline" else spec
        t0 = time.perf_counter()
        text, meta = client.generate(prompts[i], sampling)
        records.append({"index": i, "mode": mode, "seconds": time.perf_counter() - t0, "text": text, "meta": meta})
    return records


def run_batch(client, prompts, sampling, concurrency: int) -> dict:
    def one(ids):
        t0 = time.perf_counter()
        meta = client.generate(ids, sampling)[1]
        return meta, time.perf_counter() - t0

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        done = list(pool.map(one, prompts))
    wall = time.perf_counter() - t0
    metas = [m for m, _ in done]
    tokens = sum(m.completion_tokens for m in metas)
    verify = sum(m.spec_verify_ct or 0 for m in metas)
    return {"concurrency": concurrency, "requests": len(metas), "completion_tokens": tokens, "seconds": wall,
            "tokens_per_s": tokens / wall, "served_tau": tokens / verify if verify else None,
            "request_tokens_per_s": [m.completion_tokens / sec for m, sec in done if sec > 0],
            # per request, in prompt order: completion tokens, seconds, verify rounds (0 without speculation)
            "request_rows": [[m.completion_tokens, round(sec, 5), m.spec_verify_ct or 0] for m, sec in done]}


def prefill_probe(client, prompts, sampling, levels: list[int], repeats: int = 2) -> dict:
    """{n: ms per request} of prompt-only requests (max_new_tokens 1) with n in flight, after one
    uncounted batch: the server's time per request when it does nothing but admit requests (HTTP,
    tokenizing, scheduling, the prefill; on a speculative server the draft's prefill too). At n in
    flight the decode batch stalls for this while every new request is admitted."""
    one = {**sampling, "max_new_tokens": 1}
    out = {}
    for n in levels:
        run_batch(client, prompts, one, n)
        batches = [run_batch(client, prompts, one, n) for _ in range(repeats)]
        out[str(n)] = {"ms_per_request": 1e3 * sum(b["seconds"] for b in batches) / sum(b["requests"] for b in batches),
                       "repeats_ms": [1e3 * b["seconds"] / b["requests"] for b in batches]}
    return out


def run_batches_paired(base, spec, prompts, sampling, concurrency: int, repeats: int = 2) -> dict:
    """Throughput with `concurrency` requests in flight, paired: whole batches alternate between the
    two servers in ABBA order (`repeats` batches each), so a drift in the machine's load hits both.
    Each server first runs one whole batch at this concurrency that is not counted: the first
    speculative batch at a new concurrency took up to twice as long as the next."""
    for client in (base, spec):
        run_batch(client, prompts, sampling, concurrency)
    got = {"baseline": [], "spec": []}
    for rep in range(repeats):
        order = (("baseline", base), ("spec", spec)) if rep % 2 == 0 else (("spec", spec), ("baseline", base))
        for mode, client in order:
            got[mode].append(run_batch(client, prompts, sampling, concurrency))
    out = {"concurrency": concurrency, "repeats": repeats}
    for mode, batches in got.items():
        tokens, seconds = sum(b["completion_tokens"] for b in batches), sum(b["seconds"] for b in batches)
        taus = [b["served_tau"] for b in batches if b["served_tau"]]
        out[mode] = {"completion_tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
                     "per_request_tokens_per_s": statistics.median(r for b in batches for r in b["request_tokens_per_s"]),
                     "served_tau": statistics.mean(taus) if taus else None, "batches": batches}
    out["speedup"] = out["spec"]["tokens_per_s"] / out["baseline"]["tokens_per_s"]
    out["per_request_speedup"] = out["spec"]["per_request_tokens_per_s"] / out["baseline"]["per_request_tokens_per_s"]
    out.update(repeat_spread(got["baseline"], got["spec"]))
    return out


def repeat_spread(base_batches: list[dict], spec_batches: list[dict]) -> dict:
    """The speedup of each ABBA pair of batches (same prompts, back to back) and their spread
    (max / min - 1): how far the measurement itself moves between repeats. A prediction cannot be
    checked more finely than this; on one H200 two repeats of 64-prompt batches differed by up to
    32% at 8 and 16 in flight (reports/gpu-8b/same-batches)."""
    pairs = [s["tokens_per_s"] / b["tokens_per_s"] for b, s in zip(base_batches, spec_batches)]
    return {"repeat_speedups": pairs, "repeat_spread": max(pairs) / min(pairs) - 1.0 if pairs else None}


def warm_up(client, prompts, sampling) -> None:
    """Two short requests before the bs=1 pairs (each concurrency gets its own whole warm-up batch
    in run_batches_paired)."""
    short = {**sampling, "max_new_tokens": 16}
    for p in prompts[:2]:
        client.generate(p, short)


def main(argv=None) -> dict:
    args = parse_args(argv)
    start = time.perf_counter()
    import draftlab  # noqa: F401  (first: every draftlab module comes from the same package)

    if args.build_only:
        twin, draft, build_s = build(args)
        print(f"built {twin} and {draft} ({build_s})", flush=True)
        return {"build_s": build_s}
    from transformers import AutoTokenizer

    from draftlab import jsonl
    from draftlab.sglang.client import Client
    from draftlab.sglang.flags import SpecFlags
    from draftlab.sglang.launch import launch_argv, serve

    def elapsed():
        return time.perf_counter() - start

    results = {"configs": {}}
    if args.mirror and Path(args.mirror).exists():
        results = json.loads(Path(args.mirror).read_text())

    def save():
        text = json.dumps(results, indent=2) + "\n"
        for path in filter(None, (args.out, args.mirror)):
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(str(path) + ".tmp")
            tmp.write_text(text)
            tmp.replace(path)

    twin, draft, build_s = build(args)
    print(f"[{elapsed():.0f}s] twin {twin}, draft {draft} ready ({build_s})", flush=True)
    index = json.loads((twin / "model.safetensors.index.json").read_text())
    model_bytes = index["metadata"]["total_size"]
    bw = results.get("measured_copy_bandwidth") or measure_bandwidth()
    import torch

    results.update({
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "sglang_version": _version("sglang"), "torch_version": torch.__version__,
        "target": {"twin_of": Path(args.small).name, "shape": "llama-3.1-8b", "bytes": model_bytes,
                   "parameters": index["metadata"].get("total_parameters")},
        "draft": {k: v for k, v in json.loads((draft / "config.json").read_text()).items()
                  if k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                           "draft_vocab_size", "eagle_config", "draftlab")},
        "measured_copy_bandwidth": bw,
        "bandwidth_floor": {"nominal_bandwidth": NOMINAL_BANDWIDTH,
                            "tokens_per_s_at_nominal": bandwidth_floor(model_bytes, NOMINAL_BANDWIDTH),
                            "tokens_per_s_at_measured_copy": bandwidth_floor(model_bytes, bw) if bw else None},
        "method": {"prefill_cuda_graph": args.prefill_cuda_graph, "num_prompts": args.num_prompts, "concurrency_prompts": args.concurrency_prompts or args.num_prompts,
                   "concurrency_repeats": args.concurrency_repeats, "prompt_offset": args.prompt_offset, "max_new_tokens": args.max_new_tokens, "temperature": 0.0,
                   "ignore_eos": False, "pairing": "one request at a time, baseline and speculative alternating (ABBA)",
                   "server_args": ["--attention-backend", ATTENTION_BACKEND] + server_args(args.prefill_cuda_graph == "on") + ["--mem-fraction-static", str(args.mem_fraction_static),
                                                 "--max-running-requests", str(args.max_running_requests)],
                   "prompts": Path(args.prompts).name},
    })
    results.setdefault("configs", {})
    save()

    tok = AutoTokenizer.from_pretrained(str(twin), local_files_only=True)
    rows = [r for _, r in jsonl.read(args.prompts, "give a prompts stage's eval.jsonl")]
    prompts, conc_prompts = (render(tok, r) for r in prompt_windows(rows, args.prompt_offset, args.num_prompts,
                                                                     args.concurrency_prompts))
    sampling = {"max_new_tokens": args.max_new_tokens, "temperature": 0.0, "ignore_eos": False}
    extra = server_args(args.prefill_cuda_graph == "on") + ["--mem-fraction-static", str(args.mem_fraction_static)]
    probe_levels = [1] + [c for c in args.concurrency if c > 1]
    server_flags = SpecFlags(algorithm=None, max_running_requests=args.max_running_requests, attention_backend=ATTENTION_BACKEND)
    logs = Path(args.work_dir) / "logs"
    sweep_on = args.concurrency_configs

    todo = [c for c in args.configs if config_name(c) not in results["configs"]
            or "speedup" not in results["configs"][config_name(c)]]
    bench = json.loads(Path(args.advise_from).read_text()) if args.advise_from and Path(args.advise_from).exists() else None
    if args.advise_from and bench is None:
        results["served_advice"] = {"skipped": f"{Path(args.advise_from).name} not found (the bench stage did not finish)"}
    if not todo and (bench is None or "predicted_vs_measured" in results.get("served_advice", {})):
        print("every configuration is done already", flush=True)
        return results
    base_argv = launch_argv(str(twin), args.port, baseline=True, flags=server_flags, extra_args=extra)
    t0 = elapsed()
    base_log = Path(args.baseline_log) if args.baseline_log else logs / "baseline.log"
    with baseline_server(args, base_argv, base_log) as base_url, Client(base_url) as base:
        results["baseline_startup_s"] = elapsed() - t0
        results["baseline_url_given"] = bool(args.baseline_url)
        print(f"[{elapsed():.0f}s] baseline up in {results['baseline_startup_s']:.0f}s", flush=True)
        warm_up(base, prompts, sampling)
        if args.prefill_probe and "baseline_prefill_probe" not in results:
            results["baseline_prefill_probe"] = prefill_probe(base, conc_prompts, sampling, probe_levels)
            print(f"[{elapsed():.0f}s] baseline prefill probe (ms per request by concurrency): "
                  f"{ {n: round(v['ms_per_request'], 1) for n, v in results['baseline_prefill_probe'].items()} }", flush=True)
            save()
        startup_estimate = results.get("max_spec_startup_s", 150.0)

        def measure(cfg, role: str = "") -> None:
            """Serve one configuration beside the baseline and measure it paired (and its concurrency)."""
            nonlocal startup_estimate
            name = config_name(cfg)
            sweep = args.concurrency if (sweep_on == "all" or (sweep_on == "chains" and cfg[1] == 1)
                                         or name in sweep_on.split(",") or (role and role in sweep_on.split(","))) else []
            need = startup_estimate + 40 + 15 * len(sweep) * max(1.0, len(conc_prompts) / 32) * (1 + args.concurrency_repeats) / 3
            if args.deadline_s is not None and elapsed() + need > args.deadline_s:
                results["configs"][name] = {"skipped": f"not started: {need:.0f}s needed, "
                                                      f"{args.deadline_s - elapsed():.0f}s left before the deadline"}
                print(f"[{elapsed():.0f}s] {name}: skipped (time)", flush=True)
                save()
                return
            steps, topk, tokens = cfg
            flags = SpecFlags(algorithm="EAGLE3", num_steps=steps, topk=topk, num_draft_tokens=tokens,
                              max_running_requests=args.max_running_requests, attention_backend=ATTENTION_BACKEND)
            argv = launch_argv(str(twin), args.port + 1, draft_model=str(draft), flags=flags, extra_args=extra)
            log = logs / f"spec-{name}.log"
            entry = {"num_steps": steps, "topk": topk, "num_draft_tokens": tokens, **({"role": role} if role else {})}
            t0 = elapsed()
            try:
                with serve(argv, log, args.startup_timeout_s) as srv, Client(srv.url) as spec:
                    entry["startup_s"] = elapsed() - t0
                    results["max_spec_startup_s"] = startup_estimate = max(results.get("max_spec_startup_s", 0), entry["startup_s"])
                    print(f"[{elapsed():.0f}s] {name}: EAGLE3 server up in {entry['startup_s']:.0f}s", flush=True)
                    warm_up(spec, prompts, sampling)
                    t1 = elapsed()
                    entry.update(aggregate(run_paired(base, spec, prompts, sampling)))
                    entry["measure_s"] = elapsed() - t1
                    print(f"[{elapsed():.0f}s] {name}: tau {entry['served_tau']:.2f}, baseline "
                          f"{entry['baseline']['tokens_per_s']:.1f} tok/s, spec {entry['spec']['tokens_per_s']:.1f} tok/s, "
                          f"speedup {entry['speedup']:.2f}, identical {entry['greedy_identical']:.0%}", flush=True)
                    results["configs"][name] = entry
                    save()
                    if args.prefill_probe:
                        entry["prefill_probe"] = prefill_probe(spec, conc_prompts, sampling, probe_levels)
                    if sweep:
                        entry["concurrency"] = []
                        for c in sweep:
                            point = run_batches_paired(base, spec, conc_prompts, sampling, c, args.concurrency_repeats)
                            entry["concurrency"].append(point)
                            print(f"[{elapsed():.0f}s] {name} c={c}: baseline {point['baseline']['tokens_per_s']:.0f} tok/s, spec "
                                  f"{point['spec']['tokens_per_s']:.0f} tok/s, speedup {point['speedup']:.2f} "
                                  f"(per request {point['per_request_speedup']:.2f})", flush=True)
                            save()
            except Exception as e:  # noqa: BLE001  (one configuration failing must not lose the others)
                entry["error"] = f"{type(e).__name__}: {e}"[:2000]
                print(f"[{elapsed():.0f}s] {name}: FAILED {entry['error'][:500]}", flush=True)
            entry["spec_decode_log"] = decode_rate_from_log(log) if log.exists() else None
            entry["spec_log_tail"] = log_tail(log)
            results["configs"][name] = entry
            results["baseline_decode_log"] = decode_rate_from_log(base_log) if base_log.exists() else None
            save()

        first, rest = split_for_advice(args.configs, todo, args.advise_after if bench is not None else None)
        for cfg in first:
            measure(cfg)
        if bench is not None:  # the advice from the rounds measured so far; its pick is measured next
            advice = served_advice(results, bench)
            results["served_advice"] = advice
            save()
            pick = advice.get("recommended")
            if pick:
                key = (pick["num_steps"], pick["topk"], pick["num_draft_tokens"])
                print(f"[{elapsed():.0f}s] served-round advice: {advice['advice']}", flush=True)
                if "speedup" not in results["configs"].get(config_name(key), {}):
                    rest = [c for c in rest if c != key]
                    measure(key, role="advised")
                else:
                    results["configs"][config_name(key)]["role"] = "advised"
        for cfg in rest:
            measure(cfg)
        if bench is not None:
            results["served_advice"] = served_advice(results, bench)  # every measured point, the pick's included
            save()
    results["baseline_decode_log"] = decode_rate_from_log(base_log) if base_log.exists() else None
    results["baseline_log_tail"] = log_tail(base_log)
    results["wall_s"] = elapsed()
    save()
    print(f"[{elapsed():.0f}s] done", flush=True)
    return results


@contextlib.contextmanager
def baseline_server(args, argv, log):
    """The baseline's URL: --baseline-url when given (left running), else a server started here."""
    if args.baseline_url:
        yield args.baseline_url.rstrip("/")
        return
    from draftlab.sglang.launch import serve

    with serve(argv, log, args.startup_timeout_s) as srv:
        yield srv.url


def _version(name: str) -> str | None:
    try:
        from importlib.metadata import version
        return version(name)
    except Exception:  # noqa: BLE001  (a version is information, never a reason to stop)
        return None


if __name__ == "__main__":
    main()
