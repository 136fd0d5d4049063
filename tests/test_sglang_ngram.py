"""SGLang 0.5.14's NGRAM as the flags resolver replays it (read from the sglang 0.5.14 wheel,
python/sglang/srt/arg_groups/speculative_hook.py _handle_ngram), its launch argv, and the words
bench.sweep takes for it."""
import dataclasses

import pytest

from draftlab.errors import UserError
from draftlab.params import ParamsError, check_sweep, load_params, parse_ngram
from draftlab.sglang.client import flags_from_server_info
from draftlab.sglang.flags import SpecFlags, resolve
from draftlab.sglang.launch import launch_argv, read_log
from tests.test_bench_prompts import params_with

LLAMA = "LlamaForCausalLM"


def rules(res):
    return {f.rule: f.kind for f in res.findings}


def test_sglangs_defaults_are_filled_and_reported_like_eagle3s():
    res = resolve(SpecFlags("NGRAM"), LLAMA, "0.5.14")
    eff = res.effective
    assert (eff.num_draft_tokens, eff.topk, eff.num_steps, eff.max_running_requests) == (12, 10, 1, 48)
    assert (eff.ngram_min_bfs_breadth, eff.ngram_max_bfs_breadth, eff.ngram_max_trie_depth) == (1, 10, 18)
    assert rules(res) == {"max_running_requests_default": "default", "ngram_mixed_chunk": "default", "ngram_defaults": "default",
                          "ngram_topk": "default", "ngram_draft_tokens": "default", "ngram_num_steps": "default"}
    assert not res.errors and not res.adjustments
    messages = {f.sglang_message for f in res.findings if f.sglang_message}
    assert "speculative_num_draft_tokens is set to 12 by default for ngram speculative decoding." in messages


def test_a_chain_of_three_is_four_tokens_at_breadth_one():
    eff = resolve(SpecFlags("NGRAM", num_draft_tokens=4, ngram_max_bfs_breadth=1), LLAMA, "0.5.14").effective
    assert (eff.num_draft_tokens, eff.topk, eff.num_steps) == (4, 1, 4)  # steps := draft tokens // topk


def test_the_eagle_rules_never_fire_for_ngram_and_its_own_do():
    res = resolve(SpecFlags("NGRAM", num_steps=None, topk=3, num_draft_tokens=8, ngram_max_bfs_breadth=4),
                  LLAMA, "0.5.14", draft_context_length=16, target_context_length=8192, extra_server_args=["--enable-mixed-chunk"])
    hit = rules(res)
    assert not {"chain_draft_tokens", "defaults_by_architecture", "draft_context_shorter", "mixed_chunk", "topk_unset"} & set(hit)
    assert hit["ngram_topk"] == "adjusted" and res.effective.topk == 4  # any topk given is overwritten by the breadth
    assert hit["ngram_mixed_chunk"] == "adjusted"  # turned off with a WARNING (EAGLE on 0.5.14: an AssertionError)
    with pytest.raises(UserError, match=r"rule ngram_topk: SGLang would run topk 4 \(the maximum BFS breadth\), not 3"):
        res.enforce("error")


@pytest.mark.parametrize("flags,setup,rule", [
    (SpecFlags("NGRAM", page_size=16, attention_backend="triton"), {}, "ngram_paged_tree"),
    (SpecFlags("NGRAM", ngram_min_bfs_breadth=4, ngram_max_bfs_breadth=2), {}, "ngram_breadth_range"),
])
def test_what_sglang_refuses_at_start_up_is_an_error_before_launch(flags, setup, rule):
    res = resolve(flags, LLAMA, "0.5.14", **setup)
    assert rule in {f.rule for f in res.errors}
    ok = dataclasses.replace(flags, attention_backend="flashinfer") if rule == "ngram_paged_tree" else None
    if ok:
        assert not resolve(ok, LLAMA, "0.5.14").errors  # a tree on pages: flashinfer only
        assert not resolve(dataclasses.replace(flags, ngram_max_bfs_breadth=1), LLAMA, "0.5.14").errors  # or a chain


