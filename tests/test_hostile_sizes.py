"""A request larger than the data it can use is refused, or clamped loudly with what was really
used on record: never a run that measures less than its report says (no silent clamp)."""
import dataclasses
import json
from pathlib import Path

import pytest
import yaml

from draftlab.bench import run
from draftlab.data import prompts
from draftlab.check.diagnose import fewer_samples
from draftlab.errors import UserError
from draftlab.params import load_params
from draftlab.sglang.flags import SpecFlags

ROOT = Path(__file__).resolve().parents[1]
BENCH = load_params(["bench"], ROOT / "params.yaml").bench  # num_prompts 32, warmup 2, max_new_tokens 128
ROWS = [{"id": f"p{i}", "messages": [{"role": "user", "content": "q"}]} for i in range(51)]  # the default's 51 eval prompts
CHAIN = SpecFlags("EAGLE3", num_steps=5, topk=1, num_draft_tokens=6)


def bench_params(**kw):
    return dataclasses.replace(BENCH, **kw)


def test_the_bench_refuses_more_prompts_than_the_eval_split_holds():
    """`dvc exp run -S bench.num_prompts=100000` measured the 51 prompts there are and recorded 100000."""
    run.check_sizes(bench_params(num_prompts=49), ROWS, Path("data/prompts"))  # 49 + 2 warmup: all of them
    with pytest.raises(UserError, match=r"bench.num_prompts 100000 \+ bench.warmup 2 asks for 100002 eval prompts, but "
                                        r"data/prompts/eval.jsonl has 51; set bench.num_prompts to 49 or less"):
        run.check_sizes(bench_params(num_prompts=100000), ROWS, Path("data/prompts"))


def test_the_bench_refuses_more_requests_in_flight_than_it_sends():
    run.check_sizes(bench_params(num_prompts=8, concurrency=[1, 8]), ROWS, Path("p"))
    with pytest.raises(UserError, match=r"bench.concurrency 16 asks for more requests in flight than bench.num_prompts 8 sends"):
        run.check_sizes(bench_params(num_prompts=8, concurrency=[1, 16]), ROWS, Path("p"))


def test_the_bench_refuses_a_request_that_sglang_would_answer_400():
    """SGLang 0.5.14 counts the prompt, max_new_tokens and max(topk * num_steps, num_draft_tokens)
    reserved draft slots against the context; the bench says so before any server starts."""
    ids = [[1] * 100, [1] * 378]  # 378 + 6 reserved + 128 = 512: fits a 512-token context exactly
    run.check_context(ids, ROWS[:2], bench_params(max_new_tokens=128), CHAIN, 512, Path("p"))
    ids[1].append(1)
    with pytest.raises(UserError, match=r"1 bench prompt\(s\) of p/eval.jsonl do not fit the target's context of 512 tokens "
                                        r"with bench.max_new_tokens 128 and the 6 draft tokens .*: p1 \(379 tokens\); lower "
                                        r"bench.max_new_tokens to at most 127"):
        run.check_context(ids, ROWS[:2], bench_params(max_new_tokens=128), CHAIN, 512, Path("p"))
    tree = SpecFlags("EAGLE3", num_steps=3, topk=4, num_draft_tokens=8)  # 12 slots reserved, not 8
    with pytest.raises(UserError, match="the 12 draft tokens"):
        run.check_context([[1] * 373], ROWS[:1], bench_params(max_new_tokens=128), tree, 512, Path("p"))


def test_live_parity_on_fewer_sequences_than_asked_is_a_warning_on_record():
    result = {"sequences": ["a", "b"]}
    (finding,) = fewer_samples(result, 100000, "data/features/train")
    assert finding.severity == "warning" and finding.name == "live_parity_fewer_samples"
    assert finding.evidence == {"requested": 100000, "used": 2, "features": "data/features/train"}
    assert result["sequences_requested"] == 100000
    assert fewer_samples({"sequences": ["a", "b"]}, 2, "x") == [] and fewer_samples(None, 5, "x") == []


def test_builtin_prompts_say_which_families_ran_out_and_record_the_mix(tmp_path, monkeypatch, capsys):
    """The 'mul' family has 410 distinct held-out prompts: beyond 9 x 410 the others fill in for it,
    which changed the mix silently (configs/gpu-8b.yaml draws 4,800)."""
    from stages.prompts import main

    small = prompts.builtin_prompts(90, 1234)
    assert small.ran_out == [] and sum(small.families.values()) == 90 and len(small.families) == 9
    p = yaml.safe_load((ROOT / "params.yaml").read_text())
    p["prompts"]["num_prompts"] = 4000
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(p))
    monkeypatch.chdir(tmp_path)
    main(tmp_path / "prompts", tmp_path / "prompts.json")
    assert "the built-in family 'mul' has only 410 distinct held-out prompts" in capsys.readouterr().err
    info = json.loads((tmp_path / "prompts" / "manifest.json").read_text())["info"]
    assert info["families_ran_out"] == ["mul"] and info["families"]["mul"] == 410 and sum(info["families"].values()) == 4000
    assert json.loads((tmp_path / "prompts.json").read_text())["families_ran_out"] == ["mul"]
