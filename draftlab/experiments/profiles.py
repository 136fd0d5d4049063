"""Params profiles: a YAML file under configs/ (params.yaml's sections, a subset of its keys) applied
as one DVC experiment.

    draftlab exp run configs/gpu-8b.yaml [MORE.yaml ...] [-S section.key=VALUE ...] [-- dvc args]

Profiles merge in order over params.yaml (sections merge; a key's value, a list or a mapping such as
extract.engine_args, replaces the one before; later profiles and -S win) and become one
`dvc exp run -S section.key=VALUE` per key (a mapping: one per entry, dvc_overrides). Each VALUE is written in
Hydra's override grammar, which DVC parses before it edits params.yaml, so that params.yaml gets
exactly the typed value the params loader reads from the profile: strings always quoted (the
string "0.5.14" stays a string), lists as [..], null, true/false, ints, floats as Python's repr
(which reads back to the same float).

Every step is checked with the params loader before DVC runs, so a typo in a profile fails at
once, naming the profile file and the key, with the same message params.yaml would give.
"""
from __future__ import annotations

import difflib
import json
import math
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

from draftlab.errors import UserError, clip, shown
from draftlab.params import PARAMS_FILE, SECTIONS, ParamsError, _load_section, load_params, read_yaml

PROFILES_DIR = Path("configs")
MISSING = "???"  # OmegaConf's missing-value marker: DVC turns this exact string into an error, never a value
NEL = "\x85"  # a YAML line break that DVC's YAML writer (ruamel) turns into a space inside a quoted string


# ---------------------------------------------------------------------------------------------
# Hydra's override grammar, one value at a time


def hydra_string(s: str) -> str:
    """`s` as a quoted Hydra value that DVC writes back as exactly `s`.

    Two layers read it: Hydra's quoted string (double quotes, which a shell's single quotes keep
    as they are; a quote inside is escaped with a backslash, and the backslashes right before a
    quote or the closing quote are doubled), then OmegaConf (`${` starts an interpolation; `\\${`
    is a literal one, the backslashes before it doubled).
    """
    if s == MISSING:
        raise UserError(f"the string {MISSING!r} cannot be set through dvc exp run -S (OmegaConf reads it as a missing value); "
                        "write it into params.yaml by hand")
    if NEL in s:
        raise UserError(f"{shown(s)} holds U+0085 (NEL), which DVC's YAML writer turns into a space; write it into params.yaml by hand")
    s = re.sub(r"(\\*)\$\{", lambda m: m.group(1) * 2 + "\\${", s)
    s = re.sub(r'(\\*)("|\Z)', lambda m: m.group(1) * 2 + ('\\"' if m.group(2) else ""), s)
    return f'"{s}"'


def hydra_value(v) -> str:
    """A params value (str, int, float, bool, None, or a list of those) in Hydra's override grammar."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if not math.isfinite(v):
            raise UserError(f"{shown(v)} is no finite number; params take finite numbers only")
        return repr(v)  # shortest text that reads back to the same float; always has a '.' or an 'e'
    if isinstance(v, str):
        return hydra_string(v)
    if isinstance(v, list):
        return "[" + ",".join(hydra_value(x) for x in v) + "]"
    raise UserError(f"{shown(v)} ({type(v).__name__}) is no params value: use a string, number, true/false, null or a list")


ENTRY = re.compile(r"[A-Za-z_]\w*")  # an entry of a mapping key that Hydra's grammar reads as a key name


def dvc_overrides(key: str, old, new) -> list[str]:
    """dvc exp run -S overrides that make params.yaml's `key` equal `new` (it is `old` there).

    A scalar or a list: `key=VALUE`. A mapping of scalars and lists (extract.engine_args): DVC merges a
    mapping into the one in params.yaml and refuses an entry that is not there yet, so it is set entry by
    entry: `~key.ENTRY` for each entry that `new` drops, `++key.ENTRY=VALUE` for each of `new`'s."""
    if not isinstance(new, dict):
        return [f"{key}={hydra_value(new)}"]
    for entry, value in new.items():
        if not isinstance(entry, str) or not ENTRY.fullmatch(entry):
            raise UserError(f"{shown(entry)}: an entry of {key} must be a name (letters, digits and _)")
        if isinstance(value, dict):
            raise UserError(f"{key}.{entry}: {shown(value)} is a mapping inside a mapping; give it as one value "
                            "(a string, number, true/false, null or a list)")
    old = old if isinstance(old, dict) else {}
    return ([f"~{key}.{entry}" for entry in old if entry not in new]
            + [f"++{key}.{entry}={hydra_value(value)}" for entry, value in new.items()])


