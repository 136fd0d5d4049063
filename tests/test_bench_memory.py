"""How the bench's SGLang servers share one GPU (draftlab.bench.memory): each one's explicit KV pool,
the waves they start in, and the memory flags every server gets."""
import pytest

from draftlab.bench import memory
from draftlab.bench import servers as bench
from draftlab.bench.prompts import BenchSet, Conversation
from draftlab.errors import UserError
from draftlab.sglang import fleet
from tests.test_bench_sweep import make_project, prepare

GIB = memory.GIB
SWEEP = ["1-1-2", "2-2-4"]


def test_a_pool_holds_the_longest_requests_in_flight_or_every_request_whichever_is_more():
    # in flight: 8 x (300 + 256 + 8 + 1) = 4520 > the three together (1395); 25% more
    assert memory.pool_tokens([100, 300, 200], in_flight=8, max_new_tokens=256, reserved=8) == 5650
    # forty requests one at a time: 40 x (100 + 100 + 1) = 8040 > 2 x 201; 25% more
    assert memory.pool_tokens([100] * 40, in_flight=2, max_new_tokens=100, reserved=0) == 10050
    assert memory.pool_tokens([10], in_flight=1, max_new_tokens=5, reserved=0, page=16) == 48  # 32 x 1.25 = 40 -> 3 pages


def test_servers_the_gpu_cannot_hold_beside_the_first_ones_start_in_a_later_wave():
    sizes = {memory.BASELINE: 1 * GIB, "3-1-4": 2 * GIB, "7-1-8": 2 * GIB, "ngram": 1 * GIB, "advised": 2 * GIB}
    names = ["3-1-4", "7-1-8", "ngram", "advised"]  # SERVER_OVERHEAD (3 GiB) more each
    assert memory.plan_waves(sizes, names, 100 * GIB) == [names]  # all fit: one wave
    # the baseline (1 + 3) and 3-1-4 (2 + 3) hold 9 GiB, 7-1-8 would take 5 more: past 13. Beside the
    # baseline, 7-1-8 and ngram (1 + 3) hold 13; advised waits for a third wave
    assert memory.plan_waves(sizes, names, 13 * GIB) == [["3-1-4"], ["7-1-8", "ngram"], ["advised"]]
    assert memory.plan_waves(sizes, names, 9 * GIB - 1) is None  # not even the baseline and spec.*'s together