def test_the_launch_names_no_draft_and_the_ngram_settings_and_extra_args_cannot_override_them():
    eff = resolve(SpecFlags("NGRAM", num_draft_tokens=4, ngram_max_bfs_breadth=1, max_running_requests=16), LLAMA, "0.5.14").effective
    argv = launch_argv("models/t", 30000, flags=eff)
    assert "--speculative-draft-model-path" not in argv and "--speculative-eagle-topk" not in argv
    at = {argv[i]: argv[i + 1] for i in range(len(argv) - 1) if argv[i].startswith("--speculative")}
    assert at == {"--speculative-algorithm": "NGRAM", "--speculative-num-draft-tokens": "4", "--speculative-ngram-min-bfs-breadth": "1",
                  "--speculative-ngram-max-bfs-breadth": "1", "--speculative-ngram-max-trie-depth": "18"}
    assert argv[argv.index("--max-running-requests") + 1] == "16"
    assert "--speculative-algorithm" not in launch_argv("models/t", 30000, flags=eff, baseline=True)
    with pytest.raises(UserError, match=r"--speculative-ngram-max-bfs-breadth is set from the ngram configuration of bench\.sweep"):
        launch_argv("models/t", 30000, flags=eff, extra_args=["--speculative-ngram-max-bfs-breadth", "3"])


def test_a_servers_info_gives_the_ngram_settings_only_for_an_ngram_server():
    info = {"speculative_algorithm": "EAGLE3", "speculative_num_steps": 3, "speculative_eagle_topk": 1, "speculative_num_draft_tokens": 4,
            "speculative_ngram_max_bfs_breadth": 10, "speculative_ngram_min_bfs_breadth": 1, "speculative_ngram_max_trie_depth": 18}
    assert flags_from_server_info(info).ngram_max_bfs_breadth is None  # SGLang reports the defaults whatever runs
    got = flags_from_server_info({**info, "speculative_algorithm": "NGRAM", "speculative_num_steps": 1, "speculative_eagle_topk": 10,
                                  "speculative_num_draft_tokens": 12})
    assert (got.ngram_max_bfs_breadth, got.ngram_min_bfs_breadth, got.ngram_max_trie_depth, got.topk) == (10, 1, 18, 10)


def test_the_ngram_warnings_are_read_from_a_server_log(tmp_path):
    log = tmp_path / "server.log"
    log.write_text("WARNING speculative_num_draft_tokens is set to 12 by default for ngram speculative decoding. You can override ...\n"
                   "WARNING The mixed chunked prefill are disabled because of using ngram speculative decoding.\n")
    assert [a.rule for a in read_log(log).adjustments] == ["ngram_draft_tokens", "ngram_mixed_chunk"]  # in the order logged


@pytest.mark.parametrize("item,want", [("ngram", (12, 10)), ("ngram-4-1", (4, 1)), ("ngram-12-10", (12, 10)), ("ngram-2-1", (2, 1))])
def test_ngram_words_parse(item, want):
    assert parse_ngram(item) == want
    check_sweep(["3-1-4", item])


@pytest.mark.parametrize("sweep,message", [
    (["ngram-4"], r"'ngram-4' is not an n-gram configuration: write ngram \(SGLang's defaults: 12 draft tokens, breadth up to 10\) "
                  r"or ngram-DRAFT_TOKENS-BREADTH"),
    (["ngram-4-4"], r"the breadth in 1\.\.draft tokens - 1"),
    (["ngram-1-1"], r"draft tokens \(root included\) must be >= 2"),
    (["ngram", "ngram-12-10"], r"lists 'ngram' and 'ngram-12-10': the same configuration twice"),
    (["ngramx"], r"'ngramx' is not a configuration: .*or ngram / ngram-N-B"),
])
def test_an_ngram_configuration_that_cannot_be_served_names_the_key(tmp_path, sweep, message):
    with pytest.raises(ParamsError, match=r"key bench\.sweep.*" + message):
        load_params(["bench"], params_with(tmp_path, sweep=sweep))
