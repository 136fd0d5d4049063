"""A scratch copy of the project that DVC can run in seconds: the pipeline's code, dvc.yaml and
params.yaml, serving a micro target instead of the shipped one."""
import shutil
from pathlib import Path

from tests.support.micro import save_micro_model

ROOT = Path(__file__).resolve().parents[2]
COPY = ["stages", "draftlab", "dvc.yaml", "params.yaml", ".dvc/config", ".dvc/.gitignore", ".dvcignore", ".gitignore"]


def copy_project(root: Path) -> Path:
    """Copy the project into `root` with a 6-layer micro target at models/micro (the default
    target's folder is a dep in dvc.yaml; the copy's dvc.yaml names the micro one instead)."""
    for name in COPY:
        src, dst = ROOT / name, root / name
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(src, dst)
    save_micro_model(root / "models" / "micro", arch="llama", num_layers=6)
    dag = root / "dvc.yaml"
    dag.write_text(dag.read_text().replace("models/tiny-target", "models/micro"))
    return root
