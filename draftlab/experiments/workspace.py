"""A failed `draftlab exp run` puts the workspace back as the run found it, and says what it did.

`dvc exp run` runs in the workspace: it writes the -S values into params.yaml, removes a stage's
outputs before running that stage, and commits each stage that finishes (dvc.lock, the .gitignore
beside an output, DVC's cache). When a later stage fails, all of that stays: params.yaml modified,
models/target-pin.json deleted, a half-made models/target-dequantized. `Snapshot.take()` records,
before the run, what the run can touch; `Snapshot.restore()` puts it back after a failure:

- params.yaml, dvc.lock and the .gitignore files beside the outputs: their bytes as they were;
- outputs DVC does not cache (`cache: false`: the target pin, metrics, reports): copied aside
  before the run and copied back;
- outputs DVC caches: removed when the run made them (a stage that finished keeps its copy in DVC's
  cache and run cache, so the next run restores it without recomputing), checked out from DVC's
  cache (`dvc checkout`) when the run changed or removed them;
- the persistent outputs (`persist: true`) of the stage that failed: kept, because that stage
  resumes from them (synthesize per answer, extract per shard), and listed with the command that
  drops them;
- new files that dvc.yaml does not name (from `git status`): listed, never touched.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import yaml

COPY_LIMIT = 256 << 20  # bytes: a non-cached output larger than this is not copied aside (listed if the run changes it)


def _paths(entries) -> list[tuple[str, dict]]:
    from draftlab.experiments.run_stages import _paths as paths

    return paths(entries)


def outputs(dvc_file: Path) -> list[tuple[str, str, dict]]:
    """[(path, stage, options)] of every output, metric and plot file dvc.yaml's stages write."""
    try:
        stages = (yaml.safe_load(dvc_file.read_text()) or {}).get("stages") or {}
    except (OSError, yaml.YAMLError):
        return []
    return [(path.rstrip("/"), name, opts) for name, s in stages.items() if isinstance(s, dict)
            for key in ("outs", "metrics", "plots") for path, opts in _paths(s.get(key))]


