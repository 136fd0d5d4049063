"""A GGUF file as the target: checked, then dequantized once into a transformers folder.

`target.model` may name a `.gguf` file (a path, or `pkg:MODULE/FILE.gguf` inside an installed
package: draftlab.target.packaged). Stage target checks it, hashes it and writes the dequantized model
to DEQUANTIZED_DIR (safetensors, config, tokenizer with its chat template, generation config),
a DVC output. Every stage then loads that folder (draftlab.target.load.model_path), and SGLang serves
it: SGLang's own GGUF loading is another code path, with other kernels, than the one the draft's
training data came from.

The weights are dequantized by transformers (`from_pretrained(DIR, gguf_file=NAME)`, which needs
the `gguf` package) to float32: a Q4_1 weight is d * q + m with fp16 d and m, which float32 holds
exactly and bf16 does not. SmolLM2-135M-Instruct's Q4_1 file (98 MB) becomes 538 MB in float32
and converts in about 15 s on a 2-core CPU, its header parsed once (`_reader`: five parses took
35 of 50 s). transformers refuses to save a model loaded from GGUF while its quantization config
is set; once cleared, the folder reloads as a plain model.
"""
from __future__ import annotations

import contextlib
import functools
import json
import shutil
import sys
from pathlib import Path

from draftlab.errors import UserError, clip, shown
from draftlab.target.packaged import is_packaged, packaged_path

DEQUANTIZED_DIR = Path("models/target-dequantized")
SOURCE_FILE = "gguf-source.json"  # in DEQUANTIZED_DIR: which GGUF (sha256, size) the folder was made from
MAGIC = b"GGUF"


def gguf_file(model: str) -> Path | None:
    """The GGUF file `target.model` names, or None when it names something else (a folder, a hub id)."""
    if is_packaged(model):
        path = packaged_path(model, "target.model")
        return path if path.suffix.lower() == ".gguf" else None
    if not model.lower().endswith(".gguf"):  # x.GGUF too: a file a user renamed is still GGUF
        return None
    path = Path(model).expanduser()
    if not path.is_file():
        raise UserError(f"params.yaml: target.model {shown(model)}: GGUF file {clip(str(path))} not found"
                        + (" (it is a folder)" if path.is_dir() else "")
                        + "; give an existing .gguf file, pkg:MODULE/FILE.gguf, a model folder or a hub id")
    return path


def supported_architectures() -> list[str]:
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    return sorted(k for k in GGUF_CONFIG_MAPPING if k not in ("general", "tokenizer"))


def read_header(path: Path, model: str) -> dict:
    """The facts of a GGUF file's header; UserError for a file that is not GGUF, is cut short, or
    holds an architecture transformers cannot dequantize."""
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError as e:  # no permission, a file that vanished
        raise UserError(f"params.yaml: target.model {shown(model)}: cannot read {path} ({e.strerror or type(e).__name__})") from None
    if head != MAGIC:
        raise UserError(f"params.yaml: target.model {model!r}: {path} is not a GGUF file (it starts with {head!r}, "
                        f"not {MAGIC!r}); give a .gguf model file")
    try:
        import gguf
    except ImportError:
        from draftlab.target.packaged import REAL_INSTALL, REAL_INSTALL_GPU

        raise UserError(f"a GGUF target needs the gguf and accelerate packages (the extra real): on a CPU machine "
                        f"{REAL_INSTALL}; on a GPU machine, after your CUDA build of torch, {REAL_INSTALL_GPU}") from None
    try:
        reader = _reader(path)  # memory-mapped: reads the header and checks every tensor's extent
    except Exception as e:  # the reader raises ValueError/IndexError/... for a cut or damaged file
        raise UserError(f"params.yaml: target.model {model!r}: {path} ({path.stat().st_size:,} bytes) is a damaged or "
                        f"truncated GGUF file ({type(e).__name__}: {e}); download or copy it again") from None

    def field(key):
        f = reader.fields.get(key)
        return f.contents() if f is not None else None

    arch = field("general.architecture")
    if arch not in supported_architectures():
        raise UserError(f"params.yaml: target.model {model!r}: {path} holds a {arch!r} model, which transformers "
                        f"cannot dequantize (it reads GGUF files of: {', '.join(supported_architectures())}); "
                        f"use the model's transformers folder or hub id instead")
    if field("tokenizer.chat_template") is None:
        raise UserError(f"params.yaml: target.model {model!r}: {path} has no chat template (tokenizer.chat_template); "
                        f"a chat (instruct) model is required")
    return {"architecture": arch, "name": field("general.name"), "tensors": len(reader.tensors),
            "quantizations": sorted({t.tensor_type.name for t in reader.tensors})}


