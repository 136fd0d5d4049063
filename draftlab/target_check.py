"""Why a target does not load, as one named error: every load of the target goes through `loading`.

transformers fails on a bad model folder with a dozen exception types (ValueError "Unrecognized
model" for an empty folder, huggingface_hub's StrictDataclassFieldValidationError for a string
where config.json needs an int, JSONDecodeError, SafetensorError, a KeyError of a rope type...).
`loading(model, what)` turns any of them into a UserError that names the folder, what is wrong
(read from the folder's own files where they show it, else from the exception) and what to do.

On a folder the project wrote itself (a GGUF target's models/target-dequantized) the message names
the library and its version first (draftlab.library_blame).

`check_loadable` is what the target stage runs before it pins a local folder, so that no pin is
made of a folder the later stages cannot load: the folder's files (JSON files parse to objects,
safetensors headers complete, the index's shards present), config.json and the tokenizer loaded
as the stages load them, then the model's tensors against the safetensors headers
(check_weight_layout, draftlab.weight_layout). No tensor is read: a header is a few kilobytes, and
the meta build of an 8B model takes about a second, where the pin's sha256 of its 16 GB takes 12 s
or more. Weights that are not safetensors (.bin, .gguf) are left to the stages' own load.
"""
from __future__ import annotations

import contextlib
import fnmatch
import json
from pathlib import Path

from draftlab.errors import UserError

# The JSON files transformers reads from a model folder; each must hold a JSON object.
JSON_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
              "added_tokens.json", "chat_template.json", "preprocessor_config.json", "processor_config.json",
              "*.safetensors.index.json", "*.bin.index.json")
WEIGHT_FILES = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.gguf")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model", "*.tiktoken", "*.gguf")
# The config values every stage reads (draftlab.target.target_info): positive integers.
SIZES = ("num_hidden_layers", "hidden_size", "vocab_size", "num_attention_heads")
MAX_CAUSE = 300  # characters of an exception's message quoted in an error


def local_folder(model: str) -> Path | None:
    """The folder `model` names when it is a local path, else None (a hub id)."""
    path = Path(model).expanduser()
    return path if path.exists() else None


def fix_for(model: str, damaged: bool = False) -> str:
    """What to do about target `model`; `damaged`: its files themselves are broken (folder_problem)."""
    from draftlab.library_blame import reinstall, written_folder

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
        from draftlab.library_blame import library_first, written_folder

        written = written_folder(model)
        if written is not None:  # a folder the project wrote and checked: the library is named first
            raise UserError(library_first(written, what, part, e)) from None
        folder = local_folder(model)
        why = (folder_problem(folder, part) if folder else None) or cause_of(e)
        fix = fix_for(model) if folder else "check the hub id and revision, or download the model once with the hub reachable"
        raise UserError(f"target.model {model!r}: cannot load {what}: {why.rstrip('.')}; {fix}") from None


def cause_of(e: Exception) -> str:
    """What an exception of transformers says is wrong, in one line without its advice."""
    text = str(e).strip()
    name = type(e).__name__
    if name.startswith("StrictDataclass"):  # huggingface_hub's config validation: the field and the value
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        return "config.json: " + (lines[-1] if lines else text)
    if "Unrecognized model" in text:
        return "config.json has no model_type (it names the architecture, e.g. \"llama\")"
    if "does not recognize this architecture" in text:
        return text.split(" but ", 1)[0].replace("The checkpoint you are trying to load has", "config.json has") + \
            ", which this transformers release does not know (upgrade transformers, or fix model_type)"
    if "Unrecognized configuration class" in text:
        return "config.json's model_type is not a causal language model that transformers' AutoModelForCausalLM loads"
    if isinstance(e, AttributeError) and "module 'torch' has no attribute" in text:
        return f"config.json names the dtype {text.rsplit(' ', 1)[-1]}, which torch does not have (float32, bfloat16, ...)"
    if isinstance(e, KeyError):  # e.g. a rope_type or activation config.json names that this transformers lacks
        return f"config.json names {text}, which this transformers release does not know"
    first = text.splitlines()[0] if text else ""
    return f"{name}: {first[:MAX_CAUSE]}" if first else name


def _json_problem(path: Path) -> str | None:
    try:
        value = json.loads(path.read_bytes())
    except UnicodeDecodeError:
        return f"{path.name} is not UTF-8 text"
    except json.JSONDecodeError as e:
        return f"{path.name} is not valid JSON ({e.msg} at line {e.lineno} column {e.colno})"
    except RecursionError:
        return f"{path.name}: JSON nested too deeply"
    except OSError as e:
        return f"{path.name} cannot be read ({e.strerror or e})"
    if not isinstance(value, dict):
        return f"{path.name} holds a JSON {type(value).__name__}, not an object"
    return None


