"""Self prompts: the target writes user turns from its template's user prefix, through either engine;
the stage keeps its file while its settings hold; the prompts stage adds them to the train split only."""
import importlib.util
import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from draftlab.data import prompts, self_prompts
from draftlab.errors import UserError
from draftlab.lifecycle import free_port, serve
from draftlab.engine.server import launch_command
from tests.support.micro import make_micro_tokenizer, save_micro_model

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


def _load(name):
    spec = importlib.util.spec_from_file_location(f"stage_{name}", ROOT / "stages" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def settings(**kw):
    base = {"count": 6, "temperature": 1.0, "top_p": 1.0, "max_new_tokens": 12, "seed": 0, "batch_size": 4}
    return SimpleNamespace(**{**base, **kw})


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = tmp_path_factory.mktemp("target")
    save_micro_model(path, arch="llama", seed=3)
    return path


@pytest.fixture(scope="module")
def tok():
    return make_micro_tokenizer()


def test_the_user_prefix_is_the_template_up_to_a_user_turns_text(tok):
    prefix, stop = self_prompts.user_prefix(tok)
    rendered = tok.apply_chat_template([{"role": "user", "content": "Hello there"}], tokenize=False)
    assert rendered.startswith(tok.decode(prefix)) and "Hello there" not in tok.decode(prefix)
    after = rendered.split("Hello there", 1)[1]
    assert tok(after, add_special_tokens=False)["input_ids"][0] in stop  # the token that closes a user turn
    assert tok.eos_token_id in stop


def test_a_template_that_cannot_place_a_user_turn_is_named(tok, monkeypatch):
    monkeypatch.setattr(tok, "apply_chat_template", lambda *a, **k: "no room for the user")
    with pytest.raises(UserError, match="self_prompts.count: 0"):
        self_prompts.user_prefix(tok)


def test_every_turn_asked_for_is_kept_or_counted_and_the_seed_decides_them(target, tok):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target).eval()
    done = []
    first = self_prompts.write_hf(model, tok, settings(), "cpu", done.append)
    assert len(first.texts) + sum(first.left_out.values()) == 6 and done == [4, 2]
    assert first.left_out["cut"] > 0 or first.texts  # a random micro model writes something or runs to the cap
    assert all(t == t.strip() and t for t in first.texts)
    again = self_prompts.write_hf(model, tok, settings(batch_size=6), "cpu")
    assert again.texts == first.texts or again.left_out == first.left_out  # same seed: same sampling per batch start
    other = self_prompts.write_hf(model, tok, settings(seed=7), "cpu")
    assert (other.texts, other.completion_tokens) != (first.texts, first.completion_tokens)


def test_the_server_engine_writes_through_sglangs_generate_in_batches(target, tok):
    port = free_port()
    with serve(launch_command(target, port), f"http://127.0.0.1:{port}", target / "server.log", 120, env=ENV) as srv:
        got = self_prompts.write_http([srv.url], tok, settings(count=5, batch_size=2, max_new_tokens=40), 60.0)
        again = self_prompts.write_http([srv.url, srv.url], tok, settings(count=5, batch_size=2, max_new_tokens=40), 60.0)
    assert len(got.texts) + sum(got.left_out.values()) == 5 and got.completion_tokens > 0
    assert again.texts == got.texts  # each row's seed is its own: the number of servers changes nothing
    with pytest.raises(UserError, match="/generate"):
        self_prompts.write_http([f"http://127.0.0.1:{free_port()}"], tok, settings(count=1), 5.0)


def test_self_prompts_join_the_train_split_only_once_each():
    source = [{"id": prompts.prompt_id(m), "messages": m} for m in ([{"role": "user", "content": f"q{i}"}] for i in range(40))]
    texts = [f"q{i}" for i in range(3)] + [f"new {i}" for i in range(200)] + ["new 5"]
    rows = [{"id": prompts.prompt_id(r["messages"]), **r} for r in self_prompts.rows(texts)]
    kept, left = prompts.train_only(rows, {prompts.opening_id(r) for r in source}, 0.25)
    assert left["duplicates"] == 4  # three repeat a source prompt, one repeats another self prompt
    assert left["in_eval_share"] > 0 and len(kept) + sum(left.values()) == len(rows)
    assert not any(prompts.is_eval(prompts.opening_id(r), 0.25) for r in kept)


