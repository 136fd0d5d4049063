"""The train split's subset for a data curve (extract.train_conversations, extract.train_turns): a
sample of conversations that does not depend on the file's order, and each cut after its first
answers, with the loss on exactly the answers kept."""
from __future__ import annotations

import json

import pytest

from draftlab.data.answers import answers_kept, sample_conversations
from tests.test_extract_stage import extract, extracted, project, set_params, shard_masks  # noqa: F401 (fixtures)


def conversation(i: int, answers: int, reasons=None) -> dict:
    messages = []
    for k in range(answers):
        messages += [{"role": "user", "content": f"question {i}.{k}?"}, {"role": "assistant", "content": f"answer {i}.{k} " + "y" * k}]
    reasons = reasons or ["stop"] * answers
    return {"id": f"c{i:04d}", "messages": messages, "turns": answers, "finish_reasons": reasons, "finish_reason": reasons[-1]}


def test_the_sample_is_the_same_whatever_the_rows_order_and_each_smaller_one_lies_inside_each_larger():
    rows = [conversation(i, 1) for i in range(200)]
    half = sample_conversations(rows, 100)
    assert len(half) == 100
    assert [r["id"] for r in sample_conversations(rows[::-1], 100)] == [r["id"] for r in half][::-1]  # the file's order kept
    quarter = {r["id"] for r in sample_conversations(rows, 50)}
    assert quarter <= {r["id"] for r in half}
    assert sample_conversations(rows, 500) == rows and sample_conversations(rows, None) == rows
    # not the first rows of the file: a file written in the order answers finished would bias those
    assert {r["id"] for r in half} != {r["id"] for r in rows[:100]}


def test_a_conversation_cut_after_its_first_answer_keeps_that_answer_and_its_finish_reason():
    row = conversation(7, 3, ["length", "stop", "length"])
    cut = answers_kept(row, 1)
    assert cut["messages"] == row["messages"][:2]
    assert cut["turns"] == 1 and cut["finish_reasons"] == ["length"] and cut["finish_reason"] == "length"
    assert answers_kept(row, 2)["messages"] == row["messages"][:4] and answers_kept(row, 2)["finish_reason"] == "stop"
    assert answers_kept(row, 3) == row and answers_kept(row, None) == row
    assert row["turns"] == 3  # the row read is not changed


def test_answers_are_counted_among_those_the_target_wrote():
    """A row whose first answers came with the prompt (ShareGPT's own, turns 1 of 2 written by the
    target) keeps the conversation up to the target's first answer."""
    row = conversation(3, 2)
    row.update(turns=1, finish_reasons=["stop"])
    assert answers_kept(row, 1) == row


@pytest.fixture
def multi_turn(project):
    rows = [conversation(i, 3) for i in range(12)]
    (project / "synth" / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return project, rows


def test_the_extract_stage_learns_the_first_answers_of_a_sample_of_conversations_and_keeps_the_eval_split(multi_turn, extracted):
    project, rows = multi_turn
    r = extract(project)
    assert r.returncode == 0, r.stderr
    whole = shard_masks(project / "hidden", "train")
    set_params(project, "extract", train_conversations=5, train_turns=1)
    r = extract(project)
    assert r.returncode == 0, r.stderr
    masks = shard_masks(project / "hidden", "train")
    assert len(whole) == 12 and len(masks) == 5
    # one answer learned per conversation: the loss mask is one run of ones, where a whole conversation has three
    runs = [sum(1 for a, b in zip([0] + m, m) if b and not a) for m in masks]
    assert runs == [1] * 5 and all(sum(1 for a, b in zip([0] + m, m) if b and not a) == 3 for m in whole)
    assert shard_masks(project / "hidden", "eval") == shard_masks(extracted[0] / "hidden", "eval")
    counts = json.loads((project / "hidden" / "manifest.json").read_text())["info"]["counts"]["train"]
    assert counts["rows"] == 5 and counts["conversations_in_synth"] == 12 and counts["answers_left_out"] == 12 * 3 - 5
    assert "extract: train split: 5 of 12 conversations (extract.train_conversations), each cut after its first answer (extract.train_turns); 31 of its 36 answers left out" in r.stdout
