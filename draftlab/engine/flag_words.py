"""The reference server's errors in the words of its own flags.

`python -m draftlab.server --model-path M` (and `draftlab check-draft PATH --target M`) load the
target and the draft with the pipeline's loaders, whose errors name params keys (target.model,
spec.topk) and stages (dvc repro target, the export stage). A user of the command typed flags: each
error is said again with the flag that set the value, and with what to do without the pipeline.
"""
from __future__ import annotations

import re

def target_words(flag: str) -> list[tuple[str, str]]:
    """(the pipeline's words, those of a command whose `flag` gave the target), applied in order: longer phrases first."""
    return [
        (r"params\.yaml: target\.model\b", flag),
        (r"params\.yaml: target\.revision\b", "--revision"),
        (r"\bset target\.model to\b", f"give {flag}"),
        (r"\bset target\.revision to\b", "give --revision"),
        (r"\btarget\.model\b", flag),
        (r"\btarget\.revision\b", "--revision"),
        (r"\btarget\.dtype\b", "--dtype"),
        (r"run the target stage first \(dvc repro target\)",
         f"{flag} loads a GGUF file through the folder the pipeline's target stage dequantizes it into: make it first "
         f"(dvc repro target, with target.model set to this file), or give {flag} a transformers model folder"),
    ]


SPEC_FLAGS = {"num_steps": "--speculative-num-steps", "topk": "--speculative-eagle-topk",
              "num_draft_tokens": "--speculative-num-draft-tokens", "algorithm": "--speculative-algorithm"}
DRAFT_WORDS = [
    (r"re-run the export stage(?: \(dvc repro(?: -f)? export\))?|run the export stage",
     "give --speculative-draft-model-path a draft folder the export stage wrote (`draftlab check-draft PATH --target MODEL` "
     "says what is wrong with one made elsewhere)"),
]


def _rewrite(message: str, words) -> str:
    for pattern, replacement in words:
        message = re.sub(pattern, lambda _: replacement, message)
    return message


def target_error(message: str, flag: str = "--model-path") -> str:
    """A target loading error as the user of a command whose `flag` gave the target reads it."""
    return _rewrite(message, target_words(flag))


def flags_error(message: str) -> str:
    """A speculative-flags error (draftlab.sglang.flags speaks of spec.*) as a --speculative-* user reads it."""
    return re.sub(r"\bspec\.(num_steps|topk|num_draft_tokens|algorithm)(: )?",
                  lambda m: SPEC_FLAGS[m.group(1)] + (" " if m.group(2) else ""), message)


def draft_error(path: str, message: str) -> str:
    """A draft loading error, naming the flag that gave the folder."""
    return f"--speculative-draft-model-path {path}: {_rewrite(message, DRAFT_WORDS)}"
