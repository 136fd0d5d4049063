"""A grid of run-stages runs, written as `dvc exp run --queue` writes one: sweeps in -S values.

    draftlab run-stages configs/real-gpu.yaml -S 'train.epochs=3,6,10' -S 'extract.loop_tokens=learn,skip'

A -S value that is a sweep in Hydra's grammar, as DVC reads it (`a,b,c`, `choice(a,b)`,
`range(2,8,2)`), makes the run a grid: every combination of the swept values, each run by
run-stages in turn in this workspace. The keys whose first stage comes earliest in the DAG vary
slowest, so a stage upstream of every swept key runs once and a key read by a late stage costs
only that stage and what follows it (above, extract runs twice, train six times). After each
point its reports, params and manifests are copied into RUNS/<point>/ (`--runs`, default runs/),
with point.json; a point whose folder holds a finished record of the same overrides is skipped,
so an interrupted grid resumes at the point it stopped. RUNS/grid.csv and the printed table hold
one row per point: the swept values, tau predicted by training, served tau and speedup (when the
bench ran), training tokens/s and the wall time the point took. With DVC at hand,
`dvc exp run --queue` with the same -S values and `dvc exp show` do the same with versioning.

With --one-at-a-time, the base (the profiles and the single -S values) runs first, then each swept
key's values alone against it (1 + 2 + 2 points for two keys of two values, not 4): a treatment per
key, each beside the base, as a recipe study compares them (draftlab exp report). Grids run one
after another into the same RUNS folder add up: grid.csv lists every finished point there.
"""
from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import tarfile
from pathlib import Path

import pandas as pd
import yaml

from draftlab.data import self_prompts, synth
from draftlab.errors import UserError
from draftlab.fsutil import atomic_write_json, atomic_write_text
from draftlab.train import RESUME_DIR

# What a point keeps: the same files a GPU node packs after a run (pack, tools/offline_gpu_run.sh).
KEPT = ("reports", ".run-stages.json", "params.yaml", "data/*/manifest.json", "models/*/manifest.json",
        "models/draft/config.json")
# What a GPU node packs beside them: a grid's points, the target's pin and the held-out prompts.
PACKED = KEPT + ("runs", "models/target-pin.json", "data/prompts/eval.jsonl")
# On request, the target's answers too (tools/offline_gpu_run.sh with DRAFTLAB_PACK_ANSWERS=1): unpacked
# into the next node's tree, synthesize reuses every one of them and starts no server. The prompts the
# target wrote itself travel with them (stage self_prompts keeps its file under the same settings), or the
# next node would write other ones and answer those again. A synthesis stopped midway (a job's time limit,
# a preempted node) leaves its finished conversations in <split>.jsonl.partial under the key in .resume.json:
# they travel too, and the next node's synthesize keeps them and answers only the rest.
ANSWERS = (*(f"data/synth/{split}.jsonl{end}" for end in ("", ".partial") for split in synth.SPLITS),
           f"data/synth/{synth.ANSWERS_FILE}", f"data/synth/{synth.RESUME_FILE}",
           f"data/self-prompts/{self_prompts.FILE}", f"data/self-prompts/{self_prompts.KEY_FILE}")
# And the exported draft (DRAFTLAB_PACK_DRAFT=1): the SGLang checkpoint itself, to serve or study elsewhere.
DRAFT = ("models/draft/*",)
# And a training stopped midway (DRAFTLAB_PACK_RESUME=1): its last checkpoint, weights and optimizer state.
# Unpacked into the next node's tree beside the answers, train continues from the step it reached (an
# online run with a state cache first computes the cache again). Absent once train completed.
RESUME = (f"{RESUME_DIR}/last.pt",)


def pack(tar_path: str | Path, root: str | Path = ".", answers: bool = False, draft: bool = False,
         resume: bool = False) -> list[str]:
    """PACKED's files under `root` (and ANSWERS' with `answers`, DRAFT's with `draft`, RESUME's with `resume`)
    into one .tar.gz at `tar_path` (written whole: a tmp file renamed), whatever of them exists; returns the
    paths packed."""
    root, tar_path = Path(root), Path(tar_path)
    found = matching(PACKED + (ANSWERS if answers else ()) + (DRAFT if draft else ()) + (RESUME if resume else ()), root)
    tmp = tar_path.with_name(tar_path.name + ".tmp")
    with tarfile.open(tmp, "w:gz") as tar:
        for src in found:
            tar.add(src, arcname=str(src.relative_to(root)))
    os.replace(tmp, tar_path)
    return [str(src.relative_to(root)) for src in found]


