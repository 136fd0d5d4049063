"""What SGLang really runs: one test per rule of DESIGN.md section 8, plus the project's own rules."""
import json
import os

import pytest

from draftlab.errors import UserError
from draftlab.params import load_params
from draftlab.sglang.flags import RULES, RuleOutcome, SpecFlags, default_spec_params, effective_flags, requested_from_params, resolve

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "sglang")
LLAMA, QWEN = "LlamaForCausalLM", "Qwen2ForCausalLM"


def flags(steps=5, topk=1, tokens=6, **kw):
    return SpecFlags("EAGLE3", steps, topk, tokens, **kw)


def rules_hit(res, kind=None):
    return [f.rule for f in res.findings if kind is None or f.kind == kind]


# --- topk == 1: num_draft_tokens := num_steps + 1 -------------------------------------------


def test_chain_draft_tokens_refused_with_rule_message_and_fix():
    with pytest.raises(UserError) as e:
        effective_flags(flags(1, 1, 16), LLAMA, "0.5.14", on_adjust="error")
    msg = str(e.value)
    assert "rule chain_draft_tokens: SGLang would run 2 draft tokens (speculative_num_draft_tokens is adjusted to " \
           "speculative_num_steps + 1 when speculative_eagle_topk == 1); set spec.num_draft_tokens: 2" in msg
    assert "spec.on_adjust: allow" in msg


def test_chain_draft_tokens_allowed_records_requested_and_effective():
    res = effective_flags(flags(1, 1, 16), LLAMA, "0.5.14", on_adjust="allow")
    assert res.requested.num_draft_tokens == 16 and res.effective.num_draft_tokens == 2
    assert res.changed()["num_draft_tokens"] == (16, 2)
    assert rules_hit(res, "adjusted") == ["chain_draft_tokens"]


def test_chain_draft_tokens_matches_the_real_server():
    seen = json.load(open(os.path.join(FIXTURES, "observed_0.5.14.json")))
    res = resolve(SpecFlags(**seen["launched"]), seen["target_architecture"], seen["sglang_version"])
    assert res.effective.num_draft_tokens == seen["ran"]["num_draft_tokens"]
    (hit,) = [f for f in res.findings if f.rule == "chain_draft_tokens"]
    assert hit.sglang_message == seen["logged"]


def test_chain_draft_tokens_unset_is_filled_not_refused():
    res = effective_flags(flags(3, 1, None), QWEN, "0.5.14", on_adjust="error")
    assert res.effective.num_draft_tokens == 4
    assert "chain_draft_tokens" in rules_hit(res, "default")


def test_consistent_chain_passes_untouched():
    res = effective_flags(flags(5, 1, 6, max_running_requests=8), QWEN, "0.5.14", on_adjust="error")
    assert res.findings == () and res.effective == res.requested


# --- num_steps unset: defaults from the TARGET architecture, by version ---------------------


@pytest.mark.parametrize(
    "arch,version,expected",
    [
        (LLAMA, "0.5.14", (5, 4, 8)),
        ("Grok1ForCausalLM", "0.5.14", (5, 4, 8)),
        (QWEN, "0.5.8", (3, 1, 4)),
        (QWEN, "0.5.7", (5, 4, 8)),
        (QWEN, "0.5.5", (5, 4, 8)),
        ("DeepseekV3ForCausalLM", "0.5.7", (3, 1, 4)),
        (LLAMA, "0.5.5", (5, 4, 8)),
    ],
)
def test_defaults_by_target_architecture_and_version(arch, version, expected):
    assert default_spec_params(arch, version) == expected
    res = effective_flags(flags(None, None, None), arch, version, on_adjust="error")
    assert (res.effective.num_steps, res.effective.topk, res.effective.num_draft_tokens) == expected
    assert "defaults_by_architecture" in rules_hit(res, "default")


