"""Synthesis of conversations (prompt rows with next_turns): turn k is asked after the target's own
answers to turns 1..k-1, a cut one included, the same by both backends; every row records how each
answer ended; a turn that would not fit the context (or, with synth.after_cut stop, a cut answer)
ends a conversation with the turns so far; a run killed midway resumes per conversation."""
import json
import os
from collections import Counter
import signal
import subprocess
import sys
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from draftlab.data import synth
from draftlab.errors import UserError
from draftlab.lifecycle import free_port, serve
from tests.support.micro import make_micro_tokenizer
from tests.test_synth import ENV, FAKE_OPENAI, ROOT, TAUGHT, plain_server, run_stage, target, write_params  # noqa: F401

MAX_NEW = 24  # the stage tests' synth.max_new_tokens (write_params)


def conv_row(*turns):
    from draftlab.data.prompts import conversation_id

    messages = [{"role": "user", "content": turns[0]}]
    row = {"id": conversation_id(messages, list(turns[1:])), "messages": messages, "source": "test"}
    return row | ({"next_turns": list(turns[1:])} if len(turns) > 1 else {})


def make_conv_prompts(dir, train, evals):
    dir.mkdir(parents=True, exist_ok=True)
    for name, convs in (("train", train), ("eval", evals)):
        (dir / f"{name}.jsonl").write_text("".join(json.dumps(conv_row(*c)) + "\n" for c in convs))
    (dir / "manifest.json").write_text(json.dumps({"config_hash": str(hash((str(train), str(evals))))}))
    return dir


def oracle(model, tok, turns, max_new=MAX_NEW, after_cut="continue"):
    """The conversation answered one turn at a time, unbatched, with the target's own answers (cut ones
    as written) as history: (messages, each answer's finish reason, why it stopped early or None)."""
    messages, reasons = [], []
    for k, text in enumerate(turns):
        if reasons and reasons[-1] == "length" and after_cut == "stop":
            return messages, reasons, "length"
        messages.append({"role": "user", "content": text})
        ids = synth.prompt_ids(tok, messages)
        if k and len(ids) + max_new > model.config.max_position_embeddings:
            return messages[:-1], reasons, "context"
        out = model.generate(torch.tensor([ids]), max_new_tokens=max_new, do_sample=False, pad_token_id=tok.pad_token_id,
                             eos_token_id=tok.eos_token_id)[0, len(ids):].tolist()
        reasons.append("stop" if tok.eos_token_id in out else "length")
        messages.append({"role": "assistant", "content": tok.decode(out, skip_special_tokens=True)})
    return messages, reasons, None


CONVS = [(TAUGHT[2][0], TAUGHT[0][0]), ("What is 7 times 6?", "then?"),
         (TAUGHT[1][0],), (TAUGHT[0][0], "x" * 460)]  # the last one's turn 2 does not fit the 512-token context


def answered_to_the_end(model, tok):
    """A three-turn conversation whose every answer the target ends itself (within MAX_NEW tokens).
    The tiny target was taught single turns only: whether a later answer ends in time depends on
    the torch build's numerics, so the oracle picks one rather than the test guessing."""
    firsts, later = [q for q, _, _ in TAUGHT], [q for q, _, _ in TAUGHT] + ["and now?", "ok", "then?", "why?"]
    for turns in ((a, b, c) for a in firsts for b in later for c in later):
        if oracle(model, tok, turns)[1] == ["stop"] * 3:
            return turns
    raise AssertionError("no three-turn conversation of the taught questions is answered to its end by the test target")


