"""dvc.yaml's stages without DVC: for a machine with neither git nor DVC (an air-gapped GPU node).

    draftlab run-stages [PROFILE ...] [-S section.key=VALUE ...] [--until STAGE] [--force STAGE ...] [--runs DIR]
                        [--one-at-a-time]

The profiles are merged over params.yaml and written into it (as `dvc exp run -S` would), then
every stage of dvc.yaml runs in dependency order, its own `cmd`, from the project root. A stage is
skipped when its command, the params it lists and the contents of its deps are what they were
when it last completed here (recorded in .run-stages.json), and its outputs are the files it left
(each file's size and modification time: an output copied over, say by a code checkout laid over
the run's tree, or removed makes the stage run again): what `dvc repro` would skip, so a re-run after a crash or a timeout goes on where it stopped (the stages
themselves also resume inside: synthesize per row, extract per shard, train per checkpoint). As
DVC does, outputs not marked `persist` are removed before their stage runs. Each stage's wall
time is printed and recorded. With DVC at hand, prefer `draftlab exp run`: it also caches and
versions the outputs. A sweep in a -S value (`-S 'train.epochs=3,6,10'`) runs a grid, one point
after another (draftlab/experiments/grid.py).
"""
from __future__ import annotations

import hashlib
import json
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

from draftlab.errors import UserError
from draftlab.fsutil import atomic_write_json, atomic_write_text, canonical_json
from draftlab.manifest import dir_hash

STATE = Path(".run-stages.json")


def _paths(entries) -> list[tuple[str, dict]]:
    """[(path, options)] of a deps/outs/metrics list (items are 'path' or {'path': {...}})."""
    out = []
    for e in entries or []:
        if isinstance(e, str):
            out.append((e, {}))
        else:
            (path, opts), = e.items()
            out.append((path, opts or {}))
    return out


def stage_order(dvc: dict) -> list[str]:
    """The stages, each after every stage whose outputs it depends on (dvc.yaml's order otherwise)."""
    stages = dvc["stages"]
    outs = {name: [p for p, _ in _paths(s.get("outs")) + _paths(s.get("metrics")) + _paths(s.get("plots"))]
            for name, s in stages.items()}

    def producer(dep: str) -> str | None:
        for name, paths in outs.items():
            if any(dep == p or dep.startswith(p.rstrip("/") + "/") for p in paths):
                return name
        return None

    order, state = [], {}

    def visit(name: str) -> None:
        if state.get(name) == "done":
            return
        if state.get(name) == "visiting":
            raise UserError(f"dvc.yaml: stage {name} depends on itself through its deps")
        state[name] = "visiting"
        for dep, _ in _paths(stages[name].get("deps")):
            before = producer(dep)
            if before and before != name:
                visit(before)
        state[name] = "done"
        order.append(name)

    for name in stages:
        visit(name)
    return order


def _param_values(entries, params: dict) -> dict:
    """The values of the params a stage lists ('section' or 'section.key')."""
    values = {}
    for entry in entries or []:
        for name in ([entry] if isinstance(entry, str) else list(entry)):
            section, _, key = name.partition(".")
            values[name] = params.get(section) if not key else (params.get(section) or {}).get(key)
    return values


def stage_key(stage: dict, params: dict) -> str:
    """What decides whether a stage must run again: its command, its params' values, its deps' contents."""
    deps = {dep: (dir_hash(dep) if Path(dep).exists() else None) for dep, _ in _paths(stage.get("deps"))}
    return hashlib.sha256(canonical_json({"cmd": stage["cmd"], "params": _param_values(stage.get("params"), params),
                                          "deps": deps}).encode()).hexdigest()


def outputs_stamp(outs: list[tuple[str, dict]]) -> str:
    """A fingerprint of a stage's outputs as they lie: every file's path, size and modification time
    (ns), none read. Cheap on a 25 GB shard folder, and it changes when a file is written over or
    removed after the stage completed, as DVC's own check of the outputs would notice."""
    seen = []
    for out, _ in outs:
        path = Path(out)
        files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file()) if path.exists() else []
        for f in files:
            st = f.stat()
            seen.append((str(f), st.st_size, st.st_mtime_ns))
    return hashlib.sha256(canonical_json(seen).encode()).hexdigest()


