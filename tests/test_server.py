"""The reference server speaks SGLang's HTTP API and decodes exactly like transformers."""
import json
import os
import threading

import httpx
import pytest
import torch

from draftlab.lifecycle import free_port, serve
from draftlab.engine.server import launch_command, parse_reasoning
from tests.support.micro import save_micro_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# One CPU thread: test machines are shared, and thread contention slows a micro model 10x.
SERVER_ENV = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("micro")
    model = save_micro_model(path, arch="qwen2", seed=3)
    tok = AutoTokenizer.from_pretrained(path)
    port = free_port()
    with serve(launch_command(path, port), f"http://127.0.0.1:{port}", path / "server.log", startup_timeout_s=120, env=SERVER_ENV) as srv:
        yield srv.url, model, tok, str(path)


def reference(model, ids, n):
    """What transformers' greedy generate gives for prompt `ids`: the new tokens."""
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(ids):].tolist()


def chat_ids(tok, text):
    return tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=False)


def test_health_models_and_server_info(served):
    url, model, _, path = served
    assert httpx.get(url + "/health").status_code == 200
    info = httpx.get(url + "/server_info").json()
    assert info["model_path"] == path and info["context_length"] == model.config.max_position_embeddings
    assert info["speculative_algorithm"] is None and isinstance(info["internal_states"], list)
    models = httpx.get(url + "/v1/models").json()["data"]
    assert [m["id"] for m in models] == [path]


@pytest.mark.parametrize("prompt", ["Sort: 3 1 2", "Reverse 'hello' ñ"])
def test_generate_greedy_equals_transformers_generate(served, prompt):
    url, model, tok, _ = served
    ids = chat_ids(tok, prompt)
    r = httpx.post(url + "/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": 24, "temperature": 0}}, timeout=60)
    out = r.json()
    assert out["output_ids"] == reference(model, ids, 24)
    assert out["text"] == tok.decode(out["output_ids"], skip_special_tokens=True)
    meta = out["meta_info"]
    assert meta["prompt_tokens"] == len(ids) and meta["completion_tokens"] == 24
    assert meta["finish_reason"] == {"type": "length", "length": 24}
    assert meta["e2e_latency"] > 0 and meta["id"]


def test_generate_text_prompt_and_batch(served):
    url, model, tok, _ = served
    texts = ["abc", "a longer prompt"]
    out = httpx.post(url + "/generate", json={"text": texts, "sampling_params": {"max_new_tokens": 8, "temperature": 0}}, timeout=60).json()
    assert isinstance(out, list) and len(out) == 2
    for text, o in zip(texts, out):
        ids = tok(text)["input_ids"]
        assert o["meta_info"]["prompt_tokens"] == len(ids)
        assert o["output_ids"] == reference(model, ids, 8)


def test_a_batch_takes_one_sampling_params_object_per_prompt(served):
    url, model, tok, _ = served
    ids = [chat_ids(tok, "abc"), chat_ids(tok, "a longer prompt")]
    body = {"input_ids": ids, "sampling_params": [{"max_new_tokens": 3, "temperature": 0}, {"max_new_tokens": 6, "temperature": 0}]}
    out = httpx.post(url + "/generate", json=body, timeout=60).json()
    assert [o["output_ids"] for o in out] == [reference(model, ids[0], 3), reference(model, ids[1], 6)]


def test_stop_token_and_stop_string_in_sglang_shapes(served):
    url, model, tok, _ = served
    ids = chat_ids(tok, "count to five")
    greedy = reference(model, ids, 12)
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 12, "temperature": 0, "stop_token_ids": [greedy[3]]}}
    out = httpx.post(url + "/generate", json=body, timeout=60).json()
    first = greedy.index(greedy[3])
    assert out["output_ids"] == greedy[: first + 1]  # the stop token is kept and counted
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": greedy[3]}

    full = tok.decode(greedy, skip_special_tokens=True)
    stop = full[5:7]
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 12, "temperature": 0, "stop": [stop]}}
    out = httpx.post(url + "/generate", json=body, timeout=60).json()
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["text"] == full[: full.index(stop)]  # cut before the stop string


def test_seeded_sampling_is_reproducible(served):
    url, *_ = served
    body = {"text": "hello", "sampling_params": {"max_new_tokens": 16, "temperature": 1.0, "top_p": 0.9, "sampling_seed": 7}}
    a, b = (httpx.post(url + "/generate", json=body, timeout=60).json()["output_ids"] for _ in range(2))
    body["sampling_params"]["sampling_seed"] = 8
    c = httpx.post(url + "/generate", json=body, timeout=60).json()["output_ids"]
    assert a == b and a != c