# The environment variables of tools/offline_gpu_run.sh that add to its pack, and what each adds (pack's flags).
ON_REQUEST = {"DRAFTLAB_PACK_ANSWERS": "answers", "DRAFTLAB_PACK_DRAFT": "draft", "DRAFTLAB_PACK_RESUME": "resume"}


def pack_as_asked(tar_path: str | Path, env=os.environ) -> list[str]:
    """pack into `tar_path` from the current directory, with each ON_REQUEST set that `env` sets to 1."""
    return pack(tar_path, **{flag: env.get(var) == "1" for var, flag in ON_REQUEST.items()})


def matching(patterns: tuple[str, ...], root: Path) -> list[Path]:
    """The paths under `root` that `patterns` (globs, relative to it) name, pattern by pattern, each's sorted;
    a path two patterns name, once."""
    return list(dict.fromkeys(src for pattern in patterns for src in sorted(root.glob(pattern))))


def split_sets(sets: list[str]) -> tuple[list[str], list[tuple[str, list[str]]]]:
    """(-S overrides that set one value, [(key, one override per value)] for each sweep)."""
    if not sets:  # no -S: nothing for Hydra's parser (a GPU node may run without DVC, which brings it)
        return [], []
    from draftlab.experiments.profiles import hydra_parser, hydra_value

    try:
        OverridesParser, HydraException = hydra_parser()
    except UserError:  # no hydra-core: no sweep; profiles.parse_set reads plain values and names any other
        return list(sets), []

    fixed, swept = [], []
    for text in sets:
        try:
            (override,) = OverridesParser.create().parse_overrides([text])
        except HydraException:
            fixed.append(text)  # not Hydra at all: the params loader names the fault
            continue
        if not override.is_sweep_override():
            fixed.append(text)
            continue
        key = override.key_or_group
        if override.is_interval_sweep():
            raise UserError(f"-S {text}: interval() needs a sampler; list the values instead (a,b,c or range(start,stop,step))")
        if any(k == key for k, _ in swept):
            raise UserError(f"-S {text}: {key} is swept twice; give all its values in one -S")
        swept.append((key, [f"{key}={hydra_value(v)}" for v in override.sweep_iterator()]))
    return fixed, swept


def first_stage(key: str, dvc: dict) -> int:
    """Index in the DAG's order of the first stage that lists `key` (or its section) in its params."""
    from draftlab.experiments.run_stages import stage_order

    section = key.split(".")[0]
    for i, name in enumerate(stage_order(dvc)):
        for entry in dvc["stages"][name].get("params") or []:
            for listed in ([entry] if isinstance(entry, str) else list(entry)):
                if listed in (key, section):
                    return i
    return len(dvc["stages"])  # read by no stage: vary it fastest


def points(swept: list[tuple[str, list[str]]], dvc: dict, one_at_a_time: bool = False) -> list[list[str]]:
    """Every combination, the keys of the earliest stages varying slowest; or, one at a time, the base
    (no swept key: the profiles' values) and then each key's values alone, the earliest stage's key first."""
    ordered = sorted(swept, key=lambda kv: first_stage(kv[0], dvc))
    if one_at_a_time:
        return [[]] + [[value] for _, values in ordered for value in values]
    return [list(p) for p in itertools.product(*(values for _, values in ordered))]


def point_name(i: int, overrides: list[str]) -> str:
    """'03-epochs=6-loop_tokens=skip': the point's index, then each swept key's column in the study
    (its last part, or study.NAMED's: 'self_prompts=20000') and value."""
    from draftlab.experiments.study import column

    parts = [f"{column(o.split('=', 1)[0])}={o.split('=', 1)[1].strip(chr(34))}" for o in overrides] or ["base"]
    return re.sub(r"[^A-Za-z0-9._=,+-]+", "_", f"{i + 1:02d}-" + "-".join(parts))[:120]


def keep(folder: Path, record: dict) -> None:
    """The point's files into `folder`, whole or not at all (a tmp folder renamed at the end)."""
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for src in matching(KEPT, Path(".")):
        dst = tmp / src
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(src, dst) if src.is_dir() else shutil.copy2(src, dst)
    atomic_write_json(tmp / "point.json", record)
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)


