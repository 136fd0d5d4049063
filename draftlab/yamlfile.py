"""A YAML file of settings (params.yaml, a profile under configs/) read strictly, the way DVC reads it.

DVC's YAML reader (ruamel) refuses a mapping that gives one key twice ("found duplicate key");
PyYAML's safe_load keeps the last value without a word, so a stage run directly would use a value
`dvc repro` never accepts. Here the composed document is walked before it is built: a key given
twice in one mapping is an error naming the file, the key's full dotted name and both lines
(explicit keys may still override those a `<<` merge brings in, as YAML and DVC allow).

Every other way the file can be unreadable is named too: missing, a folder, unreadable, not UTF-8
(the line and column of the first bad byte), invalid YAML, nested too deeply, an integer too long
for Python. Quoted text is bounded (draftlab.errors.shown): YAML aliases can make a small file
expand to a value whose text is gigabytes.
"""
from __future__ import annotations

from pathlib import Path

import yaml

from draftlab.errors import QUOTE_CHARS, UserError, clip, shown

MERGE = "tag:yaml.org,2002:merge"


def _line(node) -> int:
    return node.start_mark.line + 1


def _check_duplicates(root, where: str) -> None:
    """UserError for the first key given twice in one mapping of the node tree `root`.

    Walked with a stack and a set of visited nodes: an alias is the same node object, and a file
    of nested aliases (a "billion laughs") must not be walked once per expansion."""
    seen_nodes, stack = set(), [(root, ())]
    while stack:
        node, path = stack.pop()
        if id(node) in seen_nodes:
            continue
        seen_nodes.add(id(node))
        if isinstance(node, yaml.MappingNode):
            first: dict = {}
            for key, value in node.value:
                if key.tag == MERGE:
                    stack.append((value, path))
                    continue
                scalar = isinstance(key, yaml.ScalarNode)
                name = key.value if scalar else f"<a {key.id} as key>"
                ident = (key.tag, name) if scalar else id(key)
                if ident in first:
                    dotted = ".".join(map(str, (*path, name)))
                    raise UserError(f"{where}:{_line(key)}: found duplicate key {clip(dotted)} (first given at line "
                                    f"{first[ident]}); DVC refuses the file too: keep one of them")
                first[ident] = _line(key)
                stack.append((value, (*path, name)))
        elif isinstance(node, yaml.SequenceNode):
            stack.extend((item, (*path, i)) for i, item in enumerate(node.value))


def _text(path: Path, what: str) -> str:
    if not path.exists():
        raise UserError(f"{path}: {what} not found (run from the project root)")
    if path.is_dir():
        raise UserError(f"{path}: a folder, not a {what}; give the YAML file")
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise UserError(f"{path}: cannot read the {what} ({e.strerror or type(e).__name__}); check its permissions") from None
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        column = e.start - (raw.rfind(b"\n", 0, e.start) + 1) + 1
        raise UserError(f"{path}:{line}:{column}: not UTF-8 text (byte 0x{raw[e.start]:02x} at line {line}, column "
                        f"{column}); save the {what} as UTF-8") from None


def read_mapping(path: str | Path, what: str = "params file") -> dict:
    """The top-level mapping of the YAML file `path` ({} when empty); UserError naming the file and
    the line for anything else (see the module docstring)."""
    path = Path(path)
    text = _text(path, what)
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return {}
        _check_duplicates(node, str(path))
        data = loader.construct_document(node)
    except yaml.YAMLError as e:
        raise UserError(f"{path}: not valid YAML: {clip(str(e), 3 * QUOTE_CHARS)}") from None
    except RecursionError:
        raise UserError(f"{path}: YAML nested too deeply to read; flatten it") from None
    except ValueError as e:  # an integer of more digits than Python converts (sys.get_int_max_str_digits)
        raise UserError(f"{path}: a value YAML cannot build ({clip(str(e))}); quote it to keep it as text") from None
    finally:
        loader.dispose()
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UserError(f"{path}: the top level must be a mapping of sections, got {type(data).__name__} {shown(data, 80)}")
    return data