def test_chat_completions_openai_shape_and_greedy_tokens(served):
    url, model, tok, path = served
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "What is 2+2?"}]
    r = httpx.post(url + "/v1/chat/completions", json={"model": path, "messages": messages, "max_tokens": 20, "temperature": 0, "seed": 1}, timeout=60)
    out = r.json()
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    expected = reference(model, ids, 20)
    choice = out["choices"][0]
    assert choice["message"]["role"] == "assistant"
    assert choice["message"]["content"] == tok.decode(expected, skip_special_tokens=True)
    assert choice["finish_reason"] == ("stop" if tok.eos_token_id in expected else "length")
    assert out["usage"] == {"prompt_tokens": len(ids), "completion_tokens": len(expected), "total_tokens": len(ids) + len(expected)}
    assert out["object"] == "chat.completion" and out["model"] == path


def test_concurrent_requests_are_served_one_at_a_time_with_the_same_result(served):
    url, model, tok, _ = served
    ids = chat_ids(tok, "same prompt")
    results = []

    def call():
        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 16, "temperature": 0}}
        results.append(httpx.post(url + "/generate", json=body, timeout=60).json()["output_ids"])

    threads = [threading.Thread(target=call) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert results == [reference(model, ids, 16)] * 3


def test_prompt_longer_than_context_is_a_400_naming_the_lengths(served):
    url, model, _, _ = served
    n = model.config.max_position_embeddings + 5
    r = httpx.post(url + "/generate", json={"input_ids": [10] * n, "sampling_params": {"max_new_tokens": 4}}, timeout=60)
    assert r.status_code == 400
    assert f"{n} tokens" in r.text and f"{model.config.max_position_embeddings} tokens" in r.text
    r = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x" * n}]}, timeout=60)
    assert r.status_code == 400 and r.json()["object"] == "error"


def test_reasoning_parser_splits_like_sglang():
    assert parse_reasoning("<think>\nstep\n</think>\nanswer", "qwen3") == ("\nstep\n", "answer")
    assert parse_reasoning("no reasoning here", "qwen3") == (None, "no reasoning here")
    assert parse_reasoning("step</think>answer", "deepseek-r1") == ("step", "answer")  # <think> was in the prompt
    assert parse_reasoning("<think>\ncut off mid", "qwen3") == ("\ncut off mid", "")


def test_the_reference_server_runs_and_logs_what_sglang_would(capsys):
    """Flags SGLang adjusts at start-up are adjusted the same way, with SGLang's own log line, so
    the bench and the check read a reference-server log exactly as a real one."""
    import argparse

    from draftlab.engine.server import apply_sglang_rules
    from draftlab.sglang.flags import default_spec_params
    from draftlab.sglang.launch import parse_log

    args = argparse.Namespace(speculative_algorithm="EAGLE3", speculative_num_steps=1, speculative_eagle_topk=1,
                              speculative_num_draft_tokens=16, sglang_version="0.5.14")
    apply_sglang_rules(args, "LlamaForCausalLM")
    assert args.speculative_num_draft_tokens == 2
    assert "chain_draft_tokens" in [a.rule for a in parse_log(capsys.readouterr().out.splitlines()).adjustments]
    unset = argparse.Namespace(speculative_algorithm="EAGLE3", speculative_num_steps=None, speculative_eagle_topk=None,
                               speculative_num_draft_tokens=None, sglang_version="0.5.14")
    apply_sglang_rules(unset, "LlamaForCausalLM")
    assert (unset.speculative_num_steps, unset.speculative_eagle_topk, unset.speculative_num_draft_tokens) == \
        default_spec_params("LlamaForCausalLM", "0.5.14")
    assert unset.max_running_requests == 48 and "Max running requests is reset to 48" in capsys.readouterr().out


def test_the_reference_server_keeps_the_bench_cap_on_running_requests(capsys):
    """bench.max_running_requests reaches the reference server: no 'reset to 48' line for the check
    to take for an unpredicted adjustment, and /server_info reports the cap it runs."""
    from draftlab.engine.server import apply_sglang_rules, parse_args

    args = parse_args(["--model-path", "m", "--speculative-algorithm", "EAGLE3", "--speculative-num-steps", "3",
                       "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4", "--max-running-requests", "16"])
    apply_sglang_rules(args, "LlamaForCausalLM")
    assert args.max_running_requests == 16 and "Max running requests" not in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------
# Hostile input, in process (fastapi's TestClient over a micro engine): every malformed request is
# a 400 whose message names the field, never a 500.

MICRO_CONTEXT = 64


def micro_client(context: int = MICRO_CONTEXT):
    """(TestClient over build_app on a micro llama engine, the engine); bodies go through `post`."""
    from fastapi.testclient import TestClient

    from draftlab.engine.runners import Engine
    from draftlab.engine.server import build_app
    from tests.support.micro import make_micro_model, make_micro_tokenizer

    model = make_micro_model("llama", max_position_embeddings=context, seed=1)
    tok = make_micro_tokenizer(model.config.vocab_size)
    model.generation_config.eos_token_id = tok.eos_token_id
    engine = Engine(model, tok, "cpu")
    return TestClient(build_app(engine, "micro", {"model_path": "micro"})), engine


def post(client, path, body):
    """POST `body` as JSON text, NaN and Infinity included (httpx's json= refuses them)."""
    import json

    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return client.post(path, content=data, headers={"content-type": "application/json"})


@pytest.fixture(scope="module")
def client():
    return micro_client()


def error_message(r) -> str:
    body = r.json()
    return body["message"] if body.get("object") == "error" else body["error"]["message"]


@pytest.mark.parametrize("body, field", [
    ({"input_ids": [1, 256]}, "input_ids[1]"),  # out of the vocabulary (256)
    ({"input_ids": [5, -1]}, "input_ids[1]"),
    ({"input_ids": [5, 1.5]}, "input_ids[1]"),
    ({"input_ids": [5, True]}, "input_ids[1]"),
    ({"input_ids": []}, "input_ids"),
    ({"input_ids": "12"}, "input_ids"),
    ({"input_ids": [[1, 2], []]}, "input_ids[1]"),
    ({"text": ""}, "text"),
    ({"text": 5}, "text"),
    ({"text": []}, "text"),
    ({}, "'text' and 'input_ids'"),
    ({"text": "a", "input_ids": [1]}, "'text' and 'input_ids'"),
    ({"text": "a", "sampling_params": [{"max_new_tokens": 2}]}, "sampling_params"),
    ({"text": "a", "sampling_params": "greedy"}, "sampling_params"),
    ({"text": "a", "sampling_params": {"temperature": float("nan")}}, "temperature must be a non-negative finite number"),
    ({"text": "a", "sampling_params": {"temperature": float("inf")}}, "temperature"),
    ({"text": "a", "sampling_params": {"temperature": -0.5}}, "temperature"),
    ({"text": "a", "sampling_params": {"temperature": "hot"}}, "temperature"),
    ({"text": "a", "sampling_params": {"top_p": -1}}, "top_p must be in (0, 1], got -1."),
    ({"text": "a", "sampling_params": {"top_p": 0}}, "top_p"),
    ({"text": "a", "sampling_params": {"top_p": float("nan")}}, "top_p"),
    ({"text": "a", "sampling_params": {"top_k": 0}}, "top_k must be -1 (disable) or at least 1"),
    ({"text": "a", "sampling_params": {"top_k": -2}}, "top_k"),
    ({"text": "a", "sampling_params": {"top_k": 2.5}}, "top_k"),
    ({"text": "a", "sampling_params": {"max_new_tokens": -5}}, "max_new_tokens must be at least 0, got -5."),
    ({"text": "a", "sampling_params": {"max_new_tokens": 2.5}}, "max_new_tokens"),
    ({"text": "a", "sampling_params": {"max_new_tokens": "4"}}, "max_new_tokens"),
    ({"text": "a", "sampling_params": {"stop": 3}}, "stop must be a string or a list of strings"),
    ({"text": "a", "sampling_params": {"stop": ["a", None]}}, "stop"),
    ({"text": "a", "sampling_params": {"stop_token_ids": [1, "x"]}}, "stop_token_ids"),
    ({"text": "a", "sampling_params": {"ignore_eos": "yes"}}, "ignore_eos"),
    ({"text": "a", "sampling_params": {"sampling_seed": 2**70}}, "sampling_seed"),
    ({"text": "a", "sampling_params": {"sampling_seed": "7"}}, "sampling_seed"),
    ({"text": "a", "sampling_params": [{"max_new_tokens": 2}]}, "sampling_params as a list needs a batch"),
    ({"text": ["a", "b"], "sampling_params": [{"max_new_tokens": 2}]}, "got 1 for 2 prompts"),
    ({"text": ["a", "b"], "sampling_params": [{}, {"top_p": 0}]}, "top_p"),
    ({"text": ["a", "b"], "sampling_params": [{}, 3]}, "sampling_params[1] must be a JSON object"),
    ({"text": "a", "rid": {"x": 1}}, "rid"),
    ({"text": ["a", "b"], "rid": ["only-one"]}, "rid"),
    ({"text": "a", "return_hidden_states": "yes"}, "return_hidden_states"),
    ({"text": "a", "stream": True}, "stream"),
    ({"input_ids": [10] * (MICRO_CONTEXT + 5)}, f"({MICRO_CONTEXT + 5} tokens) is longer than the model's context length"),
])
def test_generate_malformed_is_a_400_naming_the_field(client, body, field):
    r = post(client[0], "/generate", body)
    assert r.status_code == 400, r.text
    assert field in error_message(r), error_message(r)


@pytest.mark.parametrize("body, field", [
    ({}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": "x"}, "junk"]}, "messages[1]"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "u"}]}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": -5}, "max_tokens must be at least 0, got -5."),
    ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": "9"}, "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": float("nan")}, "temperature"),
    ({"messages": [{"role": "user", "content": "x"}], "top_p": 1.5}, "top_p"),
    ({"messages": [{"role": "user", "content": "x"}], "n": 2}, "n must be 1"),
    ({"messages": [{"role": "user", "content": "x"}], "n": True}, "n must be 1"),
    ({"messages": [{"role": "user", "content": "x"}], "stream": True}, "stream must be false"),
    ({"messages": [{"role": "user", "content": "x"}], "seed": 1.5}, "seed"),
    ({"messages": [{"role": "user", "content": "x" * (MICRO_CONTEXT + 5)}]}, "longer than the model's context length"),
])
def test_chat_malformed_is_an_openai_400_naming_the_field(client, body, field):
    r = post(client[0], "/v1/chat/completions", body)
    assert r.status_code == 400, r.text
    out = r.json()
    assert out["object"] == "error" and out["code"] == 400 and out["type"] == "BadRequestError"
    assert field in out["message"], out["message"]