@pytest.mark.parametrize("topk,tokens", [(4, None), (None, 8), (1, 2)])
def test_topk_or_draft_tokens_without_num_steps_is_an_error(topk, tokens):
    with pytest.raises(UserError, match=r"rule defaults_need_num_steps: .*AssertionError.*; set spec\.num_steps"):
        effective_flags(flags(None, topk, tokens), LLAMA, "0.5.14", on_adjust="allow")


# --- num_steps set, topk unset: TypeError -----------------------------------------------------


def test_num_steps_without_topk_is_an_error():
    with pytest.raises(UserError, match=r"rule topk_unset: .*TypeError.*; set spec\.topk"):
        effective_flags(flags(5, None, 6), LLAMA, "0.5.14", on_adjust="allow")


# --- max_running_requests unset: 48 ------------------------------------------------------------


def test_max_running_requests_defaults_to_48_without_refusing():
    res = effective_flags(flags(), QWEN, "0.5.14", on_adjust="error")
    assert res.requested.max_running_requests is None and res.effective.max_running_requests == 48
    (hit,) = [f for f in res.findings if f.rule == "max_running_requests_default"]
    assert hit.kind == "default" and hit.sglang_message == "Max running requests is reset to 48 for speculative decoding"


def test_max_running_requests_set_is_kept():
    assert resolve(flags(max_running_requests=8), QWEN, "0.5.14").effective.max_running_requests == 8


def test_concurrency_above_the_cap_is_refused_unless_allowed():
    with pytest.raises(UserError, match=r"rule concurrency_above_running: .*at most 48.*64 in flight.*bench\.max_running_requests: 64"):
        effective_flags(flags(), QWEN, "0.5.14", max_concurrency=64)
    assert effective_flags(flags(max_running_requests=64), QWEN, "0.5.14", max_concurrency=64)


# --- topk > 1, page_size > 1, backend not flashinfer/fa3/triton: ValueError ------------------


@pytest.mark.parametrize("backend", ["torch_native", "flashmla", "trtllm_mla"])
def test_tree_on_pages_with_other_backend_is_an_error(backend):
    with pytest.raises(UserError, match=rf"rule paged_tree_backend: .*backend {backend}.*bench\.page_size: 1"):
        effective_flags(flags(5, 4, 8, page_size=16, attention_backend=backend), LLAMA, "0.5.14")


@pytest.mark.parametrize("backend", ["flashinfer", "fa3", "triton"])
def test_tree_on_pages_with_supported_backend_runs(backend):
    res = effective_flags(flags(5, 4, 8, page_size=16, attention_backend=backend), LLAMA, "0.5.14")
    assert "paged_tree_backend" not in rules_hit(res)


def test_tree_on_pages_with_backend_left_to_sglang_is_recorded_not_refused():
    res = effective_flags(flags(5, 4, 8, page_size=16), LLAMA, "0.5.14")
    assert "paged_tree_backend" in rules_hit(res, "default")


def test_chain_on_pages_with_any_backend_runs():
    res = effective_flags(flags(5, 1, 6, page_size=16, attention_backend="torch_native"), LLAMA, "0.5.14")
    assert "paged_tree_backend" not in rules_hit(res)


def test_trtllm_mha_refuses_trees():
    with pytest.raises(UserError, match=r"rule trtllm_mha_topk: .*\(trtllm_mha backend only supports topk = 1"):
        effective_flags(flags(5, 4, 8, attention_backend="trtllm_mha"), LLAMA, "0.5.14")


# --- draft max_position_embeddings < target context: ValueError unless the env var ------------


def test_draft_context_shorter_than_target_is_an_error():
    with pytest.raises(UserError, match=r"rule draft_context_shorter: .*2048 < the target's 8192.*max_position_embeddings >= 8192"):
        effective_flags(flags(), LLAMA, "0.5.14", draft_context_length=2048, target_context_length=8192, allow_longer_context=False)


