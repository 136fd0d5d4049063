"""The real workload's install line is defined once (draftlab/target/packaged.py), shown by the README, and
every other place that shows a pip install of the extra `real` shows exactly that line."""
import re
import subprocess

import pytest

from draftlab.errors import UserError
from draftlab.target.packaged import REAL_INSTALL, REAL_INSTALL_GPU
from tests.support.project import ROOT

TEXT = (".md", ".yaml", ".yml", ".py", ".sh", ".toml", ".txt", ".cfg")
SECTION = "A real workload: SmolLM2 on ShareGPT"
PAGE = "docs/real-workload.md"  # the page whose title is SECTION


def shown_lines() -> list[tuple[str, int, str]]:
    """(file, line number, the command) for every `pip install ...[real...]` spelled out in the
    project's files (tests excluded: they name the lines to check them)."""
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    out = []
    for name in files:
        if not name.endswith(TEXT) or name.startswith("tests/"):
            continue
        for n, line in enumerate((ROOT / name).read_text(errors="replace").splitlines(), 1):
            start = line.find("pip install")
            if start < 0 or "[real" not in line[start:]:
                continue
            command = re.split(r"`|\s#|\"", line[start:])[0].strip()
            out.append((name, n, command))
    return out


def test_the_real_workload_page_shows_both_lines():
    section = (ROOT / PAGE).read_text()
    commands = [line.split("  #")[0].strip() for line in section.splitlines()]
    assert REAL_INSTALL in commands and REAL_INSTALL_GPU in commands  # each a line of its own, copied as is
    assert "-c constraints/cpu.txt" in REAL_INSTALL  # the CPU line installs the pinned stack


def test_every_place_that_shows_an_install_of_the_real_extra_shows_the_one_line():
    shown = shown_lines()
    assert any(name == PAGE for name, _, _ in shown)  # the scan sees the lines it checks
    wrong = [f"{name}:{n}: {command}" for name, n, command in shown if command not in (REAL_INSTALL, REAL_INSTALL_GPU)]
    assert not wrong, "another install line than draftlab/target/packaged.py's REAL_INSTALL / REAL_INSTALL_GPU:\n" + "\n".join(wrong)


@pytest.mark.parametrize("where", ["configs/real-cpu.yaml", "configs/real-gpu.yaml", "reports/real-workload/README.md"])
def test_the_profiles_and_the_report_point_to_the_real_workload_page(where):
    text = (ROOT / where).read_text()
    assert PAGE in text
    assert (ROOT / PAGE).read_text().startswith(f"# {SECTION}\n")  # the page they point to is that one


def test_the_error_for_missing_gguf_packages_prints_the_lines(monkeypatch, tmp_path):
    import builtins

    from draftlab.target.gguf import read_header

    real_import = builtins.__import__

    def no_gguf(name, *args, **kwargs):
        if name == "gguf":
            raise ImportError("No module named 'gguf'")
        return real_import(name, *args, **kwargs)

    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF" + bytes(60))
    monkeypatch.setattr(builtins, "__import__", no_gguf)
    with pytest.raises(UserError) as e:
        read_header(path, str(path))
    assert REAL_INSTALL in str(e.value) and REAL_INSTALL_GPU in str(e.value)
