"""prompts.turns all: every human turn of a ShareGPT conversation, in order, as one row (next_turns);
the id hashes every user turn, the split keys on the first turn (conversations that open alike
share a side), later turns too long end the conversation; `first` gives exactly what it always did."""
import json

from draftlab import jsonl
from draftlab.data import prompts
from tests.support.micro import make_micro_tokenizer, save_micro_model
from tests.test_sharegpt import conv, fixture_records, run_stage


def multi_turn_records():
    return [
        conv(0, ("human", "First question"), ("gpt", "recorded answer 1"), ("human", "Second question"),
             ("gpt", "recorded answer 2"), ("human", "Third question"), ("gpt", "recorded answer 3")),
        conv(1, ("system", "Be terse."), ("human", "Opening"), ("chatgpt", "a"), ("human", "Then this"),
             ("system", "a system turn mid-way"), ("user", "and this")),  # no answer after the last: still asked
        conv(2, ("human", "Ask"), ("gpt", "a"), ("human", "  "), ("gpt", "b"), ("human", "never asked")),
        conv(3, ("human", "Ask"), ("gpt", "a"), ("human", "a different follow-up")),  # opens like record 2
        conv(4, ("human", "Only one"), ("gpt", "a")),
        conv(5, ("gpt", "Hello!"), ("human", "answers a message the prompt would not show")),
    ]


def write(path, records):
    path.write_text(json.dumps(records), encoding="utf-8")
    return path


def test_all_keeps_every_human_turn_in_order_and_never_the_recorded_answers(tmp_path):
    ps = prompts.read_prompt_file(write(tmp_path / "sg.json", multi_turn_records()), "all")
    by_sg = {r["sharegpt_id"]: r for r in ps.rows}
    assert by_sg["c0"]["messages"] == [{"role": "user", "content": "First question"}]
    assert by_sg["c0"]["next_turns"] == ["Second question", "Third question"]
    assert by_sg["c1"]["next_turns"] == ["Then this", "and this"]  # system turns passed over
    assert "next_turns" not in by_sg["c2"] and "next_turns" not in by_sg["c4"]  # an empty later turn ends it there
    assert ps.cut == {"empty later human turn": 1} and ps.counts()["cut_by_rule"] == {"empty later human turn": 1}
    assert ps.skipped == {"no opening human turn": 1}
    assert not any("recorded" in t for r in ps.rows for t in r.get("next_turns", []))
    # the id hashes every user turn; a conversation of one turn has the id it has under `first`
    assert by_sg["c0"]["id"] == prompts.prompt_id([{"role": "user", "content": t} for t in
                                                   ("First question", "Second question", "Third question")])
    first = {r["sharegpt_id"]: r for r in prompts.read_prompt_file(tmp_path / "sg.json").rows}
    assert by_sg["c4"] == first["c4"] and by_sg["c2"]["id"] == first["c2"]["id"]
    assert by_sg["c3"]["id"] != by_sg["c2"]["id"]  # same opening, other follow-up: two conversations
    assert all("next_turns" not in r for r in first.values())


def test_first_is_what_it_always_was(tmp_path):
    """The default reads the fixture's rows exactly as before the key existed (ids, rows, order)."""
    path = write(tmp_path / "sg.json", fixture_records() + multi_turn_records())
    rows = prompts.read_prompt_file(path).rows
    assert rows == prompts.read_prompt_file(path, "first").rows
    assert all(set(r) == {"id", "messages", "source", "sharegpt_id"} and r["id"] == prompts.prompt_id(r["messages"])
               for r in rows)
    train, evals = prompts.split(rows, 0.3)
    assert [r["id"] for r in evals] == [r["id"] for r in rows if prompts.is_eval(r["id"], 0.3)]


def test_the_split_holds_out_whole_conversations_and_their_openings(tmp_path):
    """Many conversations share their opening with others: an eval row's first turn (what the bench
    sends) is never the first turn of a train conversation, under any eval fraction."""
    records = [conv(i, ("human", f"Opening {i % 25}"), ("gpt", "a"), ("human", f"follow-up {i}"), ("gpt", "b"),
                    ("human", f"and then {i}")) for i in range(200)]
    rows = prompts.read_prompt_file(write(tmp_path / "sg.json", records), "all").rows
    assert len(rows) == 200 and all(len(r["next_turns"]) == 2 for r in rows)
    for fraction in (0.1, 0.3, 0.5):
        train, evals = prompts.split(rows, fraction)
        assert len(train) + len(evals) == 200 and evals and train
        openings = lambda side: {r["messages"][0]["content"] for r in side}  # noqa: E731
        assert not openings(train) & openings(evals)
        # ... and a conversation's side is that of its opening alone
        assert all(prompts.is_eval(prompts.prompt_id(r["messages"]), fraction) for r in evals)
    # the side is decided by content, not order
    assert prompts.split(rows[::-1], 0.3)[1] == prompts.split(rows, 0.3)[1][::-1]


