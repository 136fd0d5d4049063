"""Every JSONL file the pipeline writes and reads round-trips any Unicode text: lines split at
"\\n" only. `str.splitlines()` also splits at the characters below, and one ShareGPT prompt holding
U+2028 stopped a real run with "not valid JSON (Unterminated string ...)"."""
import json

import pytest
from hypothesis import given, settings, strategies as st

from draftlab import jsonl
from draftlab.data import synth
from draftlab.errors import UserError
from draftlab.data.prompts import read_prompt_file
from stages.extract import read_rows

# Every character str.splitlines() treats as a line boundary, besides \n and \r.
SPLITTERS = ["\u2028", "\u2029", "\x0b", "\x0c", "\x1c", "\x1d", "\x1e", "\x85"]
HOSTILE = "a" + "b".join(SPLITTERS) + "\r\n\tc\u00e9\U0001f600"


@settings(max_examples=200, deadline=None)
@given(st.lists(st.text(), max_size=5))
def test_any_text_round_trips(tmp_path_factory, texts):
    path = tmp_path_factory.mktemp("j") / "rows.jsonl"
    jsonl.write(path, [{"id": str(i), "text": t} for i, t in enumerate(texts)])
    assert [row["text"] for _, row in jsonl.read(path, "fix")] == texts


def test_prompts_answers_and_errors_with_line_separators_survive_every_stage_reader(tmp_path):
    # a user's prompt file (what the prompts stage reads) ...
    src = tmp_path / "mine.jsonl"
    src.write_text("".join(json.dumps({"prompt": f"q{i} {HOSTILE}"}, ensure_ascii=False) + "\n" for i in range(3)),
                   encoding="utf-8")
    got = read_prompt_file(src)
    assert not got.bad and [r["messages"][0]["content"] for r in got.rows] == [f"q{i} {HOSTILE}" for i in range(3)]
    # ... written as the prompts stage writes it, read as synthesize reads it ...
    jsonl.write(tmp_path / "train.jsonl", got.rows)
    rows = synth.read_prompts(tmp_path / "train.jsonl")
    assert rows == got.rows

    # ... answered (one answer and one error carry the characters), read as extract reads it.
    class Backend:
        def answer(self, todo, done):
            done(todo[0], synth.Answer(f"answer {HOSTILE}", "stop", 3), None)
            for r in todo[1:]:
                done(r, None, f"server said {HOSTILE}")

    out = tmp_path / "synth"
    synth.synthesize({"train": rows}, Backend(), out, "k", lambda p, a: {"id": p["id"], "content": a.content, "finish_reason": a.finish_reason})
    assert [r["content"] for r in read_rows(out / "train.jsonl")] == [f"answer {HOSTILE}"]
    errors = [e for _, e in jsonl.read(out / "errors.jsonl", "fix")]
    assert [e["error"] for e in errors] == [f"server said {HOSTILE}"] * 2


def test_a_bad_line_is_named_by_file_and_line(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_bytes(b'{"id": "a", "messages": [{"role": "user", "content": "x"}]}\n\n{"id": "b", "mess\n')
    with pytest.raises(UserError, match=r"train.jsonl:3: not valid JSON .*re-run the prompts stage"):
        synth.read_prompts(path)
    path.write_bytes(b'{"id": "\xff"}\n')
    with pytest.raises(UserError, match=r"train.jsonl:1: not UTF-8 text \(byte 0xff"):
        read_rows(path)
