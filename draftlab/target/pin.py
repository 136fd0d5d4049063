"""The target pin: what exactly `target.model` names, in one small file the stages depend on.

    local path -> {"kind": "local", "content_sha256": ..., "files": {name: {"sha256", "size"}}}
    hub id     -> {"kind": "hub", "commit": <40-hex commit the revision resolves to>}
    GGUF file  -> {"kind": "gguf", "gguf_sha256": ..., "gguf_size": ..., and, once stage target has
                   dequantized it, the folder's "content_sha256" and "files" as for a local path}

The pin holds only what identifies the target (no times, no absolute paths, no record of how a
commit was resolved), so its bytes change exactly when the target does, and DVC re-runs the
stages that load the target exactly then (stages/target.py says when the pin is re-made).

Local folders: only the files transformers reads are hashed (TARGET_FILES below, top level and
chat templates); a README, an eval report or a hidden cache folder beside the weights changes
nothing. Every byte is hashed (no size + head + tail shortcut as draftlab.manifest.file_hash
takes): the pin is re-made only when target.model/target.revision change or on
`dvc repro --force target`, and then it must see any byte (a per-file cache keyed on size and
mtime could be fooled by a copy that keeps both). sha256 runs at ~1.3 GB/s here, plus the disk
read; a progress bar shows from 256 MB.

Hub ids: a 40-hex target.revision is the commit. Otherwise the hub resolves it (HfApi.model_info)
or, offline (HF_HUB_OFFLINE=1) or when the hub cannot be reached, the local Hugging Face cache
does (refs/<revision> -> snapshots/<commit>), with no network.
"""
from __future__ import annotations

import fnmatch
import hashlib
import os
import re
import sys
from pathlib import Path

from draftlab.errors import UserError, shown
from draftlab.target.gguf import gguf_file, read_header
from draftlab.target.load import check_model_name

COMMIT = re.compile(r"[0-9a-f]{40}")
# The files of a model folder that define the model: config, weights (and their index),
# tokenizer, chat template, generation config, remote code. Matched against the name of a file at
# the folder's top level (transformers reads nothing below it except these templates).
TARGET_FILES = (
    "config.json", "generation_config.json",
    "*.safetensors", "*.safetensors.index.json", "*.bin", "*.bin.index.json", "*.pt", "*.pth", "*.gguf",
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "tokenizer.model",
    "vocab.json", "vocab.txt", "merges.txt", "spiece.model", "*.tiktoken",
    "chat_template.jinja", "chat_template.json", "preprocessor_config.json", "processor_config.json",
    "*.py",
)
TEMPLATE_DIR = "additional_chat_templates"  # transformers 4.54+: named chat templates, *.jinja


def looks_local(model: str) -> bool:
    """Whether `model` can only be meant as a local path (the rule of draftlab.target.load._source):
    it exists, starts with . / ~, has more than one slash, or its first part is a local folder
    ("models/tiny-target" looks like a hub id org/name)."""
    return (Path(model).exists() or model.startswith((".", "/", "~")) or model.count("/") > 1
            or Path(model.split("/")[0]).is_dir())


def model_files(folder: Path) -> list[Path]:
    """The files of `folder` that define the model, sorted by relative name."""
    top = [p for p in folder.iterdir() if p.is_file() and not p.name.startswith(".")
           and any(fnmatch.fnmatch(p.name, pat) for pat in TARGET_FILES)]
    templates = folder / TEMPLATE_DIR
    if templates.is_dir():
        top += [p for p in templates.iterdir() if p.is_file() and p.suffix == ".jinja" and not p.name.startswith(".")]
    return sorted(top, key=lambda p: p.relative_to(folder).as_posix())


def _sha256(path: Path, bar) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(8 << 20), b""):
            h.update(chunk)
            bar.update(len(chunk))
    return h.hexdigest()


def pin_local(model: str, folder: Path) -> dict:
    from tqdm import tqdm

    if not folder.is_dir():
        raise UserError(f"params.yaml: target.model {model!r} is a file, not a model folder; give the folder that holds "
                        f"config.json and the weights, or a hub id like org/name")
    files = model_files(folder)
    if not any(p.name == "config.json" for p in files):
        raise UserError(f"params.yaml: target.model {model!r}: {folder}/config.json not found; give a transformers "
                        f"model folder (config.json, weights, tokenizer) or a hub id like org/name")
    total = sum(p.stat().st_size for p in files)
    listed, whole = {}, hashlib.sha256()
    with tqdm(total=total, unit="B", unit_scale=True, desc=f"target: hashing {model}", disable=total < (256 << 20),
              file=sys.stderr) as bar:
        for p in files:
            name = p.relative_to(folder).as_posix()
            digest = _sha256(p, bar)
            listed[name] = {"sha256": digest, "size": p.stat().st_size}
            whole.update(f"{name}\0{digest}\n".encode())
    return {"kind": "local", "content_sha256": whole.hexdigest(), "files": listed}