def finished(folder: Path) -> dict | None:
    """The point.json of a point that finished (its overrides, its swept values), else None."""
    try:
        record = json.loads((folder / "point.json").read_text())
    except (OSError, ValueError):
        return None
    ok = isinstance(record, dict) and record.get("finished") is True and isinstance(record.get("swept"), list)
    return record if ok else None


def summary_row(folder: Path, swept_keys: list[str]) -> dict:
    """One row of grid.csv from a point's folder."""
    record = json.loads((folder / "point.json").read_text())
    values = {k: v.strip('"') for k, v in (o.split("=", 1) for o in record["swept"])}
    ran = {r["stage"] for r in record.get("stages") or []}  # run or unchanged for this point: not an older run's file
    train, bench = (json.loads(p.read_text()) if stage in ran and p.exists() else {} for stage, p in
                    (("train", folder / "reports/train/metrics.json"), ("bench", folder / "reports/bench.json")))
    figures = (train.get("tau_pred"), decoded_first_turns(folder, train), bench.get("tau"), bench.get("speedup"),
               train.get("tokens_per_s"), record.get("seconds"))
    return {"point": folder.name, **{k: values.get(k) for k in swept_keys}, **dict(zip(SUMMARY, figures))}


# grid.csv's columns after the point and its swept keys (a key a point did not sweep: empty, the profiles' value)
SUMMARY = ("tau_pred", "decoded_tau_first_turns", "served_tau", "speedup", "train_tokens_per_s", "seconds")


def decoded_first_turns(folder: Path, train_metrics: dict) -> float | None:
    """Greedy chains of the point's spec.num_steps replayed over the eval split's first answers
    (train metrics tau_decoded_first_turns_by_steps): the training-side figure closest to what a bench
    of first turns serves, so a grid run --until train can rank its points without serving them."""
    by_steps = train_metrics.get("tau_decoded_first_turns_by_steps") or {}
    try:
        steps = yaml.safe_load((folder / "params.yaml").read_text())["spec"]["num_steps"]
    except (OSError, KeyError, TypeError, yaml.YAMLError):
        return None
    return by_steps.get(f"steps_{steps}") if steps else None


def run_grid(profiles: list[str], sets: list[str], until: str | None, force: list[str], params_file, dvc_file,
             runs: str | Path = "runs", one_at_a_time: bool = False) -> list[dict]:
    """Run every point of the grid in `sets` (see the module's doc); returns grid.csv's rows: this
    grid's points, then those of earlier grids run into the same `runs` folder."""
    from draftlab.experiments.run_stages import run_stages

    fixed, swept = split_sets(sets)
    dvc = yaml.safe_load(Path(dvc_file).read_text())
    grid = points(swept, dvc, one_at_a_time)
    keys = list(dict.fromkeys(o.split("=", 1)[0] for point in grid for o in point))
    runs = Path(runs)
    how = "one key at a time" if one_at_a_time else "every combination"
    print(f"run-stages: a grid of {len(grid)} points over {', '.join(keys)} ({how}) -> {runs}/", flush=True)
    folders = []
    for i, point in enumerate(grid):
        folder = runs / point_name(i, point)
        folders.append(folder)
        overrides = fixed + point
        if (finished(folder) or {}).get("overrides") == overrides:
            print(f"run-stages: point {folder.name}: done before, skipped", flush=True)
            continue
        print(f"run-stages: point {i + 1} of {len(grid)}: {' '.join(point)}", flush=True)
        records = run_stages(profiles, overrides, until, force, params_file, dvc_file)
        keep(folder, {"profiles": profiles, "overrides": overrides, "swept": point, "finished": True,
                      "stages": records, "seconds": round(sum(r.get("seconds", 0) for r in records), 1)})
    rows = [summary_row(f, keys) for f in folders]
    print(pd.DataFrame(rows).to_string(index=False))
    others = sorted(p for p in runs.iterdir() if p.is_dir() and p not in folders and p.suffix != ".tmp")  # .tmp: keep()'s, unfinished
    earlier = {f: r for f in others if (r := finished(f))}  # the points of other grids run into this folder
    if earlier:
        keys += [k for k in dict.fromkeys(o.split("=", 1)[0] for r in earlier.values() for o in r["swept"]) if k not in keys]
        rows = [summary_row(f, keys) for f in folders + list(earlier)]
        print(f"run-stages: {runs / 'grid.csv'} also lists the {len(earlier)} finished point(s) of earlier grids there", flush=True)
    atomic_write_text(runs / "grid.csv", pd.DataFrame(rows, columns=["point", *keys, *SUMMARY]).to_csv(index=False))
    return rows
