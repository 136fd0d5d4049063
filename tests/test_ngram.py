"""The reference server's n-gram drafter (draftlab.engine.ngram): suffix matching over the request and
earlier requests, one cache per server, verified by the target like any draft; and the server's
NGRAM mode over HTTP (/server_info, /flush_cache)."""
import os
from pathlib import Path

import httpx
import pytest

from draftlab.engine import ngram
from draftlab.data import prompts
from draftlab.engine.runners import Engine, NgramEngine, SamplingParams
from draftlab.lifecycle import free_port, serve
from draftlab.params import TargetParams
from draftlab.engine.server import launch_command
from draftlab.target.load import load_target

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "models/tiny-target"
SERVER_ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


def cache_of(*seqs, max_match=18):
    c = ngram.NgramCache(max_match)
    for s in seqs:
        c.start(s)
    return c


def test_the_longest_suffix_seen_before_gives_its_continuations_most_recent_first():
    c = cache_of([1, 2, 3, 4, 5], [9, 2, 3, 7, 8], [6, 6])
    c.start([0, 2, 3])  # the running request ends in 2 3: seen twice, followed by 4 5 and (later) 7 8
    assert c.continuations(2) == [[7, 8], [4, 5]]
    c.extend([4])  # ... 2 3 4: the 3-token match beats the 1-token one (4 alone was followed by 5 only)
    assert c.continuations(3) == [[5]]


def test_no_continuation_crosses_from_one_request_into_the_next():
    c = cache_of([1, 2, 3], [4, 5])
    c.start([7, 3])
    assert c.continuations(4) == []  # 3 ended the first request: nothing followed it there
    c2 = cache_of([1, 2, 3, 3, 9])
    c2.start([3])
    assert c2.continuations(2) == [[9], [3, 9]]  # most recent occurrence first, cut at the request's end


def test_a_request_matches_its_own_earlier_tokens():
    c = ngram.NgramCache()
    c.start([5, 6, 7, 5, 6])
    assert c.continuations(3) == [[7, 5, 6]]


def test_the_tree_is_filled_breadth_first_within_the_breadth_and_padded_to_the_width():
    c = cache_of([1, 2, 10, 11], [1, 2, 20, 21], [1, 2, 30, 31])
    c.start([1, 2])
    tree = c.propose(2, 6, 2)  # root 2; at most 2 children per node; 5 nodes
    assert len(tree.tokens) == 6 and tree.tokens[0] == 2
    assert tree.tokens[1:3] == [30, 20] and tree.parents[1:3] == [0, 0]  # the two most recent continuations
    assert tree.tokens[3:5] == [31, 21] and tree.parents[3:5] == [1, 2]
    assert tree.tokens[5] == ngram.PAD and tree.parents[5] == 0  # nothing more to draft: SGLang's zero padding
    chain = c.propose(2, 4, 1)
    assert chain.tokens == [2, 30, 31, ngram.PAD] and chain.parents == [-1, 0, 1, 0]
    nothing = ngram.NgramCache()
    nothing.start([42])
    assert nothing.propose(42, 4, 1).tokens == [42, ngram.PAD, ngram.PAD, ngram.PAD]  # a verify of 4 tokens even so


def test_the_cache_keeps_at_most_its_capacity_and_never_the_running_requests_tokens():
    c = ngram.NgramCache(capacity_tokens=10)
    for i in range(5):
        c.start([100 + i] * 4)
    assert len(c) <= 10
    c.start(list(range(30)))  # longer than the capacity: the running request is kept whole
    assert c.continuations(1) == [] and len(c) >= 30


@pytest.fixture(scope="module")
def tiny():
    model, tok = load_target(TargetParams(str(TINY), None, "float32", "cpu"), "cpu")
    rows = prompts.builtin_prompts(40, 3).rows[:4]
    ids = [tok.apply_chat_template(r["messages"], add_generation_prompt=True, tokenize=True, return_dict=False) for r in rows]
    return model, tok, ids


