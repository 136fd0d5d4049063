"""Make the embedded target model, models/tiny-target, from a seed.

Steps: generate a corpus of reasoning problems (draftlab.data.tasks), train a byte-level BPE tokenizer
on it, train a small Llama (GQA, untied embeddings) on the chat-formatted problems with the loss
on the assistant turn only, evaluate it on held-out problems (answer accuracy per family with
greedy decoding, share of generations that end with EOS, held-out loss), and write the model
directory with its eval.json and model card README.md, both filled from this run's measurements.

    python tools/make_tiny_target.py                         # GPU if there is one, else CPU
    python tools/make_tiny_target.py --device cpu --time-steps 5 --timing-out cpu-timing.json

Length: over 400 lines because the corpus, tokenizer, training loop and evaluation of the one
shipped model are read together when the model is remade; each part is a short function.
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import shlex
import string
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, not installed
from draftlab.data import tasks  # noqa: E402
from draftlab.target.tokenizer import save_tokenizer  # noqa: E402
from draftlab.fsutil import atomic_replace_dir, atomic_write_json, atomic_write_text  # noqa: E402

MAX_BYTES = 30 * 2**20  # the whole model directory must stay under 30 MiB (it is committed)
CARD_TEMPLATE = Path(__file__).resolve().parent / "templates" / "tiny_target_card.md"  # the model card, string.Template


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="models/tiny-target")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1, ...")
    p.add_argument("--steps", type=int, default=9000)
    p.add_argument("--batch-size", type=int, default=256, help="problems per step")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=300, help="steps of linear warm-up")
    p.add_argument("--time-limit-min", type=float, default=None,
                   help="finish the schedule early when training would take longer (minutes)")
    p.add_argument("--num-problems", type=int, default=600_000, help="training corpus size")
    p.add_argument("--vocab-size", type=int, default=2048)
    p.add_argument("--eval-per-family", type=int, default=100, help="held-out problems per family")
    p.add_argument("--max-new-tokens", type=int, default=200, help="default generation length")
    p.add_argument("--time-steps", type=int, default=0, help="only time this many steps, then exit")
    p.add_argument("--timing-out", default=None, help="where --time-steps writes its JSON")
    p.add_argument("--cpu-timing", default=None, help="a --time-steps JSON from a CPU, for the card")
    p.add_argument("--card-only", action="store_true",
                   help="only rewrite --out's README.md and eval.json from its eval.json (and --cpu-timing)")
    return p.parse_args(argv)


# ------------------------------------------------------------------------------- tokenizer
def train_tokenizer(problems, vocab_size: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE; digits split one per token (as in Llama 3 and Qwen) so arithmetic is learnable."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=tasks.SPECIAL_TOKENS + tasks.THINK_TOKENS)  # ids 0..6, as in tests.support.micro
    tok.train_from_iterator((f"{p.prompt}\n{p.reasoning}\n{p.final}" for p in problems), trainer)
    # the think markers stay single tokens but are not special: decoded text keeps them
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in tasks.THINK_TOKENS])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=tasks.EOS, pad_token=tasks.PAD,
                                   chat_template=tasks.CHAT_TEMPLATE, model_max_length=512)


def render(problem) -> tuple[str, str]:
    """(generation prompt, prompt + answer + EOS), the chat template's output written out fast."""
    prompt = f"{tasks.USER}\n{problem.prompt}{tasks.EOS}{tasks.ASSISTANT}\n"
    return prompt, prompt + problem.response + tasks.EOS


