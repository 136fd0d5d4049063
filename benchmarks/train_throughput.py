"""Online training throughput: padded batches against packed ones (train.batch_tokens), tokens/s and MFU.

    python benchmarks/train_throughput.py                        # tiny shape (CPU, a minute)
    python benchmarks/train_throughput.py --shape smollm2        # SmolLM2-135M's shape (one GPU)
    python benchmarks/train_throughput.py --shape smollm2 --compile --profile --out results.json
    python benchmarks/train_throughput.py --shape smollm2-conversations --skip-padded --attention eager flex --compile --check-grads

Method. A target of the chosen shape is built with transformers' LlamaForCausalLM from a config,
random weights (bf16 on CUDA, float32 on CPU; nothing is downloaded), and a synthetic train split
is written as the extract stage writes it in online mode (a tokens record, draftlab.features.dataset
.write_tokens): `--sequences` random token sequences whose lengths are drawn like a chat set
(log-normal, median `median` tokens, clamped to [min, max]: 20-1600 at smollm2), the first 30%
of each a prompt (loss mask off), the rest an answer. The split is read by the train stage's own
reader (draftlab.features.online.OnlineFeatures: the target's forward and layer capture per batch)
and trained by the stage's own loop, draftlab.train.loop.fit, with a fresh seeded draft
(ttt_steps, draft vocab as the shape says; bf16 autocast on CUDA), once per mode:
  padded   train.batch_size `--batch-size` random sequences per step, padded to the longest
  packed   train.batch_tokens `--batch-tokens`: the same shuffle laid end to end into rows as
           wide as the longest sequence, batch_tokens // that rows per step (row padding only)
fit stops after `--warmup` + `--steps` optimizer steps (no eval); the figures cover the last
`--steps` (draftlab.train.flops.Meter, as the stage records them): real tokens/s, padding share
(padded / all token slots of the timed steps), FLOPs counted from the shapes for the target (forward
+ the soft labels' head) and the draft (7 TTT steps, forward + backward), their FLOP/s and share,
and MFU against the GPU's peak dense bf16 (draftlab.train.flops.PEAK_BF16; DRAFTLAB_PEAK_FLOPS
overrides; none on a CPU). `--compile` also runs the packed mode with the draft's decoder layer
and the soft cross-entropy under torch.compile(dynamic=True) (train.compile); `--compare-loss` adds
the compiled layer with the eager loss, `--compare-trace` the flex attention traced into the compiled
layer (TTTCache.trace_flex), `--compare-target` the target's decoder layers compiled too (which
train.compile does not do: on one H100 at smollm2-conversations, 110.0k against 105.9k tok/s once
warm, and its recompiles for new batch shapes made the first timed steps of a cold run slower than
eager: reports/perf/target-compile/), and each mode prints its warm-up (untimed steps' wall, compile
included). `--compare-cache` times the last packed mode twice more with train.state_cache's cache:
filling it (the target runs and each sequence's states are copied into the cache and read back, as
the first epoch trains) and read from it (the timed steps' states computed first, as every epoch
after the first trains). `--profile-filling` traces the filling mode instead of the plain one. `--attention eager flex` times the packed modes with each TTT attention kernel
(train.attention; flex is FlexAttention, CUDA only for training), and `--check-grads` first compares one packed step's loss and gradients under both. The shape
`smollm2-conversations` has lengths of whole regenerated conversations (20-4096 tokens). `--split DIR`
trains on a split the pipeline wrote instead (data/features/train: its tokens record, so its real
sequence lengths, loss masks and token ids; the target keeps the shape's random weights, so the
split must be of a target of that shape): what the train stage's own data costs, against the shape's
synthetic lengths. `--profile` runs --warmup + 3 more packed-mode steps under torch.profiler, traces
the 3 after the warm-up with the train stage's own tracer (draftlab.train.profile, as
DRAFTLAB_TRAIN_PROFILE does) and prints the operators with the most host time and the kernels with the
most GPU time per step, and the GPU's busy share: the union of its kernels over the traced steps' wall
time (below ~90%, the host side, not the kernels, bounds the step). `--eval DIR` times the stage's evaluation of that split
(data/features/eval) twice after each mode's timed steps: the first call includes what
compiling for evaluation costs.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from draftlab.features.dataset import build_draft_vocab, write_tokens  # noqa: E402
from draftlab.features.extract import TOKENS_FILE, decoder_layers  # noqa: E402
from draftlab.features.online import OnlineFeatures, OnlineTarget  # noqa: E402
from draftlab.params import TrainParams  # noqa: E402
from draftlab.train import evaluate, loop, objective  # noqa: E402
from draftlab.train.batches import packed_batches  # noqa: E402
from draftlab.train.draft import DraftConfig, TTTCache  # noqa: E402
from draftlab.train.flops import Meter, peak_flops  # noqa: E402
from draftlab.train.profile import StepProfile  # noqa: E402


def quiet_progress_bars() -> None:
    """fit's progress bar off (the figures printed say it all); in main only, so importing this
    module changes nothing."""
    def bar(*a, **kw):
        return bar.__wrapped__(*a, **{**kw, "disable": True})

    bar.__wrapped__, bar.write = loop.tqdm, loop.tqdm.write
    loop.tqdm = bar

SHAPES = {
    # SmolLM2-135M (its config.json), a 16k draft vocab, 7 TTT steps; lengths of a chat set
    "smollm2": dict(target=dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                                intermediate_size=1536, vocab_size=49152, max_position_embeddings=8192, rope_theta=100000.0,
                                rms_norm_eps=1e-5, tie_word_embeddings=True),
                    draft_vocab=16384, ttt_steps=7, lengths=(20, 1600, 350), sequences=2048, batch_size=32,
                    batch_tokens=32768, steps=20, warmup=5),
    # the same model over whole regenerated conversations (prompts.turns all): up to 4096 tokens
    "smollm2-conversations": dict(target=dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                                              intermediate_size=1536, vocab_size=49152, max_position_embeddings=8192,
                                              rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True),
                                  draft_vocab=16384, ttt_steps=7, lengths=(20, 4096, 1200), sequences=1024, batch_size=8,
                                  batch_tokens=32768, steps=12, warmup=4),
    # small enough for two CPU cores
    "tiny": dict(target=dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                             intermediate_size=128, vocab_size=512, max_position_embeddings=1024, rope_theta=10000.0,
                             rms_norm_eps=1e-5, tie_word_embeddings=False),
                 draft_vocab=256, ttt_steps=3, lengths=(8, 160, 40), sequences=96, batch_size=8,
                 batch_tokens=640, steps=6, warmup=2),
}


def chat_lengths(n: int, low: int, high: int, median: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * 0.9 + math.log(median)
    return x.exp().round().clamp(low, high).long().tolist()


def build_target(t: dict, device: torch.device):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(**t)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(dtype).eval()
    model.requires_grad_(False)
    return model


def write_split(root: Path, lengths: list[int], t: dict, physical: list[int], dtype: str) -> Path:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, t["vocab_size"], (sum(lengths),), generator=g)
    mask = torch.cat([torch.arange(n) >= int(0.3 * n) for n in lengths])
    offsets = torch.tensor([0] + lengths).cumsum(0)
    meta = {"physical_layers": physical, "hidden_size": t["hidden_size"], "num_layers": t["num_hidden_layers"],
            "architecture": "LlamaForCausalLM", "vocab_size": t["vocab_size"], "dtype": dtype}
    split = root / "train"
    split.mkdir(parents=True, exist_ok=True)
    write_tokens(split / TOKENS_FILE, {"input_ids": ids, "loss_mask": mask, "seq_offsets": offsets}, meta)
    return split


def read_split(split: Path, t: dict, max_length: int) -> tuple[list[int], list[int]]:
    """(sequence lengths cut at max_length, physical layers) of a split the pipeline wrote, read as the
    train stage reads it (OnlineFeatures); SystemExit naming what does not fit the shape's target."""
    if not (split / TOKENS_FILE).exists():
        raise SystemExit(f"--split {split}: no {TOKENS_FILE} (the extract stage writes it with train.features online: "
                         f"give data/features/train)")
    ds = OnlineFeatures(split, max_length, None)
    physical = ds.physical_layers
    if not physical or max(physical) >= t["num_hidden_layers"]:
        raise SystemExit(f"--split {split}: physical layers {physical} do not fit the shape's {t['num_hidden_layers']} layers; "
                         f"pick the --shape of the target that wrote it")
    top = int(ds.input_ids.max()) if len(ds.input_ids) else 0
    if top >= t["vocab_size"]:
        raise SystemExit(f"--split {split}: token id {top} is outside the shape's vocabulary of {t['vocab_size']}; "
                         f"pick the --shape of the target that wrote it")
    return [ds.length(i) for i in range(len(ds))], physical