@pytest.mark.parametrize("path", ["/generate", "/v1/chat/completions"])
@pytest.mark.parametrize("data", [b"{not json", b"[1, 2]", b"", b"null", b"\xff\xfe"])
def test_a_body_that_is_not_a_json_object_is_a_400(client, path, data):
    r = post(client[0], path, data)
    assert r.status_code == 400, r.text
    assert "JSON object" in error_message(r)


def test_max_new_tokens_zero_is_an_empty_completion_as_in_sglang(client):
    """SGLang's SamplingParams.verify allows 0 (and refuses < 0): nothing generated, finish length."""
    c, _ = client
    out = post(c, "/generate", {"input_ids": [10, 11, 12], "sampling_params": {"max_new_tokens": 0}}).json()
    assert out["output_ids"] == [] and out["text"] == ""
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    assert out["meta_info"]["completion_tokens"] == 0 and out["meta_info"]["prompt_tokens"] == 3
    out = post(c, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}).json()
    assert out["choices"][0]["message"]["content"] == "" and out["choices"][0]["finish_reason"] == "length"
    assert out["usage"]["completion_tokens"] == 0


def test_null_sampling_values_mean_the_default_and_valid_edges_are_served(client):
    c, _ = client
    out = post(c, "/generate", {"input_ids": [10, 255], "sampling_params": {"max_new_tokens": None, "temperature": None}})
    assert out.status_code == 200 and len(out.json()["output_ids"]) <= 128
    body = {"input_ids": [[0, 1], [255]], "rid": ["a", None],
            "sampling_params": {"max_new_tokens": 2, "temperature": 0.7, "top_p": 1, "top_k": 1, "sampling_seed": -3,
                                "stop": "zz", "stop_token_ids": [2**40], "ignore_eos": True}}
    out = post(c, "/generate", body)
    assert out.status_code == 200, out.text
    assert [o["meta_info"]["id"] for o in out.json()] == ["a", out.json()[1]["meta_info"]["id"]] and len(out.json()) == 2