def test_both_backends_answer_each_turn_after_the_targets_own_answers(tmp_path, monkeypatch, target, plain_server):
    model, tok = AutoModelForCausalLM.from_pretrained(target).eval(), make_micro_tokenizer()
    convs = [answered_to_the_end(model, tok), *CONVS]
    prompts = make_conv_prompts(tmp_path / "prompts", convs[:3], convs[3:])
    hf, hf_man = run_stage(tmp_path / "hf", monkeypatch, prompts, tmp_path / "hf" / "out", target, batch_size=2)
    asked = []
    real_url = synth.OpenAIBackend._url
    monkeypatch.setattr(synth.OpenAIBackend, "_url", lambda self, row: asked.append(row["id"]) or real_url(self, row))
    oa, oa_man = run_stage(tmp_path / "oa", monkeypatch, prompts, tmp_path / "oa" / "out", target, backend="openai",
                           base_url=plain_server + "/v1", concurrency=3)
    assert oa == hf

    rows = hf["train"] + hf["eval"]
    for turns, r in zip(convs, rows):
        messages, reasons, stopped = oracle(model, tok, turns)
        assert r["messages"] == messages, turns
        assert r["finish_reasons"] == reasons and r["finish_reason"] == reasons[-1], turns
        answered = sum(m["role"] == "assistant" for m in messages)
        if len(turns) > 1:  # a conversation records its turns and why it ended early
            assert r["turns"] == answered and r.get("stopped") == stopped
        else:  # a single turn stays a plain row
            assert "turns" not in r and "stopped" not in r
    assert rows[0]["turns"] == 3 and len(rows[0]["messages"]) == 6  # every turn asked: the test reaches turn 3
    assert rows[-1]["stopped"] == "context" and rows[-1]["finish_reason"] == "stop" and len(rows[-1]["messages"]) == 2
    info = hf_man["info"]
    assert info["turns_answered"] == sum(r.get("turns", 1) for r in rows) > len(rows)
    assert info["conversations_stopped"]["context"] == 1 and info["ok"] == 5
    assert oa_man["info"]["turns_answered"] == info["turns_answered"]
    assert sorted(asked) == sorted(r["id"] for r in rows for _ in range(r.get("turns", 1)))  # every request through _url(row)


class Scripted:
    """Answers "a<turn>", cut ("length") where the user turn says "cut"; through Dialogue as both backends do."""

    def __init__(self, after_cut):
        self.after_cut = after_cut

    def answer(self, rows, done):
        for r in rows:
            d = synth.Dialogue(r, make_micro_tokenizer(), 512, 8, self.after_cut)
            while d.advance(synth.Answer(f"a{d.turn}", "length" if "cut" in d.messages[-1]["content"] else "stop", 5)):
                pass
            done(r, d.reply, None)


def answer_row(prompt, reply):
    """The row the stage writes (make_row), without its provenance fields."""
    return {"id": prompt["id"], "messages": synth.conversation(prompt, reply), "finish_reason": reply.finish_reason,
            "finish_reasons": reply.finish_reasons, "completion_tokens": reply.completion_tokens, "turns": len(reply.answers),
            **({"stopped": reply.stopped} if reply.stopped else {})}


def test_a_cut_answer_does_not_end_its_conversation(tmp_path):
    rows = [conv_row("q", "u2", "cut here", "then more"), conv_row("p", "u2")]
    stats = synth.synthesize({"train": rows, "eval": []}, Scripted("continue"), tmp_path, "k", answer_row)
    out = [json.loads(x) for x in (tmp_path / "train.jsonl").read_text().splitlines()]
    assert [m["content"] for m in out[0]["messages"]] == ["q", "a1", "u2", "a2", "cut here", "a3", "then more", "a4"]
    assert out[0]["finish_reasons"] == ["stop", "stop", "length", "stop"] and out[0]["finish_reason"] == "stop"
    assert (out[0]["turns"], out[0].get("stopped"), out[0]["completion_tokens"]) == (4, None, 20)
    assert (out[1]["turns"], out[1].get("stopped"), out[1]["completion_tokens"]) == (2, None, 10)
    assert stats["turns"] == 6 and stats["stopped"] == {}
    assert stats["answer_finish_reasons"] == {"stop": 5, "length": 1} and stats["finish_reasons"] == {"stop": 2}


