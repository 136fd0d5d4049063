"""JSON Lines, read and written one way everywhere: one JSON value per line, lines split at "\\n" only.

Python's `str.splitlines()` also splits at U+2028/U+2029 (line and paragraph separators), \\x0b,
\\x0c, \\x1c-\\x1e and \\x85, and `json.dumps(..., ensure_ascii=False)` writes those characters raw
inside strings. A prompt holding one of them (ShareGPT has them) was cut in two by such a reader
and reported as invalid JSON. Here a file is read as bytes and split at b"\\n" alone, which JSON
never leaves raw inside a string, so any Unicode text round-trips.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Iterator

from draftlab.errors import UserError
from draftlab.fsutil import atomic_write_text


def dumps(obj) -> str:
    """One line: the JSON text of `obj` (UTF-8 characters kept as they are) and "\\n"."""
    return json.dumps(obj, ensure_ascii=False) + "\n"


def write(path: str | Path, rows: Iterable) -> None:
    """All `rows`, one per line, atomically (draftlab.fsutil)."""
    atomic_write_text(path, "".join(dumps(r) for r in rows))


def lines(path: str | Path) -> Iterator[tuple[int, bytes]]:
    """(1-based line number, line bytes without "\\n") for every non-blank line of `path`."""
    with open(path, "rb") as f:
        for n, raw in enumerate(f, start=1):  # binary iteration splits at b"\n" only
            if raw.strip():
                yield n, raw.rstrip(b"\r\n")


def loads_line(path: str | Path, n: int, raw: bytes, fix: str):
    """The JSON value of line `n` of `path`, or a UserError naming file:line and `fix`."""
    try:
        text = raw.decode("utf-8-sig" if n == 1 else "utf-8")  # a byte-order mark opens some editors' files
    except UnicodeDecodeError as e:
        raise UserError(f"{path}:{n}: not UTF-8 text (byte 0x{raw[e.start]:02x} at column {e.start + 1}); {fix}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(f"{path}:{n}: not valid JSON ({e.msg} at column {e.colno}); {fix}") from None
    except RecursionError:
        raise UserError(f"{path}:{n}: JSON nested too deeply; {fix}") from None


def read(path: str | Path, fix: str) -> Iterator[tuple[int, object]]:
    """(line number, value) for every non-blank line; a bad line is a UserError naming file:line and `fix`."""
    for n, raw in lines(path):
        yield n, loads_line(path, n, raw, fix)