def encode(tok, problems, max_len: int):
    """ids [N, max_len] (pad-filled) and the number of prompt tokens and of all tokens per row."""
    for p in problems[:50]:  # the fast rendering must equal the chat template exactly
        assert render(p)[1] == tok.apply_chat_template(p.messages(), tokenize=False), p
        assert render(p)[0] == tok.apply_chat_template(p.messages()[:1], tokenize=False, add_generation_prompt=True)
    prompts, fulls = zip(*map(render, problems))
    n_prompt = [len(e.ids) for e in tok.backend_tokenizer.encode_batch(list(prompts))]
    full = [e.ids for e in tok.backend_tokenizer.encode_batch(list(fulls))]
    longest = max(map(len, full))
    assert longest <= max_len, f"a problem has {longest} tokens > {max_len}"
    ids = torch.full((len(full), max_len), tok.pad_token_id, dtype=torch.int16)  # vocab < 32768
    for i, row in enumerate(full):
        ids[i, :len(row)] = torch.tensor(row, dtype=torch.int16)
    return ids, torch.tensor(n_prompt), torch.tensor(list(map(len, full)))


def batch_tensors(ids, n_prompt, n_all, idx, device):
    """Inputs and labels for rows idx, trimmed to the longest row; loss only on the assistant turn."""
    width = int(n_all[idx].max())
    x = ids[idx, :width].long()
    pos = torch.arange(width)[None]
    keep = (pos >= n_prompt[idx, None]) & (pos < n_all[idx, None])
    y = torch.where(keep, x, -100)
    # right padding needs no attention mask: causal attention never looks ahead at the pads
    return x.to(device, non_blocking=True), y.to(device, non_blocking=True)


def loss_fn(model, x, y):
    logits = model(input_ids=x).logits[:, :-1]
    return F.cross_entropy(logits.flatten(0, 1).float(), y[:, 1:].flatten(), ignore_index=-100)


# ------------------------------------------------------------------------------- model
def build_model(tok) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=256, intermediate_size=768,
        num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2, head_dim=32,
        max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )
    return LlamaForCausalLM(config)