def test_after_cut_stop_ends_the_conversation_at_the_cut_answer(tmp_path):
    rows = [conv_row("q", "u2", "cut here", "never asked"), conv_row("p", "u2")]
    stats = synth.synthesize({"train": rows, "eval": []}, Scripted("stop"), tmp_path, "k", answer_row)
    out = [json.loads(x) for x in (tmp_path / "train.jsonl").read_text().splitlines()]
    assert [m["content"] for m in out[0]["messages"]] == ["q", "a1", "u2", "a2", "cut here", "a3"]
    assert (out[0]["turns"], out[0]["stopped"], out[0]["finish_reason"], out[0]["completion_tokens"]) == (3, "length", "length", 15)
    assert out[0]["finish_reasons"] == ["stop", "stop", "length"]
    assert (out[1]["turns"], out[1].get("stopped"), out[1]["completion_tokens"]) == (2, None, 10)
    assert stats["turns"] == 5 and stats["stopped"] == {"length": 1}


def test_a_partial_row_must_answer_the_very_conversation():
    prompt = conv_row("q", "u2", "u3")
    reply = synth.Reply([synth.Answer("a1", "stop", 1), synth.Answer("a2", "length", 1)])
    good = {"messages": synth.conversation(prompt, reply)}
    assert synth.follows(good, prompt)
    assert not synth.follows(good, conv_row("q", "other", "u3"))  # a different later turn
    assert not synth.follows({"messages": good["messages"][:-1]}, prompt)  # ends with a user turn
    assert not synth.follows(good, conv_row("q"))  # more turns than the prompt has
    assert synth.follows({"messages": good["messages"][:2]}, prompt)  # ended after turn 1


def test_a_failed_later_turn_fails_the_conversation_naming_the_turn(tmp_path, monkeypatch, target):
    script = tmp_path / "fake_openai.py"
    script.write_text(FAKE_OPENAI)
    prompts = make_conv_prompts(tmp_path / "prompts", [("good one", "please fail"), ("good two", "fine")], [("good three",)])
    port = free_port()
    with serve([sys.executable, script, port, tmp_path / "log.jsonl"], f"http://127.0.0.1:{port}", tmp_path / "fake.log", 30):
        rows, man = run_stage(tmp_path / "run", monkeypatch, prompts, tmp_path / "run" / "out", target, backend="openai",
                              base_url=f"http://127.0.0.1:{port}/v1", max_retries=0)
    errors = [json.loads(x) for x in (tmp_path / "run" / "out" / "errors.jsonl").read_text().splitlines()]
    assert [e["id"] for e in errors] == [conv_row("good one", "please fail")["id"]]
    assert errors[0]["error"].startswith("turn 2 of 2: HTTP 500")
    assert [m["content"] for m in rows["train"][0]["messages"]] == ["good two", "ok: good two", "fine", "ok: fine"]
    assert man["info"]["turns_answered"] == 3 and man["info"]["errors"] == 1


