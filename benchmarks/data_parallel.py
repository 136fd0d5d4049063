"""Data parallel on the GPUs of one host: DDP draft training and data-parallel extraction (one run, one JSON).

    python benchmarks/data_parallel.py --out DIR            # >= 2 GPUs: the 8B-shaped draft and target, random weights
    python benchmarks/data_parallel.py --quick --out DIR    # a CPU: tiny shapes, 2 processes over gloo (the test)

Every launch is the project's own code: `train.fit` (what `torchrun -m stages.train` runs) and the extract stage
(`torchrun -m stages.extract`), one process per GPU, NCCL_NVLS_ENABLE=0 (NVLink multicast off). Sections:
  training    synthetic features of the 8B-shaped draft (hidden 4096, target vocab 128256, draft vocab 32000,
              3 aux layers, 7 TTT steps), global batch 4 x 2048 tokens: train.fit in 1 process, then in 2
              (torchrun). Per-step loss and seconds; scaling efficiency = tokens/s with 2 / (2 x tokens/s with 1),
              over the steps after the first two; loss curves compared step by step.
  extraction  a random Llama-3.1-8B-shaped target saved to disk, synthetic answers: the extract stage in 1
              process (GPU 0), then in 2 (torchrun); every shard compared byte for byte, tokens/s from each manifest.
DIR/results.json is rewritten after every figure; DIR/logs/ keeps each launch's output.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RESULTS: dict = {}


def plan(quick: bool) -> dict:
    if quick:
        return dict(target=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                                num_key_value_heads=2, vocab_size=256, max_position_embeddings=512),
                    draft_vocab=128, seq=64, batch=4, steps=4, ttt=3, layers=[0, 1, 2],
                    rows=24, row_tokens=48, shard_tokens=200, extract_batch=4)
    return dict(target=dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                            num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192),
                draft_vocab=32000, seq=2048, batch=4, steps=12, ttt=7, layers=[1, 15, 28],
                rows=256, row_tokens=1024, shard_tokens=16384, extract_batch=16)


def record(key: str, value, out: Path) -> None:
    section, name = key.split(".", 1)
    RESULTS.setdefault(section, {})[name] = value
    print(f"[{section}] {name} = {value}", flush=True)
    tmp = out / "results.json.tmp"
    tmp.write_text(json.dumps(RESULTS, indent=2))
    tmp.replace(out / "results.json")


def shown(argv: list[str], cwd: Path | None = None) -> str:
    """A command as a user would type it: the interpreter by name, paths relative to the run's
    working directory or the repository root (no absolute paths of the machine that ran it)."""
    def rel(arg: str) -> str:
        if arg == sys.executable:
            return os.path.basename(arg)
        if not os.path.isabs(arg):
            return arg
        for base in ([cwd] if cwd else []) + [ROOT, Path.cwd()]:
            try:
                return Path(arg).resolve().relative_to(base.resolve()).as_posix() or "."
            except ValueError:
                continue
        return arg

    return " ".join(rel(a) for a in argv)


def launch(argv: list[str], cwd: Path, log: Path, nproc: int, env: dict | None = None) -> float:
    """Run `argv` (a python module or script and its args) in `nproc` processes in `cwd`; seconds taken."""
    head = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"] if nproc > 1 else [sys.executable]
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), "NCCL_NVLS_ENABLE": "0", "PYTHONUNBUFFERED": "1", **(env or {})}
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with open(log, "w") as f:
        f.write("$ " + shown(head + argv, cwd) + "\n")
        f.flush()
        rc = subprocess.run(head + argv, cwd=cwd, env=full_env, stdout=f, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        raise RuntimeError(f"{log.name}: rc {rc}; last lines:\n" + "\n".join(log.read_text().splitlines()[-25:]))
    return time.perf_counter() - t0


# ---------------------------------------------------------------------------------------------
# Training


def make_features(P: dict, work: Path) -> None:
    """Random features in the standardize stage's format, a random target embedding and lm_head."""
    from safetensors.torch import save_file

    from draftlab.features.dataset import pack_sequences, save_draft_vocab, shard_name, write_shard
    from draftlab.sglang.layers import physical_from_user_layers

    t, H, k = P["target"], P["target"]["hidden_size"], len(P["layers"])
    g = torch.Generator().manual_seed(0)
    meta = {"physical_layers": physical_from_user_layers(P["layers"]), "hidden_size": H, "num_layers": t["num_hidden_layers"],
            "architecture": "LlamaForCausalLM", "vocab_size": t["vocab_size"]}
    T = P["seq"]
    for split, n in (("train", P["batch"] * P["steps"]), ("eval", P["batch"])):
        (work / "features" / split).mkdir(parents=True, exist_ok=True)
        for s in range(0, n, 4):  # 4 sequences per shard
            seqs = [{"input_ids": torch.randint(0, t["vocab_size"], (T,), generator=g),
                     "loss_mask": torch.arange(T) >= T // 8,  # a prompt, then the answer
                     "aux_hidden": torch.randn(T, k * H, generator=g).to(torch.bfloat16),
                     "final_hidden": torch.randn(T, H, generator=g).to(torch.bfloat16)} for _ in range(min(4, n - s))]
            write_shard(work / "features" / split / shard_name(s // 4), pack_sequences(seqs), meta)
    V, Vd = t["vocab_size"], P["draft_vocab"]
    kept = torch.randperm(V, generator=g)[:Vd].sort().values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[kept] = True
    save_draft_vocab(work / "features" / "draft_vocab.safetensors", kept - torch.arange(Vd), t2d)
    save_file({"embed": (torch.randn(V, H, generator=g) * 0.02).to(torch.bfloat16),
               "head": (torch.randn(V, H, generator=g) * 0.02).to(torch.bfloat16)}, str(work / "target_head.safetensors"))
    (work / "facts.json").write_text(json.dumps({**t, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
                                                 "head_dim": H // t["num_attention_heads"], **{k_: P[k_] for k_ in ("batch", "seq", "steps", "ttt")}}))


def worker_train(work: Path, result: Path) -> None:
    """One process of the training measurement (launched by `launch`, under torchrun for several)."""
    from safetensors.torch import load_file

    from draftlab import parallel
    from draftlab.train import loop
    from draftlab.train.draft import DraftConfig
    from draftlab.features.dataset import FeatureDataset, load_draft_vocab
    from draftlab.params import TrainParams

    facts = json.loads((work / "facts.json").read_text())
    device = loop.resolve_device("auto")
    rank, world = parallel.setup_distributed(device.type)
    d2t, t2d = load_draft_vocab(work / "features" / "draft_vocab.safetensors")
    w = load_file(str(work / "target_head.safetensors"))
    cfg = DraftConfig.from_target(facts, 3, len(d2t))
    draft = loop.init_draft(cfg, w["embed"].float(), w["head"].float(), d2t, t2d, seed=0)
    tp = TrainParams(seed=0, epochs=1, batch_size=facts["batch"], max_length=facts["seq"], lr=3e-4, min_lr_ratio=0.1,
                     warmup_ratio=0.0, weight_decay=0.0, grad_clip=0.5, ttt_steps=facts["ttt"], ttt_decay=0.8,
                     intermediate_size=None, checkpoint_every=0, device="auto", autocast="auto")
    resume = work / f"resume-{world}.pt"
    resume.unlink(missing_ok=True)
    steps: list[list[float]] = []
    loop.fit(draft, w["head"].float(), FeatureDataset(work / "features" / "train"), FeatureDataset(work / "features" / "eval"),
          tp, resume, f"scale-{world}", device, rank, world, stop_after_steps=facts["steps"],
          on_step=lambda s, loss, sec: steps.append([s, loss, sec]))
    if rank == 0:
        peak = torch.cuda.max_memory_allocated() / 1e9 if device.type == "cuda" else None
        result.write_text(json.dumps({"world": world, "steps": steps, "tokens_per_step": facts["batch"] * facts["seq"],
                                      "peak_mem_gb_rank0": peak, "device": str(device)}))
    parallel.finish(world)


def training(P: dict, out: Path, nprocs: int) -> None:
    work = out / "work"
    t0 = time.perf_counter()
    make_features(P, work)
    record("training.features_s", round(time.perf_counter() - t0, 1), out)
    runs = {}
    for n in (1, nprocs):
        res = work / f"train-{n}.json"
        launch([str(Path(__file__).resolve()), "--worker-train", str(work), str(res)], work, out / "logs" / f"train-{n}.log", n)
        runs[n] = json.loads(res.read_text())
    steady = {n: r["steps"][2:] or r["steps"] for n, r in runs.items()}  # the first two steps warm up
    tps = {n: runs[n]["tokens_per_step"] * len(s) / sum(x[2] for x in s) for n, s in steady.items()}
    for n in runs:
        record(f"training.tokens_per_s_{n}proc", round(tps[n], 1), out)
        record(f"training.loss_{n}proc", [round(x[1], 6) for x in runs[n]["steps"]], out)
        record(f"training.peak_mem_gb_rank0_{n}proc", runs[n]["peak_mem_gb_rank0"], out)
    record("training.scaling_efficiency", round(tps[nprocs] / (nprocs * tps[1]), 4), out)
    diffs = [abs(a[1] - b[1]) / max(abs(a[1]), 1e-12) for a, b in zip(runs[1]["steps"], runs[nprocs]["steps"])]
    record("training.loss_max_rel_diff", max(diffs), out)
    record("training.global_batch_tokens", runs[1]["tokens_per_step"], out)


# ---------------------------------------------------------------------------------------------
# Extraction


def make_target(P: dict, work: Path, quick: bool) -> Path:
    """A random target saved like a hub checkpoint, with the tiny target's chat template and tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    dest = work / "target"
    if quick:
        from tests.support.micro import save_micro_model

        save_micro_model(dest, arch="llama", num_layers=P["target"]["num_hidden_layers"])
        return dest
    cfg = LlamaConfig(**P["target"], rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(torch.float32)
    model.save_pretrained(dest)
    del model
    torch.cuda.empty_cache()
    tiny = ROOT / "models" / "tiny-target"
    for f in tiny.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, dest / f.name)
    return dest


def make_answers(P: dict, work: Path, target: Path) -> None:
    """Synthetic conversations of about row_tokens tokens each, as the synthesize stage writes them."""
    from draftlab.target.load import load_tokenizer

    tok = load_tokenizer(str(target))
    g = torch.Generator().manual_seed(1)
    (work / "synth").mkdir(parents=True, exist_ok=True)
    for split, n in (("train", P["rows"]), ("eval", max(2, P["rows"] // 16))):
        rows = []
        for i in range(n):
            ids = torch.randint(10, min(tok.vocab_size, 2000), (P["row_tokens"] + (i % 7) * 8,), generator=g).tolist()
            rows.append({"id": f"{split[0]}{i:015d}", "messages": [{"role": "user", "content": f"question {i}?"},
                                                                   {"role": "assistant", "content": tok.decode(ids, skip_special_tokens=True)}]})
        (work / "synth" / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (work / "synth" / "manifest.json").write_text(json.dumps({"config_hash": "0" * 64}))


def shard_digests(d: Path) -> dict[str, str]:
    return {p.relative_to(d).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.rglob("shard-*.safetensors"))}


def extraction(P: dict, out: Path, nprocs: int, quick: bool) -> None:
    import yaml

    work = out / "work"
    t0 = time.perf_counter()
    target = make_target(P, work, quick)
    make_answers(P, work, target)
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["target"].update(model=str(target), revision=None, dtype="float32" if quick else "bfloat16", device="auto")
    params["capture"]["layers"] = P["layers"]
    params["extract"].update(shard_tokens=P["shard_tokens"], batch_size=P["extract_batch"], dtype="bfloat16",
                             max_length=P["target"]["max_position_embeddings"])  # decoded random ids re-encode longer
    (work / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    record("extraction.setup_s", round(time.perf_counter() - t0, 1), out)
    found = {}
    for n in (1, nprocs):
        dest = work / f"hidden-{n}"
        shutil.rmtree(dest, ignore_errors=True)
        env = {"CUDA_VISIBLE_DEVICES": "0"} if n == 1 and not quick else {}
        secs = launch(["-m", "stages.extract", "--synth", "synth", "--out", dest.name], work, out / "logs" / f"extract-{n}.log", n, env)
        info = json.loads((dest / "manifest.json").read_text())["info"]
        found[n] = shard_digests(dest)
        record(f"extraction.tokens_per_s_{n}proc", info["tokens_per_s"], out)
        record(f"extraction.stage_s_{n}proc", round(secs, 1), out)
        record(f"extraction.device_{n}proc", info["device"], out)
    record("extraction.shards", len(found[1]), out)
    record("extraction.shards_identical", found[1] == found[nprocs], out)
    record("extraction.scaling_efficiency", round(RESULTS["extraction"][f"tokens_per_s_{nprocs}proc"] /
                                                  (nprocs * RESULTS["extraction"]["tokens_per_s_1proc"]), 4), out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="results directory")
    ap.add_argument("--quick", action="store_true", help="a CPU: tiny shapes, gloo")
    ap.add_argument("--nproc", type=int, default=2, help="processes (GPUs) of the data-parallel runs")
    ap.add_argument("--sections", default="training,extraction")
    ap.add_argument("--worker-train", nargs=2, metavar=("WORK", "RESULT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker_train:
        worker_train(Path(args.worker_train[0]), Path(args.worker_train[1]))
        return 0
    out = Path(args.out).resolve()
    (out / "work").mkdir(parents=True, exist_ok=True)
    if not args.quick and torch.cuda.device_count() < args.nproc:
        print(f"needs {args.nproc} GPUs, sees {torch.cuda.device_count()}: use --quick on a CPU")
        return 2
    P = plan(args.quick)
    RESULTS.clear()
    RESULTS["meta"] = {"mode": "quick" if args.quick else "full", "nproc": args.nproc, "torch": torch.__version__,
                       "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
                       "command": shown([sys.executable] + sys.argv), "plan": P}
    status = 0
    for name in args.sections.split(","):
        t0 = time.perf_counter()
        try:
            training(P, out, args.nproc) if name == "training" else extraction(P, out, args.nproc, args.quick)
        except Exception as e:  # noqa: BLE001 - one section failing must not lose the other
            record(f"{name}.error", f"{type(e).__name__}: {e}"[:3000], out)
            status = 1
        record(f"{name}.section_s", round(time.perf_counter() - t0, 1), out)
    shutil.rmtree(out / "work", ignore_errors=True)  # features and weights: gigabytes, not results
    return status


if __name__ == "__main__":
    sys.exit(main())
