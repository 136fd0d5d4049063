"""The reference server refuses a text too long for the context before tokenizing it whole (10 MiB
took 24 s to get its 400 on the embedded target's tokenizer), and, started on its own, speaks of its
own flags: --model-path, --speculative-*, never params.yaml's target.model or a dvc stage."""
import random
import shlex
import time
from pathlib import Path

import pytest

from draftlab.errors import UserError
from draftlab.engine.text_limits import max_token_bytes, refuse_oversize
from tests.test_server import post

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "models" / "tiny-target"
MiB = 1 << 20


def words_text(n_bytes: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "12", "delta", "x", "foo", "bar", "ünï", "中文"]
    return " ".join(rng.choice(words) for _ in range(n_bytes // 4))[:n_bytes]


@pytest.fixture(scope="module")
def tiny():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(TINY), AutoTokenizer.from_pretrained(TINY)


def client_for(tiny, context: int | None = None):
    from fastapi.testclient import TestClient

    from draftlab.engine.runners import Engine
    from draftlab.engine.server import build_app

    model, tok = tiny
    return TestClient(build_app(Engine(model, tok, "cpu", context), "tiny", {"model_path": str(TINY)}))


@pytest.mark.parametrize("context", [None, 131_072])  # the target's 512, and a long context where the byte bound is loose
@pytest.mark.parametrize("shape", ["words", "one word", "spaces"])
def test_a_10_mib_text_is_refused_in_well_under_a_second(tiny, context, shape):
    c = client_for(tiny, context)
    text = {"words": words_text(10 * MiB), "one word": "a" * (10 * MiB), "spaces": " " * (10 * MiB)}[shape]
    for path, body in (("/generate", {"text": text}), ("/generate", {"text": ["hi", text]}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": text}]}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": text}]}]})):
        t0 = time.perf_counter()
        r = post(c, path, body)
        took = time.perf_counter() - t0
        assert r.status_code == 400, (path, r.text[:300])
        message = r.json()["message"] if path.startswith("/v1/") else r.json()["error"]["message"]
        assert "is longer than the model's context length" in message and len(message) < 400
        assert took < 5, (path, shape, took)  # generous: JSON parsing included, about 0.3 s here


def test_a_text_that_fits_is_served_as_before(tiny):
    c = client_for(tiny)
    r = post(c, "/generate", {"text": "Sort: 3 1 2", "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
    assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 4
    # just over the context, by exact count: still SGLang's own message with the token count
    tok = tiny[1]
    text = words_text(20_000)
    n = len(tok(text)["input_ids"])
    assert n > 512
    r = post(c, "/generate", {"text": text})
    assert r.status_code == 400 and "longer than the model's context length (512 tokens)" in r.json()["error"]["message"]


def test_the_bounds_never_refuse_a_text_that_fits(tiny):
    """Texts just under the context, of every shape, pass both bounds (no false refusals)."""
    tok = tiny[1]
    bytes_per_token = max_token_bytes(tok)
    for text in (words_text(1500), "a" * 1500, " " * 1500, "中" * 400, "\n\n".join(["x y"] * 200)):
        n = len(tok(text, add_special_tokens=False)["input_ids"])
        refuse_oversize(text, tok, n + 1, bytes_per_token, "text")  # a context one token larger: must pass
    long_context = 400_000
    refuse_oversize(words_text(MiB), tok, long_context, bytes_per_token, "text")  # about 600k tokens: passes the probes it can


def load_error(argv: str) -> str:
    from draftlab.engine.server import load_engine, parse_args

    with pytest.raises(UserError) as e:
        load_engine(parse_args(shlex.split(argv)))
    return str(e.value)


@pytest.mark.parametrize("argv, words", [
    ("--model-path nowhere/x/y", "--model-path: local path 'nowhere/x/y' does not exist"),
    ("--model-path absent.gguf", "--model-path 'absent.gguf': GGUF file absent.gguf not found"),
    ("--model-path bad!name", "--model-path 'bad!name': neither an existing folder or file nor a valid hub id"),
    ("--model-path {empty}", "cannot load its config: the folder"),
    ("--model-path {tiny} --speculative-algorithm EAGLE3 --speculative-draft-model-path {empty}",
     "--speculative-draft-model-path {empty}: {empty}/config.json not found: not an exported draft; give --speculative-draft-model-path"),
    ("--model-path {tiny} --speculative-algorithm EAGLE3 --speculative-draft-model-path {empty} --speculative-num-steps 3",
     "set --speculative-eagle-topk (1 = chain)"),
])
def test_standalone_errors_name_the_servers_flags(tmp_path, argv, words):
    empty = tmp_path / "empty"
    empty.mkdir()
    fill = {"empty": empty, "tiny": TINY}
    message = load_error(argv.format(**fill))
    assert words.format(**fill) in message
    for pipeline_word in ("params.yaml", "target.model", "dvc repro", "spec.", "export stage first", "run the export stage"):
        assert pipeline_word not in message, message


def test_a_gguf_file_without_its_folder_says_how_to_make_it(tmp_path, monkeypatch):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + b"\0" * 60)
    monkeypatch.chdir(tmp_path)
    message = load_error(f"--model-path {gguf}")
    assert "--model-path" in message and "give --model-path a transformers model folder" in message and "target.model '" not in message


@pytest.mark.parametrize("path, body, field", [
    ("/generate", '{"text": "\\ud800 hi"}', "text holds a lone UTF-16 surrogate"),
    ("/generate", '{"text": ["ok", "x\\udfff"]}', "text[1] holds a lone UTF-16 surrogate ('\\udfff') at character 1"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\udfff"}]}', "messages[0].content holds a lone UTF-16 surrogate"),
])
def test_a_lone_surrogate_is_a_400_naming_the_field(path, body, field):
    from tests.test_server import micro_client

    c, _ = micro_client()
    r = post(c, path, body)
    message = r.json()["message"] if path.startswith("/v1/") else r.json()["error"]["message"]
    assert r.status_code == 400 and field in message and "TextEncodeInput" not in message
    ok = post(c, "/generate", {"text": "\ud83d\ude00 a whole pair", "sampling_params": {"max_new_tokens": 1}})
    assert ok.status_code == 200


@pytest.mark.parametrize("body", ['{"text": "hi", "x": ' + "[" * 100_000 + "]" * 100_000 + "}",
                                  '{"text": "hi", "sampling_params": {"max_new_tokens": ' + "9" * 5000 + "}}"])
def test_bodies_json_cannot_parse_are_400s(body):
    from tests.test_server import micro_client

    c, _ = micro_client()
    r = post(c, "/generate", body)
    assert r.status_code == 400 and "must be a JSON object" in r.json()["error"]["message"]