class Timed(Meter):
    """The stage's Meter over the steps after the first `skip` (warm-up: allocator, kernels, compile)."""

    def __init__(self, skip: int, *a):
        super().__init__(*a)
        self.skip = skip

    def step(self, *a, **kw):
        if self.skip:
            self.skip -= 1
            return
        super().step(*a, **kw)


@contextlib.contextmanager
def loss_kernel(kind: str):
    """train.compile compiles the soft cross-entropy with the draft's layer; "eager" keeps the layer
    compiled and the loss eager, to time what compiling the loss alone buys."""
    saved = objective.compiled_soft_cross_entropy
    if kind == "eager":
        objective.compiled_soft_cross_entropy = lambda: objective.soft_cross_entropy
    try:
        yield
    finally:
        objective.compiled_soft_cross_entropy = saved


def compile_layers(model, on: bool = True) -> None:
    """Each decoder layer's forward under torch.compile(dynamic=True), in place (`on=False` puts the
    eager ones back). The layers share their code, so one graph serves all of them (a second for
    batches without padding, where the model passes no mask); the capture hooks stay outside it
    (nn.Module runs them around forward)."""
    _, layers, _ = decoder_layers(model)
    for layer in layers:
        if not on:
            layer.__dict__.pop("forward", None)  # the class's own forward again
        elif "forward" not in layer.__dict__:
            layer.forward = torch.compile(layer.forward, dynamic=True)