# ---------------------------------------------------------------------------------------------
# The context length as SGLang 0.5.14 validates it (TokenizerManager._validate_one_request), and
# the request-size limit.

SGLANG_TOTAL = ("Requested token count exceeds the model's maximum context length of {ctx} tokens. You requested a total of "
                "{total} tokens: {n} tokens from the input messages and {new} tokens for the completion. Please reduce the "
                "number of tokens in the input messages or the completion to fit within the limit.")


def app_client(server_args: dict, context: int = MICRO_CONTEXT):
    from fastapi.testclient import TestClient

    from draftlab.engine.server import build_app

    _, engine = micro_client(context)
    return TestClient(build_app(engine, "micro", {"model_path": "micro", **server_args})), engine


def test_input_plus_max_new_tokens_past_the_context_is_sglangs_400(client):
    c, _ = client
    r = post(c, "/generate", {"input_ids": [10] * 60, "sampling_params": {"max_new_tokens": 10}})
    assert r.status_code == 400 and error_message(r) == SGLANG_TOTAL.format(ctx=64, total=70, n=60, new=10)
    assert post(c, "/generate", {"input_ids": [10] * 60, "sampling_params": {"max_new_tokens": 4}}).status_code == 200  # 64: fits
    out = post(c, "/generate", {"input_ids": [10] * 60, "sampling_params": {"ignore_eos": True}})  # no max_new_tokens: not checked
    assert out.status_code == 200 and out.json()["meta_info"]["completion_tokens"] == 4  # stops at the context, as SGLang
    body = {"messages": [{"role": "user", "content": "x" * 50}], "max_tokens": 40}
    r = post(c, "/v1/chat/completions", body)
    assert r.status_code == 400 and r.json()["object"] == "error" and r.json()["message"].startswith(
        "Requested token count exceeds the model's maximum context length of 64 tokens.")  # SGLang's words, no type prefix
    assert post(c, "/v1/chat/completions", {**body, "max_tokens": None}).status_code == 200