def test_kill_9_mid_run_then_rerun_keeps_whole_conversations_only(tmp_path, monkeypatch, target):
    convs = [(TAUGHT[i % 3][0], f"follow-up {i}") for i in range(34)]
    prompts = make_conv_prompts(tmp_path / "prompts", convs[:30], convs[30:])
    clean, _ = run_stage(tmp_path / "clean", monkeypatch, prompts, tmp_path / "clean" / "out", target, batch_size=1)

    work, out = tmp_path / "work", tmp_path / "work" / "out"
    work.mkdir()
    write_params(work, target, batch_size=1)
    proc = subprocess.Popen([sys.executable, "-m", "stages.synthesize", "--prompts", str(prompts), "--out", str(out)],
                            cwd=work, env={**ENV, "PYTHONPATH": str(ROOT)}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    partial = out / "train.jsonl.partial"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if partial.exists() and partial.read_text().count("\n") >= 3:
            break
        time.sleep(0.02)
    assert proc.poll() is None, "the run finished before it could be interrupted"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    kept = [json.loads(x) for x in partial.read_text().splitlines()]
    assert 3 <= len(kept) < 30 and all(r["turns"] == 2 for r in kept)  # only whole conversations were written
    with open(partial, "a") as f:
        f.write('{"id": "torn-by-the-kill", "mess')

    resumed, man = run_stage(work, monkeypatch, prompts, out, target, batch_size=1)
    assert resumed == clean
    assert man["info"]["counts"]["train"]["resumed"] >= len(kept)
    assert man["info"]["turns_answered"] == sum(r["turns"] for side in clean.values() for r in side)
    assert not partial.exists()


CUT_AT = 4  # synth.max_new_tokens of the cut tests: shorter than any taught answer, so every first answer is cut


def test_both_backends_ask_the_next_turn_after_a_cut_answer(tmp_path, monkeypatch, target, plain_server):
    model, tok = AutoModelForCausalLM.from_pretrained(target).eval(), make_micro_tokenizer()
    convs = [(TAUGHT[0][0], TAUGHT[1][0], "then?"), (TAUGHT[2][0], "why?")]
    prompts = make_conv_prompts(tmp_path / "prompts", convs[:1], convs[1:])
    hf, hf_man = run_stage(tmp_path / "hf", monkeypatch, prompts, tmp_path / "hf" / "out", target, batch_size=2,
                           max_new_tokens=CUT_AT)
    sent = []  # the messages of every request the openai backend sends
    real_one = synth.OpenAIBackend._answer_one

    def recorded(self, client, row, messages, seed_key):
        sent.append(messages)
        return real_one(self, client, row, messages, seed_key)

    monkeypatch.setattr(synth.OpenAIBackend, "_answer_one", recorded)
    oa, oa_man = run_stage(tmp_path / "oa", monkeypatch, prompts, tmp_path / "oa" / "out", target, backend="openai",
                           base_url=plain_server + "/v1", concurrency=2, max_new_tokens=CUT_AT)
    assert oa == hf

    rows = hf["train"] + hf["eval"]
    for turns, r in zip(convs, rows):
        messages, reasons, stopped = oracle(model, tok, turns, CUT_AT)
        assert r["messages"] == messages and r["finish_reasons"] == reasons and stopped is None, turns
        assert reasons[0] == "length" and r["turns"] == len(turns) and "stopped" not in r  # every turn past the cut
    # Turn 2 was asked after the cut answer, as the target wrote it.
    assert rows[0]["messages"][:3] in sent and rows[1]["messages"][:3] in sent
    every = Counter(x for r in rows for x in r["finish_reasons"])
    for man in (hf_man, oa_man):
        assert man["info"]["answer_finish_reasons"] == dict(every) and man["info"]["conversations_stopped"] == {}
        assert man["info"]["turns_answered"] == 5


def test_after_cut_stop_ends_each_conversation_at_its_cut_answer(tmp_path, monkeypatch, target):
    model, tok = AutoModelForCausalLM.from_pretrained(target).eval(), make_micro_tokenizer()
    convs = [(TAUGHT[0][0], TAUGHT[1][0]), (TAUGHT[2][0], "why?")]
    prompts = make_conv_prompts(tmp_path / "prompts", convs[:1], convs[1:])
    out, man = run_stage(tmp_path / "hf", monkeypatch, prompts, tmp_path / "hf" / "out", target, max_new_tokens=CUT_AT,
                         after_cut="stop")
    for turns, r in zip(convs, out["train"] + out["eval"]):
        messages, reasons, stopped = oracle(model, tok, turns, CUT_AT, after_cut="stop")
        assert (r["messages"], r["finish_reasons"], r["stopped"]) == (messages, reasons, stopped) == (messages, ["length"], "length")
    assert man["info"]["conversations_stopped"] == {"length": 2} and man["info"]["turns_answered"] == 2


def test_a_rerun_keeps_the_finish_reasons_of_the_conversations_already_written(tmp_path, monkeypatch, target):
    convs = [(TAUGHT[0][0], "then?"), (TAUGHT[1][0], "why?"), (TAUGHT[2][0], "ok")]
    prompts = make_conv_prompts(tmp_path / "prompts", convs[:2], convs[2:])
    clean, _ = run_stage(tmp_path / "clean", monkeypatch, prompts, tmp_path / "clean" / "out", target, max_new_tokens=CUT_AT)

    real = synth.HFBackend.answer

    def interrupted(self, rows, done):  # Ctrl-C right after the first conversation is written
        def then_stop(row, reply, err):
            done(row, reply, err)
            raise KeyboardInterrupt

        real(self, rows, then_stop)

    monkeypatch.setattr(synth.HFBackend, "answer", interrupted)
    out = tmp_path / "work" / "out"
    with pytest.raises(KeyboardInterrupt):
        run_stage(tmp_path / "work", monkeypatch, prompts, out, target, max_new_tokens=CUT_AT)
    (kept,) = [json.loads(x) for x in (out / "train.jsonl.partial").read_text().splitlines()]
    assert kept["finish_reasons"][0] == "length" and kept["turns"] == 2

    asked = []
    monkeypatch.setattr(synth.HFBackend, "answer",
                        lambda self, rows, done: asked.extend(r["id"] for r in rows) or real(self, rows, done))
    resumed, man = run_stage(tmp_path / "work", monkeypatch, prompts, out, target, max_new_tokens=CUT_AT)
    assert kept["id"] not in asked and len(asked) == 2  # the kept conversation is not asked again
    assert resumed == clean and kept in resumed["train"]
    every = Counter(x for side in clean.values() for r in side for x in r["finish_reasons"])
    assert man["info"]["answer_finish_reasons"] == dict(every)


def test_rows_written_before_finish_reasons_are_resumed_and_counted(tmp_path):
    """An older row holds only the last answer's finish_reason: its earlier answers all stopped then."""
    old = conv_row("q", "u2", "u3")
    old_row = {k: v for k, v in answer_row(old, synth.Reply([synth.Answer("a1", "stop", 1), synth.Answer("a2", "length", 1)],
                                                            "length")).items() if k != "finish_reasons"}
    new = conv_row("p", "u2")
    synth.prepare_resume(tmp_path, "k")
    (tmp_path / "train.jsonl.partial").write_text(json.dumps(old_row) + "\n")
    stats = synth.synthesize({"train": [old, new], "eval": []}, Scripted("continue"), tmp_path, "k", answer_row)
    out = [json.loads(x) for x in (tmp_path / "train.jsonl").read_text().splitlines()]
    assert out[0] == old_row and out[1]["finish_reasons"] == ["stop", "stop"]
    assert stats["counts"]["train"]["resumed"] == 1
    assert stats["answer_finish_reasons"] == {"stop": 3, "length": 1} and stats["finish_reasons"] == {"length": 1, "stop": 1}


GOOD = answer_row(conv_row("q", "u2"), synth.Reply([synth.Answer("a1", "length", 1), synth.Answer("a2", "stop", 1)]))
BAD_REASONS = {  # a partial line whose finish_reasons do not say how each answer ended: named by file:line
    "one short": ({**GOOD, "finish_reasons": ["stop"]}, r"'finish_reasons' must list \"stop\" or \"length\" for each of its 2 answer"),
    "not a reason": ({**GOOD, "finish_reasons": ["length", "eos"]}, r"'finish_reasons' must list"),
    "not a list": ({**GOOD, "finish_reasons": "stop"}, r"'finish_reasons' must list"),
    "last differs": ({**GOOD, "finish_reasons": ["stop", "length"]}, r"'finish_reasons' ends with 'length' but 'finish_reason'"),
}


@pytest.mark.parametrize("case", sorted(BAD_REASONS))
def test_a_partial_row_with_wrong_finish_reasons_is_named(tmp_path, case):
    bad, message = BAD_REASONS[case]
    path = tmp_path / "train.jsonl.partial"
    path.write_text(json.dumps(GOOD) + "\n" + json.dumps(bad) + "\n" + json.dumps(GOOD) + "\n")
    with pytest.raises(UserError, match=r"train.jsonl.partial:2: row \w+: " + message):
        synth.load_partial(path)
    path.write_text(json.dumps(GOOD) + "\n")
    assert synth.load_partial(path)[GOOD["id"]]["finish_reasons"] == ["length", "stop"]