def hydra_parser(text: str | None = None):
    """(OverridesParser, HydraException): -S values are read by Hydra's grammar, as DVC reads them.
    hydra-core comes with DVC; a GPU node that runs run-stages without DVC needs it for what
    plain_set does not read (sweeps, lists, quoted strings). `text`: the -S that needs it, named."""
    try:
        from hydra.core.override_parser.overrides_parser import OverridesParser
        from hydra.errors import HydraException
    except ImportError:
        raise UserError((f"-S {text}: " if text else "") + "-S values are read with Hydra's grammar, as dvc exp run "
                        "reads them, and hydra-core is not installed: pip install hydra-core (it comes with dvc), or put "
                        "the values in a profile file. Without it, -S takes one plain value per key: a number, true, "
                        "false, null, or a word or path (letters, digits and _ - . / : @ +)") from None
    return OverridesParser, HydraException


# The -S values read without hydra-core (a GPU node without DVC): one plain scalar per key, read as
# Hydra's grammar reads it (tests/test_profiles.py holds the two readers side by side). Sweeps,
# lists, quotes, spaces and interpolations need Hydra.
PLAIN_SET = re.compile(r"(?P<section>[A-Za-z_]\w*)\.(?P<key>[A-Za-z_]\w*)=(?P<value>[\w./:@+-]+)")
PLAIN_INT = re.compile(r"[+-]?(0|[1-9]\d*)")
PLAIN_FLOAT = re.compile(r"[+-]?((\d+\.\d*|\.\d+)([eE][+-]?\d+)?|\d+[eE][+-]?\d+|inf|nan)", re.IGNORECASE)
PLAIN_WORD = re.compile(r"[A-Za-z_/:@][\w./:@+-]*")  # Hydra joins such tokens into one string, as written


def plain_set(text: str):
    """`-S section.key=VALUE` with a plain VALUE as (section, key, value), as parse_set reads it; None
    for any other (the caller needs Hydra for it)."""
    m = PLAIN_SET.fullmatch(text)
    if not m:
        return None
    v = m["value"]
    if PLAIN_INT.fullmatch(v):
        value = int(v)
    elif PLAIN_FLOAT.fullmatch(v):
        value = float(v)
    elif v.lower() in ("true", "false"):
        value = v.lower() == "true"
    elif v.lower() == "null":
        value = None
    elif PLAIN_WORD.fullmatch(v):
        value = v
    else:  # 007, 1.5x: what Hydra makes of these is its own business
        return None
    return m["section"], m["key"], value


def parse_set(text: str):
    """`-S section.key=VALUE` as DVC reads it: (section, key, value), VALUE in Hydra's grammar (a plain
    VALUE without hydra-core: plain_set)."""
    try:
        OverridesParser, HydraException = hydra_parser(text)
    except UserError:
        if (plain := plain_set(text)) is not None:
            return plain
        raise

    try:
        (override,) = OverridesParser.create().parse_overrides([text])
    except HydraException as e:
        raise UserError(f"-S {text}: not a Hydra override ({str(e).splitlines()[0]}); write section.key=VALUE, "
                        "quoting strings, e.g. -S 'export.sglang_version=\"0.5.14\"'") from None
    if override.is_sweep_override() or override.package is not None or override.type.name != "CHANGE":
        raise UserError(f"-S {text}: give one value to an existing key (section.key=VALUE); sweeps, +/~ prefixes and "
                        "packages are for dvc exp run itself")
    section, _, key = override.key_or_group.partition(".")
    if not key or "." in key:
        raise UserError(f"-S {text}: the key must be section.key, e.g. spec.num_steps")
    return section, key, override.value()


# ---------------------------------------------------------------------------------------------
# merging and checking


@dataclass
class Applied:
    """The merge of params.yaml and the profiles: each key set, its old and new typed value, and who set it."""

    params_file: Path
    keys: list[str]  # section.key, in the order first set
    old: dict  # section.key -> params.yaml's value (as the loader types it)
    new: dict  # section.key -> the merged value (as the loader types it)
    origin: dict  # section.key -> the profile file (or the -S) that set it last

    def overrides(self) -> list[str]:
        """The -S overrides of dvc exp run that set each key: `section.key=VALUE`, or one per entry of a
        mapping (dvc_overrides)."""
        return [o for k in self.keys for o in dvc_overrides(k, self.old[k], self.new[k])]