def test_draft_context_override_by_env_is_an_adjustment(monkeypatch):
    monkeypatch.setenv("SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN", "1")
    kw = dict(draft_context_length=2048, target_context_length=8192)
    with pytest.raises(UserError, match="rule draft_context_shorter: SGLang overrides"):
        effective_flags(flags(), LLAMA, "0.5.14", on_adjust="error", **kw)
    assert "draft_context_shorter" in rules_hit(effective_flags(flags(), LLAMA, "0.5.14", on_adjust="allow", **kw), "adjusted")


def test_draft_context_long_enough_passes():
    res = resolve(flags(), LLAMA, "0.5.14", draft_context_length=8192, target_context_length=8192)
    assert "draft_context_shorter" not in rules_hit(res)


# --- topk > 1: SGLang does not check num_draft_tokens against the tree ------------------------


def test_tree_draft_tokens_beyond_the_candidates_are_an_error():
    # 2 steps, topk 2: 2 + 1*4 = 6 scored candidates -> at most 7 verified tokens
    assert effective_flags(flags(2, 2, 7), LLAMA, "0.5.14")
    with pytest.raises(UserError, match=r"rule tree_draft_tokens_exceed: .*only 6 candidate.*spec\.num_draft_tokens: 7 or less"):
        effective_flags(flags(2, 2, 8), LLAMA, "0.5.14", on_adjust="allow")


def test_tree_without_draft_tokens_is_an_error():
    with pytest.raises(UserError, match=r"rule tree_draft_tokens_unset: .*set spec\.num_draft_tokens"):
        effective_flags(flags(5, 4, None), LLAMA, "0.5.14", on_adjust="allow")


# --- EAGLE with an EAGLE-3 draft: runs, skips fc, acceptance collapses ------------------------


def test_eagle_with_eagle3_draft_is_an_error_even_when_adjustments_are_allowed():
    req = SpecFlags("EAGLE", 5, 1, 6)
    with pytest.raises(UserError, match=r"rule eagle_with_eagle3_draft: .*skipped.*set spec\.algorithm: EAGLE3"):
        effective_flags(req, LLAMA, "0.5.14", on_adjust="allow", draft_architecture="LlamaForCausalLMEagle3")


def test_eagle3_with_eagle3_draft_and_eagle_with_eagle_draft_run():
    assert effective_flags(SpecFlags("EAGLE3", 5, 1, 6), LLAMA, "0.5.14", draft_architecture="LlamaForCausalLMEagle3")
    assert effective_flags(SpecFlags("EAGLE", 5, 1, 6), LLAMA, "0.5.14", draft_architecture="LlamaForCausalLMEagle")


# --- the whole table --------------------------------------------------------------------------


def test_every_error_is_listed_at_once():
    req = SpecFlags("EAGLE", 5, 4, None, page_size=16, attention_backend="torch_native")
    res = resolve(req, LLAMA, "0.5.14", draft_architecture="LlamaForCausalLMEagle3")
    assert {"eagle_with_eagle3_draft", "paged_tree_backend", "tree_draft_tokens_unset"} <= set(rules_hit(res, "error"))
    with pytest.raises(UserError) as e:
        res.enforce("allow")
    assert str(e.value).count("\n  rule ") == len(res.errors)


def test_rules_are_named_documented_and_sourced():
    names = [r.name for r in RULES]
    assert len(names) == len(set(names))
    for r in RULES:
        assert r.condition and r.effect and r.fix and r.source, r.name


def test_bad_version_or_algorithm_names_the_key():
    with pytest.raises(UserError, match="sglang_version"):
        resolve(flags(), LLAMA, "latest")
    with pytest.raises(UserError, match="spec.algorithm"):
        resolve(SpecFlags("MEDUSA", 5, 1, 6), LLAMA, "0.5.14")


def test_shipped_params_run_as_requested():
    p = load_params(["spec", "bench", "export"], "params.yaml")
    res = effective_flags(requested_from_params(p.spec, p.bench), LLAMA, p.export.sglang_version,
                          on_adjust=p.spec.on_adjust, max_concurrency=max(p.bench.concurrency))
    assert not res.adjustments and not res.errors
    eff = res.as_dict()["effective"]
    assert eff["num_steps"] == p.spec.num_steps and eff["topk"] == p.spec.topk
    # null draft tokens: SGLang fills in num_steps + 1 for a chain, which is not an adjustment
    assert eff["num_draft_tokens"] == (p.spec.num_draft_tokens or p.spec.num_steps + 1)