def test_a_speculative_servers_reserved_draft_slots_count_as_input():
    """SGLang reserves max(topk * num_steps, num_draft_tokens) slots of an EAGLE request and counts them as input."""
    c, engine = app_client({})
    engine.reserved_tokens = 6  # what SpecEngine sets for a 5-1-6 chain
    r = post(c, "/generate", {"input_ids": [10] * 58, "sampling_params": {"max_new_tokens": 1}})
    assert error_message(r) == "The input (64 tokens) is longer than the model's context length (64 tokens)."
    r = post(c, "/generate", {"input_ids": [10] * 50, "sampling_params": {"max_new_tokens": 9}})
    assert error_message(r) == SGLANG_TOTAL.format(ctx=64, total=65, n=56, new=9)


def test_chat_max_tokens_above_context_length_flag_is_sglangs_400():
    c, _ = app_client({"context_length": 32})
    r = post(c, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 40})
    assert r.status_code == 400
    assert r.json()["message"] == "max_completion_tokens is too large: 40.This model supports at most 32 completion tokens."


def test_a_body_over_the_limit_is_a_413_in_the_endpoints_shape():
    c, _ = app_client({"max_request_bytes": 1000})
    small = {"input_ids": [10, 11], "sampling_params": {"max_new_tokens": 1}}
    assert post(c, "/generate", small).status_code == 200
    big = json.dumps({"input_ids": [10] * 500})  # ~2 kB
    r = post(c, "/generate", big)
    assert r.status_code == 413 and "larger than this server's limit of 1000 bytes (--max-request-bytes)" in r.json()["error"]["message"]
    chunks = (big[i:i + 100].encode() for i in range(0, len(big), 100))  # no Content-Length: counted as it arrives
    r = c.post("/v1/chat/completions", content=chunks, headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["object"] == "error" and "received so far" in r.json()["message"]
    assert post(c, "/generate", small).status_code == 200


def test_a_huge_body_is_refused_before_it_is_read(served):
    """A 10 GB Content-Length: the 413 comes at once, no byte of the body sent; the server goes on."""
    import socket
    import time
    from urllib.parse import urlsplit

    url = served[0]
    u = urlsplit(url)
    t0 = time.perf_counter()
    with socket.create_connection((u.hostname, u.port), timeout=10) as s:
        s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 10000000000\r\n\r\n")
        reply = b""
        while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
            data = s.recv(65536)
            if not data:
                break
            reply += data
    assert time.perf_counter() - t0 < 1.0
    assert reply.startswith(b"HTTP/1.1 413") and b"10000000000 bytes" in reply
    assert httpx.get(url + "/health").status_code == 200
