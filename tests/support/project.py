"""A scratch copy of the project that DVC can run in seconds: the pipeline's code, dvc.yaml and
params.yaml, serving a micro target instead of the shipped one."""
import os
import shutil
import subprocess
from pathlib import Path

import yaml

from tests.support.micro import save_micro_model

ROOT = Path(__file__).resolve().parents[2]
COPY = ["stages", "draftlab", "dvc.yaml", "params.yaml", ".dvc/config", ".dvc/.gitignore", ".dvcignore", ".gitignore"]
# The reduced params of the DVC tests (tests/test_pipeline_dvc.py, tests/test_dvc_remote.py).
REDUCED = {"target": {"model": "models/micro"}, "prompts": {"num_prompts": 24, "eval_fraction": 0.25},
           "synth": {"max_new_tokens": 12, "batch_size": 12}, "capture": {"layers": [0, 2, 4]},
           "extract": {"shard_tokens": 400}, "standardize": {"draft_vocab_size": 64},
           "train": {"epochs": 1, "batch_size": 4, "checkpoint_every": 0},
           "bench": {"num_prompts": 3, "warmup": 1, "max_new_tokens": 8, "concurrency": [1, 2]},
           "check": {"live_parity_samples": 1,
                     "fail_on_error": False}}  # a random micro target and a 1-epoch draft: tau checks may warn


def copy_project(root: Path) -> Path:
    """Copy the project into `root` with a 6-layer micro target at models/micro (REDUCED's
    target.model; dvc.yaml needs no edit: the stages depend on the target's pin, stage target)."""
    for name in COPY:
        src, dst = ROOT / name, root / name
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(src, dst)
    save_micro_model(root / "models" / "micro", arch="llama", num_layers=6)
    return root


def reduced_project(root: Path) -> Path:
    """copy_project() with the REDUCED params."""
    copy_project(root)
    p = yaml.safe_load((root / "params.yaml").read_text())
    for section, values in REDUCED.items():
        p[section].update(values)
    (root / "params.yaml").write_text(yaml.safe_dump(p, sort_keys=False))
    return root


def reproduced_project(root: Path) -> tuple[Path, str]:
    """reduced_project() in a fresh git repository after one `dvc repro` of the whole DAG:
    (root, that run's stdout). Tests that need the pipeline's products take a copy (copy_run)."""
    reduced_project(root)
    env = {**os.environ, "PYTHONPATH": str(root), "DVC_NO_ANALYTICS": "1"}
    subprocess.run(["git", "init", "-q"], cwd=root, check=True, capture_output=True)
    r = subprocess.run(["dvc", "repro"], cwd=root, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise AssertionError(f"dvc repro in {root} failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")
    return root, r.stdout


def copy_run(src: Path, dst: Path) -> Path:
    """A copy of a reproduced project (workspace, dvc.lock and DVC cache, file times kept) without
    its git repository and DVC's per-repository temp files: the caller runs `git init` itself."""
    def skip(folder, names):
        here = Path(folder)
        return [n for n in names if (here == src and n == ".git") or (here == src / ".dvc" and n == "tmp")]
    shutil.copytree(src, dst, symlinks=True, ignore=skip)
    return dst