def lr_at(step: int, progress: float, args) -> float:
    """Linear warm-up, then cosine decay to 10% of the peak as progress goes from 0 to 1."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    t = min(1.0, progress)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def progress_at(step: int, seconds: float, args) -> float:
    """Share of the schedule done after warm-up: by steps, or by time under --time-limit-min."""
    by_steps = (step - args.warmup) / max(1, args.steps - args.warmup)
    if args.time_limit_min is None or step < args.warmup:
        return by_steps
    return max(by_steps, seconds / (60 * args.time_limit_min))


def make_optimizer(model, args):
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]  # no decay on norms
    other = [p for n, p in model.named_parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
                             lr=args.lr, betas=(0.9, 0.95))


def train_step(model, opt, x, y, device) -> float:
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        loss = loss_fn(model, x, y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


# ------------------------------------------------------------------------------- evaluation
@torch.no_grad()
def heldout_loss(model, data, device, batch_size=256) -> float:
    """Mean cross-entropy (nats/token) over held-out assistant turns, EOS included."""
    ids, n_prompt, n_all = data
    total, count = 0.0, 0
    for i in range(0, len(ids), batch_size):
        idx = torch.arange(i, min(i + batch_size, len(ids)))
        x, y = batch_tensors(ids, n_prompt, n_all, idx, device)
        n = int((y[:, 1:] != -100).sum())
        total += float(loss_fn(model, x, y)) * n
        count += n
    return total / count


@torch.no_grad()
def generate_answers(model, tok, problems, max_new_tokens, device, batch_size=512) -> list[tuple[str, bool]]:
    """Greedy assistant turns (text, ended with EOS) for each problem, batched with left padding."""
    tok.padding_side = "left"
    out = []
    for i in range(0, len(problems), batch_size):
        prompts = [render(p)[0] for p in problems[i:i + batch_size]]
        enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
        gen = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        for row in gen[:, enc["input_ids"].shape[1]:].tolist():
            ended = tok.eos_token_id in row
            row = row[:row.index(tok.eos_token_id)] if ended else row
            out.append((tok.decode(row), ended))
    tok.padding_side = "right"
    return out


def evaluate(model, tok, problems, data, args, device) -> dict:
    model.eval()
    answers = generate_answers(model, tok, problems, args.max_new_tokens, device)
    right, seen = defaultdict(int), defaultdict(int)
    for p, (text, _) in zip(problems, answers):
        seen[p.family] += 1
        right[p.family] += tasks.check_answer(p, text)
    accuracy = {f: right[f] / seen[f] for f in tasks.FAMILIES}
    wrong = [{"family": p.family, "prompt": p.prompt, "output": t}
             for p, (t, _) in zip(problems, answers) if not tasks.check_answer(p, t)]
    model.train()
    return {
        "accuracy_per_family": accuracy,
        "accuracy_mean": sum(accuracy.values()) / len(accuracy),
        "eos_share": sum(e for _, e in answers) / len(answers),
        "heldout_loss": heldout_loss(model, data, device),
        "num_heldout_problems": len(problems),
        "max_new_tokens": args.max_new_tokens,
        "generated_tokens_max": max(len(tok(t, add_special_tokens=False)["input_ids"]) for t, _ in answers),
        "examples_wrong": wrong[:10],
    }


# ------------------------------------------------------------------------------- writing
def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def write_model_dir(model, tok, args, out: Path) -> None:
    model.generation_config = GenerationConfig(
        max_new_tokens=args.max_new_tokens, do_sample=False,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model.save_pretrained(out)  # float32: CPU users load it without dtype surprises
    if dir_bytes(out) > MAX_BYTES * 0.95:  # leave room for the card and eval.json
        model.to(torch.bfloat16).save_pretrained(out)
    save_tokenizer(tok, out)


def _saved_dtype(path: Path) -> str:
    config = json.loads((path / "config.json").read_text())
    return config.get("dtype") or config.get("torch_dtype")


def fmt_seconds(s: float) -> str:
    return f"{s:.0f} s" if s < 120 else f"{s / 60:.1f} min" if s < 7200 else f"{s / 3600:.1f} h"


def card(info: dict) -> str:
    """The model card, CARD_TEMPLATE filled in: every figure comes from `info`, i.e. from the run that made the model."""
    a, e, t = info["architecture"], info["eval"], info["training"]
    cpu = info.get("cpu_timing")
    cpu_line = (
        f"- On a CPU ({cpu['hardware'].removeprefix('CPU ')}): {cpu['seconds_per_step']:.1f} s per step wall-clock "
        f"({cpu['cpu_seconds_per_step']:.1f} CPU-seconds per step), measured over {cpu['steps_timed']} steps "
        f"of {cpu['batch_size']} problems with `{cpu['command']}`; at that rate {t['steps']} steps would take "
        f"about {fmt_seconds(cpu['seconds_per_step'] * t['steps'])} of training. This is an extrapolation "
        f"from the timed steps, not a run; the machine was shared with other work while it was timed."
    ) if cpu else "- On a CPU: not measured."
    early = (f" (of {t['steps_planned']} planned: the schedule was compressed to fit "
             f"--time-limit-min {t['time_limit_min']})") if t["steps"] < t["steps_planned"] else ""
    values = {
        **{k: a[k] for k in ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                             "intermediate_size", "vocab_size", "max_position_embeddings", "dtype")},
        "transformers_version": info["transformers_version"],
        "longest_sequence": info["longest_sequence"],
        "parameters": f"{a['parameters']:,}",
        "dir_mib": f"{info['dir_bytes'] / 2**20:.1f}",
        "specials": ", ".join(f"`{s}` = {i}" for s, i in sorted(info["special_token_ids"].items(), key=lambda kv: kv[1])),
        "example": info["example"],
        "max_new_tokens": e["max_new_tokens"],
        "generated_tokens_max": e["generated_tokens_max"],
        "eos_token_id": info["special_token_ids"][tasks.EOS],
        "num_problems": f"{info['corpus']['num_problems']:,}",
        "seed": info["seed"],
        "num_families": len(tasks.FAMILIES),
        "families": ", ".join(tasks.FAMILIES),
        "heldout_percent": tasks.HELDOUT_PERCENT,
        "lr": t["lr"], "warmup": t["warmup"], "steps": t["steps"], "early": early, "batch_size": t["batch_size"],
        "tokens_seen_m": f"{t['tokens_seen'] / 1e6:.0f}",
        "precision": t["precision"],
        "command": info["command"],
        "hardware": info["hardware"],
        "train_time": fmt_seconds(t["seconds"]),
        "ms_per_step": f"{t['seconds'] / t['steps'] * 1000:.1f}",
        "script_time": fmt_seconds(info["script_seconds"]),
        "cpu_line": cpu_line,
        "num_heldout_problems": e["num_heldout_problems"],
        "per_family": e["num_heldout_problems"] // len(tasks.FAMILIES),
        "accuracy_rows": "\n".join(f"| {f} | {e['accuracy_per_family'][f]:.1%} |" for f in tasks.FAMILIES),
        "accuracy_mean": f"{e['accuracy_mean']:.1%}",
        "eos_share": f"{e['eos_share']:.1%}",
        "heldout_loss": f"{e['heldout_loss']:.4f}",
    }
    return string.Template(CARD_TEMPLATE.read_text()).substitute(values)


def write_card_and_eval(out: Path, info: dict) -> None:
    if info.get("cpu_timing"):  # kept beside the card, so the command can be run again as written
        atomic_write_json(out / "cpu-timing.json", info["cpu_timing"])
    info["dir_bytes"] = 0
    for _ in range(2):  # the second pass states the size that includes the card and eval.json
        atomic_write_json(out / "eval.json", info)
        atomic_write_text(out / "README.md", card(info))
        info["dir_bytes"] = dir_bytes(out)
    assert dir_bytes(out) <= MAX_BYTES, f"model directory is {dir_bytes(out)} bytes > {MAX_BYTES}"


def rewrite_card(out: Path, cpu_timing: str | None) -> dict:
    """Card and eval.json again from the figures a full run saved, adding a CPU timing run's."""
    info = json.loads((out / "eval.json").read_text())
    if cpu_timing:
        info["cpu_timing"] = json.loads(Path(cpu_timing).read_text())
    write_card_and_eval(out, info)
    for f in out.iterdir():
        f.chmod(0o644)
    return info


