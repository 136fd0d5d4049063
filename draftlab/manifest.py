"""Stage manifests and the configuration hash (DESIGN.md section 3).

Every stage writes `manifest.json` next to its outputs:
  stage, params (resolved, only the sections it read), inputs (name -> upstream config_hash or
  content hash), code (sha256 of the stage script and every draftlab module it imports), packages,
  config_hash = sha256(canonical JSON of the five above), and `info` (timings, counts, figures:
  NOT hashed, so re-running with nothing changed gives a byte-identical config_hash).
"""
from __future__ import annotations

import ast
import hashlib
import json
import platform
from importlib import metadata
from pathlib import Path

from draftlab.errors import UserError
from draftlab.fsutil import atomic_write_json, canonical_json

MANIFEST = "manifest.json"
# Packages whose version can change an output; recorded and hashed.
PACKAGES = ("torch", "transformers", "tokenizers", "safetensors", "numpy")
# Files larger than this are hashed by size + head + tail (a 16 GB checkpoint must not take
# minutes to hash on every stage run); smaller ones fully.
FULL_HASH_LIMIT = 64 << 20  # bytes
PARTIAL_CHUNK = 1 << 20  # bytes read from each end of a large file


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def file_hash(path: str | Path) -> str:
    path = Path(path)
    h = hashlib.sha256()
    size = path.stat().st_size
    with open(path, "rb") as f:
        if size <= FULL_HASH_LIMIT:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        else:
            h.update(f"partial:{size}:".encode())
            h.update(f.read(PARTIAL_CHUNK))
            f.seek(size - PARTIAL_CHUNK)
            h.update(f.read(PARTIAL_CHUNK))
    return h.hexdigest()


def dir_hash(path: str | Path, exclude: tuple[str, ...] = (MANIFEST,)) -> str:
    """Content hash of a file or a directory tree (relative names + file hashes)."""
    path = Path(path)
    if path.is_file():
        return file_hash(path)
    h = hashlib.sha256()
    for p in sorted(path.rglob("*")):
        if p.is_file() and p.name not in exclude and not any(part.startswith(".") for part in p.relative_to(path).parts):
            h.update(f"{p.relative_to(path).as_posix()}\0{file_hash(p)}\n".encode())
    return h.hexdigest()


ROOT = Path(__file__).resolve().parent.parent  # the checkout: draftlab/ and stages/ live here
CODE_PACKAGES = ("draftlab",)  # imports followed into the code hash; third-party code is in `packages`


def _module_files(module: str) -> list[Path]:
    """Files Python runs for `import module`: every package __init__ on the way, then the module."""
    parts, files = module.split("."), []
    for i in range(1, len(parts) + 1):
        base = ROOT.joinpath(*parts[:i])
        for f in (base / "__init__.py", base.with_suffix(".py")):
            if f.is_file():
                files.append(f)
    return files


def _name(f: Path) -> str:
    return f.relative_to(ROOT).as_posix() if f.is_relative_to(ROOT) else f.name


def code_files(script: str | Path) -> list[Path]:
    """The stage script and every project module it can import, followed transitively through
    the import statements (function-level ones included), sorted by repo-relative name.

    Read from the source, not from what one run happened to load, so that dvc.yaml's deps can be
    checked against it (tests/test_dvc_deps.py) and the code hash covers a lazily imported module
    even on a run that did not need it. Returns absolute paths; code_hash names them.
    """
    script = Path(script).resolve()
    todo, seen = [script], set()
    while todo:
        f = todo.pop()
        if f in seen:
            continue
        seen.add(f)
        for node in ast.walk(ast.parse(f.read_text(), filename=str(f))):
            if isinstance(node, ast.Import):
                modules = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                modules = [node.module] + [f"{node.module}.{a.name}" for a in node.names]  # names may be submodules
            else:
                continue
            for m in modules:
                if m.split(".")[0] in CODE_PACKAGES:
                    todo += [g for g in _module_files(m) if g not in seen]
    return sorted(seen, key=_name)


def code_hash(script: str | Path | None) -> dict:
    """sha256 over code_files(script): names and contents."""
    files = code_files(script) if script else []
    h = hashlib.sha256()
    for f in files:
        h.update(f"{_name(f)}\0{file_hash(f)}\n".encode())
    return {"sha256": h.hexdigest(), "files": [_name(f) for f in files]}


def package_versions() -> dict:
    out = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def build_manifest(stage: str, params: dict, inputs: dict, script: str | Path | None = None, info: dict | None = None) -> dict:
    """Assemble a manifest; `inputs` maps names to upstream config hashes or content hashes."""
    code = code_hash(script)
    hashed = {"stage": stage, "params": params, "inputs": inputs, "code": code["sha256"], "packages": package_versions()}
    config_hash = hashlib.sha256(canonical_json(hashed).encode()).hexdigest()
    return {**hashed, "code_files": code["files"], "config_hash": config_hash, "info": info or {}}


def write_manifest(out_dir: str | Path, manifest: dict) -> Path:
    path = Path(out_dir) / MANIFEST
    atomic_write_json(path, manifest)
    return path


def read_manifest(out_dir: str | Path) -> dict:
    path = Path(out_dir) / MANIFEST
    if not path.exists():
        raise UserError(f"{path}: manifest not found; run the stage that writes {out_dir} first (dvc repro)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"{path}: corrupt manifest ({e}); re-run the stage that writes it") from None


def with_lineage(metrics: dict, manifest: dict, key_settings: dict) -> dict:
    """Metrics file content: the figures plus config_hash and key settings in plain sight."""
    return {"config_hash": manifest["config_hash"], "stage": manifest["stage"], "settings": key_settings, **metrics}
