"""Every load of the target goes through `loading`: any failure becomes one UserError that names
the folder, what is wrong (draftlab.target.diagnosis) and what to do; and the config values and
weights the stages rely on, checked once loaded (check_config, check_weights).
"""
from __future__ import annotations

import contextlib

from draftlab.errors import UserError
from draftlab.target.diagnosis import MAX_CAUSE, SIZES, cause_of, folder_problem, library_first, local_folder, reinstall, written_folder


def fix_for(model: str, damaged: bool = False) -> str:
    """What to do about target `model`; `damaged`: its files themselves are broken (folder_problem)."""
    if written_folder(model) is not None:  # the target stage's own output: not the user's to fix
        if damaged:
            return "the target stage wrote this folder: make it again with dvc repro --force target"
        return f"the target stage wrote this folder itself, so the installed libraries are the likely cause: {reinstall()}"
    return (f"fix {model}, or set target.model to a complete transformers model folder "
            f"(config.json, weights, tokenizer) or a hub id like org/name")


@contextlib.contextmanager
def loading(model: str, what: str, part: str = "config"):
    """Any failure inside (but a UserError, which already names its input) becomes one UserError:
    "target.model M: cannot load <what>: <why>; <what to do>". `part` (config, tokenizer, model):
    which files folder_problem looks for besides config.json."""
    try:
        yield
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 - transformers and its readers raise many types for one bad folder
        written = written_folder(model)
        if written is not None:  # a folder the project wrote and checked: the library is named first
            raise UserError(library_first(written, what, part, e)) from None
        folder = local_folder(model)
        why = (folder_problem(folder, part) if folder else None) or cause_of(e)
        fix = fix_for(model) if folder else "check the hub id and revision, or download the model once with the hub reachable"
        raise UserError(f"target.model {model!r}: cannot load {what}: {why.rstrip('.')}; {fix}") from None


def check_config(cfg, model: str) -> None:
    """The config values the stages read, sane: positive sizes, a context of 2 tokens or more, a list of architectures."""
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    for name in SIZES:
        value = getattr(text, name, None)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UserError(f"target.model {model!r}: config.json: {name} must be a positive integer, got {value!r}; {fix_for(model)}")
    context = getattr(text, "max_position_embeddings", None)
    if context is not None and (isinstance(context, bool) or not isinstance(context, int) or context < 2):
        raise UserError(f"target.model {model!r}: config.json: max_position_embeddings must be an integer >= 2 (the context "
                        f"in tokens), got {context!r}; {fix_for(model)}")
    arch = getattr(cfg, "architectures", None)
    if arch is not None and not (isinstance(arch, list) and arch and all(isinstance(a, str) for a in arch)):
        raise UserError(f"target.model {model!r}: config.json: architectures must be a list of class names such as "
                        f"[\"LlamaForCausalLM\"], got {arch!r}; {fix_for(model)}")


def in_layer_order(name: str) -> tuple:
    """A sort key that puts tensor names in layer order (layers.2 before layers.10), whatever order
    transformers listed them in (a set's: the same checkpoint named other tensors on each run)."""
    return tuple((0, int(part), "") if part.isdigit() else (1, 0, part) for part in name.split("."))


def check_weights(info: dict, model: str) -> None:
    """transformers' loading info (output_loading_info=True, or draftlab.target.layout's): a tensor
    the checkpoint lacks would be left random, one of another shape would not load, checkpoint
    tensors that do not combine (a fused MoE tensor) would not load; all are refused, named."""
    conversion = info.get("conversion_errors") or {}
    if conversion:
        named = [f"{name} ({conversion_cause(text)})" for name, text in sorted(conversion.items())]
        raise UserError(f"target.model {model!r}: the checkpoint's tensors do not combine into {'; '.join(named[:3])}"
                        + (f" (and {len(named) - 3} more)" if len(named) > 3 else "")
                        + f": a tensor is missing or of another shape; {fix_for(model)}")
    mismatched = [f"{name} is {list(ckpt)} in the checkpoint, the config needs {list(want)}"  # in layer order:
                  for name, ckpt, want in sorted(info.get("mismatched_keys") or [], key=lambda m: in_layer_order(m[0]))]
    if mismatched:
        raise UserError(f"target.model {model!r}: the weights do not fit config.json: {'; '.join(mismatched[:3])}"
                        + (f" (and {len(mismatched) - 3} more)" if len(mismatched) > 3 else "") + f"; {fix_for(model)}")
    missing = sorted(info.get("missing_keys") or [])
    if missing:
        raise UserError(f"target.model {model!r}: the weights lack {len(missing)} tensor(s) the model needs "
                        f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}); transformers would leave them "
                        f"random; {fix_for(model)}")


def conversion_cause(text: str) -> str:
    """The exception line of a conversion error transformers recorded with its traceback."""
    lines = [line.strip() for line in str(text).splitlines() if line.strip()]
    errors = [line for line in lines if not line.startswith(("File ", "Traceback", "Error: ")) and "Error: " in line]
    return (errors[-1] if errors else lines[-1] if lines else "unknown")[:MAX_CAUSE]


