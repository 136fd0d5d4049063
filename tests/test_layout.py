"""The package layout reads as the DAG: draftlab/ is a few shared basics and one wing per part of
the pipeline, and imports point one way, from a later part of the DAG to an earlier one.

The rule is a table (WINGS, lower first), not a list of files: a module of a wing may import the
basics, its own wing and the wings listed before it; a basic imports basics only. Function-level
imports count (they run too). docs/architecture.md draws the same table.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "draftlab"

# Lower first. A wing may import the ones before it, never the ones after.
WINGS = ["target", "data", "features", "train", "sglang", "engine", "bench", "check", "experiments"]
# What every wing may use: the params, manifests, metrics, errors and file helpers.
BASICS = {"errors", "fsutil", "dtypes", "params", "manifest", "metrics", "jsonl", "cli", "parallel", "lifecycle",
          "progress", "tracing", "yamlfile"}
# Entry points above everything: the draftlab command and the short names of python -m.
TOP = {"__init__", "__main__", "main", "server"}


def modules() -> dict[str, Path]:
    out = {}
    for f in sorted(PACKAGE.rglob("*.py")):
        parts = f.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


def import_graph() -> dict[str, set[str]]:
    """module -> the project modules it imports (package __init__s on the way included)."""
    mods = modules()
    graph = {}
    for name, f in mods.items():
        deps = set()
        for node in ast.walk(ast.parse(f.read_text(), filename=str(f))):
            if isinstance(node, ast.Import):
                wanted = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                wanted = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            for w in wanted:
                parts = w.split(".")
                deps |= {".".join(parts[:i]) for i in range(2, len(parts) + 1) if ".".join(parts[:i]) in mods}
        graph[name] = deps - {name}
    return graph


def rank(module: str) -> tuple[int, str]:
    """(rank, wing): basics 0, the wings 1.. in table order, the entry points above all."""
    parts = module.split(".")
    if len(parts) == 1:
        return 0, "draftlab"  # the package's own __init__
    head = parts[1]
    if head in WINGS:
        return WINGS.index(head) + 1, head
    if len(parts) == 2 and head in BASICS:
        return 0, "basics"
    if len(parts) == 2 and head in TOP:
        return len(WINGS) + 1, "top"
    raise AssertionError(f"{module}: neither a basic, an entry point nor in a wing; add it to one (tests/test_layout.py)")


def backward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Each import that points the wrong way, as 'a -> b (why)'."""
    bad = []
    for a, deps in sorted(graph.items()):
        ra, wa = rank(a)
        for b in sorted(deps):
            rb, wb = rank(b)
            if b == "draftlab" or wa == wb or rb < ra:
                continue
            bad.append(f"{a} -> {b} ({wa} may not import {wb})")
    return bad


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every import circle found by a depth-first walk (one per back edge)."""
    found, state = [], {}

    def walk(node, path):
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if nxt == "draftlab":
                continue  # the package's own __init__ imports nothing of the project
            if state.get(nxt) == "open":
                found.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                walk(nxt, path + [nxt])
        state[node] = "done"

    for n in sorted(graph):
        if n not in state:
            walk(n, [n])
    return found


def test_every_module_has_a_place():
    for m in modules():
        rank(m)  # raises with the module's name


def test_imports_point_from_later_parts_of_the_dag_to_earlier_ones():
    assert backward_imports(import_graph()) == []


def test_no_module_imports_itself_round_a_circle():
    assert cycles(import_graph()) == []


def test_no_module_in_a_wing_repeats_the_wings_name():
    for m in modules():
        parts = m.split(".")
        if len(parts) == 3 and parts[1] in WINGS:
            assert not parts[2].startswith(parts[1]), f"{m}: inside draftlab.{parts[1]} the name needs no '{parts[1]}' prefix"


def test_no_flat_module_is_left_beside_the_wings():
    flat = {f.stem for f in PACKAGE.glob("*.py")}
    assert flat <= BASICS | TOP, f"modules outside any wing: {sorted(flat - BASICS - TOP)}"


@pytest.mark.parametrize("edge, expected", [
    ({"draftlab.target.load": {"draftlab.bench.run"}}, "target may not import bench"),
    ({"draftlab.errors": {"draftlab.features.extract"}}, "basics may not import features"),
    ({"draftlab.check.draft": {"draftlab.main"}}, "check may not import top"),
])
def test_a_backward_import_is_named(edge, expected):
    graph = {**{m: set() for deps in edge.values() for m in deps}, **edge}
    bad = backward_imports(graph)
    assert len(bad) == 1 and expected in bad[0]


def test_a_circle_is_named():
    graph = {"draftlab.target.load": {"draftlab.target.check"}, "draftlab.target.check": {"draftlab.target.load"}}
    (circle,) = cycles(graph)
    assert circle[0] == circle[-1] and set(circle) == set(graph)


def test_an_install_that_is_not_editable_ships_every_wing():
    """pyproject's package list finds every package under draftlab/ (a plain `pip install .`
    copies only the packages listed; an editable install would hide a missing one)."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+, as the lock
    from setuptools import find_packages

    find = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    shipped = set(find_packages(str(ROOT), include=find["include"]))
    packages = {".".join(f.parent.relative_to(ROOT).parts) for f in PACKAGE.rglob("__init__.py")}
    assert packages <= shipped, f"not shipped by a plain install: {sorted(packages - shipped)}"