def test_a_later_turn_over_max_prompt_tokens_ends_its_conversation():
    tok = make_micro_tokenizer()  # one token per byte
    rows = [{"id": "", "messages": [{"role": "user", "content": "q"}], "next_turns": ["short", "x" * 50, "after"]},
            {"id": "", "messages": [{"role": "user", "content": "q"}], "next_turns": ["short", "y" * 60]},  # cut alike
            {"id": "", "messages": [{"role": "user", "content": "r"}], "next_turns": ["z" * 50]},
            {"id": "", "messages": [{"role": "user", "content": "s"}], "next_turns": ["fine"]}]
    for r in rows:
        r["id"] = prompts.conversation_id(r["messages"], r["next_turns"])
    kept, counts = prompts.cut_long_turns(rows, tok, 20)
    assert [r.get("next_turns") for r in kept] == [["short"], None, ["fine"]]
    assert counts == {"cut_at_long_turn": 3, "duplicates": 1}
    assert [r["id"] for r in kept] == [prompts.conversation_id(r["messages"], r.get("next_turns", [])) for r in kept]
    assert kept[1]["id"] == prompts.prompt_id(kept[1]["messages"])
    assert prompts.cut_long_turns(rows, tok, None) == (rows, {"cut_at_long_turn": 0, "duplicates": 0})


def test_the_stage_writes_conversations_and_counts_their_turns(tmp_path):
    save_micro_model(tmp_path / "target")
    records = multi_turn_records() + [conv(10 + i, ("human", f"Question number {i}"), ("gpt", "a"),
                                           ("human", "Go on" + "!" * 40 * (i % 2)), ("gpt", "b")) for i in range(30)]
    write(tmp_path / "sg.json", records)
    r = run_stage(tmp_path, {"source": "sg.json", "turns": "all", "max_prompt_tokens": 30, "eval_fraction": 0.3})
    assert r.returncode == 0, r.stderr
    rows = {name: [x for _, x in jsonl.read(tmp_path / "out" / f"{name}.jsonl", "")] for name in ("train", "eval")}
    metrics = json.loads((tmp_path / "m.json").read_text())
    for name in ("train", "eval"):
        assert metrics[f"{name}_turns"] == sum(1 + len(x.get("next_turns", [])) for x in rows[name])
    assert metrics["cut_at_long_turn"] == 15 and metrics["cut_at_empty_turn"] == 1
    assert all(len(t.encode()) <= 30 for side in rows.values() for x in side for t in x.get("next_turns", []))
    assert "user turns)" in r.stdout


def test_leading_assistant_drop_opens_a_conversation_at_its_first_human_turn(tmp_path):
    """skip (the default) leaves out a conversation that opens with the assistant; drop opens it at
    its first human turn, with its later turns, and counts it. One with no human turn is skipped either way."""
    records = multi_turn_records() + [
        conv(6, ("system", "s"), ("gpt", "Hi"), ("bard", "more"), ("human", "Now a question"), ("gpt", "x"), ("human", "And a second")),
        conv(7, ("gpt", "only the assistant")),
    ]
    path = write(tmp_path / "sg.json", records)
    skipped = prompts.read_prompt_file(path, "all")
    dropped = prompts.read_prompt_file(path, "all", "drop")
    assert skipped.skipped == {"no opening human turn": 3} and "opened_after_assistant" not in skipped.counts()
    assert dropped.skipped == {"no opening human turn": 1}  # record 7: no human turn to open at
    assert dropped.counts()["opened_after_assistant"] == dropped.opened_after_assistant == 2
    by_sg = {r["sharegpt_id"]: r for r in dropped.rows}
    assert by_sg["c5"]["messages"] == [{"role": "user", "content": "answers a message the prompt would not show"}]
    assert by_sg["c6"]["messages"] == [{"role": "user", "content": "Now a question"}] and by_sg["c6"]["next_turns"] == ["And a second"]
    # the others first, as skip gives them (so eval.jsonl and the bench's prompts open alike), the opened ones last
    assert dropped.rows[: len(skipped.rows)] == skipped.rows and [r["sharegpt_id"] for r in dropped.rows[len(skipped.rows):]] == ["c5", "c6"]
    first = {r["sharegpt_id"]: r for r in prompts.read_prompt_file(path, "first", "drop").rows}
    assert "next_turns" not in first["c6"] and first["c6"]["messages"] == by_sg["c6"]["messages"]


def test_the_stage_takes_prompts_leading_assistant_and_records_the_conversations_it_opened(tmp_path):
    save_micro_model(tmp_path / "target")
    write(tmp_path / "sg.json", multi_turn_records() * 3 + [conv(10 + i, ("gpt", "hello"), ("human", f"question {i}"),
                                                                 ("gpt", "a"), ("human", f"follow-up {i}")) for i in range(20)])
    r = run_stage(tmp_path, {"source": "sg.json", "turns": "all", "leading_assistant": "drop", "eval_fraction": 0.3,
                             "num_prompts": None})
    assert r.returncode == 0, r.stderr
    assert "23 conversations opened at their first human turn" in r.stderr  # the 20 and record 5, three times (counted as read)
    info = json.loads((tmp_path / "out" / "manifest.json").read_text())["info"]
    assert info["opened_after_assistant"] == 23 and info["skipped_by_rule"] == {}
    rows = [row for name in ("train", "eval") for _, row in jsonl.read(tmp_path / "out" / f"{name}.jsonl", "")]
    assert sum(row["messages"][0]["content"].startswith("question") for row in rows) == 20
    r = run_stage(tmp_path, {"source": "sg.json", "leading_assistant": "keep"})
    assert r.returncode != 0 and "prompts.leading_assistant" in r.stderr