def fingerprint(path: Path) -> str | None:
    """None when absent; else a hash of the names, sizes and modification times under `path` (no
    content read: an output of several GB is fingerprinted in milliseconds)."""
    if not path.exists() and not path.is_symlink():
        return None
    files = [path] if not path.is_dir() else sorted(p for p in path.rglob("*"))
    h = hashlib.sha256()
    for p in files:
        st = p.lstat()
        h.update(f"{p.relative_to(path.parent).as_posix()}\0{st.st_mode}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def _copy(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    if src.is_dir():
        shutil.copytree(src, dst, symlinks=True)
    else:
        shutil.copy2(src, dst)


def untracked() -> set[str] | None:
    """Files and folders git shows as untracked (not ignored), or None outside a git repository."""
    try:
        r = subprocess.run(["git", "status", "--porcelain=v1", "-z", "--untracked-files=normal"], capture_output=True,
                           text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return {e[3:].rstrip("/") for e in r.stdout.split("\0") if e.startswith("?? ")}


def _under(path: str, roots) -> bool:
    return any(path == r or path.startswith(r + "/") or r.startswith(path + "/") for r in roots)


@dataclass
class Outcome:
    """What restore did, each path with why."""

    restored: list[str] = field(default_factory=list)  # copied back as it was
    removed: list[str] = field(default_factory=list)  # made by the run
    checked_out: list[str] = field(default_factory=list)  # from DVC's cache
    kept: list[tuple[str, str]] = field(default_factory=list)  # (path, why and how to drop it)
    left: list[tuple[str, str]] = field(default_factory=list)  # (path, why and what to do)
    backup: str | None = None  # where the copies as they were stay (kept when something could not be put back)

    def text(self, rc: int, acted: bool = True) -> str:
        head = f"draftlab exp run: dvc exp run failed (exit {rc})"
        if not (self.restored or self.removed or self.checked_out or self.kept or self.left):
            return f"{head}; the workspace is as the run found it"
        if acted:
            lines = [f"{head}; the workspace is put back as the run found it:"]
            if self.restored:
                lines.append("  put back as it was: " + ", ".join(self.restored))
            if self.removed:
                lines.append("  removed (the run made it): " + ", ".join(self.removed))
            if self.checked_out:
                lines.append("  checked out from DVC's cache: " + ", ".join(self.checked_out))
        else:
            lines = [f"{head}; --keep-failed: the workspace is left as the run left it:"]
            if self.restored:
                lines.append("  changed: " + ", ".join(self.restored) + f" (as they were before the run: copies in {self.backup})")
            if self.removed:
                lines.append("  made by the run: " + ", ".join(self.removed) + f" (undo: rm -r {' '.join(self.removed)})")
            if self.checked_out:
                lines.append("  changed or removed: " + ", ".join(self.checked_out) +
                             f" (undo: dvc checkout --force {' '.join(self.checked_out)}, once dvc.lock is back)")
        lines += [f"  kept: {p}: {why}" for p, why in self.kept]
        lines += [f"  left: {p}: {why}" for p, why in self.left]
        if acted and self.backup:
            lines.append(f"  copies of params.yaml and of the outputs DVC does not cache, as they were before the run: {self.backup}")
        return "\n".join(lines)


@dataclass
class Snapshot:
    """What a `dvc exp run` in the current directory can touch, as it was before the run."""

    backup: Path  # copies of the small files and non-cached outputs
    saved: dict  # path -> its copy under backup | False (absent) | str: its fingerprint (too large to copy)
    cached: dict  # path -> (stage, persist, fingerprint or None)
    lock: dict  # dvc.lock's stages before the run
    untracked: set | None

    @classmethod
    def take(cls, params_file: Path, dvc_file: Path = Path("dvc.yaml")) -> "Snapshot":
        outs = outputs(dvc_file)
        small = [str(params_file), "dvc.lock", ".gitignore"]
        small += sorted({(Path(p).parent / ".gitignore").as_posix() for p, _, _ in outs})
        small += [p for p, _, opts in outs if opts.get("cache") is False]
        backup = Path(tempfile.mkdtemp(prefix="draftlab-exp-run-"))
        saved = {}
        for i, rel in enumerate(dict.fromkeys(small)):
            p = Path(rel)
            if not (p.exists() or p.is_symlink()):
                saved[rel] = False
            elif _size(p) > COPY_LIMIT:
                saved[rel] = fingerprint(p)
            else:
                saved[rel] = backup / f"{i}-{p.name}"
                _copy(p, saved[rel])
        cached = {p: (stage, bool(opts.get("persist")), fingerprint(Path(p)))
                  for p, stage, opts in outs if opts.get("cache", True) is not False}
        return cls(backup, saved, cached, _lock_stages(), untracked())

    def discard(self) -> None:
        shutil.rmtree(self.backup, ignore_errors=True)

    def restore(self, act: bool = True) -> Outcome:
        """Put back what the run changed (act=False: only say what it changed). The backup is
        removed once everything came back."""
        out = Outcome()
        finished = {s for s, entry in _lock_stages().items() if self.lock.get(s) != entry}  # stages the run committed
        for rel, copy in self.saved.items():
            p = Path(rel)
            if isinstance(copy, str):
                if fingerprint(p) != copy:
                    out.left.append((rel, f"changed by the run and too large (over {COPY_LIMIT >> 20} MB) to have been "
                                          "copied aside before it; the stage that writes it makes it again"))
                continue
            if copy is False:
                if p.exists() or p.is_symlink():
                    if act:
                        _remove(p)
                    out.removed.append(rel)
                continue
            if _same(copy, p):
                continue
            if act:
                _remove(p)
                _copy(copy, p)
            out.restored.append(rel)
        for rel, (stage, persist, before) in self.cached.items():
            p = Path(rel)
            now = fingerprint(p)
            if now == before:
                continue
            if persist and stage not in finished and now is not None:
                out.kept.append((rel, f"stage {stage} stopped in it; the same run again resumes from it "
                                      f"(rm -r {rel} drops it)"))
                continue
            if before is None:
                if act:
                    _remove(p)
                out.removed.append(rel)
                continue
            if not act:
                out.checked_out.append(rel)
                continue
            problem = _checkout(rel)
            if problem is None:
                out.checked_out.append(rel)
            else:
                out.left.append((rel, f"the run changed it and DVC's cache has no copy of what was there ({problem}); "
                                      f"`dvc repro {stage}` makes it again"))
        if self.untracked is not None:
            named = list(self.saved) + list(self.cached)
            for rel in sorted((untracked() or set()) - self.untracked):
                if not _under(rel, named):
                    out.left.append((rel, "new since the run started and not an output dvc.yaml names, so not touched"))
        if act and not out.left:
            self.discard()
        else:
            out.backup = str(self.backup)
        return out


def _same(a: Path, b: Path) -> bool:
    """Whether `b` holds the same files with the same bytes as `a`."""
    if not (b.exists() or b.is_symlink()):
        return False
    if a.is_dir() != b.is_dir():
        return False
    if not a.is_dir():
        return a.read_bytes() == b.read_bytes()
    names = lambda d: sorted(p.relative_to(d).as_posix() for p in d.rglob("*") if p.is_file())  # noqa: E731
    return names(a) == names(b) and all((a / n).read_bytes() == (b / n).read_bytes() for n in names(a))


def _lock_stages() -> dict:
    try:
        return (yaml.safe_load(Path("dvc.lock").read_text()) or {}).get("stages") or {}
    except (OSError, yaml.YAMLError):
        return {}


def _checkout(rel: str) -> str | None:
    """None when `dvc checkout` put `rel` back as dvc.lock records it; else the first line of why not."""
    r = subprocess.run([sys.executable, "-m", "dvc", "checkout", "--force", rel], capture_output=True, text=True,
                       env={**os.environ, "DVC_NO_ANALYTICS": "1"})
    if r.returncode == 0 and Path(rel).exists():
        return None
    lines = [line.strip() for line in (r.stderr + r.stdout).splitlines() if line.strip()]
    return (lines[0] if lines else f"dvc checkout exited {r.returncode}")[:200]
