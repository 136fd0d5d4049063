"""Check: were the stage outputs made on the hardware that re-runs the check?

A config_hash ties every output to its inputs, code, params and package versions, not to the
machine: the same hash on another CPU type or GPU gives slightly different floats (other SIMD
kernels, other thread splits of a reduction). Measured: tau_pred 3.2877 vs 3.2939 (0.19%) under
one config_hash on two 2-core x86 CPUs. After `dvc pull` a teammate re-runs some stages on their
machine and reads the others as pulled; this check names the outputs that came from other
hardware, so that a small metric difference reads as "different hardware", not "different
configuration". Pure: manifests and this machine's description in, Findings out.
"""
from __future__ import annotations

import json
from pathlib import Path

from draftlab.check.findings import Finding, info

# What changes float results, in the order a reader compares them. The core count is compared
# since torch's default thread count follows it (and a reduction split over other threads rounds
# differently); the torch thread count itself is recorded but not compared: each stage sets its own
# (standardize and export leave torch's default), so it is a stage setting, not the machine. The
# full flag hash is not compared either: a hypervisor's or kernel's extra flag changes no kernel.
COMPARED = ("machine", "cpu_model", "cpu_simd", "torch_cpu_capability", "cpu_count", "gpu")


def _compared(hw: dict) -> dict:
    torch = hw.get("torch")
    gpu = hw.get("gpu")
    return {
        "machine": hw.get("machine"),
        "cpu_model": hw.get("cpu_model"),
        "cpu_simd": hw.get("cpu_simd"),
        # None when the stage never imported torch: nothing to compare then
        "torch_cpu_capability": torch.get("cpu_capability") if torch else None,
        "cpu_count": hw.get("cpu_count"),
        "gpu": (gpu.get("name") or "unnamed") if gpu else "none",
    }


def hardware_differences(recorded: dict, here: dict) -> dict:
    """{key: {"recorded": ..., "here": ...}} for each compared property known on both sides that differs."""
    a, b = _compared(recorded), _compared(here)
    return {k: {"recorded": a[k], "here": b[k]} for k in COMPARED
            if a[k] is not None and b[k] is not None and a[k] != b[k] and "unnamed" not in (a[k], b[k])}


def _short(hw: dict) -> str:
    torch, gpu = hw.get("torch") or {}, hw.get("gpu")
    parts = [f"{hw.get('cpu_model') or 'unknown CPU'} ({'/'.join(hw.get('cpu_simd') or []) or 'no SIMD flags recorded'}"
             + (f", torch {torch['cpu_capability']}" if torch.get("cpu_capability") else "")
             + (f", {hw['cpu_count']} cores" if hw.get("cpu_count") else "") + ")"]
    parts.append(f"{gpu['count']}x {gpu.get('name') or 'GPU'}" if gpu else "no GPU")
    return ", ".join(parts)


def check_hardware(manifests: dict[str, dict | None], here: dict) -> list[Finding]:
    """One `hardware_differs` finding (ok-info) per kind of machine other than `here` that produced
    some of `manifests` (stage name -> manifest.json content, None where absent); its evidence
    names the stages, what differs, the recorded hardware (of the first stage) and this machine's.

    `here` is draftlab.manifest.describe_hardware() on the machine running the check. Manifests
    without a `hardware` record (written before it existed) are skipped, and so is everything
    when all outputs came from this kind of machine: the list is then empty.
    """
    groups: dict[str, tuple[dict, dict, list[str]]] = {}  # machine -> (recorded, what differs, stages)
    for name, manifest in manifests.items():
        recorded = (manifest or {}).get("hardware")
        if not recorded:
            continue
        differs = hardware_differences(recorded, here)
        if differs:
            # one finding per kind of machine: the hardware proper, not what a stage's torch made of it
            machine = {k: v for k, v in _compared(recorded).items() if k != "torch_cpu_capability"}
            group = groups.setdefault(json.dumps(machine, sort_keys=True, default=str), (recorded, {}, []))
            group[1].update(differs)
            group[2].append((manifest or {}).get("stage") or name)
    out = []
    for recorded, differs, stages in groups.values():
        out.append(info(
            "hardware_differs",
            {"stages": stages, "differs": differs, "recorded": recorded, "here": here},
            f"{', '.join(stages)} ran on other hardware than this check: {_short(recorded)} against {_short(here)} here "
            f"(differs in {', '.join(differs)}); a config_hash pins inputs, code, params and packages, not the machine, "
            "and float rounding differs across CPU types, core counts and GPUs, so figures may differ slightly (tau_pred "
            "3.2877 vs 3.2939, 0.19%, under one hash on two 2-core x86 CPUs): a difference this small is the hardware, "
            "not the configuration",
            "to compare figures like for like, re-run the stages on one kind of machine (dvc repro --force STAGE "
            "re-runs one here; or compare with runs made on the recorded hardware)",
        ))
    return out


def hardware_unrecorded(manifests: dict[str, dict | None]) -> list[Finding]:
    """The stages whose manifest check_hardware skipped for want of a `hardware` record, said as one
    ok-info finding (empty when every present manifest has one)."""
    stages = [(m or {}).get("stage") or name for name, m in manifests.items() if m and not m.get("hardware")]
    if not stages:
        return []
    return [info("hardware_not_checked", {"stages": stages},
                 f"not checked: the hardware {', '.join(stages)} ran on (their manifests predate the hardware record)",
                 "re-run those stages to record it (dvc repro --force STAGE)")]


def _read(path: Path) -> dict | None:
    try:
        return json.loads(Path(path).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def stage_manifests(run) -> dict[str, dict | None]:
    """The manifests of a diagnose.Run by stage name, for check_hardware: those the Run holds,
    plus train's (models/draft-ckpt, beside models/draft) and bench's (reports/bench/, beside
    reports/bench.json), read here since the Run keeps only their metrics. Absent ones are None."""
    paths = run.paths
    return {
        "synthesize": run.synth,
        "extract": run.hidden,
        "standardize": run.features,
        "train": _read(Path(paths.draft).with_name(Path(paths.draft).name + "-ckpt") / "manifest.json"),
        "export": run.export_manifest,
        "bench": _read(Path(paths.bench).with_suffix("") / "manifest.json"),
    }
