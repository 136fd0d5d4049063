"""Errors meant for the user: the stage prints the message (no traceback) and exits non-zero."""
from __future__ import annotations

import reprlib

QUOTE_CHARS = 300  # the most characters of a user's value that an error message quotes


class UserError(Exception):
    """Bad input or configuration; the message names the file/key/row and what to do."""


def _bounded_repr(limit: int) -> reprlib.Repr:
    r = reprlib.Repr()
    r.maxlevel, r.maxstring, r.maxother, r.maxlong = 4, limit, limit, limit
    r.maxlist = r.maxtuple = r.maxdict = r.maxset = r.maxfrozenset = r.maxdeque = r.maxarray = 16
    return r


def shown(value, limit: int = QUOTE_CHARS) -> str:
    """repr(value) for an error message, at most `limit` characters (and "..." when cut).

    Built piece by piece with bounded depth and length, never as the whole repr first: a YAML
    alias can expand to a value whose repr is gigabytes, and an int of more than 4,300 digits
    has no repr at all (Python's int-to-text limit)."""
    try:
        text = _bounded_repr(limit).repr(value)
    except ValueError:  # an int past sys.get_int_max_str_digits()
        text = f"<an integer of about {value.bit_length() * 3 // 10:,} digits>" if isinstance(value, int) else f"<a {type(value).__name__}>"
    return text if len(text) <= limit else text[:limit] + "..."


def clip(text: str, limit: int = QUOTE_CHARS) -> str:
    """Free text (a key, another library's message) for an error message: at most `limit` characters."""
    text = str(text)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text):,} characters)"