def folder_problem(folder: Path, part: str = "all") -> str | None:
    """What is wrong with the files of a local model folder, when they show it; None when they look
    whole. `part`: config (config.json and the JSON files), tokenizer or model (also: its files are
    there), all."""
    from draftlab.manifest import safetensors_header

    if not folder.is_dir():
        return f"{folder} is a file, not a model folder"
    files = sorted(p for p in folder.iterdir() if not p.name.startswith("."))
    if not files:
        return f"the folder {folder} is empty"
    config = folder / "config.json"
    if not config.is_file():
        return f"no config.json in {folder}"
    for p in files:
        if p.is_file() and any(fnmatch.fnmatch(p.name, pat) for pat in JSON_FILES):
            problem = _json_problem(p)
            if problem:
                return problem
    for p in files:
        if p.suffix == ".safetensors" and p.is_file():
            try:
                safetensors_header(p)
            except UserError as e:
                return str(e)
    if part in ("model", "all") and not any(fnmatch.fnmatch(p.name, pat) for p in files for pat in WEIGHT_FILES):
        return f"no weights in {folder} (model.safetensors, its shards with model.safetensors.index.json, or *.bin)"
    if part in ("tokenizer", "all") and not any(fnmatch.fnmatch(p.name, pat) for p in files for pat in TOKENIZER_FILES):
        return f"no tokenizer in {folder} (tokenizer.json, or tokenizer.model / vocab.json and merges.txt)"
    for index in folder.glob("*.safetensors.index.json"):
        weight_map = json.loads(index.read_bytes()).get("weight_map")
        if not isinstance(weight_map, dict):
            return f"{index.name} has no weight_map object"
        missing = sorted({f for f in weight_map.values() if not isinstance(f, str) or not (folder / f).is_file()}, key=str)
        if missing:
            return f"{index.name} names shard(s) {missing[:3]} that are not in {folder}"
    return None


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


def check_weights(info: dict, model: str) -> None:
    """transformers' loading info (output_loading_info=True, or draftlab.weight_layout's): a tensor
    the checkpoint lacks would be left random, one of another shape would not load, checkpoint
    tensors that do not combine (a fused MoE tensor) would not load; all are refused, named."""
    conversion = info.get("conversion_errors") or {}
    if conversion:
        named = [f"{name} ({conversion_cause(text)})" for name, text in sorted(conversion.items())]
        raise UserError(f"target.model {model!r}: the checkpoint's tensors do not combine into {'; '.join(named[:3])}"
                        + (f" (and {len(named) - 3} more)" if len(named) > 3 else "")
                        + f": a tensor is missing or of another shape; {fix_for(model)}")
    mismatched = [f"{name} is {list(ckpt)} in the checkpoint, the config needs {list(want)}"
                  for name, ckpt, want in info.get("mismatched_keys") or []]
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


def check_loadable(model: str, revision: str | None = None) -> None:
    """UserError unless the local folder `model` loads as a target: its files, config.json and the
    tokenizer (with a chat template that renders a user turn). Hub ids are left to the stages."""
    folder = local_folder(model)
    if folder is None:
        return
    problem = folder_problem(folder, "all")
    if problem:
        raise UserError(f"target.model {model!r}: not a loadable model folder: {problem}; {fix_for(model, damaged=True)}")
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

    from draftlab.params import TargetParams
    from draftlab.target import load_config, load_tokenizer

    cfg = load_config(TargetParams(model=model, revision=revision, dtype="float32", device="cpu"))
    if type(cfg) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise UserError(f"target.model {model!r}: config.json's model_type {cfg.model_type!r} is not a causal language model "
                        f"that transformers' AutoModelForCausalLM loads; {fix_for(model)}")
    load_tokenizer(model, revision)
    if any(folder.glob("*.safetensors")):
        check_weight_layout(folder, model, cfg)


def check_weight_layout(folder: Path, model: str, cfg) -> None:
    """The model of `cfg` (config.json as load_config read it) against the safetensors headers
    (draftlab.weight_layout: a meta-device skeleton, transformers' own name conversions applied, no
    tensor read): a tensor missing or of another shape is refused. About a second for an 8B
    checkpoint, against the pin's ~12 s of sha256 over its 16 GB."""
    from draftlab.weight_layout import loading_info

    with loading(model, "the weights (config.json against the safetensors headers)", "model"):
        info = loading_info(folder, cfg)
    if info is not None:  # None: a transformers release without these loading steps; the stages' load checks
        check_weights(info, model)
