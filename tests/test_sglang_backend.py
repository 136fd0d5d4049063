"""SGLang launch argv, log and meta_info parsing, and the client over real HTTP on 127.0.0.1."""
import json
import math
import os
import sys
import threading
import time

import pytest

from draftlab.errors import UserError
from draftlab.lifecycle import free_port
from draftlab.sglang.launch import free_port as sglang_free_port
from draftlab.sglang.launch import check_extra_args, launch_argv, parse_adjustment_line, parse_decode_line, read_log, serve
from draftlab.sglang.client import Client, flags_from_server_info, parse_meta, pooled_accept_rate, server_accept_length, served_tau
from draftlab.sglang.flags import RULES, SpecFlags, resolve

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "sglang")


def fixture_lines(name):
    return [l.rstrip("\n") for l in open(os.path.join(FIXTURES, name)) if not l.startswith("#")]


def value_after(argv, flag):
    return argv[argv.index(flag) + 1]


# --- (a) launch argv --------------------------------------------------------------------------

EFFECTIVE = resolve(SpecFlags("EAGLE3", 1, 1, 16, attention_backend="triton"), "LlamaForCausalLM", "0.5.14").effective


def test_speculative_argv_carries_the_effective_flags():
    argv = launch_argv("models/t", 30001, draft_model="models/d", flags=EFFECTIVE, python="python3")
    assert argv[:3] == ["python3", "-m", "sglang.launch_server"]
    assert all(isinstance(a, str) for a in argv)
    assert value_after(argv, "--model-path") == "models/t" and value_after(argv, "--host") == "127.0.0.1"
    assert value_after(argv, "--port") == "30001"
    assert value_after(argv, "--speculative-algorithm") == "EAGLE3"
    assert value_after(argv, "--speculative-draft-model-path") == "models/d"
    assert value_after(argv, "--speculative-num-steps") == "1" and value_after(argv, "--speculative-eagle-topk") == "1"
    assert value_after(argv, "--speculative-num-draft-tokens") == "2"  # effective, so SGLang has nothing to adjust
    assert value_after(argv, "--max-running-requests") == "48" and value_after(argv, "--attention-backend") == "triton"
    assert "--enable-return-hidden-states" not in argv


def test_baseline_argv_has_no_speculative_flag_but_the_same_server_flags():
    spec = launch_argv("models/t", 30001, draft_model="models/d", flags=EFFECTIVE)
    base = launch_argv("models/t", 30001, flags=EFFECTIVE, baseline=True)
    assert not any(a.startswith("--speculative") or a == "models/d" for a in base)
    spec_pairs = [i for i, a in enumerate(spec) if a.startswith("--speculative")]
    assert len(spec_pairs) == 5
    dropped = set(spec_pairs) | {i + 1 for i in spec_pairs}
    assert base == [a for i, a in enumerate(spec) if i not in dropped]  # otherwise identical
    assert value_after(base, "--max-running-requests") == "48"


def test_tp_dtype_hidden_states_and_extra_args():
    argv = launch_argv("t", 1, draft_model="d", flags=EFFECTIVE, tp_size=2, dtype="bfloat16", return_hidden_states=True,
                       extra_args=["--mem-fraction-static", "0.8", "--grammar-backend=none"])
    assert value_after(argv, "--tp-size") == "2" and value_after(argv, "--dtype") == "bfloat16"
    assert "--enable-return-hidden-states" in argv
    assert argv[-3:] == ["--mem-fraction-static", "0.8", "--grammar-backend=none"]  # one item per argument, kept as given


def test_other_speculative_server_flags_pass_through():
    check_extra_args(["--speculative-draft-attention-backend", "fa3", "--cuda-graph-max-bs", "8"])


def test_speculative_argv_needs_draft_and_flags():
    with pytest.raises(ValueError):
        launch_argv("t", 1, flags=EFFECTIVE)