def test_a_turn_written_as_an_answer_is_left_out_and_most_such_turns_warn(target, tmp_path, monkeypatch, capsys):
    """A target never trained on user turns writes its own answers when asked for one (the embedded target: its
    reasoning markup in all 454 turns it closed). Such turns are left out and counted, and when they are most,
    the stage says self prompts add little for this target."""
    got = self_prompts.Written()
    for text in ["How do I sort a list?", "Take 3 away.\n</think>\nThe answer is 0.", "<think>\nFirst add.", "  "]:
        got.add(text, closed=True, tokens=5)
    got.add("never closed", closed=False, tokens=12)
    assert got.texts == ["How do I sort a list?"] and got.left_out == {"cut": 1, "empty": 1, "as_answer": 2}

    stage = _load("self_prompts")
    monkeypatch.chdir(tmp_path)
    write_params(tmp_path, target, count=5)
    monkeypatch.setattr(stage, "write", lambda params, out: (got, {}))
    stage.main(tmp_path / "self")
    said = capsys.readouterr().out
    assert "1 of 5 user turns written (1 cut at self_prompts.max_new_tokens, 1 empty, 2 written as an answer" in said
    assert "warning" not in said  # 2 of 5: not most
    for _ in range(2):
        got.add("It is 4.\n</think>\nThe answer is 4.", closed=True, tokens=5)
    write_params(tmp_path, target, count=6, seed=1)
    stage.main(tmp_path / "self")
    assert "warning: 4 of 6 turns hold the target's reasoning markup" in capsys.readouterr().out
    assert (tmp_path / "self/prompts.jsonl").read_text().count("\n") == 1  # only the user-like turn

    calls = []
    monkeypatch.setattr(stage, "write", lambda params, out: calls.append(1) or (got, {}))
    stage.main(tmp_path / "self")
    assert calls == []  # the same settings, target and rule: kept
    monkeypatch.setattr(self_prompts, "REASONING_MARKUP", ("<think>", "</think>", "<reflect>"))
    stage.main(tmp_path / "self")
    assert calls == [1]  # another rule for what is an answer: a file written under the old one is written again


def write_params(dir, model, **self_kw):
    base = yaml.safe_load((ROOT / "params.yaml").read_text())
    params = {"target": {**base["target"], "model": str(model), "device": "cpu"},
              "synth": base["synth"], "prompts": {**base["prompts"], "num_prompts": 40},
              "self_prompts": {**base["self_prompts"], "max_new_tokens": 16, "batch_size": 8, **self_kw}}
    (dir / "params.yaml").write_text(yaml.safe_dump(params))


def test_the_stage_writes_none_by_default_keeps_its_file_and_the_prompts_stage_takes_them(target, tmp_path, monkeypatch):
    stage, prompts_stage = _load("self_prompts"), _load("prompts")
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "self"
    write_params(tmp_path, target, count=0)
    stage.main(out)
    assert (out / "prompts.jsonl").read_text() == ""
    assert json.loads((out / "manifest.json").read_text())["info"]["written"] == 0

    write_params(tmp_path, target, count=60)
    stage.main(out)
    info = json.loads((out / "manifest.json").read_text())["info"]
    written = (out / "prompts.jsonl").read_text()
    assert info["written"] == len(written.splitlines()) and info["written"] + sum(info["left_out"].values()) == 60
    assert info["written"] > 0, "the micro target closed no user turn in 16 tokens"

    def never(*a, **k):
        raise AssertionError("the file was written again")

    monkeypatch.setattr(stage, "write", never)
    write_params(tmp_path, target, count=60)
    (tmp_path / "params.yaml").write_text((tmp_path / "params.yaml").read_text().replace("startup_timeout_s: 600.0",
                                                                                         "startup_timeout_s: 30.0"))
    stage.main(out)  # an engine setting changed, not the prompts': kept
    assert (out / "prompts.jsonl").read_text() == written
    monkeypatch.undo()
    monkeypatch.chdir(tmp_path)
    (out / "prompts.jsonl").write_text(written.splitlines(keepends=True)[0])  # cut by hand: written again, whole
    stage.main(out)
    assert (out / "prompts.jsonl").read_text() == written

    prompts_stage.main(tmp_path / "prompts", tmp_path / "prompts.json", out)
    train = [json.loads(x) for x in (tmp_path / "prompts" / "train.jsonl").read_text().splitlines()]
    evals = [json.loads(x) for x in (tmp_path / "prompts" / "eval.jsonl").read_text().splitlines()]
    mine = [r for r in train if r.get("source") == "self"]
    counts = json.loads((tmp_path / "prompts" / "manifest.json").read_text())["info"]["self_prompts"]
    assert len(mine) == counts["used"] and counts["read"] == info["written"]
    assert counts["used"] + counts["duplicates"] + counts["in_eval_share"] == counts["read"]
    assert not any(r.get("source") == "self" for r in evals) and len(evals) > 0
    assert json.loads((tmp_path / "prompts.json").read_text())["self_prompts_used"] == len(mine)

    (out / "prompts.jsonl").write_text(written + '{"messages": []}\n')
    with pytest.raises(UserError, match=r"prompts.jsonl:\d+: 'messages' must be a non-empty list"):
        prompts.read_self_prompts(out)