@contextlib.contextmanager
def target_layers_compiled(model, on: bool):
    """The online target's decoder layers compiled too (`--compare-target`), which train.compile does
    not do; the next mode starts from the eager target again."""
    compile_layers(model, on)
    try:
        yield
    finally:
        compile_layers(model, False)


@contextlib.contextmanager
def flex_traced(on: bool):
    """The flex attention traced into the compiled draft layer (TTTCache.trace_flex: one graph per
    TTT step) instead of compiled apart (the default): what the default's warm-up saves, and costs."""
    saved, TTTCache.trace_flex = TTTCache.trace_flex, on
    try:
        yield
    finally:
        TTTCache.trace_flex = saved


def run_mode(name, args, shape, model, split, physical, head, embed, d2t, t2d, device, batch_tokens, compiled=False, profile=False,
             attention="auto", cache=None):
    t = shape["target"]
    facts = {**t, "num_layers": t["num_hidden_layers"], "head_dim": t["hidden_size"] // t["num_attention_heads"]}
    target = OnlineTarget(None)
    target._model, target.device = model, device  # the benchmark's target: nothing loaded from disk
    ds = OnlineFeatures(split, max(shape["lengths"][:2]), target)
    cfg = DraftConfig.from_target(facts, len(physical), len(d2t))
    draft = loop.init_draft(cfg, embed, head, d2t, t2d, seed=0)
    tp = TrainParams(seed=0, epochs=1, batch_size=args.batch_size, max_length=max(shape["lengths"][:2]), lr=1e-4,
                     min_lr_ratio=0.1, warmup_ratio=0.0, weight_decay=0.0, grad_clip=0.5, ttt_steps=shape["ttt_steps"],
                     ttt_decay=0.8, intermediate_size=None, checkpoint_every=0, device=device.type, autocast="auto",
                     features="online", batch_tokens=batch_tokens,
                     compile=compiled,  # train.compile: the stage compiles the draft's decoder layer itself
                     attention=attention)  # train.attention: the TTT attention's kernel
    steps = 3 if profile else args.steps
    available = len(loop.epoch_plans(ds, tp, 1)[0])  # past the epoch, fit would evaluate: not timed here
    if args.warmup + steps > available:
        raise SystemExit(f"{name}: an epoch has {available} steps, fewer than --warmup {args.warmup} + --steps {steps}; "
                         f"raise --sequences or lower the steps")
    if cache is not None:  # train.state_cache: "fill" as epoch 1 trains, "read" as epochs 2+ do
        ds.keep_states(device)
    if cache == "read":  # the steps' states computed first (as epoch 1 would), then read back
        loop.refill_state_cache(ds, loop.epoch_plans(ds, tp, 1)[0][: args.warmup + steps], True, device, 1, 0)
    meter = Timed(args.warmup, facts, cfg, True)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        call = lambda on_step=None: loop.fit(draft, head, ds, ds, tp, Path(tmp) / "resume.pt", name, device,  # noqa: E731
                                             stop_after_steps=args.warmup + steps, meter=meter, on_step=on_step)
        if not profile:
            call()
        else:  # the warm-up steps (compile included) run untraced; the next `steps` are traced as the stage traces its own
            traced = StepProfile(args.warmup + 1, steps, device, Path(tmp) / "step-profile.json", top=args.top)
            traced.step(0)
            call(on_step=lambda step, *_: traced.step(step))
            got = traced.close()
            print(traced.line(), flush=True)
            for group in ("host_self_time", "gpu_kernel_time"):
                for e in got[group]:
                    print(f"  {group}: {e['ms_per_step']:9.2f} ms a step  {e['calls_per_step']:7.1f} calls  {e['name'][:90]}", flush=True)
            return {"mode": name, **got}
        evals = []
        for _ in range(2 if args.eval else 0):  # the stage's evaluation of the eval split, as after an epoch
            t0 = time.perf_counter()
            evaluate.evaluate(objective.TTT(draft, tp.ttt_steps, tp.ttt_decay, loop.attention_kernel(attention, device), device.type == "cuda",
                                   compile_loss=compiled), OnlineFeatures(args.eval, tp.max_length, target), head.to(device),
                          tp.batch_size, device, loop.use_autocast("auto", device), batch_tokens=batch_tokens)
            evals.append(round(time.perf_counter() - t0, 2))
    s = meter.summary(peak_flops(device))
    if evals:
        s["eval_s"] = evals  # the first includes compiling for evaluation
    s["mode"] = name
    # the untimed steps' wall: allocator, kernel selection and, compiled, torch.compile's warm-up
    s["warmup_s"] = round(time.perf_counter() - started - meter.seconds, 1)
    s["step_s"] = round(meter.seconds / max(1, meter.steps), 4)
    if device.type == "cuda":
        s["peak_mem_gb"] = round(torch.cuda.max_memory_allocated() / 1e9, 2)
    return s


def check_grads(args, shape, model, split, physical, head, embed, d2t, t2d, device, batch_tokens):
    """One packed step of the shape, eager against flex TTT attention: loss and every gradient,
    as relative differences (bf16 autocast on CUDA: ~1e-2 is rounding, a mask error is O(1))."""
    if device.type != "cuda":
        print("grad check: FlexAttention computes gradients on CUDA only; skipped", flush=True)
        return
    t = shape["target"]
    facts = {**t, "num_layers": t["num_hidden_layers"], "head_dim": t["hidden_size"] // t["num_attention_heads"]}
    target = OnlineTarget(None)
    target._model, target.device = model, device
    ds = OnlineFeatures(split, max(shape["lengths"][:2]), target)
    cfg = DraftConfig.from_target(facts, len(physical), len(d2t))
    longest = max(ds.length(i) for i in range(len(ds)))
    rows = packed_batches([ds.length(i) for i in range(len(ds))], longest, batch_tokens // longest, 0, 0)[0]
    batch = ds.packed_batch(rows, device)
    got = {}
    for kernel in ("eager", "flex"):
        draft = loop.init_draft(cfg, embed, head, d2t, t2d, seed=0).to(device)
        labels = objective.target_labels(batch["final_hidden"], head.to(device), draft.d2t, dtype=objective.labels_dtype(device.type == "cuda"))
        with torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda"):
            loss, _ = objective.TTT(draft, shape["ttt_steps"], 0.8, kernel, device.type == "cuda")(
                batch, labels, objective.step_token_counts(batch, shape["ttt_steps"], 1))
        loss.backward()
        got[kernel] = (loss.detach().float(), {n: p.grad.float() for n, p in draft.named_parameters() if p.grad is not None})
    (le, ge), (lf, gf) = got["eager"], got["flex"]
    worst = max(((ge[n] - gf[n]).norm() / ge[n].norm().clamp(min=1e-12)).item() for n in ge)
    print(f"grad check ({sum(map(len, rows))} sequences in {len(rows)} rows): loss eager {le.item():.5f} flex {lf.item():.5f} "
          f"(relative {abs(le - lf).item() / abs(le).item():.2e}); worst parameter gradient relative difference {worst:.2e}", flush=True)


def show(s: dict) -> str:
    mfu = "n/a (CPU or unknown GPU)" if s["mfu"] is None else f"{s['mfu']:.1%}"
    flops = (f"target {s['target_flops_per_s'] / 1e12:.2f} + draft {s['draft_flops_per_s'] / 1e12:.2f} TFLOP/s "
             f"(target share {s['target_flop_share']:.0%})") if s["target_flops_per_s"] else "FLOPs n/a"
    mem = f", peak {s['peak_mem_gb']} GB" if "peak_mem_gb" in s else ""
    if "eval_s" in s:
        mem += f"; evaluation {s['eval_s'][0]} s, then {s['eval_s'][1]} s"
    return (f"{s['mode']:>15}: {s['tokens_per_s']:>10,.0f} tok/s, {s['step_s'] * 1e3:7.1f} ms/step, "
            f"padding {s['padding_share']:.1%}, MFU {mfu}, {flops}{mem}; warm-up {s['warmup_s']} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    ap.add_argument("--device", default="auto", help="auto: cuda when visible, else cpu")
    ap.add_argument("--sequences", type=int, help="train sequences (default: the shape's)")
    ap.add_argument("--batch-size", type=int, help="padded mode: sequences per step (default: the shape's)")
    ap.add_argument("--batch-tokens", type=int, nargs="*", help="packed mode: budgets to time (default: the shape's)")
    ap.add_argument("--steps", type=int, help="timed optimizer steps per mode")
    ap.add_argument("--warmup", type=int, help="untimed optimizer steps first")
    ap.add_argument("--compile", action="store_true", help="also time packed mode with torch.compile of the draft layer")
    ap.add_argument("--compare-loss", action="store_true",
                    help="with --compile, also time the compiled layer with the eager soft cross-entropy")
    ap.add_argument("--compare-target", action="store_true",
                    help="with --compile, also time the target's decoder layers compiled beside the compiled draft "
                         "(train.compile leaves the target eager)")
    ap.add_argument("--compare-cache", action="store_true",
                    help="also time the last packed mode (compiled with --compile) with train.state_cache's cache: "
                         "filling it, as the first epoch does, and read from it, as epochs after the first are (no target forward)")
    ap.add_argument("--compare-trace", action="store_true",
                    help="with --compile, also time the flex attention traced into the compiled layer (one graph "
                         "per TTT step) against the default, which compiles it apart")
    ap.add_argument("--attention", nargs="+", default=["auto"], choices=["auto", "eager", "flex"],
                    help="train.attention kernels to time in packed mode (auto: flex on CUDA, eager elsewhere)")
    ap.add_argument("--check-grads", action="store_true",
                    help="first compare one packed step's loss and gradients, eager against flex attention (CUDA)")
    ap.add_argument("--profile", action="store_true", help="top operators of 3 packed-mode steps (torch.profiler)")
    ap.add_argument("--profile-filling", action="store_true",
                    help="profile as --profile does, with the steps' states filling train.state_cache's cache (the first epoch)")
    ap.add_argument("--top", type=int, default=20, help="rows of the profile table")
    ap.add_argument("--skip-padded", action="store_true", help="time the packed mode only")
    ap.add_argument("--split", type=Path, help="train on this split the pipeline wrote (data/features/train), not the shape's synthetic one")
    ap.add_argument("--eval", type=Path, help="time the stage's evaluation of this split (data/features/eval) twice after each mode")
    ap.add_argument("--out", type=Path, help="write the figures as JSON here")
    args = ap.parse_args()
    quiet_progress_bars()
    shape = SHAPES[args.shape]
    for k in ("sequences", "batch_size", "steps", "warmup"):
        if getattr(args, k) is None:
            setattr(args, k, shape[k])
    budgets = args.batch_tokens or [shape["batch_tokens"]]
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    t = shape["target"]
    L = t["num_hidden_layers"]
    physical = [2, L // 2, L - 3]  # three layers low, middle, high, as EAGLE-3 captures
    low, high, median = shape["lengths"]
    if args.split:  # the pipeline's own split: its lengths (cut at the shape's longest, as train.max_length cuts)
        lengths, physical = read_split(args.split, t, high)
    else:
        lengths = chat_lengths(args.sequences, low, high, median)
    model = build_target(t, device)
    embed = model.get_input_embeddings().weight.detach().float().cpu()
    head = model.get_output_embeddings().weight.detach().float().cpu()
    counts = torch.bincount(torch.randint(0, t["vocab_size"], (100_000,), generator=torch.Generator().manual_seed(2)),
                            minlength=t["vocab_size"])
    d2t, t2d = build_draft_vocab(counts, shape["draft_vocab"])
    print(f"shape {args.shape} on {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}): "
          f"target hidden {t['hidden_size']} x {L} layers, vocab {t['vocab_size']}; draft vocab {shape['draft_vocab']}, "
          f"{shape['ttt_steps']} TTT steps; {len(lengths)} sequences of {min(lengths)}-{max(lengths)} tokens"
          f"{' from ' + str(args.split) if args.split else ''} (median {sorted(lengths)[len(lengths) // 2]}, "
          f"mean {sum(lengths) / len(lengths):.0f}); {args.warmup} warm-up + {args.steps} timed steps per mode", flush=True)
    results = []
    with tempfile.TemporaryDirectory() as root:
        split = args.split or write_split(Path(root), lengths, t, physical, "bfloat16" if device.type == "cuda" else "float32")
        common = (args, shape, model, split, physical, head, embed, d2t, t2d, device)
        t0 = time.perf_counter()
        if not args.skip_padded:
            results.append(run_mode(f"padded B={args.batch_size}", *common, batch_tokens=None))
            print(show(results[-1]), flush=True)
        if args.check_grads:
            check_grads(*common, batch_tokens=budgets[-1])
        for attention in args.attention:
            tag = "" if attention == "auto" else f" {attention}"
            for budget in budgets:
                results.append(run_mode(f"packed {budget}{tag}", *common, batch_tokens=budget, attention=attention))
                print(show(results[-1]), flush=True)
            variants = (["compiled"] + ["eager"] * args.compare_loss + ["traced"] * args.compare_trace
                        + ["target"] * args.compare_target)
            for variant in variants if args.compile else []:
                label = {"compiled": "", "eager": ", eager loss", "traced": ", flex traced", "target": ", target compiled"}[variant]
                try:
                    with loss_kernel(variant), flex_traced(variant == "traced"), target_layers_compiled(model, variant == "target"):
                        results.append(run_mode(f"packed {budgets[-1]}{tag} +compile{label}",
                                                *common, batch_tokens=budgets[-1], compiled=True, attention=attention))
                    print(show(results[-1]), flush=True)
                except Exception as e:  # noqa: BLE001 - report it, keep the other figures
                    print(f"torch.compile failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
        if args.compare_cache:  # the same packed mode with train.state_cache's cache: filled (epoch 1), read (epochs 2+)
            for cache, label in (("fill", "states filling the cache"), ("read", "states cached")):
                results.append(run_mode(f"packed {budgets[-1]}{' +compile' if args.compile else ''}, {label}", *common,
                                        batch_tokens=budgets[-1], compiled=args.compile, attention=args.attention[-1], cache=cache))
                print(show(results[-1]), flush=True)
        if args.profile or args.profile_filling:
            results.append(run_mode("profile" + (", states filling the cache" if args.profile_filling else ""), *common,
                                    batch_tokens=budgets[-1], profile=True, compiled=args.compile, attention=args.attention[-1],
                                    cache="fill" if args.profile_filling else None))
        print(f"({time.perf_counter() - t0:.0f} s in all)")
    f = results[0]
    print(f"FLOPs per real token: target {f['target_flops_per_token'] / 1e6:,.1f} MFLOP (forward + soft-label head), "
          f"draft {f['draft_flops_per_token'] / 1e6:,.1f} MFLOP ({shape['ttt_steps']} TTT steps, forward + backward), "
          f"at these lengths")
    if args.out:
        args.out.write_text(json.dumps({"shape": args.shape, "device": str(device), "results": results}, indent=2))


if __name__ == "__main__":
    main()
