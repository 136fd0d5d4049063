"""tools/gpu_8b.py, the parts that need no GPU: the params it runs with and the deadline."""
import importlib.util
import json
import sys
from pathlib import Path

import pytest
import yaml

from draftlab.params import load_params

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("gpu_8b", ROOT / "tools" / "gpu_8b.py")
tool = importlib.util.module_from_spec(spec)
sys.modules["gpu_8b"] = tool
spec.loader.exec_module(tool)
sys.path.insert(0, str(ROOT / "tools"))
import sglang_run  # noqa: E402
from support.tools import load_tool  # noqa: E402


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


def test_the_sweep_measures_the_prompts_the_bench_stage_measured(tmp_path):
    """The advice per concurrency is calibrated on the bench stage's batches and compared with the
    sweep's: both must be the same eval prompts, since a batch's throughput depends on which of its
    prompts are still running in its last wave."""
    from draftlab import bench

    twin_sweep = load_tool("serve_8b_twin")
    warmup, num_prompts = tool.bench_prompts()
    rows = [{"messages": [{"role": "user", "content": f"question {i}"}]} for i in range(num_prompts + 40)]
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    measured = bench.read_eval_prompts(tmp_path, num_prompts + warmup)[warmup:]  # what the bench stage's batches send
    bs1, batches = twin_sweep.prompt_windows(rows, warmup, 32, num_prompts)
    assert batches == measured and len(batches) == num_prompts and bs1 == measured[:32]
    with pytest.raises(SystemExit, match="prompt-offset"):
        twin_sweep.prompt_windows(rows[:num_prompts], warmup, 32, num_prompts)