def profile_path(name: str) -> Path:
    """PROFILE as given, or configs/PROFILE.yaml."""
    path = Path(name)
    try:
        for candidate in (path, PROFILES_DIR / name, PROFILES_DIR / f"{name}.yaml"):
            if candidate.exists():
                return candidate
    except OSError:  # a name longer than the file system allows
        raise UserError(f"{clip(name, 80)}: no such profile (a name of {len(name):,} characters is no file name)") from None
    known = ", ".join(sorted(p.stem for p in PROFILES_DIR.glob("*.yaml"))) or "none"
    raise UserError(f"{path}: no such profile (neither a file nor {PROFILES_DIR / (path.stem + '.yaml')}; profiles in "
                    f"{PROFILES_DIR}/: {known})")


def _check_sections(data: dict, label: str) -> None:
    for name in data:
        if name not in SECTIONS:
            close = difflib.get_close_matches(str(name), list(SECTIONS), n=1, cutoff=0.6)
            raise ParamsError(f"{label}: unknown section '{clip(name)}'" + (f", did you mean {close[0]}?" if close else ""))


def _typed(merged: dict, section: str, label: str):
    """The section loaded by params.yaml's own loader; its errors name `label`."""
    return _load_section(section, merged[section], label)


def apply_profiles(profiles: list[str], sets: list[str] = (), params_file: str | Path = PARAMS_FILE) -> Applied:
    """Merge `profiles` and then `sets` over `params_file`, one step at a time. Each step is loaded with
    the params loader while the merge so far loaded clean, so its error names the step's own file
    (or -S) and key."""
    params_file = Path(params_file)
    base = load_params(list(SECTIONS), params_file)  # params.yaml itself first: its own faults name it
    merged = {name: dict(values) for name, values in read_yaml(params_file).items()}
    old = {f"{s}.{k}": v for s, sec in vars(base).items() for k, v in vars(sec).items()}
    new, origin, keys = dict(old), {}, []

    def step(data: dict, label: str) -> None:
        _check_sections(data, label)
        for section, values in data.items():
            if not isinstance(values, dict):
                raise ParamsError(f"{label}: section '{clip(section)}' must be a mapping of keys, got {type(values).__name__}")
            merged[section].update(values)  # a key's value replaces params.yaml's whole: lists replace
            typed = _typed(merged, section, label)
            for key in values:
                name = f"{section}.{key}"
                new[name], origin[name] = getattr(typed, key), label
                if name not in keys:
                    keys.append(name)

    for name in profiles:
        path = profile_path(name)
        step(read_yaml(path, "profile"), str(path))
    for text in sets:
        section, key, value = parse_set(text)
        step({section: {key: value}}, f"-S {text}")
    for name in keys:  # a value DVC cannot carry fails here, before anything runs
        try:
            dvc_overrides(name, old[name], new[name])
        except UserError as e:
            raise UserError(f"{origin[name]}: key {name}: {e}") from None
    return Applied(params_file, keys, {k: old[k] for k in keys}, {k: new[k] for k in keys}, origin)


# ---------------------------------------------------------------------------------------------
# the command


def dvc_exp_run(applied: Applied, queue: bool = False, name: str | None = None, extra: list[str] = ()) -> list[str]:
    """argv of the `dvc exp run` that applies `applied`."""
    argv = ["dvc", "exp", "run"]
    if queue:
        argv.append("--queue")
    if name:
        argv += ["--name", name]
    for override in applied.overrides():
        argv += ["-S", override]
    return argv + list(extra)


def show(applied: Applied) -> str:
    """`key: old -> new` per key (values typed as the params loader reads them, in JSON), with the file that set each."""
    lines = []
    for k in applied.keys:
        old, new = (json.dumps(applied.old[k], ensure_ascii=False), json.dumps(applied.new[k], ensure_ascii=False))
        change = f"{old} -> {new}" if applied.old[k] != applied.new[k] else f"{new} (unchanged)"
        lines.append(f"{k}: {change}    # {applied.origin[k]}")
    changed = sum(applied.old[k] != applied.new[k] for k in applied.keys)
    lines.append(f"{len(applied.keys)} key(s) over {applied.params_file}, {changed} changed")
    return "\n".join(lines)


def command_line(argv: list[str]) -> str:
    return shlex.join(argv)