def pass_over(engine, ids, n=40):
    outs = [engine.generate(p, SamplingParams(max_new_tokens=n, temperature=0.0)) for p in ids]
    return [c.output_ids for c in outs], [len(c.output_ids) / c.meta["spec_verify_ct"] for c in outs]


def test_greedy_output_is_the_targets_own_and_a_flushed_cache_remembers_nothing(tiny):
    """A second pass over the same prompts on one cache drafts the answers it gave the first time
    (SGLang measured tau 4.06 against 2.06 so); after flush() the pass is the first one again,
    request by request."""
    model, tok, ids = tiny
    plain = [Engine(model, tok, "cpu").generate(p, SamplingParams(max_new_tokens=40, temperature=0.0)).output_ids for p in ids]
    engine = NgramEngine(model, tok, "cpu", None, num_draft_tokens=6, max_breadth=2)
    first, taus = pass_over(engine, ids)
    assert first == plain  # the target decides every token
    again, remembered = pass_over(engine, ids)
    assert again == plain and sum(remembered) > 1.5 * sum(taus)  # its own earlier answers, drafted whole
    engine.flush()
    fresh, after = pass_over(engine, ids)
    assert fresh == plain and after == taus


def test_the_counters_mean_what_sglangs_mean(tiny):
    model, tok, ids = tiny
    engine = NgramEngine(model, tok, "cpu", None, num_draft_tokens=4, max_breadth=1)
    c = engine.generate(ids[0], SamplingParams(max_new_tokens=40, temperature=0.0))
    m = c.meta
    assert m["completion_tokens"] == len(c.output_ids) == 40
    assert sum(m["spec_correct_drafts_histogram"]) == m["spec_verify_ct"] and len(m["spec_correct_drafts_histogram"]) == 4
    assert m["spec_num_proposed_drafts"] == 3 * m["spec_verify_ct"]  # every slot of the 4-token block, as SGLang counts
    assert m["spec_accept_length"] == pytest.approx(40 / m["spec_verify_ct"])
    assert engine.info()["speculative_eagle_topk"] == 1 and engine.info()["speculative_num_steps"] == 4


def test_the_reference_server_serves_ngram_with_sglangs_flags_and_flushes_on_request(tmp_path):
    port = free_port()
    argv = launch_command(TINY, port, speculative_algorithm="NGRAM", speculative_num_draft_tokens=4,
                          speculative_ngram_max_bfs_breadth=1, log_level="warning")
    tok_ids = [1, 2, 3]
    with serve(argv, f"http://127.0.0.1:{port}", tmp_path / "server.log", startup_timeout_s=120, env=SERVER_ENV) as srv:
        info = httpx.get(srv.url + "/server_info").json()
        assert info["speculative_algorithm"] == "NGRAM" and info["speculative_num_draft_tokens"] == 4
        # SGLang's rewrites: topk := the maximum breadth, num_steps := draft tokens // topk, its defaults filled
        assert info["speculative_eagle_topk"] == 1 and info["speculative_num_steps"] == 4
        assert info["speculative_ngram_min_bfs_breadth"] == 1 and info["speculative_ngram_max_trie_depth"] == 18
        body = {"input_ids": tok_ids, "sampling_params": {"max_new_tokens": 16, "temperature": 0}}
        taus = [httpx.post(srv.url + "/generate", json=body, timeout=60).json()["meta_info"]["spec_accept_length"] for _ in range(2)]
        assert taus[1] > taus[0]  # the second answer was drafted from the first
        assert httpx.post(srv.url + "/flush_cache?timeout=5").status_code == 200
        assert httpx.post(srv.url + "/generate", json=body, timeout=60).json()["meta_info"]["spec_accept_length"] == taus[0]
    log = (tmp_path / "server.log").read_text()
    assert "Max running requests is reset to 48" in log and "mixed chunked prefill are disabled" in log