# ------------------------------------------------------------------------------- main
def pick_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def hardware(device: torch.device) -> str:
    if device.type == "cuda":
        return f"1x {torch.cuda.get_device_name(device)}, torch {torch.__version__}"
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"CPU {cpu}, {torch.get_num_threads()} threads, torch {torch.__version__}"


def main(argv=None):
    args = parse_args(argv)
    if args.card_only:
        return rewrite_card(Path(args.out), args.cpu_timing)
    t_start = time.time()
    device = pick_device(args.device)
    torch.manual_seed(args.seed)
    print(f"device {hardware(device)}", flush=True)

    problems = tasks.generate(args.num_problems, args.seed, "train")
    heldout = tasks.generate(args.eval_per_family * len(tasks.FAMILIES), args.seed, "heldout")
    tok = train_tokenizer(problems[:100_000], args.vocab_size)
    train_data = encode(tok, problems, max_len=256)
    heldout_data = encode(tok, heldout, max_len=256)
    print(f"corpus {len(problems)} problems, {int(train_data[2].sum()):,} tokens; vocab {len(tok)}; "
          f"prep {time.time() - t_start:.0f} s", flush=True)

    model = build_model(tok).to(device)
    opt = make_optimizer(model, args)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model {n_params:,} parameters", flush=True)

    gen = torch.Generator().manual_seed(args.seed)
    order, pos = torch.randperm(len(problems), generator=gen), 0
    tokens_seen, t_loop, t_timed = 0, time.time(), None
    total_steps = args.time_steps + 1 if args.time_steps else args.steps
    for step in range(total_steps):
        progress = progress_at(step, time.time() - t_loop, args)
        if progress >= 1.0 and step > args.warmup:  # out of time: the schedule is finished early
            break
        if pos + args.batch_size > len(order):  # next epoch, reshuffled
            order, pos = torch.randperm(len(problems), generator=gen), 0
        idx = order[pos:pos + args.batch_size]
        pos += args.batch_size
        for g in opt.param_groups:
            g["lr"] = lr_at(step, progress, args)
        x, y = batch_tensors(*train_data, idx, device)
        loss = train_step(model, opt, x, y, device)
        tokens_seen += int(train_data[2][idx].sum())
        if step == 0:  # the first step pays one-off set-up costs: time the rest
            if device.type == "cuda":
                torch.cuda.synchronize()
            t_timed, cpu_timed = time.time(), time.process_time()
        if step % 250 == 0 or step == total_steps - 1:
            ms = (time.time() - t_timed) / max(1, step) * 1000
            print(f"step {step} loss {float(loss):.4f} lr {lr_at(step, progress, args):.2e} {ms:.0f} ms/step",
                  flush=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
    steps_done, train_seconds = step + 1 if progress < 1.0 else step, time.time() - t_loop
    command = "python " + " ".join(map(shlex.quote, [Path(sys.argv[0]).as_posix()] + sys.argv[1:]))

    if args.time_steps:
        timing = {"seconds_per_step": (time.time() - t_timed) / args.time_steps, "steps_timed": args.time_steps,
                  "cpu_seconds_per_step": (time.process_time() - cpu_timed) / args.time_steps,
                  "batch_size": args.batch_size, "hardware": hardware(device),
                  "threads": torch.get_num_threads(), "command": command}
        print(json.dumps(timing, indent=2))
        if args.timing_out:
            atomic_write_json(args.timing_out, timing)
        return timing

    # write the weights first: a failure in evaluation must not lose the trained model
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}."))
    write_model_dir(model, tok, args, tmp)

    model.eval()
    result = evaluate(model, tok, heldout, heldout_data, args, device)
    print(json.dumps({k: v for k, v in result.items() if k != "examples_wrong"}, indent=2), flush=True)

    cfg = model.config
    info = {
        "seed": args.seed,
        "command": command,
        "hardware": hardware(device),
        "transformers_version": transformers.__version__,
        "architecture": {k: getattr(cfg, k) for k in (
            "num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
            "intermediate_size", "vocab_size", "max_position_embeddings", "tie_word_embeddings")}
        | {"parameters": n_params, "dtype": _saved_dtype(tmp)},
        "special_token_ids": {s: tok.convert_tokens_to_ids(s) for s in tasks.SPECIAL_TOKENS + tasks.THINK_TOKENS},
        "corpus": {"num_problems": len(problems), "tokens": int(train_data[2].sum()),
                   "families": list(tasks.FAMILIES), "split": "train"},
        "longest_sequence": int(max(train_data[2].max(), heldout_data[2].max())),
        "training": {"steps": steps_done, "steps_planned": args.steps, "time_limit_min": args.time_limit_min,
                     "batch_size": args.batch_size, "lr": args.lr, "warmup": args.warmup,
                     "tokens_seen": tokens_seen, "seconds": train_seconds,
                     "precision": "bf16 autocast, float32 weights" if device.type == "cuda" else "float32"},
        "eval": result,
        "example": tok.apply_chat_template(heldout[0].messages(), tokenize=False),
        "cpu_timing": json.loads(Path(args.cpu_timing).read_text()) if args.cpu_timing else None,
    }
    info["script_seconds"] = time.time() - t_start  # up to writing the card
    write_card_and_eval(tmp, info)
    for f in [tmp, *tmp.iterdir()]:  # temp files are private (0600); a model directory is not
        f.chmod(0o755 if f.is_dir() else 0o644)
    atomic_replace_dir(tmp, out)
    print(f"wrote {out} ({dir_bytes(out) / 2**20:.1f} MiB) in {fmt_seconds(time.time() - t_start)}")
    return info

if __name__ == "__main__":
    main()
