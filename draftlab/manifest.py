"""Stage manifests and the configuration hash (DESIGN.md section 3).

Every stage writes `manifest.json` next to its outputs:
  stage, params (resolved, only the sections it read), inputs (name -> upstream config_hash or
  content hash), code (sha256 of the stage script and every draftlab module it imports), packages,
  config_hash = sha256(canonical JSON of the five above), `info` (timings, counts, figures; every
  stage's wall time in `info.wall_s`, set by write_manifest) and
  `hardware` (the CPU, GPU and torch threads the stage ran on, see describe_hardware): neither is
  hashed, so re-running with nothing changed gives a byte-identical config_hash, on any machine.
  The same config_hash means the same inputs, code, params and package versions; the hardware
  record says whether two outputs of one hash also came from the same kind of machine (float
  rounding differs across CPU types and GPUs).
"""
from __future__ import annotations

import ast
import hashlib
import json
import os
import platform
import sys
import time
from functools import lru_cache
from importlib import metadata
from pathlib import Path

from draftlab.errors import UserError
from draftlab.fsutil import atomic_write_json, canonical_json

MANIFEST = "manifest.json"
# Packages whose version can change an output; recorded and hashed.
PACKAGES = ("torch", "transformers", "tokenizers", "safetensors", "numpy", "sglang")  # None where not installed
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
    return {**hashed, "code_files": code["files"], "config_hash": config_hash, "info": info or {}, "hardware": describe_hardware()}


# CPU features that change which float kernels run (and so the rounding of results): x86 SIMD
# widths, FMA, AMX; ARM NEON/SVE. Recorded by name; the full flag line only as a hash, since
# hypervisors and kernels add or mask flags that change nothing numerically.
SIMD_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
              "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8", "asimd", "asimdhp", "sve", "sve2", "bf16", "i8mm")


@lru_cache(maxsize=1)
def _cpu() -> dict:
    """The CPU, from the first processor block of /proc/cpuinfo (read once per process)."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo", errors="replace") as f:
            for line in f:
                if not line.strip():
                    if fields:
                        break  # the first processor's block is enough: the cores of a machine are alike
                    continue
                key, _, value = line.partition(":")
                fields.setdefault(key.strip().lower(), value.strip())
    except OSError:  # not Linux
        pass
    flags = sorted(set((fields.get("flags") or fields.get("features") or "").split()))
    model = fields.get("model name") or fields.get("cpu model") or fields.get("hardware") or platform.processor() or None
    if model is None and "cpu part" in fields:  # ARM: implementer and part number
        model = f"arm implementer {fields.get('cpu implementer')} part {fields['cpu part']}"
    try:
        count = len(os.sched_getaffinity(0))  # the cores this process may use
    except (AttributeError, OSError):
        count = os.cpu_count()
    return {"machine": platform.machine(), "cpu_model": model, "cpu_simd": [f for f in flags if f in SIMD_FLAGS],
            "cpu_flags_sha256": hashlib.sha256(" ".join(flags).encode()).hexdigest() if flags else None, "cpu_count": count}


@lru_cache(maxsize=1)
def _proc_gpus() -> tuple[str, ...]:
    """NVIDIA GPU models from the driver's /proc files: no CUDA context is created."""
    names = []
    for info in sorted(Path("/proc/driver/nvidia/gpus").glob("*/information")):
        try:
            for line in info.read_text(errors="replace").splitlines():
                if line.startswith("Model:"):
                    names.append(line.split(":", 1)[1].strip())
        except OSError:
            pass
    return tuple(names)


def _gpu(torch) -> dict | None:
    names = list(_proc_gpus())
    if not names and torch is not None and torch.cuda.is_initialized():  # a container without the driver's /proc files
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    if not names and torch is not None and getattr(torch.version, "cuda", None):
        try:
            n = torch.cuda.device_count()  # does not initialise CUDA
        except Exception:  # noqa: BLE001 - a broken driver must not stop a stage from writing its manifest
            n = 0
        return {"name": None, "count": n} if n else None
    return {"name": ", ".join(sorted(set(names))), "count": len(names)} if names else None


def describe_hardware() -> dict:
    """The machine a stage runs on, as recorded in its manifest (NOT in the config hash).

    machine, cpu_model, cpu_simd (the SIMD flags of SIMD_FLAGS it has), cpu_flags_sha256 (all
    flags), cpu_count (cores this process may use), gpu ({name, count} or None) and torch
    ({threads, cpu_capability: the kernel set torch dispatches to, e.g. AVX2 or AVX512, cuda: the
    CUDA version torch was built for}) or None when the stage never imported torch. Cheap:
    /proc/cpuinfo is read once per process, torch is only looked at if already imported, and CUDA
    is never initialised for this.
    """
    torch = sys.modules.get("torch")
    out = {**_cpu(), "gpu": _gpu(torch), "torch": None}
    if torch is not None:
        try:
            capability = torch.backends.cpu.get_cpu_capability()
        except Exception:  # noqa: BLE001 - older torch
            capability = None
        out["torch"] = {"threads": torch.get_num_threads(), "cpu_capability": capability, "cuda": getattr(torch.version, "cuda", None)}
    return out


