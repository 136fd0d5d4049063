"""What the wiring check reports: one Finding per fault (or per thing proven right).

A finding names the fault with a stable identifier (`capture_layers_shifted`), says how bad it
is, shows the numbers that prove it, the likely cause in plain words, and what to do. The check
functions of draftlab/check/*.py return lists of these; they never raise for a fault.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from draftlab.errors import QUOTE_CHARS, shown

ERROR, WARNING, INFO = "error", "warning", "ok-info"
SEVERITIES = (ERROR, WARNING, INFO)  # worst first


@dataclass(frozen=True)
class Finding:
    name: str  # stable identifier, e.g. "capture_layers_shifted"
    severity: str  # error | warning | ok-info
    evidence: dict = field(default_factory=dict)  # the fields and numbers that show it
    cause: str = ""  # the likely cause, in plain words
    fix: str = ""  # what to do

    def __post_init__(self):
        if self.severity not in SEVERITIES:
            raise ValueError(f"severity must be one of {SEVERITIES}, got {self.severity!r}")

    def as_dict(self) -> dict:
        return asdict(self)


def error(name: str, evidence: dict, cause: str, fix: str) -> Finding:
    return Finding(name, ERROR, evidence, cause, fix)


def warning(name: str, evidence: dict, cause: str, fix: str = "") -> Finding:
    return Finding(name, WARNING, evidence, cause, fix)


def info(name: str, evidence: dict, cause: str = "", fix: str = "") -> Finding:
    return Finding(name, INFO, evidence, cause, fix)


def errors(findings: list[Finding]) -> list[Finding]:
    return [f for f in findings if f.severity == ERROR]


def by_severity(findings: list[Finding]) -> list[Finding]:
    """Errors first, then warnings, then ok-info; the check order is kept within each."""
    return sorted(findings, key=lambda f: SEVERITIES.index(f.severity))


def names(findings: list[Finding]) -> list[str]:
    return [f.name for f in findings]


def bounded(value):
    """`value` as evidence: itself when short, else its repr cut to QUOTE_CHARS characters (a hostile
    config.json value never makes a report unbounded)."""
    text = shown(value)
    return value if len(text) < QUOTE_CHARS and "..." not in text else text


def finite(x):
    """Strict JSON for the reports: an infinite or NaN float becomes null."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [finite(v) for v in x]
    return x
