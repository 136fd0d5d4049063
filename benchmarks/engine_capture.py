"""Capture engines side by side: the states SGLang's ModelRunner captures (extract.engine sglang)
against transformers' (extract.engine transformers) on the same tokens, and each engine's capture
throughput.

    python benchmarks/engine_capture.py [--params params.yaml] [--rows 256] [--batch 16] [--max-tokens 1024]
        [--engines transformers sglang] [--engine-args attention_backend=triton] [--texts FILE]
        [--out engine-capture.json]

Reads target and capture from params.yaml (run the target stage first for a GGUF target: SGLang
loads its dequantized folder). Rows are ShareGPT texts (the packaged file's first messages) or the
lines of --texts, each tokenized alone and cut at --max-tokens; rows under 32 tokens are left out.
Both engines run in this process on one device, the reference (the first of --engines) first;
SGLang's KV pool is sized for one batch (--batch x --max-tokens tokens), as extraction sizes it.

Per captured layer it prints ||engine - reference|| / ||reference|| over the real tokens and the
worst row's, and the same against the reference's neighbouring layers, naming the closest: in the
middle of the stack neighbouring layers can differ by little more than two engines' bf16 rounding,
so the error alone does not name the layer. Then the same for the final (post-norm) state.
Throughput: tokens captured per second over all rows after one warm-up batch, synchronized, the
states left on the device (what extraction then moves to the host is the same for both).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import re
import time
import traceback
from pathlib import Path

import torch
import yaml

from draftlab.data.sharegpt import PACKAGED
from draftlab.features.engines import open_engine
from draftlab.params import load_params
from draftlab.parallel import resolve_device
from draftlab.target.load import target_info
from draftlab.target.packaged import packaged_path


def sharegpt_texts(limit_bytes: int = 8_000_000) -> list[str]:
    """The first messages of the packaged ShareGPT file, read from its head (no whole-file parse)."""
    with packaged_path(PACKAGED, "prompts.source").open(encoding="utf-8") as f:
        head = f.read(limit_bytes)
    return [json.loads(f'"{v}"') for v in re.findall(r'"value": "((?:[^"\\]|\\.)*)"', head)]


def batches(tok, texts: list[str], rows: int, batch: int, max_tokens: int, device: str):
    ids = [tok(t, add_special_tokens=False)["input_ids"][:max_tokens] for t in texts]
    ids = [x for x in ids if len(x) >= 32][:rows]
    out = []
    for i in range(0, len(ids), batch):
        part = ids[i:i + batch]
        T = max(map(len, part))
        input_ids = torch.zeros(len(part), T, dtype=torch.long)
        mask = torch.zeros(len(part), T, dtype=torch.long)
        for j, x in enumerate(part):
            input_ids[j, :len(x)], mask[j, :len(x)] = torch.tensor(x), 1
        out.append((input_ids.to(device), mask.to(device)))
    return out


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run(engine, data, physical):
    """Every batch's states (on the GPU) and the tokens/s of all but the warm-up batch."""
    engine.capture(*data[0], physical)  # warm-up: kernels compiled or tuned on first use
    sync()
    t0, got = time.perf_counter(), []
    for input_ids, mask in data:
        got.append(engine.capture(input_ids, mask, physical))
    sync()
    tokens = sum(int(m.sum()) for _, m in data)
    return got, tokens / (time.perf_counter() - t0), tokens


def errors(a, b, data):
    """(relative error over all real tokens, worst row's) of states a against b."""
    num = den = 0.0
    worst = 0.0
    for (_, mask), x, y in zip(data, a, b):
        for j in range(mask.shape[0]):
            n = int(mask[j].sum())
            d = (x[j, :n].float() - y[j, :n].float()).norm() ** 2
            r = y[j, :n].float().norm() ** 2
            num, den, worst = num + float(d), den + float(r), max(worst, float((d / r).sqrt()))
    return (num / den) ** 0.5, worst