@pytest.mark.parametrize(
    "extra,match",
    [
        ("--mem-fraction-static 0.8", "must be a list"),
        (["--mem-fraction-static 0.8"], r"own item: \['--mem-fraction-static', '0.8'\]"),
        (["--speculative-num-steps", "3"], r"spec\.num_steps"),
        (["--speculative-eagle-topk=4"], r"spec\.topk"),
        (["--attention-backend=fa3"], r"bench\.attention_backend"),
        (["--tp", "2"], r"bench\.tp_size"),
    ],
)
def test_extra_args_that_would_override_params_are_refused(extra, match):
    with pytest.raises(UserError, match=match):
        check_extra_args(extra)


FAKE_SGLANG = """\
import http.server, sys
args = sys.argv[1:]
print("argv", args, flush=True)
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
    def log_message(self, *a):
        pass
http.server.HTTPServer((args[args.index("--host") + 1], int(args[args.index("--port") + 1])), Health).serve_forever()
"""


def test_serve_runs_the_argv_through_lifecycle_and_stops_it(tmp_path):
    # A stand-in for `python -m sglang.launch_server`: it answers /health on the argv's host:port.
    python = tmp_path / "python"
    python.write_text(f"#!{sys.executable}\n" + FAKE_SGLANG)
    python.chmod(0o755)
    argv = launch_argv("models/t", sglang_free_port(), draft_model="models/d", flags=EFFECTIVE, python=str(python))
    with serve(argv, tmp_path / "logs" / "sglang.log", startup_timeout_s=20) as srv:
        assert srv.url == f"http://127.0.0.1:{value_after(argv, '--port')}"
        with Client(srv.url, timeout_s=5) as c:
            assert c.health()
    assert srv.process.poll() is not None  # stopped on exit
    assert "'--speculative-num-draft-tokens', '2'" in (tmp_path / "logs" / "sglang.log").read_text()  # log kept


# --- (b) the server log -----------------------------------------------------------------------


def test_decode_line_from_a_real_0_5_14_server():
    (line,) = fixture_lines("decode_0.5.14.log")
    s = parse_decode_line(line)
    assert (s.running_req, s.tokens, s.token_usage, s.queue_req) == (1, 46, 0.0, 0)
    assert (s.accept_len, s.accept_rate, s.graph, s.gen_throughput) == (1.0, 0.0, True, 52.34)


def test_decode_line_tolerates_older_format_prefix_and_changed_fields():
    # Formats printed by SGLang's scheduler (log_decode_stats) in other releases and modes:
    # "Decode batch." with a period, a log prefix, no accept rate, PD-disaggregation fields,
    # "cpu graph", an iteration tag, a trailing ", ".
    old = "[2025-11-02 10:00:01 TP0] Decode batch. #running-req: 4, #token: 900, token usage: 0.01, accept len: 3.21, " \
          "pre-allocated usage: 0.10, #retracted-req: 0, cpu graph: False, gen throughput (token/s): 812.50, #queue-req: 2, "
    s = parse_decode_line(old)
    assert s.prefix == "[2025-11-02 10:00:01 TP0]"
    assert (s.running_req, s.accept_len, s.accept_rate, s.graph, s.queue_req) == (4, 3.21, None, False, 2)
    assert s.fields["pre-allocated usage"] == "0.10"
    tagged = parse_decode_line("Decode batch [1200], #running-req: 2, #token: 10, cuda graph: True, gen throughput (token/s): 9.00, #queue-req: 0")
    assert (tagged.running_req, tagged.gen_throughput, tagged.tokens) == (2, 9.0, 10)


def test_baseline_decode_line_has_no_acceptance():
    s = parse_decode_line("Decode batch, #running-req: 1, #token: 46, token usage: 0.00, cuda graph: True, gen throughput (token/s): 90.10, #queue-req: 0")
    assert s.accept_len is None and s.accept_rate is None and s.gen_throughput == 90.1


@pytest.mark.parametrize("line", ["Prefill batch, #new-seq: 1, #new-token: 20", "", "INFO: 127.0.0.1 - POST /generate 200"])
def test_other_lines_are_not_decode_stats(line):
    assert parse_decode_line(line) is None


