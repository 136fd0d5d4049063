"""The prompts stage: validation with file:line, dedupe, deterministic split, on_bad_row."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import yaml

import pytest

from draftlab.data import prompts
from draftlab.errors import UserError

ROOT = Path(__file__).resolve().parents[1]


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


GOOD = [
    {"prompt": "What is 2+2?"},
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a prime."}]},
    {"prompt": "  What is 2+2?  "},  # duplicate after normalisation
]


def test_validation_reasons_name_the_line(tmp_path):
    f = write_jsonl(
        tmp_path / "p.jsonl",
        GOOD
        + [
            "{not json",
            {"prompt": ""},
            {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
            {"messages": [{"role": "robot", "content": "hi"}]},
            {"text": "hi"},
            [1, 2],
        ],
    )
    ps = prompts.read_prompt_file(f)
    assert len(ps.rows) == 2 and ps.duplicates == 1
    reasons = {b.line: b.reason for b in ps.bad}
    assert set(reasons) == {4, 5, 6, 7, 8, 9}
    assert "not valid JSON" in reasons[4]
    assert "non-empty string" in reasons[5]
    assert "last message must be from the user" in reasons[6]
    assert "robot" in reasons[7]
    assert "needs 'messages'" in reasons[8]
    assert str(ps.bad[0]).startswith(f"{f}:4: ")


def test_split_is_by_content_not_order(tmp_path):
    rows = [{"prompt": f"question number {i}"} for i in range(200)]
    a = prompts.read_prompt_file(write_jsonl(tmp_path / "a.jsonl", rows))
    b = prompts.read_prompt_file(write_jsonl(tmp_path / "b.jsonl", rows[::-1] + [{"prompt": "new one"}]))
    ea = {r["id"] for r in prompts.split(a.rows, 0.2)[1]}
    eb = {r["id"] for r in prompts.split(b.rows, 0.2)[1]}
    assert ea == eb - {prompts.prompt_id([{"role": "user", "content": "new one"}])}
    assert 20 <= len(ea) <= 60  # ~20% of 200


def test_parquet_same_rows_as_jsonl(tmp_path):
    pd.DataFrame({"prompt": ["a question?", "another one?"]}).to_parquet(tmp_path / "p.parquet")
    pq = prompts.read_prompt_file(tmp_path / "p.parquet")
    js = prompts.read_prompt_file(write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a question?"}, {"prompt": "another one?"}]))
    assert [r["id"] for r in pq.rows] == [r["id"] for r in js.rows]


def run_stage(tmp_path, prompts_params):
    """Run the real stage script in a scratch project dir with its own params.yaml."""
    params = yaml.safe_load(open(ROOT / "params.yaml"))
    params["prompts"].update(prompts_params)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "stages.prompts", "--out", "out", "--metrics", "m.json"],
        cwd=tmp_path, env=env, capture_output=True, text=True,
    )


def test_stage_errors_on_bad_row_with_file_and_line(tmp_path):
    write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"q{i}"} for i in range(30)] + ["{oops"])
    r = run_stage(tmp_path, {"source": "p.jsonl", "on_bad_row": "error"})
    assert r.returncode == 2
    assert "p.jsonl:31: not valid JSON" in r.stderr and "on_bad_row: skip" in r.stderr
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "out").exists()


def test_stage_skips_and_counts(tmp_path):
    write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"q{i}"} for i in range(30)] + ["{oops", {"prompt": ""}])
    r = run_stage(tmp_path, {"source": "p.jsonl", "on_bad_row": "skip", "eval_fraction": 0.3})
    assert r.returncode == 0, r.stderr
    m = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert m["info"]["skipped_bad_rows"] == 2 and m["info"]["train"] + m["info"]["eval"] == 30
    metrics = json.loads((tmp_path / "m.json").read_text())
    assert metrics["config_hash"] == m["config_hash"]


def test_stage_empty_file_is_an_error(tmp_path):
    (tmp_path / "p.jsonl").write_text("")
    r = run_stage(tmp_path, {"source": "p.jsonl"})
    assert r.returncode == 2 and "no valid prompts" in r.stderr


def test_builtin_prompts_are_deterministic_and_heldout():
    from draftlab.data import tasks

    a = prompts.builtin_prompts(40, seed=7)
    b = prompts.builtin_prompts(40, seed=7)
    assert [r["id"] for r in a.rows] == [r["id"] for r in b.rows]
    assert {r["family"] for r in a.rows} == set(tasks.FAMILIES)
    train_prompts = {p.prompt for p in tasks.generate(400, seed=7, split="train")}
    assert not train_prompts & {r["messages"][0]["content"] for r in a.rows}


def test_undecodable_and_deeply_nested_lines_are_bad_rows_with_their_line(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_bytes(json.dumps(GOOD[0]).encode() + b"\n" + b'{"prompt": "caf\xe9"}\n' + b"[" * 100_000 + b"\n")
    ps = prompts.read_prompt_file(f)
    assert len(ps.rows) == 1
    reasons = {b.line: b.reason for b in ps.bad}
    assert set(reasons) == {2, 3}
    assert "not UTF-8" in reasons[2] and "0xe9" in reasons[2]
    assert "nested too deeply" in reasons[3] or "not valid JSON" in reasons[3]


def test_a_directory_or_a_damaged_parquet_file_is_named(tmp_path):
    (tmp_path / "prompts.jsonl").mkdir()
    with pytest.raises(UserError, match="is a directory"):
        prompts.read_prompt_file(tmp_path / "prompts.jsonl")
    bad = tmp_path / "p.parquet"
    bad.write_bytes(b"PAR1 not really")
    with pytest.raises(UserError, match=f"{bad}: not a readable Parquet file"):
        prompts.read_prompt_file(bad)


def test_a_byte_order_mark_at_the_start_is_not_a_bad_row(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_bytes(b"\xef\xbb\xbf" + json.dumps(GOOD[0]).encode() + b"\n" + json.dumps(GOOD[1]).encode() + b"\n")
    ps = prompts.read_prompt_file(f)
    assert len(ps.rows) == 2 and not ps.bad
