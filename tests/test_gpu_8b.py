"""tools/gpu_8b.py, the parts that need no GPU: the params it runs with and the deadline."""
import importlib.util
import sys
from pathlib import Path

import yaml

from draftlab.params import load_params

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("gpu_8b", ROOT / "tools" / "gpu_8b.py")
tool = importlib.util.module_from_spec(spec)
sys.modules["gpu_8b"] = tool
spec.loader.exec_module(tool)
sys.path.insert(0, str(ROOT / "tools"))
import sglang_run  # noqa: E402


def test_gpu_params_load_and_point_synthesis_at_the_server(tmp_path):
    run = tool.Run(tool.parse_args(["--work", str(tmp_path / "w"), "--results", str(tmp_path / "r")]))
    path = tool.run_params(run, "http://127.0.0.1:4321")
    over = yaml.safe_load(path.read_text())
    assert over["synth"] == {**over["synth"], "backend": "openai", "base_url": "http://127.0.0.1:4321/v1"}
    # merged as tools/sglang_run.py merges it, every key passes the params loader
    merged = sglang_run.merge(sglang_run.merge(yaml.safe_load((ROOT / "params.yaml").read_text()), sglang_run.SGLANG_PARAMS), over)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(merged))
    p = load_params(["target", "prompts", "synth", "capture", "extract", "standardize", "train", "export", "spec", "bench", "check"],
                    tmp_path / "params.yaml")
    assert p.bench.backend == "sglang" and p.bench.side_by_side and p.bench.concurrency == [1, 4, 8, 16]
    assert p.prompts.num_prompts >= 4800 and p.target.dtype == "bfloat16"
    assert "--mem-fraction-static" in p.bench.extra_server_args


def test_a_step_that_would_not_fit_is_skipped_and_recorded(tmp_path):
    run = tool.Run(tool.parse_args(["--work", str(tmp_path / "w"), "--results", str(tmp_path / "r"), "--deadline-s", "100"]))
    assert run.fits("sweep", 50)
    assert not run.fits("parity", 500)
    again = tool.Run(tool.parse_args(["--work", str(tmp_path / "w"), "--results", str(tmp_path / "r")]))
    assert "500 s expected" in again.record["steps"]["parity"]["skipped"]  # run.json survives a re-run