def test_adjustment_lines_from_real_logs_name_their_rule():
    got = [parse_adjustment_line(l).rule for l in fixture_lines("adjustments.log")]
    assert got == ["chain_draft_tokens", "max_running_requests_default"]
    stamped = parse_adjustment_line("[2026-01-05 09:00:00] WARNING server_args.py:2301: Max running requests is reset to 48 "
                                    "for speculative decoding. You can override this by explicitly setting --max-running-requests.")
    assert stamped.rule == "max_running_requests_default"


def test_every_rule_message_is_found_in_a_log_line():
    for rule in RULES:
        if rule.log_pattern:
            text = rule.sglang_message.replace("(T)", "(8192)").replace("(D)", "(2048)")
            assert parse_adjustment_line(f"[ts] WARNING {text} ...").rule == rule.name


def test_read_log_splits_decode_stats_and_adjustments(tmp_path):
    log = tmp_path / "server.log"
    log.write_text(open(os.path.join(FIXTURES, "adjustments.log")).read() + open(os.path.join(FIXTURES, "decode_0.5.14.log")).read() * 3)
    parsed = read_log(log)
    assert [s.accept_len for s in parsed.decode] == [1.0, 1.0, 1.0]
    assert [a.rule for a in parsed.adjustments] == ["chain_draft_tokens", "max_running_requests_default"]


# --- (c) meta_info ----------------------------------------------------------------------------

# Values built with SGLang's formulas for a 6-token chain (5 drafts per verify): 10 verify steps,
# 15 drafts accepted, 25 tokens; histogram [i] = steps that accepted i drafts.
SPEC_META = {
    "id": "r1", "prompt_tokens": 12, "completion_tokens": 25, "e2e_latency": 0.42, "cached_tokens": 0,
    "finish_reason": {"type": "length", "length": 25},
    "spec_verify_ct": 10, "spec_accept_length": 2.5, "spec_accept_rate": 0.3,
    "spec_num_correct_drafts": 15, "spec_num_proposed_drafts": 50, "spec_correct_drafts_histogram": [3, 3, 1, 2, 1, 0],
}


def test_every_field_a_real_server_returned_is_parsed():
    fields = json.load(open(os.path.join(FIXTURES, "meta_info_fields_0.5.14.json")))["fields"]
    m = parse_meta(SPEC_META)
    for name in fields:
        assert getattr(m, name) == SPEC_META[name], name
    assert m.speculative and m.prompt_tokens == 12 and m.finish_reason["type"] == "length"
    assert sum(m.spec_correct_drafts_histogram) == m.spec_verify_ct


def test_baseline_meta_has_no_spec_fields():
    m = parse_meta({"prompt_tokens": 12, "completion_tokens": 25, "e2e_latency": 0.3})
    assert not m.speculative
    assert m.spec_verify_ct is None and m.spec_accept_length is None and m.spec_correct_drafts_histogram is None
    assert m.completion_tokens == 25


def test_older_field_names_are_read():
    m = parse_meta({"completion_tokens": 25, "spec_verify_ct": 10, "spec_accepted_drafts": 15,
                    "spec_proposed_drafts": 50, "spec_accept_histogram": [3, 3, 1, 2, 1, 0]})
    assert (m.spec_num_correct_drafts, m.spec_num_proposed_drafts) == (15, 50)
    assert m.spec_correct_drafts_histogram == [3, 3, 1, 2, 1, 0]
    assert parse_meta({"spec_accept_token_num": 7, "spec_draft_token_num": 20}).spec_num_correct_drafts == 7


@pytest.mark.parametrize("meta", [None, [], {"completion_tokens": "25", "spec_verify_ct": 2.5, "e2e_latency": True,
                                             "spec_correct_drafts_histogram": "3,3"}])
def test_malformed_meta_gives_none_not_an_error(meta):
    m = parse_meta(meta)
    assert m.completion_tokens is None and m.spec_verify_ct is None and m.e2e_latency is None
    assert m.spec_correct_drafts_histogram is None


def test_served_tau_is_pooled_over_requests_not_averaged():
    metas = [parse_meta(SPEC_META), parse_meta({"completion_tokens": 12, "spec_verify_ct": 8}),
             parse_meta({"completion_tokens": 40})]  # a request without speculation is left out
    assert served_tau(metas) == pytest.approx(37 / 18)  # mean of 2.5 and 1.5 would be 2.0
    assert math.isnan(served_tau([parse_meta({"completion_tokens": 40})]))


