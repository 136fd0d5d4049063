"""Crash-safe file writes: write to a temp file in the same directory, then rename.

A reader (or a resumed stage) sees either the old file or the complete new one, never a
half-written file, even after Ctrl-C or a kill.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path


def umask() -> int:
    """The process's umask (read by setting it and putting it back)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


def make_readable(folder: str | os.PathLike) -> None:
    """`folder` and the files in it get the modes a plain mkdir/open would (0777/0666 less the umask):
    mkdtemp makes 0700 and some writers 0600, and a model folder is read by others (servers, teammates)."""
    mask = umask()
    for f in [Path(folder), *Path(folder).iterdir()]:
        f.chmod((0o777 if f.is_dir() else 0o666) & ~mask)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.chmod(tmp, 0o666 & ~umask())  # mkstemp makes 0600; outputs should read like any file
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def canonical_json(obj) -> str:
    """The one JSON spelling used for hashing: sorted keys, no spaces, UTF-8."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def atomic_write_json(path: str | os.PathLike, obj, indent: int = 2) -> None:
    atomic_write_text(path, json.dumps(obj, indent=indent, sort_keys=True, ensure_ascii=False) + "\n")


def atomic_replace_dir(tmp_dir: str | os.PathLike, final_dir: str | os.PathLike) -> None:
    """Swap a fully written temp directory into place (the old one is removed only after)."""
    tmp_dir, final_dir = Path(tmp_dir), Path(final_dir)
    old = final_dir.with_name(f".{final_dir.name}.old")
    if old.exists():
        shutil.rmtree(old)
    if final_dir.exists():
        os.replace(final_dir, old)
    os.replace(tmp_dir, final_dir)
    if old.exists():
        shutil.rmtree(old)


# safetensors serialises `__metadata__` from a hash map: equal tensors and metadata give other
# bytes in every process, and DVC then sees a changed output on each recompute. Sorting the
# header's keys (the data and its offsets untouched) makes the bytes a function of the content.


def _sorted_header(header_json: bytes) -> bytes:
    header = json.loads(header_json)
    meta = header.pop("__metadata__", None)
    ordered = {"__metadata__": dict(sorted(meta.items()))} if meta is not None else {}
    ordered.update(sorted(header.items()))
    return json.dumps(ordered, separators=(",", ":"), ensure_ascii=False).encode()


def canonical_safetensors(blob: bytes) -> bytes:
    """`blob` (safetensors bytes) with its header in sorted key order."""
    n = int.from_bytes(blob[:8], "little")
    text = _sorted_header(blob[8:8 + n])
    text += b" " * (-(8 + len(text)) % 8)  # data 8-byte aligned, as safetensors writes it
    return len(text).to_bytes(8, "little") + text + blob[8 + n:]


def canonicalize_safetensors_file(path: str | os.PathLike) -> None:
    """The same for a file, rewriting only its header (a multi-GB shard is not read again)."""
    with open(path, "r+b") as f:
        n = int.from_bytes(f.read(8), "little")
        text = _sorted_header(f.read(n))
        if len(text) <= n:  # the usual case: same keys and values in another order, same length
            f.seek(8)
            f.write(text + b" " * (n - len(text)))
            return
    Path(path).write_bytes(canonical_safetensors(Path(path).read_bytes()))