def write_params(applied, params_file: Path) -> dict:
    """params.yaml with the merged values (comments are not kept); returns the written mapping."""
    from draftlab.params import read_yaml

    data = read_yaml(params_file)
    for name in applied.keys:
        section, key = name.split(".", 1)
        data[section][key] = applied.new[name]
    atomic_write_text(params_file, yaml.safe_dump(data, sort_keys=False, allow_unicode=True))
    return data


def read_state() -> dict:
    """What ran before, by stage; an unreadable record is set aside loudly (every stage then runs, and
    each stage's own resume keeps finished work), never trusted."""
    if not STATE.exists():
        return {}
    try:
        state = json.loads(STATE.read_text())
        if isinstance(state, dict) and all(isinstance(v, dict) for v in state.values()):
            return state
        why = "not a mapping of stage -> record"
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        why = f"not valid JSON ({e})"
    print(f"warning: {STATE}: {why}; ignoring it: every stage runs (delete the file to silence this)", file=sys.stderr)
    return {}


def run_stages(profiles: list[str], sets: list[str] = (), until: str | None = None, force: list[str] = (),
               params_file: str | Path = "params.yaml", dvc_file: str | Path = "dvc.yaml") -> list[dict]:
    """Apply the profiles, then run (or skip) each stage in order; returns one record per stage."""
    from draftlab.params import read_yaml
    from draftlab.experiments.profiles import apply_profiles

    params_file, dvc = Path(params_file), yaml.safe_load(Path(dvc_file).read_text())
    order = stage_order(dvc)
    for name in [until, *force]:
        if name is not None and name not in order:
            raise UserError(f"{dvc_file}: no stage {name!r}; stages: {', '.join(order)}")
    if profiles or sets:
        applied = apply_profiles(profiles, list(sets), params_file)
        params = write_params(applied, params_file)
        print(f"run-stages: {params_file}: {len(applied.keys)} key(s) from {', '.join(profiles) or '-S'}")
    else:
        params = read_yaml(params_file)  # a key given twice is refused here as DVC refuses it
    state = read_state()
    records = []
    for name in order[:order.index(until) + 1] if until else order:
        stage = dvc["stages"][name]
        key = stage_key(stage, params)
        outs = _paths(stage.get("outs")) + _paths(stage.get("metrics"))
        record = state.get(name) or {}
        if name not in force and record.get("key") == key and all(Path(p).exists() for p, _ in outs):
            # A record from before outputs were stamped is trusted as it was then.
            if record.get("outputs") in (None, outputs_stamp(outs)):
                print(f"run-stages: {name}: unchanged, skipped")
                records.append({"stage": name, "skipped": True})
                continue
            print(f"run-stages: {name}: its outputs changed since it completed (a file written over or removed: "
                  f"{', '.join(p for p, _ in outs)}); it runs again", flush=True)
        for path, opts in outs:  # as DVC: outputs are made anew unless persist
            if not opts.get("persist") and Path(path).exists():
                shutil.rmtree(path) if Path(path).is_dir() else Path(path).unlink()
        argv = shlex.split(stage["cmd"])
        if argv[0] == "python":
            argv[0] = sys.executable
        print(f"run-stages: {name}: {stage['cmd']}", flush=True)
        t0 = time.perf_counter()
        rc = subprocess.run(argv).returncode
        seconds = round(time.perf_counter() - t0, 1)
        records.append({"stage": name, "skipped": False, "seconds": seconds, "rc": rc})
        if rc != 0:
            raise UserError(f"stage {name} failed (exit {rc}) after {seconds} s; fix what it printed and run again: "
                            f"the stages done are skipped, and {name} resumes where it can")
        state[name] = {"key": stage_key(stage, params), "outputs": outputs_stamp(outs), "seconds": seconds,
                       "finished": time.strftime("%Y-%m-%dT%H:%M:%S")}
        atomic_write_json(STATE, state)
        print(f"run-stages: {name}: done in {seconds} s", flush=True)
    return records
