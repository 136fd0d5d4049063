"""tools/inflight_h200.py, the parts that need no GPU: its prompts are the prompts stage's eval split."""
import json

import yaml

from draftlab import prompts
from tests.support.tools import load_tool

tool = load_tool("inflight_h200")


def test_the_eval_prompts_are_the_gpu_prompt_sets_eval_split(tmp_path):
    settings = tool.gpu_prompt_settings()
    gpu = yaml.safe_load((tool.ROOT / "configs" / "gpu-8b.yaml").read_text())
    assert settings["num_prompts"] == gpu["prompts"]["num_prompts"] and settings["batch"] == gpu["bench"]["num_prompts"]
    small = {**settings, "num_prompts": 200}
    n = tool.write_eval_prompts(tmp_path / "eval.jsonl", small)
    rows = [json.loads(line) for line in (tmp_path / "eval.jsonl").read_text().splitlines()]
    _, evals = prompts.split(prompts.builtin_prompts(200, settings["seed"]).rows, settings["eval_fraction"])
    assert n == len(rows) == len(evals) and [r["messages"] for r in rows] == [r["messages"] for r in evals]


def test_only_the_decode_lines_of_a_server_log_are_kept(tmp_path):
    log = tmp_path / "spec.log"
    log.write_text("[x] Prefill batch, #new-seq: 1\n[x] Decode batch, #running-req: 4, accept len: 3.1\nother\n")
    tool.decode_lines(log, tmp_path / "decode.log")
    assert (tmp_path / "decode.log").read_text() == "[x] Decode batch, #running-req: 4, accept len: 3.1\n"
    tool.decode_lines(tmp_path / "missing.log", tmp_path / "none.log")
    assert not (tmp_path / "none.log").exists()