def neighbours(physical: list[int], num_layers: int) -> list[int]:
    """Each captured layer with the ones before and after it (physical 0 .. L-1: L is the post-norm state)."""
    return sorted({j for i in physical for j in (i - 1, i, i + 1) if 0 <= j < num_layers})


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=1024)
    ap.add_argument("--out", default="engine-capture.json")
    ap.add_argument("--engine-args", nargs="*", default=[], metavar="FIELD=VALUE",
                    help="extract.engine_args for the sglang engine, over params.yaml's (attention_backend=triton, say)")
    ap.add_argument("--engines", nargs=2, default=["transformers", "sglang"], metavar=("REFERENCE", "ENGINE"),
                    help="the reference engine and the one measured against it")
    ap.add_argument("--texts", help="a text file, one row per line (default: the packaged ShareGPT's first messages)")
    a = ap.parse_args(argv)
    p = load_params(["target", "capture", "extract"], a.params)
    from draftlab.sglang.layers import ids_for_physical, physical_from_user_layers

    device = resolve_device(p.target.device)
    physical = physical_from_user_layers(p.capture.layers)
    result = {"model": p.target.model, "dtype": p.target.dtype, "physical": physical, "rows": a.rows,
              "batch": a.batch, "max_tokens": a.max_tokens, "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"}
    engine_args = {**p.extract.engine_args, **{k: yaml.safe_load(v) for k, v in (x.split("=", 1) for x in a.engine_args)}}
    result["engine_args"] = engine_args
    ref = a.engines[0]
    labels = [ref, a.engines[1] if a.engines[1] != ref else f"{ref} (again)"]
    states, data, num_layers = {}, None, None
    for k, (name, label) in enumerate(zip(a.engines, labels)):
        t0 = time.perf_counter()
        try:
            args = engine_args if name == "sglang" else {}
            engine = open_engine(p.target, dataclasses.replace(p.extract, engine=name, engine_args=args), device,
                                 layer_ids=ids_for_physical, max_tokens=a.batch * a.max_tokens)
            load_s = time.perf_counter() - t0
            if k == 0:
                texts = Path(a.texts).read_text().splitlines() if a.texts else sharegpt_texts()
                data = batches(engine.tokenizer, texts, a.rows, a.batch, a.max_tokens, device)
                num_layers = target_info(engine.config, p.target)["num_layers"]
            # The reference also captures each layer's neighbours: mid-stack states can differ from the next
            # layer's by about as much as two engines' bf16 kernels differ, so the error alone does not name the layer.
            got, tok_s, tokens = run(engine, data, neighbours(physical, num_layers) if k == 0 else physical)
            states[label] = got
            result[label] = {"load_s": round(load_s, 1), "tok_s": round(tok_s), "tokens": tokens,
                             "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if torch.cuda.is_available() else None}
            print(f"{label}: loaded in {load_s:.1f} s, {tokens} tokens at {tok_s:,.0f} tok/s", flush=True)
            engine.close()
        except Exception as e:  # noqa: BLE001 -- the measurement names what failed and goes on
            traceback.print_exc()
            result[label] = {"error": f"{type(e).__name__}: {e}"}
            if k == 0:
                break  # nothing to measure against
    if len(states) == 2:
        ref_states, got_states = (states[x] for x in labels)
        rows = {}
        for i in physical:
            near = {j: errors([g[0][i] for g in got_states], [g[0][j] for g in ref_states], data)
                    for j in neighbours([i], num_layers)}  # (all, worst row) against each; j == i is the error
            rows[f"physical {i}"] = {**dict(zip(("all", "worst_row"), near[i])),
                                     **{f"against physical {j}": e[0] for j, e in near.items() if j != i},
                                     "closest": min(near, key=lambda j: near[j][0])}
        rows["final (after the norm)"] = dict(zip(("all", "worst_row"), errors([g[1] for g in got_states],
                                                                               [g[1] for g in ref_states], data)))
        result["relative_error"] = {k: {n: round(v, 5) if isinstance(v, float) else v for n, v in row.items()}
                                    for k, row in rows.items()}
        for k, row in rows.items():
            others = ", ".join(f"{n} {v:.4f}" for n, v in row.items() if n.startswith("against"))
            print(f"{k:>24}: relative error {row['all']:.4f} (worst row {row['worst_row']:.4f})"
                  + (f"; {others}; closest: physical {row['closest']}" if others else ""))
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