def test_the_probe_accounts_for_every_turn_and_compares_lengths_with_a_source(target, tmp_path, capsys):
    """benchmarks/self_prompts_probe.py: kept + left out = asked, and the source's length quartiles beside."""
    from tests.support.micro import make_micro_tokenizer

    make_micro_tokenizer().save_pretrained(target)
    source = tmp_path / "train.jsonl"
    source.write_text("".join(json.dumps({"messages": [{"role": "user", "content": "q" * n}]}) + "\n" for n in (3, 5, 9, 12)))
    spec = importlib.util.spec_from_file_location("self_prompts_probe", ROOT / "benchmarks" / "self_prompts_probe.py")
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    out = tmp_path / "probe.json"
    probe.main([str(target), "--count", "6", "--batch-size", "4", "--max-new-tokens", "12", "--source", str(source),
                "--out", str(out)])
    res = json.loads(out.read_text())
    assert res["kept"] + sum(res["left_out"].values()) == 6 and res["distinct_kept"] <= res["kept"]
    assert res["source_first_turn_tokens_quartiles"] == probe.quartiles([3, 5, 9, 12])
    assert json.loads(capsys.readouterr().out) == res


def test_the_sglang_backend_writes_them_through_its_own_server_and_stops_it(target, tmp_path, monkeypatch):
    """synth.backend sglang on a CPU: `python -m sglang.launch_server` is the stand-in (the reference server).
    Sampled turns differ between engines, so the check is the accounting and the stopped server."""
    import httpx

    from tests.support.micro import make_micro_tokenizer

    make_micro_tokenizer().save_pretrained(target)
    stage = _load("self_prompts")
    monkeypatch.setenv("PYTHONPATH", f"{ROOT / 'tests' / 'fixtures' / 'sglang_standin'}{os.pathsep}{ROOT}")
    monkeypatch.chdir(tmp_path)
    base = yaml.safe_load((ROOT / "params.yaml").read_text())
    (tmp_path / "params.yaml").write_text(yaml.safe_dump({
        "target": {**base["target"], "model": str(target), "device": "cpu"},
        "synth": {**base["synth"], "backend": "sglang", "startup_timeout_s": 120.0},
        "self_prompts": {**base["self_prompts"], "count": 5, "batch_size": 2, "max_new_tokens": 16}}))
    out = tmp_path / "self"
    stage.main(out)
    info = json.loads((out / "manifest.json").read_text())["info"]
    assert info["backend"] == "sglang" and info["written"] + sum(info["left_out"].values()) == 5
    assert info["written"] == len((out / "prompts.jsonl").read_text().splitlines()) and info["server_startup"]
    log = (out / ".sglang-server.log").read_text()
    port = int(log.split("--port ", 1)[1].split(";")[0])
    with pytest.raises(httpx.HTTPError):  # stopped with the stage
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
