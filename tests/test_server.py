"""The reference server speaks SGLang's HTTP API and decodes exactly like transformers."""
import os
import threading

import httpx
import pytest
import torch

from draftlab.lifecycle import free_port, serve
from tests.support.micro import save_micro_model
from draftlab.server import launch_command, parse_reasoning

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

    from draftlab.server import apply_sglang_rules
    from draftlab.sglang.launch import parse_log
    from draftlab.sglang.flags import default_spec_params

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
