"""Capture at physical index i equals transformers' output_hidden_states[i]; golden loss masks."""
import pytest
import torch

from draftlab.features import extract
from tests.support.micro import make_micro_model, make_micro_tokenizer


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_capture_equals_output_hidden_states(arch):
    model = make_micro_model(arch, num_layers=6)
    ids = torch.randint(5, 200, (2, 11))
    att = torch.ones_like(ids)
    att[1, 8:] = 0  # right padding in the second row
    physical = [0, 1, 3, 5, 6]  # embedding, layer outputs, and L = after the final norm
    aux, final = extract.capture(model, ids, att, physical)
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=att, output_hidden_states=True).hidden_states
    assert len(ref) == 7
    for i in physical:
        torch.testing.assert_close(aux[i], ref[i], rtol=0, atol=0)
    torch.testing.assert_close(final, ref[-1], rtol=0, atol=0)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_right_padded_batch_runs_without_its_mask_and_gives_every_real_token_the_same_states(arch):
    """The stages pad at the end: the causal target then needs no mask (transformers builds none and
    takes its causal kernel), and each real token's states are those of its own unpadded forward."""
    model = make_micro_model(arch, num_layers=6)
    lengths = [11, 8, 3]
    ids = torch.randint(5, 200, (3, 11))
    physical = [1, 3, 6]
    seen = []
    hook = model.get_decoder().register_forward_pre_hook(lambda m, a, kw: seen.append(kw.get("attention_mask")), with_kwargs=True)
    try:
        aux, final = extract.capture(model, ids, None, physical)  # padded at the end: no mask given
        extract.extract_shard(model, [(ids[j, :n].tolist(), [True] * n) for j, n in enumerate(lengths)], [1], batch_size=3,
                              dtype=torch.float32, device="cpu")  # the stage's own batches, padded at the end
    finally:
        hook.remove()
    assert seen == [None, None]  # no mask reached the model, from capture or from the extract stage
    for j, n in enumerate(lengths):
        with torch.no_grad():
            solo = model(input_ids=ids[j:j + 1, :n], output_hidden_states=True).hidden_states
        for i in physical:
            torch.testing.assert_close(aux[i][j, :n], solo[i][0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(final[j, :n], solo[-1][0], rtol=1e-5, atol=1e-5)


def test_packed_shard_matches_unpadded_forward():
    """Batched, padded extraction gives each row the states of its own unpadded forward."""
    model = make_micro_model("llama", num_layers=4)
    rows = [([5, 6, 7, 8, 9], [False] * 3 + [True] * 2), ([10, 11, 12], [False, True, True])]
    t = extract.extract_shard(model, rows, [2], batch_size=2, dtype=torch.float32, device="cpu")
    assert t["seq_offsets"].tolist() == [0, 5, 8]
    assert t["input_ids"].tolist() == [5, 6, 7, 8, 9, 10, 11, 12]
    assert t["loss_mask"].tolist() == [False] * 3 + [True] * 2 + [False, True, True]
    with torch.no_grad():
        solo = model(input_ids=torch.tensor([[10, 11, 12]]), output_hidden_states=True).hidden_states
    torch.testing.assert_close(t["hidden.2"][5:8], solo[2][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(t["final_hidden"][5:8], solo[-1][0], rtol=1e-5, atol=1e-5)


def test_loss_mask_golden_tokens():
    tok = make_micro_tokenizer()
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 12+5?"},
        {"role": "assistant", "content": "<think>\n2+5=7\n</think>\n17"},
    ]
    ids, mask = extract.render(tok, msgs)
    tokens = tok.convert_ids_to_tokens(ids)
    masked = [t for t, m in zip(tokens, mask) if m]
    # Exactly the assistant content (reasoning included) plus the closing EOS.
    assert masked == ["<think>", "Ċ", "2", "+", "5", "=", "7", "Ċ", "</think>", "Ċ", "1", "7", "<|end|>"]
    # The boundary: the assistant header and its newline are scaffolding, not learned.
    first = mask.index(True)
    assert tokens[first - 2 : first] == ["<|assistant|>", "Ċ"]
    assert not any(mask[: first])
    assert tok.decode(ids) == tok.apply_chat_template(msgs, tokenize=False)


def test_loss_mask_covers_only_the_last_assistant_turn():
    tok = make_micro_tokenizer()
    msgs = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo"},
        {"role": "user", "content": "ok?"},
        {"role": "assistant", "content": "fine"},
    ]
    ids, mask = extract.render(tok, msgs)
    masked = tok.decode([i for i, m in zip(ids, mask) if m])
    assert masked == "fine<|end|>"


def test_loss_mask_of_a_regenerated_conversation_labels_every_token():
    """Every assistant turn the target wrote is learned (content and its closing end-of-turn token);
    the system and user turns and every role marker are not. Each token's label written out by hand."""
    tok = make_micro_tokenizer()
    msgs = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "<think>\nx\n</think>\nyo"},
        {"role": "user", "content": "ok?"},
        {"role": "assistant", "content": "fine"},
    ]
    want = [("<|system|>", 0), ("Ċ", 0), ("S", 0), ("<|end|>", 0),
            ("<|user|>", 0), ("Ċ", 0), ("h", 0), ("i", 0), ("<|end|>", 0),
            ("<|assistant|>", 0), ("Ċ", 0), ("<think>", 1), ("Ċ", 1), ("x", 1), ("Ċ", 1), ("</think>", 1), ("Ċ", 1),
            ("y", 1), ("o", 1), ("<|end|>", 1),
            ("<|user|>", 0), ("Ċ", 0), ("o", 0), ("k", 0), ("?", 0), ("<|end|>", 0),
            ("<|assistant|>", 0), ("Ċ", 0), ("f", 1), ("i", 1), ("n", 1), ("e", 1), ("<|end|>", 1)]
    ids, mask = extract.render(tok, msgs, turns=2)
    assert list(zip(tok.convert_ids_to_tokens(ids), map(int, mask))) == want
    # turns=1 (a single answer after a given history): only the last turn, as before
    _, last = extract.render(tok, msgs)
    assert [int(m) for m in last] == [0] * 28 + [1] * 5
    with pytest.raises(ValueError, match="turns 3: the conversation has 2 assistant turns"):
        extract.render(tok, msgs, turns=3)


