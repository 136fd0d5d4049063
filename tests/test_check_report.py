"""reports/summary.md links the run's own plots: what dvc.yaml's stages write, not every image kept under reports/."""
import shutil
from pathlib import Path

from draftlab.check.diagnose import Paths, Run
from draftlab.check.report import pipeline_plots, summary_markdown

ROOT = Path(__file__).resolve().parents[1]
OWN = ["train/plots/accept.png", "train/plots/loss.png", "bench/bench.png"]  # the train and bench stages' outs
FOREIGN = ["gpu-8b/speedup.png", "gpu-8b/earlier/run-1/train-accept.png", "sglang-h200/bench.png", "advice_sweep/sweep.png",
           "perf/roofline.svg", "stray.png"]  # other experiments' reports, committed beside the run's


def project(tmp_path: Path, dvc_yaml: str | None = None) -> Path:
    """A project folder with the shipped dvc.yaml (or `dvc_yaml`) and every image above under reports/."""
    if dvc_yaml is None:
        shutil.copy(ROOT / "dvc.yaml", tmp_path / "dvc.yaml")
    else:
        (tmp_path / "dvc.yaml").write_text(dvc_yaml)
    for name in OWN + FOREIGN:
        (tmp_path / "reports" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "reports" / name).write_bytes(b"\x89PNG")
    return tmp_path


def plot_links(summary: str) -> list[str]:
    section = summary.split("## Plots\n", 1)[1].split("\n## ", 1)[0]
    return [line for line in section.splitlines() if line.startswith("- ")]


def test_the_summary_links_the_runs_plots_and_no_other_experiments(tmp_path):
    root = project(tmp_path)
    out = root / "reports"
    summary = summary_markdown(Run(Paths()), [], "c0ffee", out, pipeline_plots(root / "dvc.yaml", out))
    assert plot_links(summary) == [f"- [{p}]({p})" for p in sorted(OWN)]
    for name in FOREIGN:
        assert name not in summary


def test_a_plot_file_dvc_yaml_names_is_linked_and_one_it_does_not_is_not(tmp_path):
    root = project(tmp_path, """
stages:
  report:
    cmd: python make.py
    outs: [reports/bench]
plots:
  - reports/gpu-8b/speedup.png
  - curves:
      x: {reports/train/plots/loss.tsv: epoch}
      y: {reports/train/plots/accept.png: value}
""")
    got = [p.relative_to(root / "reports").as_posix() for p in pipeline_plots(root / "dvc.yaml", root / "reports")]
    assert got == ["bench/bench.png", "gpu-8b/speedup.png", "train/plots/accept.png"]


def test_without_a_dvc_yaml_no_plot_is_claimed(tmp_path):
    (tmp_path / "reports").mkdir()
    (tmp_path / "reports" / "other.png").write_bytes(b"\x89PNG")
    plots = pipeline_plots(tmp_path / "dvc.yaml", tmp_path / "reports")
    assert plots == [] and "- none yet" in summary_markdown(Run(Paths()), [], "c0ffee", tmp_path / "reports", plots)