def _offline() -> bool:
    from huggingface_hub import constants

    env = any(os.environ.get(k, "").upper() in ("1", "ON", "YES", "TRUE") for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))
    return env or bool(constants.HF_HUB_OFFLINE)


def commit_from_cache(model: str, revision: str, cache_dir: str | os.PathLike | None = None) -> str | None:
    """The commit `revision` of hub repo `model` resolves to in the local Hugging Face cache
    (refs/<revision> -> snapshots/<commit>/config.json), or None when it is not cached."""
    from huggingface_hub import try_to_load_from_cache

    path = try_to_load_from_cache(model, "config.json", cache_dir=cache_dir, revision=revision)
    if not isinstance(path, str):
        return None
    commit = Path(path).parent.name
    return commit if COMMIT.fullmatch(commit) else None


def commit_from_hub(model: str, revision: str) -> str:
    """The commit of `revision` on the hub; UserError for a repo or revision the hub refuses."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    try:
        return HfApi().model_info(model, revision=revision).sha
    except RevisionNotFoundError:
        raise UserError(f"params.yaml: target.revision {revision!r}: no such revision of hub model {model!r}; "
                        f"set target.revision to a branch, tag or commit of it (null = main)") from None
    except GatedRepoError:
        raise UserError(f"params.yaml: target.model {model!r} is gated: accept its licence on the hub and log in "
                        f"(huggingface-cli login, or set HF_TOKEN)") from None
    except RepositoryNotFoundError:
        raise UserError(f"params.yaml: target.model {model!r}: no such hub model and no such local path; give a local "
                        f"folder or a hub id like org/name (a private one needs HF_TOKEN)") from None


def pin_hub(model: str, revision: str | None, cache_dir: str | os.PathLike | None = None,
            offline: bool | None = None) -> tuple[dict, str]:
    """({"kind": "hub", "commit"}, how it was resolved: given | hub | cache)."""
    if revision is not None and COMMIT.fullmatch(revision):
        return {"kind": "hub", "commit": revision}, "given"
    rev = revision or "main"
    offline = _offline() if offline is None else offline
    reason = "HF_HUB_OFFLINE is set"
    if not offline:
        try:
            return {"kind": "hub", "commit": commit_from_hub(model, rev)}, "hub"
        except UserError:
            raise
        except Exception as e:  # no network, a proxy, a timeout: the cache may still know the commit
            reason = f"the hub could not be reached ({type(e).__name__})"
    commit = commit_from_cache(model, rev, cache_dir)
    if commit is None:
        raise UserError(f"params.yaml: target.model {model!r}: {reason} and revision {rev!r} is not in the local "
                        f"Hugging Face cache ({cache_dir or 'HF_HUB_CACHE'}); set target.revision to the 40-hex commit, "
                        f"or download the model once with the hub reachable (HF_HUB_OFFLINE unset)")
    return {"kind": "hub", "commit": commit}, "cache"


def pin_target(model: str, revision: str | None, cache_dir: str | os.PathLike | None = None,
               offline: bool | None = None) -> tuple[dict, str]:
    """(the pin of target.model / target.revision, how it was made: hashed | given | hub | cache)."""
    head = {"model": model, "revision": revision}
    check_model_name(model)  # an empty value or an invalid hub id named here, before the hub is asked
    source = gguf_file(model)
    if source is not None:
        read_header(source, model)  # not GGUF, cut short, an architecture transformers cannot read: named here
        from tqdm import tqdm

        size = source.stat().st_size
        with tqdm(total=size, unit="B", unit_scale=True, desc=f"target: hashing {source.name}", disable=size < (256 << 20),
                  file=sys.stderr) as bar:
            digest = _sha256(source, bar)
        return head | {"kind": "gguf", "gguf_sha256": digest, "gguf_size": size}, "hashed"
    folder = Path(model).expanduser()
    if folder.exists():
        return head | pin_local(model, folder), "hashed"
    if looks_local(model):
        raise UserError(f"params.yaml: target.model {shown(model)}: local path {shown(str(folder))} does not exist; set target.model to "
                        f"an existing model folder or to a hub id like org/name")
    pin, how = pin_hub(model, revision, cache_dir, offline)
    return head | pin, how