def test_the_end_of_turn_token_after_a_cut_answer_is_not_learned():
    """An answer cut at synth.max_new_tokens: its own tokens are learned, the end-of-turn token the
    template puts after it is not (the target would have gone on). Each token's label by hand."""
    tok = make_micro_tokenizer()
    msgs = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo"},
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": "la la"},  # cut: the target had more to say
        {"role": "user", "content": "ok?"},
        {"role": "assistant", "content": "no"},
    ]
    want = [("<|user|>", 0), ("Ċ", 0), ("h", 0), ("i", 0), ("<|end|>", 0),
            ("<|assistant|>", 0), ("Ċ", 0), ("y", 1), ("o", 1), ("<|end|>", 1),
            ("<|user|>", 0), ("Ċ", 0), ("g", 0), ("o", 0), ("<|end|>", 0),
            ("<|assistant|>", 0), ("Ċ", 0), ("l", 1), ("a", 1), ("Ġ", 1), ("l", 1), ("a", 1), ("<|end|>", 0),
            ("<|user|>", 0), ("Ċ", 0), ("o", 0), ("k", 0), ("?", 0), ("<|end|>", 0),
            ("<|assistant|>", 0), ("Ċ", 0), ("n", 1), ("o", 1), ("<|end|>", 1)]
    ids, mask = extract.render(tok, msgs, 3, ["stop", "length", "stop"])
    assert list(zip(tok.convert_ids_to_tokens(ids), map(int, mask))) == want
    # The last answer cut too: only its end-of-turn token changes.
    _, last_cut = extract.render(tok, msgs, 3, ["stop", "length", "length"])
    assert [int(m) for m in last_cut] == [m for _, m in want[:-1]] + [0]
    # A single answer cut: its content only.
    ids, mask = extract.render(tok, msgs[:2], 1, ["length"])
    assert tok.decode([i for i, m in zip(ids, mask) if m]) == "yo"
    with pytest.raises(ValueError, match="2 finish reasons for 3 assistant turns"):
        extract.render(tok, msgs, 3, ["stop", "stop"])