def _reader(path: Path):
    """One parsed GGUFReader per file (and size and mtime) in this process. Parsing the header of
    a 49k-token vocabulary field by field takes ~7 s of Python on a 2-core CPU, and the stage
    needs it five times (the pin, the check, and transformers' config, tokenizer and weights)."""
    st = path.stat()
    return _parsed(str(path.resolve()), st.st_size, st.st_mtime_ns)


@functools.cache
def _parsed(path: str, size: int, mtime_ns: int):
    import gguf

    cls = gguf.GGUFReader
    return getattr(cls, "original", cls)(path)  # the class itself, also while _parsed_once stands in for it


@contextlib.contextmanager
def _parsed_once(path: Path):
    """transformers' GGUF loading (`from gguf import GGUFReader` on each call) reads `path` through
    _reader while inside: one parse for its config, tokenizer and weights. Other files as before.
    Its weights' loading also asks gguf for the tensor-name map once per module of the model, each
    built anew (3.7 of the target stage's 15 s for SmolLM2 on a CPU): one is built and reused."""
    import gguf

    cls = gguf.GGUFReader
    mine = path.resolve()

    def reader(p, *a, **kw):
        return _reader(Path(p)) if Path(p).resolve() == mine and not a and not kw else cls(p, *a, **kw)

    reader.original = cls
    name_map = gguf.get_tensor_name_map
    gguf.GGUFReader, gguf.get_tensor_name_map = reader, functools.cache(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = cls, name_map


def materialize(path: Path, model: str, gguf_sha256: str, out: Path = DEQUANTIZED_DIR) -> dict:
    """Dequantize `path` into the folder `out` (written whole, then swapped in: an interrupted run
    leaves the previous folder or none); returns the source record written beside the weights."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from draftlab.fsutil import atomic_replace_dir, atomic_write_json, canonicalize_safetensors_file, make_readable
    from draftlab.target.tokenizer import save_tokenizer

    header = read_header(path, model)
    source = {"gguf": model, "sha256": gguf_sha256, "size": path.stat().st_size, **header,
              "dtype": "float32", "transformers": transformers.__version__}
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        print(f"target: dequantizing {path.name} ({header['architecture']}, {', '.join(header['quantizations'])}) "
              f"to float32 -> {out}", file=sys.stderr)
        with _parsed_once(path):
            tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
            lm = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
        lm.hf_quantizer = None  # else save_pretrained refuses: "quantized with gguf and is not serializable"
        if hasattr(lm.config, "quantization_config"):
            del lm.config.quantization_config
        lm.config.name_or_path = model
        lm.save_pretrained(tmp)
        save_tokenizer(tok, tmp)
        for shard in tmp.glob("*.safetensors"):
            canonicalize_safetensors_file(shard)  # same bytes for the same weights, every run
        atomic_write_json(tmp / SOURCE_FILE, source)
        make_readable(tmp)  # transformers writes weights 0600; the folder is shared like any model folder
    except UserError:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    except Exception as e:  # transformers' GGUF path raises many types for files it cannot map
        shutil.rmtree(tmp, ignore_errors=True)
        raise UserError(f"transformers {transformers.__version__} could not dequantize {path} (target.model {model!r}): "
                        f"{type(e).__name__}: {e}") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    atomic_replace_dir(tmp, out)
    return source


def dequantized_dir(model: str, out: Path = DEQUANTIZED_DIR) -> Path:
    """The folder every stage loads for GGUF target `model`; UserError when stage target has not made
    it from this very file (checked by the size recorded beside it; the pin holds the sha256)."""
    path = gguf_file(model)
    try:
        source = json.loads((out / SOURCE_FILE).read_text())
    except (OSError, ValueError):
        source = None
    if not source or source.get("gguf") != model or source.get("size") != path.stat().st_size:
        raise UserError(f"target.model {model!r} is a GGUF file and {out} does not hold its dequantized weights; "
                        f"run the target stage first (dvc repro target)")
    return out


def placeholder(out: Path = DEQUANTIZED_DIR) -> None:
    """For a target that is not GGUF the stage's output folder holds only a note (DVC needs it to exist)."""
    from draftlab.fsutil import atomic_write_text

    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    atomic_write_text(out / "README.md", "target.model is not a GGUF file: the stages load it directly and this folder "
                                         "stays empty. For a .gguf target, stage target writes its dequantized weights here.\n")