def test_pooled_accept_rate_uses_sglang_counts():
    metas = [parse_meta(SPEC_META), parse_meta({"spec_num_correct_drafts": 1, "spec_num_proposed_drafts": 10})]
    assert pooled_accept_rate(metas) == pytest.approx(16 / 60)


def test_server_info_helpers():
    info = {"speculative_algorithm": "EAGLE3", "speculative_num_steps": 1, "speculative_eagle_topk": 1,
            "speculative_num_draft_tokens": 2, "max_running_requests": 48, "page_size": 1, "attention_backend": "triton",
            "internal_states": [{"avg_spec_accept_length": 1.75}]}
    assert flags_from_server_info(info) == SpecFlags("EAGLE3", 1, 1, 2, 48, 1, "triton")
    assert server_accept_length(info) == 1.75
    assert server_accept_length({"internal_states": [{}]}) is None
    assert flags_from_server_info({}).algorithm is None


# --- (d) the client, over real HTTP -----------------------------------------------------------


def make_app(with_server_info: bool):
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, Response

    app = FastAPI()

    @app.get("/health")
    def health():
        return Response(status_code=200)

    @app.post("/generate")
    def generate(body: dict):
        sampling = body.get("sampling_params") or {}
        if sampling.get("sleep_s"):
            time.sleep(sampling["sleep_s"])
        if sampling.get("max_new_tokens", 1) < 1:
            return JSONResponse({"object": "error", "message": "max_new_tokens must be positive", "code": 400}, status_code=400)
        # echo what arrived, so the test sees the request the client built
        return {"text": json.dumps({k: body.get(k) for k in ("text", "input_ids", "return_hidden_states")}),
                "output_ids": [1, 2], "meta_info": SPEC_META}

    info = {"speculative_algorithm": "EAGLE3", "speculative_num_draft_tokens": 2, "internal_states": [{"avg_spec_accept_length": 2.5}]}
    app.get("/server_info" if with_server_info else "/get_server_info")(lambda: info)
    return app


@pytest.fixture(scope="module", params=[True, False], ids=["server_info", "get_server_info"])
def server_url(request):
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(make_app(request.param), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline, "test server did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(10)


def test_generate_text_and_token_ids(server_url):
    with Client(server_url, timeout_s=10) as c:
        text, meta = c.generate("Hello", {"max_new_tokens": 4, "temperature": 0})
        assert json.loads(text) == {"text": "Hello", "input_ids": None, "return_hidden_states": None}
        assert meta.spec_verify_ct == 10 and meta.spec_accept_length == 2.5
        text, _ = c.generate([5, 6, 7], {"max_new_tokens": 4}, return_hidden_states=True)
        assert json.loads(text) == {"text": None, "input_ids": [5, 6, 7], "return_hidden_states": True}


def test_health_and_server_info(server_url):
    with Client(server_url, timeout_s=10) as c:
        assert c.health()
        info = c.server_info()  # /server_info, or /get_server_info on servers that only have that
        assert info["speculative_num_draft_tokens"] == 2 and server_accept_length(info) == 2.5


def test_server_error_message_reaches_the_user(server_url):
    with Client(server_url, timeout_s=10) as c, pytest.raises(UserError, match="HTTP 400: max_new_tokens must be positive"):
        c.generate("Hello", {"max_new_tokens": 0})


def test_slow_request_times_out_with_the_key_to_raise(server_url):
    with Client(server_url, timeout_s=0.2) as c, pytest.raises(UserError, match=r"no answer within 0\.2 s \(bench\.request_timeout_s\)"):
        c.generate("Hello", {"sleep_s": 1.0})


def test_nothing_listening():
    url = f"http://127.0.0.1:{free_port()}"
    with Client(url, timeout_s=2) as c:
        assert c.health() is False
        with pytest.raises(UserError, match="/generate: ConnectError"):
            c.generate("Hello")