def test_plan_shards_sorted_and_complete():
    lengths = [50, 10, 30, 20, 40]
    plan = extract.plan_shards(lengths, shard_tokens=45)
    assert sorted(i for s in plan for i in s) == list(range(5))
    flat = [lengths[i] for s in plan for i in s]
    assert flat == sorted(flat)
    assert plan == extract.plan_shards(lengths, shard_tokens=45)


def test_shard_is_the_same_whatever_the_batching():
    """Rows of several batches land in their own places (the copy of batch b overlaps batch b+1)."""
    model = make_micro_model("llama", num_layers=4)
    rows = [([5, 6, 7], [False, True, True]), ([8, 9, 10, 11, 12], [False] * 2 + [True] * 3), ([13, 14], [True, True])]
    one = extract.extract_shard(model, rows, [1, 3], batch_size=1, dtype=torch.float32, device="cpu")
    all_ = extract.extract_shard(model, rows, [1, 3], batch_size=3, dtype=torch.float32, device="cpu")
    assert one.keys() == all_.keys()
    for k in one:
        torch.testing.assert_close(one[k], all_[k], rtol=1e-5, atol=1e-5)
    half = extract.extract_shard(model, rows, [1, 3], batch_size=2, dtype=torch.bfloat16, device="cpu")
    assert half["hidden.1"].dtype == torch.bfloat16 and half["hidden.1"].shape == (10, one["hidden.1"].shape[1])
    torch.testing.assert_close(half["final_hidden"].float(), one["final_hidden"], rtol=2e-2, atol=2e-2)


def test_a_conversation_too_long_ends_after_its_last_turn_that_fits(tmp_path):
    from stages.extract import fitted
    from draftlab.errors import UserError

    tok = make_micro_tokenizer()  # one token per byte
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a" * 10},
            {"role": "user", "content": "u" * 10}, {"role": "assistant", "content": "b" * 10},
            {"role": "user", "content": "v" * 30}, {"role": "assistant", "content": "c" * 30}]
    row = {"id": "r1", "messages": msgs, "turns": 3, "finish_reason": "stop", "finish_reasons": ["stop", "length", "stop"]}
    full, _ = extract.render(tok, msgs, 3)
    two, two_mask = extract.render(tok, msgs[:4], 2, ["stop", "length"])
    assert fitted(tok, row, len(full), tmp_path / "t.jsonl")[2] == 0
    ids, mask, left_out = fitted(tok, row, len(full) - 1, tmp_path / "t.jsonl")
    # The kept turns keep their own finish reasons: the cut second answer's end-of-turn token is not learned.
    assert (ids, mask, left_out) == (two, two_mask, 1) and tok.decode([i for i, m in zip(ids, mask) if m]) == \
        "a" * 10 + "<|end|>" + "b" * 10
    assert fitted(tok, row, len(two) - 1, tmp_path / "t.jsonl")[2] == 2
    with pytest.raises(UserError, match=r"t.jsonl: row r1: its first turn alone has \d+ tokens, more than extract.max_length/context 5"):
        fitted(tok, row, 5, tmp_path / "t.jsonl")
    with pytest.raises(UserError, match=r"t.jsonl: row r2 has \d+ tokens"):  # a single answer: an error, as always
        fitted(tok, {"id": "r2", "messages": msgs, "finish_reason": "stop"}, 5, tmp_path / "t.jsonl")


def test_a_row_written_before_finish_reasons_masks_as_its_answers_ended(tmp_path):
    """A row without finish_reasons: a cut answer ended its conversation then, so only its last answer
    can have been cut; the end-of-turn token after that one is not learned."""
    from stages.extract import fitted

    tok = make_micro_tokenizer()
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "aa"},
            {"role": "user", "content": "u"}, {"role": "assistant", "content": "bb"}]
    ids, mask, _ = fitted(tok, {"id": "r", "messages": msgs, "turns": 2, "finish_reason": "length"}, 512, tmp_path / "t.jsonl")
    assert tok.decode([i for i, m in zip(ids, mask) if m]) == "aa<|end|>bb"
    ids, mask, _ = fitted(tok, {"id": "r", "messages": msgs[:2], "finish_reason": "stop"}, 512, tmp_path / "t.jsonl")
    assert tok.decode([i for i, m in zip(ids, mask) if m]) == "aa<|end|>"