def test_each_rule_that_fires_is_a_rule_outcome_recorded_with_the_same_fields():
    res = resolve(flags(1, 1, 16), LLAMA, "0.5.14")
    assert res.findings and all(isinstance(f, RuleOutcome) for f in res.findings)
    recorded = res.as_dict()["findings"]  # what bench.json keeps and the wiring check reads (check.serving.check_flags)
    assert {"rule", "kind", "what", "sglang_message", "fix"} == set(recorded[0])


# --- releases 0.5.18..0.5.23: rules on flags passed in bench.extra_server_args ------------------------

MIXED = ["--enable-mixed-chunk"]
BLOCK = ["--speculative-use-block-verification"]
DETERMINISTIC = ["--enable-deterministic-inference"]


@pytest.mark.parametrize("version, kind", [("0.5.5", "adjusted"), ("0.5.14", "error"), ("0.5.17", "adjusted"),
                                           ("0.5.18", "adjusted"), ("0.5.19", None), ("0.5.23", None)])
def test_mixed_chunk_with_speculation_by_release(version, kind):
    # 0.5.18 -> 0.5.19: _handle_eagle_family keeps it when SpeculativeAlgorithm.supports_mixed_chunk() (EAGLE, EAGLE3)
    res = resolve(flags(), LLAMA, version, extra_server_args=MIXED)
    hit = [f for f in res.findings if f.rule == "mixed_chunk"]
    assert [f.kind for f in hit] == ([kind] if kind else [])
    assert resolve(flags(), LLAMA, version).findings == resolve(flags(), LLAMA, version, extra_server_args=["--foo"]).findings


def test_block_verification_is_unknown_before_0_5_22_and_turns_rejection_sampling_on_after():
    # 0.5.21 -> 0.5.22: --speculative-use-block-verification added (handle_speculative_decoding)
    with pytest.raises(UserError, match="rule block_verification: SGLang 0.5.21 has no --speculative-use-block-verification"):
        effective_flags(flags(5, 1, 6), LLAMA, "0.5.21", extra_server_args=BLOCK)
    res = effective_flags(flags(5, 1, 6), LLAMA, "0.5.22", extra_server_args=BLOCK)
    assert rules_hit(res, "default") == ["block_verification", "max_running_requests_default"]
    assert rules_hit(resolve(flags(5, 1, 6), LLAMA, "0.5.22", extra_server_args=BLOCK + ["--speculative-use-rejection-sampling"])) \
        == ["max_running_requests_default"]


def test_rejection_sampling_needs_a_chain():
    res = resolve(flags(5, 4, 8), LLAMA, "0.5.22", extra_server_args=BLOCK)
    assert "rejection_sampling_topk" in rules_hit(res, "error")
    # SGLang's defaults for a Llama target are a tree (5, 4, 8): refused too
    assert "rejection_sampling_topk" in rules_hit(resolve(SpecFlags("EAGLE3"), LLAMA, "0.5.23",
                                                          extra_server_args=["--speculative-use-rejection-sampling"]), "error")
    assert "rejection_sampling_topk" not in rules_hit(resolve(flags(5, 4, 8), LLAMA, "0.5.23"))


@pytest.mark.parametrize("version, refused", [("0.5.17", True), ("0.5.22", True), ("0.5.23", False)])
def test_rejection_sampling_with_deterministic_inference_is_allowed_from_0_5_23(version, refused):
    # 0.5.22 -> 0.5.23: the ValueError became a CUDA-only check (deterministic rejection sampling)
    res = resolve(flags(5, 1, 6), LLAMA, version, extra_server_args=["--speculative-use-rejection-sampling"] + DETERMINISTIC)
    assert ("rejection_sampling_deterministic" in rules_hit(res, "error")) == refused
