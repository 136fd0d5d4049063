"""Property tests of the reference server's HTTP side: whatever JSON a client sends to /generate or
/v1/chat/completions (wrong types, missing fields, huge, negative and NaN numbers, nested junk),
the answer is a 200 with a well-formed body or a 4xx with a message, never a 500.

In process: fastapi's TestClient over build_app on a micro engine (tests.test_server.micro_client),
a 64-token context so that even an unbounded request decodes only a few dozen micro-model steps.
"""
import json

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests.test_server import MICRO_CONTEXT, micro_client, post

VOCAB = 256
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                         HealthCheck.too_slow])

scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True, allow_infinity=True),
                    st.text(max_size=8))
junk = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                     st.dictionaries(st.text(max_size=6), inner, max_size=3)), max_leaves=8)


nonfinite = st.sampled_from([float("nan"), float("inf"), float("-inf")])


def either(good):
    """Mostly plausible values, often junk."""
    return st.one_of(good, good, junk)


token_ids = st.lists(st.integers(-3, VOCAB + 3), min_size=0, max_size=8)
small_tokens = st.one_of(st.integers(-3, 4), st.sampled_from([2**31, 10**30, -(10**30)]), st.floats(-2, 4))
content_parts = st.one_of(st.text(max_size=12), st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=6)}), max_size=2))


def bodies(either, small_tokens):
    """(generate bodies, chat bodies): `either` mixes junk into each field's plausible values."""
    sampling = st.fixed_dictionaries({}, optional={
        "max_new_tokens": either(small_tokens),
        "temperature": either((st.floats(-1, 3) | nonfinite) | st.sampled_from([0, 1e-9, 1e308, float("nan")])),
        "top_p": either(st.floats(-1, 2) | nonfinite),
        "top_k": either(st.integers(-3, VOCAB + 10) | st.just(2**62)),
        "sampling_seed": either(st.integers(-2**65, 2**65)),
        "stop": either(st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=3)),
        "stop_token_ids": either(st.lists(st.integers(-5, 2**40), max_size=3)),
        "ignore_eos": either(st.booleans()),
        "min_p": junk,  # keys the reference server does not read
    })
    generate_bodies = st.fixed_dictionaries({}, optional={
        "text": either(st.text(max_size=12) | st.lists(st.text(max_size=6), max_size=3)),
        "input_ids": either(token_ids | st.lists(token_ids, max_size=3)),
        "sampling_params": either(sampling),
        "rid": either(st.text(max_size=6) | st.lists(st.one_of(st.none(), st.text(max_size=4)), max_size=3)),
        "stream": either(st.booleans()),
        "return_hidden_states": either(st.just(False)),
    })
    message = st.fixed_dictionaries({}, optional={
        "role": either(st.sampled_from(["system", "user", "assistant", "tool", "developer"])),
        "content": either(content_parts),
        "reasoning_content": either(st.text(max_size=4)),
    })
    chat_bodies = st.fixed_dictionaries({}, optional={
        "model": junk,
        "messages": either(st.lists(either(message), max_size=3)),
        "max_tokens": either(small_tokens),
        "max_completion_tokens": either(small_tokens),
        "temperature": either(st.floats(-1, 3) | nonfinite),
        "top_p": either(st.floats(-1, 2) | nonfinite),
        "top_k": either(st.integers(-3, 300)),
        "seed": either(st.integers(-2**65, 2**65)),
        "n": either(st.integers(0, 3)),
        "stream": either(st.booleans()),
        "stop": either(st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=3)),
        "separate_reasoning": either(st.booleans()),
    })
    return generate_bodies, chat_bodies