_IMPORTED = time.monotonic()  # the fallback start of process_seconds where /proc is not there


def process_seconds() -> float:
    """Seconds since this process started: /proc/self/stat's start time against /proc/uptime (both
    since boot, 10 ms ticks) on Linux, else since this module was imported (a stage imports it first
    thing, through draftlab.cli's callers)."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK"))  # field 22 of the line: starttime
    except (OSError, ValueError, IndexError):
        return time.monotonic() - _IMPORTED


def write_manifest(out_dir: str | Path, manifest: dict) -> Path:
    """manifest.json in out_dir, with `info.wall_s` set (in `manifest` too, so that it is what was
    written): the stage's wall time so far, from its process's start (Python's own start and imports
    included), in seconds. A stage writes its manifest last, so this is the stage's time under
    `dvc repro` and `dvc exp run` as under `draftlab run-stages`; not hashed."""
    path = Path(out_dir) / MANIFEST
    manifest["info"] = {**(manifest.get("info") or {}), "wall_s": round(process_seconds(), 1)}
    atomic_write_json(path, manifest)
    return path


def read_manifest(out_dir: str | Path) -> dict:
    path = Path(out_dir) / MANIFEST
    if not path.exists():
        raise UserError(f"{path}: manifest not found; run the stage that writes {out_dir} first (dvc repro)")
    fix = f"re-run the stage that writes {out_dir} (dvc repro)"
    try:
        manifest = json.loads(path.read_bytes())
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise UserError(f"{path}: corrupt manifest ({e}); {fix}") from None
    problem = manifest_problem(manifest)
    if problem:
        raise UserError(f"{path}: {problem}; {fix}")
    return manifest


def manifest_problem(manifest) -> str | None:
    """Why a parsed manifest.json is not one a stage wrote (hand-edited into another shape), or None."""
    if not isinstance(manifest, dict):
        return f"a JSON {type(manifest).__name__}, not a manifest object"
    if not isinstance(manifest.get("config_hash"), str):
        return f"no config_hash string (got {manifest.get('config_hash')!r})"
    for key in ("info", "inputs", "params"):
        if key in manifest and manifest[key] is not None and not isinstance(manifest[key], dict):
            return f"{key} is a JSON {type(manifest[key]).__name__}, not an object"
    return None


def with_lineage(metrics: dict, manifest: dict, key_settings: dict) -> dict:
    """Metrics file content: the figures plus config_hash and key settings in plain sight."""
    return {"config_hash": manifest["config_hash"], "stage": manifest["stage"], "settings": key_settings, **metrics}


# ---------------------------------------------------------------------------------------------
# Output records and their verification: every stage checks its upstream's outputs before
# computing, and names the file that is missing, truncated or changed.

OUTPUT_SUFFIXES = (".jsonl", ".safetensors")  # the files a stage's output record lists


def safetensors_header(path: str | Path) -> dict:
    """The JSON header of a safetensors file, checked against the file's size (pure Python, no
    tensor is read). UserError naming the file when it is not a complete safetensors file."""
    path = Path(path)
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            if n < 2 or 8 + n > size:
                raise ValueError(f"header length {n} does not fit in {size} bytes")
            header = json.loads(f.read(n))
        ends = [int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"]
    except (ValueError, KeyError, TypeError, IndexError) as e:
        raise UserError(f"{path}: not a readable safetensors file ({e}): truncated or damaged") from None
    need = 8 + n + max(ends, default=0)
    if size < need:
        raise UserError(f"{path}: truncated: {size} bytes, its header needs {need}")
    return header


def _tokens(header: dict) -> int | None:
    shape = (header.get("input_ids") or {}).get("shape")
    return int(shape[0]) if shape else None


def _rows(path: Path) -> int:
    with open(path, "rb") as f:
        return sum(1 for line in f if line.strip())


def file_record(path: str | Path) -> dict:
    """What a manifest records of one output file: bytes, sha256 (file_hash: a large shard by its
    size, head and tail, so checking it stays cheap), and rows (jsonl) or tokens (safetensors, from
    the header)."""
    path = Path(path)
    rec = {"bytes": path.stat().st_size}
    if path.suffix == ".jsonl":
        rec["rows"] = _rows(path)
    elif path.suffix == ".safetensors":
        tokens = _tokens(safetensors_header(path))
        if tokens is not None:
            rec["tokens"] = tokens
    rec["sha256"] = file_hash(path)
    return rec


def output_files(out_dir: str | Path) -> dict[str, dict]:
    """{relative path: file_record} of every output file under out_dir (manifest.json and
    hidden or temporary files excluded): the `info.files` a stage records for its readers."""
    out_dir = Path(out_dir)
    return {p.relative_to(out_dir).as_posix(): file_record(p) for p in sorted(out_dir.rglob("*"))
            if p.is_file() and p.suffix in OUTPUT_SUFFIXES and not any(s.startswith(".") for s in p.relative_to(out_dir).parts)}


def verify_outputs(out_dir: str | Path, manifest: dict) -> None:
    """Check that out_dir still holds what its manifest says its stage wrote; UserError naming the
    first file that is missing, truncated, changed or foreign, and the stage to re-run.

    Uses what the manifest has: `info.files` (per file: bytes, rows, tokens, sha256), else
    `inputs.outputs_sha256` (synthesize), else the per-split counts of older manifests (extract:
    info.counts[split].shards/tokens; standardize: info.tokens[split]). Every safetensors file
    present must have a complete header either way.
    """
    out_dir = Path(out_dir)
    stage = manifest.get("stage") or "upstream"
    fix = f"re-run the {stage} stage (dvc repro {stage})"
    info = manifest.get("info") or {}
    present = {p.relative_to(out_dir).as_posix(): p for p in sorted(out_dir.rglob("*"))
               if p.is_file() and p.suffix in OUTPUT_SUFFIXES and not any(s.startswith(".") for s in p.relative_to(out_dir).parts)}
    headers = {}
    for name, p in present.items():
        if p.suffix == ".safetensors":
            try:
                headers[name] = safetensors_header(p)
            except UserError as e:
                raise UserError(f"{e}; {fix}") from None
    files = info.get("files")
    if isinstance(files, dict) and files:
        for name, rec in files.items():
            p = out_dir / name
            if name not in present:
                raise UserError(f"{p}: missing, but {out_dir / MANIFEST} lists it; {fix}")
            if "tokens" in rec and _tokens(headers.get(name, {})) != rec["tokens"]:
                raise UserError(f"{p}: {_tokens(headers.get(name, {}))} tokens, but {out_dir / MANIFEST} records {rec['tokens']}; {fix}")
            if "rows" in rec and _rows(p) != rec["rows"]:
                raise UserError(f"{p}: {_rows(p)} rows, but {out_dir / MANIFEST} records {rec['rows']} (cut or changed); {fix}")
            size = p.stat().st_size
            if "bytes" in rec and size != rec["bytes"]:
                raise UserError(f"{p}: {size} bytes, but {out_dir / MANIFEST} records {rec['bytes']} (truncated or changed); {fix}")
            if "sha256" in rec and file_hash(p) != rec["sha256"]:
                raise UserError(f"{p}: content differs from what {out_dir / MANIFEST} records (sha256); {fix}")
        foreign = [n for n in present if n not in files]
        if foreign:
            raise UserError(f"{out_dir / foreign[0]}: not written by the run {out_dir / MANIFEST} describes; delete it or {fix}")
        return
    recorded = (manifest.get("inputs") or {}).get("outputs_sha256")
    if recorded:
        if dir_hash(out_dir) != recorded:
            raise UserError(f"{out_dir}: its files differ from what {out_dir / MANIFEST} records (outputs_sha256: a file is "
                            f"missing, cut or changed); {fix}")
        return
    counts, tokens = info.get("counts"), info.get("tokens")
    for split in ("train", "eval"):
        shards = {n: h for n, h in headers.items() if n.startswith(f"{split}/shard-")}
        want = (counts or {}).get(split) if isinstance(counts, dict) else None
        if isinstance(want, dict) and "shards" in want and len(shards) != want["shards"]:
            raise UserError(f"{out_dir / split}: {len(shards)} shards, but {out_dir / MANIFEST} records {want['shards']} "
                            f"(a shard is missing or foreign); {fix}")
        n_tok = want.get("tokens") if isinstance(want, dict) else (tokens or {}).get(split) if isinstance(tokens, dict) else None
        have = sum(_tokens(h) or 0 for h in shards.values())
        if n_tok is not None and have != n_tok:
            raise UserError(f"{out_dir / split}: its shards hold {have} tokens, but {out_dir / MANIFEST} records {n_tok} "
                            f"(a shard is missing, cut or foreign); {fix}")


def read_verified(out_dir: str | Path) -> dict:
    """read_manifest + verify_outputs: an upstream stage's manifest, its outputs checked against it."""
    manifest = read_manifest(out_dir)
    verify_outputs(out_dir, manifest)
    return manifest
