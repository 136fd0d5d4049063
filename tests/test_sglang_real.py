"""The parsers and checks against what a real SGLang 0.5.14 server wrote on an H200.

tests/fixtures/sglang/pipeline-run/ holds files the pipeline's own run on a GPU produced
(figures in reports/sglang-h200/): the EAGLE3 and baseline server logs of the bench stage, the
log of a server launched with topk=1, num_steps=1, num_draft_tokens=16, the log of the EAGLE-3
draft served with --speculative-algorithm EAGLE (2026-12-01), the log of a launch SGLang refused at start-up, six /generate meta_info answers, and one /generate answer with
return_hidden_states for a 12-token prompt of which SGLang's radix cache already held 3.
"""
import json
from pathlib import Path

import pytest
import torch

from draftlab.check.parity import prompt_rows
from draftlab.check.serving import _ALGORITHM_IN_LOG, check_algorithm
from draftlab.errors import UserError
from draftlab.sglang.launch import MAX_PORT, free_port, launch_argv, parse_decode_line, read_log
from draftlab.sglang.client import parse_meta, served_tau
from draftlab.sglang.flags import SpecFlags

H200 = Path(__file__).parent / "fixtures" / "sglang" / "pipeline-run"
ROOT = Path(__file__).resolve().parents[1]


def metas(mode):
    rows = [json.loads(x) for x in (H200 / "requests.jsonl").read_text().splitlines()]
    return [parse_meta(r["meta"]) for r in rows if r["mode"] == mode]


def test_every_decode_line_of_the_real_logs_parses():
    spec = read_log(H200 / "server-spec.log").decode
    assert len(spec) >= 10
    for d in spec:
        assert d.running_req == 1 and d.graph is True and d.queue_req == 0
        assert 1.0 <= d.accept_len <= 6.0 and 0.0 <= d.accept_rate <= 1.0 and d.gen_throughput > 0
    base = read_log(H200 / "server-baseline.log").decode
    assert base and all(d.accept_len is None and d.graph is True for d in base)
    lines = [x for x in (H200 / "server-spec.log").read_text().splitlines() if "Decode batch" in x]
    assert len(lines) == len(spec) and all(parse_decode_line(x) for x in lines)


def test_the_real_adjustment_line_names_its_rule_and_nothing_else_does():
    forced = read_log(H200 / "server-chain-forced.log")
    assert [a.rule for a in forced.adjustments] == ["chain_draft_tokens"]
    assert read_log(H200 / "server-spec.log").adjustments == []  # the project passed the effective flags


def test_real_meta_info_gives_sglang_tau_and_histogram():
    spec, base = metas("speculative"), metas("baseline")
    assert spec and all(m.speculative for m in spec) and not any(m.speculative for m in base)
    for m in spec:
        assert m.spec_accept_length == pytest.approx(m.completion_tokens / m.spec_verify_ct)
        hist = m.spec_correct_drafts_histogram
        assert sum(hist) == m.spec_verify_ct and len(hist) == 6  # 5-step chain: 0..5 drafts accepted
        assert sum(i * n for i, n in enumerate(hist)) == m.spec_num_correct_drafts
        assert m.spec_num_proposed_drafts == 5 * m.spec_verify_ct
    assert 1.0 < served_tau(spec) < 6.0


def test_the_real_server_args_line_names_the_algorithm_it_ran():
    log = (H200 / "server-spec.log").read_text()
    assert _ALGORITHM_IN_LOG.findall(log) == ["EAGLE3"]
    config = {"architectures": ["LlamaForCausalLMEagle3"]}
    assert check_algorithm(None, config, log) == []
    assert check_algorithm(None, config, log.replace("speculative_algorithm='EAGLE3'", "speculative_algorithm='EAGLE'"))


def test_the_real_eagle_launch_is_named_from_its_log_alone():
    """SGLang 0.5.14 served the EAGLE-3 draft as EAGLE without a warning (tau 1.6 instead of 3.3):
    its server_args line is the only trace, and it also filled in the chain's draft tokens."""
    log = (H200 / "server-eagle.log").read_text()
    assert _ALGORITHM_IN_LOG.findall(log) == ["EAGLE"]
    found = check_algorithm(None, {"architectures": ["LlamaForCausalLMEagle3"]}, log)
    assert [f.name for f in found] == ["eagle_instead_of_eagle3"] and found[0].evidence["server log"] == "speculative_algorithm=EAGLE"
    parsed = read_log(H200 / "server-eagle.log")
    assert [a.rule for a in parsed.adjustments] == ["chain_draft_tokens"]
    assert parsed.decode and max(d.accept_len for d in parsed.decode) < 2.5  # collapsed: EAGLE3 served 3.3


def test_hidden_states_rows_start_after_the_prefix_cache():
    """SGLang returns no rows for cached prompt tokens: aligned from cached_tokens, its rows are
    transformers' hidden_states[2], [4], [6] of the tiny target (ids [1, 3, 5]) to bf16 precision."""
    from transformers import AutoModelForCausalLM

    answer = json.loads((H200 / "hidden_states_response.json").read_text())
    ids, meta = answer["input_ids"], answer["response"]["meta_info"]
    rows, start = prompt_rows(meta, len(ids), 256)
    assert (start, tuple(rows.shape)) == (3, (9, 768)) and meta["prompt_tokens"] == 12
    model = AutoModelForCausalLM.from_pretrained(ROOT / "models" / "tiny-target", dtype=torch.float32)
    with torch.no_grad():
        hs = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
    ref = torch.cat([hs[i][0] for i in (2, 4, 6)], -1)

    def rel(a, b):
        return ((a - b).norm() / b.norm()).item()

    assert rel(rows, ref[3:]) < 0.02
    assert rel(rows, ref[:9]) > 0.5  # read from position 0, the same rows match nothing


def test_a_port_sglang_would_refuse_is_refused_before_launch(monkeypatch):
    """SGLang 0.5.14 refused --port 59419 at start-up (its gRPC port, port + 10000, > 65535)."""
    assert "SGLANG_GRPC_PORT (69419) must be between 1 and 65535" in (H200 / "server-grpc-port.log").read_text()
    monkeypatch.delenv("SGLANG_GRPC_PORT", raising=False)
    flags = SpecFlags("EAGLE3", 5, 1, 6)
    with pytest.raises(UserError, match=r"port \+ 10000.*<= 55535.*bench\.port"):
        launch_argv("m", 59419, draft_model="d", flags=flags)
    argv = launch_argv("m", MAX_PORT, draft_model="d", flags=flags)
    assert argv[argv.index("--port") + 1] == str(MAX_PORT)
    monkeypatch.setenv("SGLANG_GRPC_PORT", "40000")
    launch_argv("m", 59419, draft_model="d", flags=flags)  # the user moved the gRPC port: allowed
    assert all(20000 <= free_port() <= MAX_PORT for _ in range(20))