generate_hostile, chat_hostile = bodies(either, small_tokens)
# Requests within the rules, so that the 200 path is fuzzed as well (the hostile ones are mostly 400s).
ascii_text = st.text(st.characters(min_codepoint=32, max_codepoint=126), min_size=1, max_size=10)
valid_sampling = st.fixed_dictionaries({"max_new_tokens": st.integers(0, 4)}, optional={
    "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1), "top_k": st.just(-1) | st.integers(1, 300),
    "sampling_seed": st.integers(0, 2**32), "stop": st.lists(ascii_text, max_size=2),
    "stop_token_ids": st.lists(st.integers(0, 300), max_size=2), "ignore_eos": st.booleans(),
})
valid_ids = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=8)
generate_plausible = st.one_of(
    st.fixed_dictionaries({"text": ascii_text | st.lists(ascii_text, min_size=1, max_size=2), "sampling_params": valid_sampling}),
    st.fixed_dictionaries({"input_ids": valid_ids | st.lists(valid_ids, min_size=1, max_size=2), "sampling_params": valid_sampling}),
)
chat_plausible = st.fixed_dictionaries(
    {"messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]), "content": content_parts}),
                          min_size=1, max_size=3),
     "max_tokens": st.integers(0, 4)},
    optional={"temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1), "seed": st.integers(0, 2**32), "n": st.just(1),
              "stream": st.just(False), "stop": ascii_text, "separate_reasoning": st.booleans()})
generate_bodies = st.one_of(generate_plausible, generate_hostile)
chat_bodies = st.one_of(chat_plausible, chat_hostile)


@pytest.fixture(scope="module")
def client():
    return micro_client()


def assert_4xx_with_message(r, openai: bool):
    assert 400 <= r.status_code < 500, (r.status_code, r.text)
    body = r.json()
    message = body["message"] if openai else body["error"]["message"]
    assert isinstance(message, str) and message and "Traceback" not in message


def assert_completion(out: dict, max_new):
    assert isinstance(out["text"], str)
    assert all(isinstance(t, int) and 0 <= t < VOCAB for t in out["output_ids"])
    meta = out["meta_info"]
    assert meta["finish_reason"]["type"] in ("length", "stop")
    assert meta["completion_tokens"] == len(out["output_ids"]) and 0 < meta["prompt_tokens"] < MICRO_CONTEXT
    if isinstance(max_new, int) and not isinstance(max_new, bool):
        assert len(out["output_ids"]) <= max_new


def requested_max_new(body: dict):
    sp = body.get("sampling_params")
    return sp.get("max_new_tokens") if isinstance(sp, dict) else None


@FUZZ
@given(body=st.one_of(generate_bodies, junk))
def test_generate_answers_200_or_a_4xx_with_a_message(client, body):
    r = post(client[0], "/generate", body)
    event(f"HTTP {r.status_code}")  # --hypothesis-show-statistics: how many were served
    if r.status_code != 200:
        return assert_4xx_with_message(r, openai=False)
    assert isinstance(body, dict)
    out = r.json()
    for o in out if isinstance(out, list) else [out]:
        assert_completion(o, requested_max_new(body))


@FUZZ
@given(body=st.one_of(chat_bodies, junk))
def test_chat_answers_200_or_a_4xx_with_a_message(client, body):
    r = post(client[0], "/v1/chat/completions", body)
    event(f"HTTP {r.status_code}")
    if r.status_code != 200:
        return assert_4xx_with_message(r, openai=True)
    assert isinstance(body, dict) and body.get("n") in (None, 1) and body.get("stream") in (None, False)
    out = r.json()
    choice, = out["choices"]
    assert choice["message"]["role"] == "assistant" and isinstance(choice["message"]["content"], str)
    assert choice["finish_reason"] in ("length", "stop")
    usage = out["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    limit = body.get("max_completion_tokens") if body.get("max_completion_tokens") is not None else body.get("max_tokens")
    if isinstance(limit, int):
        assert usage["completion_tokens"] <= limit


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.one_of(st.binary(max_size=24), st.text(max_size=24).map(str.encode),
                      junk.filter(lambda v: not isinstance(v, dict)).map(lambda v: json.dumps(v).encode())),
       path=st.sampled_from(["/generate", "/v1/chat/completions"]))
def test_a_body_that_is_not_a_json_object_is_a_4xx(client, data, path):
    try:
        parsed = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        parsed = None
    if isinstance(parsed, dict):
        return  # a JSON object is the other tests' business
    r = post(client[0], path, data)
    assert_4xx_with_message(r, openai=path.startswith("/v1/"))

