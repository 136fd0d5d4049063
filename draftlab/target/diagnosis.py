"""Why a target folder does not load, read from the folder's own files; and, on a folder the
project wrote itself, the library named first.

transformers fails on a bad model folder with a dozen exception types (ValueError "Unrecognized
model" for an empty folder, huggingface_hub's StrictDataclassFieldValidationError for a string
where config.json needs an int, JSONDecodeError, SafetensorError, a KeyError of a rope type...).
`folder_problem` reads what is wrong from the files themselves where they show it (JSON that does
not parse, a safetensors header cut short, an index naming shards that are not there), `cause_of`
from the exception otherwise.

The target stage writes models/target-dequantized from a GGUF target (draftlab.target.gguf, with
gguf-source.json beside the weights) and checks that it loads; every stage loads it after. A load
error there, on files the stage wrote and checked, almost always means the installed transformers
(or a package it calls into) reads the folder differently from the release that wrote it. So
`library_first` starts the message with that library and its version, says which release wrote
the folder, and says to install the versions the project pins, instead of telling the user to fix
a folder they never touched. A folder that is damaged (a file cut or edited) is told apart by its
files (folder_problem) and made again by the target stage.
"""
from __future__ import annotations

import fnmatch
import json
from importlib import metadata
from pathlib import Path

from draftlab.errors import UserError

# The JSON files transformers reads from a model folder; each must hold a JSON object.
JSON_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
              "added_tokens.json", "chat_template.json", "preprocessor_config.json", "processor_config.json",
              "*.safetensors.index.json", "*.bin.index.json")
WEIGHT_FILES = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.gguf")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model", "*.tiktoken", "*.gguf")
# The config values every stage reads (draftlab.target.load.target_info): positive integers.
SIZES = ("num_hidden_layers", "hidden_size", "vocab_size", "num_attention_heads")
MAX_CAUSE = 300  # characters of an exception's message quoted in an error


def local_folder(model: str) -> Path | None:
    """The folder `model` names when it is a local path, else None (a hub id)."""
    path = Path(model).expanduser()
    return path if path.exists() else None


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


def written_folder(model: str) -> Path | None:
    """The folder the target stage wrote for `model` (a GGUF target, or that folder named directly),
    or None for a folder or hub id the user gave."""
    from draftlab.target.gguf import DEQUANTIZED_DIR, SOURCE_FILE, gguf_file

    try:
        folder = DEQUANTIZED_DIR if gguf_file(model) is not None else Path(model).expanduser()
    except UserError:  # a GGUF path that is not there: not a folder of ours
        return None
    return folder if (folder / SOURCE_FILE).is_file() else None


def source_record(folder: Path) -> dict:
    """gguf-source.json of a folder the target stage wrote ({} when unreadable)."""
    from draftlab.target.gguf import SOURCE_FILE

    try:
        record = json.loads((folder / SOURCE_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def raising_package(e: BaseException) -> tuple[str, str] | None:
    """(distribution, version) of the innermost installed package the exception passed through (a
    frame under site-packages; the standard library and the project's own code are not packages
    installed there), or None."""
    tb, frames = e.__traceback__, []
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    owners = metadata.packages_distributions()  # top-level module -> distributions that install it
    for frame in reversed(frames):
        path = frame.f_code.co_filename.replace("\\", "/")
        top = (frame.f_globals.get("__name__") or "").split(".")[0]
        if ("/site-packages/" not in path and "/dist-packages/" not in path) or top not in owners:
            continue
        dist = owners[top][0]
        try:
            return dist, metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def reinstall() -> str:
    from draftlab.target.packaged import REAL_INSTALL

    return (f"install the versions the project pins (README.md, \"A real workload\": {REAL_INSTALL}), "
            f"then run the target stage again (dvc repro --force target)")


def library_first(folder: Path, what: str, part: str, e: Exception) -> str:
    """The message for `e`, raised while loading `what` from `folder`, a folder the target stage wrote."""
    import transformers

    record = source_record(folder)
    made_from = f" from {record['gguf']!r}" if record.get("gguf") else ""
    problem = folder_problem(folder, part)
    if problem:  # the files show the damage: not the library
        return (f"{folder}, the folder the target stage wrote{made_from}, does not load ({what}): {problem}; "
                f"make it again: dvc repro --force target")
    names = ["transformers"]
    library = f"transformers {transformers.__version__}"
    origin = raising_package(e)
    if origin and origin[0].lower() != "transformers":
        library += f" (through {origin[0]} {origin[1]}, where the error was raised)"
        names.append(origin[0])
    by = f" with transformers {record['transformers']}" if record.get("transformers") else ""
    return (f"{library} could not load {folder}, the folder the target stage wrote{made_from}{by}: "
            f"cannot load {what}: {cause_of(e).rstrip('.')}; the folder is the project's own output, so the cause is most "
            f"likely this release of {' or '.join(names)}, not the folder: {reinstall()}")