def test_a_later_turn_is_given_room_for_the_longest_answers_before_it(tmp_path):
    from transformers import AutoTokenizer

    from tests.support.micro import save_micro_model

    save_micro_model(tmp_path / "micro", arch="llama", num_layers=2)
    tok = AutoTokenizer.from_pretrained(tmp_path / "micro")
    conv = Conversation("c1", None, [[{"role": "user", "content": "Name a fruit."}], [{"role": "user", "content": "Another?"}]])
    bset = BenchSet("set", "set.jsonl", "0" * 64, [conv])
    lengths = memory.request_lengths(tok, [bset], [[1, 2, 3]], max_new_tokens=20)
    assert len(lengths) == 3 and lengths[0] == 3  # the warm-up prompt, then both turns
    assert lengths[1] == len(bset.render(tok, turn=1)[0])
    longest = BenchSet("set", "set.jsonl", "0" * 64, [conv], answers={(0, 1): "x" * 20})  # the byte tokenizer: 20 tokens
    assert len(longest.render(tok, turn=2)[0]) <= lengths[2]


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A micro project for prepare(): nothing is served."""
    return make_project(tmp_path_factory.mktemp("memory"))


@pytest.fixture
def gpu(monkeypatch):
    """GPU 0 visible with `free` bytes free (a list, so that a test may change it)."""
    free = [80 * GIB]
    monkeypatch.setattr(fleet, "visible_gpus", lambda: ["0"])
    monkeypatch.setattr(fleet, "gpu_free_memory", lambda g: free[0])
    return free


def sglang_plan(root, tmp_path, **bench_params):
    return prepare(root, tmp_path, backend="sglang", side_by_side=True, sweep=SWEEP, **bench_params)


def test_every_server_of_a_sweep_on_sglang_gets_the_pool_its_requests_need_and_starts_with_the_others(small, tmp_path, gpu):
    plan = sglang_plan(small, tmp_path)
    layout = plan.layout
    assert layout.waves == [["2-1-3", "1-1-2", "2-2-4"]]
    lengths = memory.request_lengths(plan.tokenizer, plan.sets, plan.warmup_ids, plan.bench_params.max_new_tokens)
    assert layout.tokens == memory.pool_tokens(lengths, 2, plan.bench_params.max_new_tokens, 4)  # in flight 2; 2-2-4 reserves 4
    argv, _ = bench.server_argv("sglang", plan.bench_params, plan.target_params, plan.draft.path, plan.flags, "0.5.14", True,
                                30001, memory_args=layout.args)
    assert argv[argv.index("--max-total-tokens") + 1] == str(layout.tokens)
    assert argv[argv.index("--mem-fraction-static") + 1] == "0.95"  # 1 - (1 - USABLE) / 2: the check passes while others load


def test_the_users_share_is_checked_and_replaced_by_the_benchs_fraction(small, tmp_path, gpu):
    plan = sglang_plan(small, tmp_path, extra_server_args=["--mem-fraction-static", "0.3", "--grammar-backend", "none"])
    argv, _ = bench.server_argv("sglang", plan.bench_params, plan.target_params, plan.draft.path, plan.flags, "0.5.14", False,
                                30001, memory_args=plan.layout.args)
    assert argv.count("--mem-fraction-static") == 1 and argv[argv.index("--mem-fraction-static") + 1] == "0.95"
    assert "--grammar-backend" in argv
    with pytest.raises(UserError, match=r"bench.extra_server_args: --mem-fraction-static 1e-09 gives a server .* raise it"):
        sglang_plan(small, tmp_path, extra_server_args=["--mem-fraction-static", "1e-09"])
    with pytest.raises(UserError, match=r"bench.extra_server_args: --max-total-tokens is set by the bench .* remove it"):
        sglang_plan(small, tmp_path, extra_server_args=["--max-total-tokens", "4096"])


def test_without_a_gpu_that_holds_them_the_servers_start_one_after_another(small, tmp_path, gpu, monkeypatch, capsys):
    gpu[0] = 5 * GIB  # less than the baseline and spec.*'s server need together (SERVER_OVERHEAD each)
    assert sglang_plan(small, tmp_path).layout is None
    assert "the servers start one after another" in capsys.readouterr().out
    monkeypatch.setattr(fleet, "visible_gpus", lambda: [])
    plan = sglang_plan(small, tmp_path)
    assert plan.layout is None
    from draftlab.bench import sweep

    assert sweep.waves(plan) == [["2-1-3"], ["1-1-2"], ["2-2-4"]]  # each configuration beside the baseline in turn, as before


def test_the_offline_run_decodes_beside_the_first_wave_only_where_its_copy_fits_too(small, tmp_path, gpu):
    plan = sglang_plan(small, tmp_path)
    assert plan.layout.offline_beside  # 80 GiB: room for the servers and the in-process copy
    wave = memory.first_wave_bytes(plan.layout.sizes, plan.layout.waves[0])
    # the servers alone fit USABLE of the free memory; with the in-process copy (IN_PROCESS_OVERHEAD
    # more than the micro models' weights) they would not: it runs before they start
    gpu[0] = int((wave + memory.IN_PROCESS_OVERHEAD // 2) / memory.USABLE)
    plan = sglang_plan(small, tmp_path)
    assert plan.layout.waves == [["2-1-3", "1-1-2", "2-2-4"]] and not plan.layout.offline_beside


def test_fa3_on_a_gpu_sglangs_fa3_refuses_is_refused_before_a_bench_server_starts(small, tmp_path, gpu, monkeypatch):
    import dataclasses

    plan = sglang_plan(small, tmp_path)
    fa3 = dataclasses.replace(plan.flags, attention_backend="fa3")
    monkeypatch.setattr(fleet, "compute_capability", lambda g: ("NVIDIA H100 80GB HBM3", 9, 0))
    argv, _ = bench.server_argv("sglang", plan.bench_params, plan.target_params, plan.draft.path, fa3, "0.5.14", True, 30001)
    assert argv[argv.index("--attention-backend") + 1] == "fa3"
    monkeypatch.setattr(fleet, "compute_capability", lambda g: ("NVIDIA RTX PRO 6000 Blackwell", 12, 0))
    with pytest.raises(UserError, match=r"bench.attention_backend: --attention-backend fa3 .* GPU 0 is a NVIDIA RTX PRO 6000 "
                                        r"Blackwell \(12.0\): choose triton or flashinfer in bench.attention_backend"):
        bench.server_argv("sglang", plan.bench_params, plan.target_params, plan.draft.path, fa3, "0.5.14", True, 30001)