def test_loop_tokens_are_the_repeats_of_an_8_gram_within_one_answer():
    """Hand-labelled: the first pass through a passage is not a loop; its repeat is, from the
    repeat's 8th token on; a passage that repeats another answer is not a loop of this one."""
    from draftlab.data.loops import answer_loop_flags, loop_flags, spans

    ids = [ord(c) for c in "abcdefghabcdefghab"]  # 'abcdefgh' twice, then 'ab'
    assert [int(f) for f in loop_flags(ids)] == [0] * 15 + [1, 1, 1]
    assert not any(loop_flags(ids[:8] + ids[:7]))  # 7 tokens of a repeat: below the rule's 8
    assert [int(f) for f in loop_flags([7] * 11)] == [0] * 8 + [1] * 3  # one token looping
    # Two answers of the same 16 tokens, a user turn between: each answer on its own.
    passage = [ord(c) for c in "abcdefghijklmnop"]
    conv = [1, 2] + passage + [3, 4, 5] + passage + [6]
    mask = [False] * 2 + [True] * 16 + [False] * 3 + [True] * 16 + [False]
    assert spans(mask) == [(2, 18), (21, 37)]
    assert not any(answer_loop_flags(conv, mask))
    looping = [1, 2] + passage + passage[:10] + [3]
    lmask = [False] * 2 + [True] * 26 + [False]
    assert [int(f) for f in answer_loop_flags(looping, lmask)] == [0] * 2 + [0] * 16 + [0] * 7 + [1] * 3 + [0]


def test_rows_rendered_by_a_pool_of_processes_match_one_process_and_name_a_bad_row(tmp_path):
    """The extract stage renders a large split in forked processes: the same ids, loss masks,
    turns left out and loop flags, in the rows' order; a row too long still stops the stage with
    the file and row named."""
    from stages.extract import render_rows
    from draftlab.errors import UserError

    tok = make_micro_tokenizer()
    rows = []
    for n in range(40):  # conversations of 1-3 turns, some cut to fit 60 tokens, some looping
        msgs = []
        for t in range(n % 3 + 1):
            msgs += [{"role": "user", "content": f"q{n}-{t}"}, {"role": "assistant", "content": ("ab" * (n % 7 + 2))[: 3 + n]}]
        rows.append({"id": f"r{n}", "messages": msgs, "turns": n % 3 + 1, "finish_reason": "stop"})
    path = tmp_path / "train.jsonl"
    alone = render_rows(tok, rows, 60, path, workers=1, quiet=True)
    pooled = render_rows(tok, rows, 60, path, workers=3, quiet=True)
    assert pooled == alone and len(alone) == 40
    assert any(left_out for _, _, left_out, _ in alone) and any(any(f) for *_, f in alone)
    with pytest.raises(UserError, match=r"train.jsonl: row r0 has \d+ tokens, more than extract.max_length/context 8"):
        render_rows(tok, rows, 8, path, workers=2, quiet=True)


def test_rendering_falls_back_to_one_process_where_no_more_can_start(tmp_path, monkeypatch):
    """A container that refuses more processes (fork fails with EAGAIN): the rows render here, the same."""
    import stages.extract as stage

    class NoFork:
        def __init__(self, *a, **kw):
            pass

        def __enter__(self):
            raise BlockingIOError(11, "Resource temporarily unavailable")

        def __exit__(self, *exc):
            return False

    tok = make_micro_tokenizer()
    rows = [{"id": f"r{n}", "messages": [{"role": "user", "content": f"q{n}"}, {"role": "assistant", "content": "ab" * n}],
             "finish_reason": "stop"} for n in range(1, 6)]
    alone = stage.render_rows(tok, rows, 60, tmp_path / "t.jsonl", workers=1, quiet=True)
    monkeypatch.setattr(stage, "ProcessPoolExecutor", NoFork)
    assert stage.render_rows(tok, rows, 60, tmp_path / "t.jsonl", workers=2, quiet=True) == alone
