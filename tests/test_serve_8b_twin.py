"""tools/serve_8b_twin.py, the parts that need no GPU: arguments, pairing order, paired figures."""
import importlib.util
import math
import sys
from pathlib import Path

import pytest

from draftlab.sglang.client import GenerateMeta

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("serve_8b_twin", ROOT / "tools" / "serve_8b_twin.py")
tool = importlib.util.module_from_spec(spec)
sys.modules["serve_8b_twin"] = tool
spec.loader.exec_module(tool)


def test_configs_parse_and_chains_must_verify_steps_plus_one():
    assert tool.parse_config("5-1-6") == (5, 1, 6) and tool.parse_config("6-8-32") == (6, 8, 32)
    for bad, word in (("5-1-8", "chain"), ("2-2-9", "exceed"), ("5-1", "STEPS"), ("0-1-1", ">= 1")):
        with pytest.raises(Exception, match=word):
            tool.parse_config(bad)
    args = tool.parse_args(["--work-dir", "w", "--prompts", "p.jsonl", "--out", "r.json", "--configs", "3-1-4,5-4-8",
                            "--concurrency", "4,8,16"])
    assert args.configs == [(3, 1, 4), (5, 4, 8)] and args.concurrency == [4, 8, 16] and args.mem_fraction_static == 0.4
    assert tool.parse_args(["--work-dir", "w", "--prompts", "p", "--out", "r"]).configs == [(3, 1, 4), (5, 1, 6), (7, 1, 8), (5, 4, 8)]
    with pytest.raises(SystemExit):
        tool.parse_args(["--work-dir", "w", "--prompts", "p", "--out", "r", "--port", "55535"])


def test_pair_order_alternates_abba():
    assert tool.pair_order(3) == [(0, "baseline"), (0, "spec"), (1, "spec"), (1, "baseline"), (2, "baseline"), (2, "spec")]


def test_aggregate_pools_tokens_over_seconds_and_compares_texts():
    def rec(i, mode, seconds, tokens, text, verify=None):
        meta = GenerateMeta(completion_tokens=tokens, e2e_latency=seconds * 0.9, spec_verify_ct=verify,
                            spec_num_correct_drafts=None if verify is None else tokens - verify,
                            spec_num_proposed_drafts=None if verify is None else 5 * verify)
        return {"index": i, "mode": mode, "seconds": seconds, "text": text, "meta": meta}

    records = [rec(0, "baseline", 1.0, 100, "a"), rec(0, "spec", 0.5, 100, "a", verify=25),
               rec(1, "spec", 0.2, 20, "b", verify=10), rec(1, "baseline", 0.1, 20, "c")]
    out = tool.aggregate(records)
    assert out["baseline"]["tokens_per_s"] == pytest.approx(120 / 1.1)
    assert out["spec"]["tokens_per_s"] == pytest.approx(120 / 0.7)
    assert out["speedup"] == pytest.approx(1.1 / 0.7)
    assert out["served_tau"] == pytest.approx(120 / 35)  # pooled, not the mean of 4.0 and 2.0
    assert out["accepted_drafts_per_proposed"] == pytest.approx(85 / 175)
    assert out["greedy_identical"] == 0.5 and out["greedy_differs_at_prompts"] == [1]
    assert out["per_prompt_speedup"]["min"] == pytest.approx(0.5) and out["per_prompt_speedup"]["max"] == pytest.approx(2.0)
    assert out["baseline"]["server_tokens_per_s"] == pytest.approx(120 / 0.99)


def test_bandwidth_floor_and_decode_lines(tmp_path):
    assert tool.bandwidth_floor(14_000_000_000, 4.8e12) == pytest.approx(342.86, rel=1e-4)
    log = tmp_path / "s.log"
    log.write_text("\n".join(f"[2026-12-01] Decode batch, #running-req: {n}, #token: 46, token usage: 0.00, cuda graph: True, "
                             f"gen throughput (token/s): {r}, #queue-req: 0" for n, r in ((1, 290.0), (1, 300.0), (4, 900.0))))
    assert tool.decode_rate_from_log(log) == {"median": 295.0, "max": 300.0, "lines": 2}
    assert tool.log_tail(log, 1)[0].endswith("#queue-req: 0") and tool.log_tail(tmp_path / "none") == []
    assert not math.isnan(tool.NOMINAL_BANDWIDTH)


class FakeClient:
    """A server stand-in: every request takes `seconds` and yields `tokens`; calls are logged."""

    def __init__(self, name, seconds, tokens, log, verify=None):
        self.name, self.seconds, self.tokens, self.log, self.verify = name, seconds, tokens, log, verify

    def generate(self, ids, sampling):
        self.log.append(self.name)
        return "", GenerateMeta(completion_tokens=self.tokens, spec_verify_ct=self.verify)


def test_concurrency_is_paired_batch_by_batch_in_abba_order(monkeypatch):
    log = []
    base, spec = FakeClient("b", 0, 10, log), FakeClient("s", 0, 10, log, verify=4)
    clock = iter(range(1000))  # each perf_counter call advances one second
    monkeypatch.setattr(tool.time, "perf_counter", lambda: next(clock))
    out = tool.run_batches_paired(base, spec, [[1], [2], [3], [4]], {}, concurrency=1, repeats=2)
    # one uncounted warm-up batch each, then ABBA: a load drift hits both alike
    assert log == ["b"] * 4 + ["s"] * 4 + ["b"] * 4 + ["s"] * 4 + ["s"] * 4 + ["b"] * 4
    assert out["baseline"]["completion_tokens"] == out["spec"]["completion_tokens"] == 80
    assert out["spec"]["served_tau"] == pytest.approx(2.5)
    assert out["speedup"] == pytest.approx(out["spec"]["tokens_per_s"] / out["baseline"]["tokens_per_s"])
    assert len(out["baseline"]["batches"]) == 2 and out["repeats"] == 2
    assert out["repeat_speedups"] == pytest.approx([1.0, 1.0]) and out["repeat_spread"] == pytest.approx(0.0)


def test_the_repeat_spread_is_the_range_of_the_pairs_speedups():
    base = [{"tokens_per_s": 100.0}, {"tokens_per_s": 100.0}, {"tokens_per_s": 80.0}]
    spec = [{"tokens_per_s": 200.0}, {"tokens_per_s": 150.0}, {"tokens_per_s": 200.0}]
    out = tool.repeat_spread(base, spec)
    assert out["repeat_speedups"] == pytest.approx([2.0, 1.5, 2.5])
    assert out["repeat_spread"] == pytest.approx(2.5 / 1.5 - 1)


def test_an_existing_baseline_server_is_used_not_started():
    args = tool.parse_args(["--work-dir", "w", "--prompts", "p", "--out", "r", "--baseline-url", "http://127.0.0.1:9/"])
    with tool.baseline_server(args, ["python", "-m", "sglang.launch_server"], Path("unused.log")) as url:
        assert url == "http://127.0.0.1:9"


def test_the_served_advice_reads_the_kept_requests_and_compares_every_measured_config():
    def entry(cfg, round_s, tau):
        rows, records = [], []
        for i, n in enumerate((30, 60, 90, 120)):
            rounds = round(n / tau)
            for mode, sec, ver in (("baseline", 0.02 + n * 0.005, 0), ("spec", 0.02 + rounds * round_s, rounds)):
                records.append({"index": i, "mode": mode, "seconds": sec, "text": "x",
                                "meta": GenerateMeta(completion_tokens=n, spec_verify_ct=ver or None)})
        return {"num_steps": cfg[0], "topk": cfg[1], "num_draft_tokens": cfg[2], **tool.aggregate(records)}

    cfgs = {(3, 1, 4): (0.0070, 3.0), (7, 1, 8): (0.0090, 4.0), (5, 4, 8): (0.0082, 4.2), (6, 8, 32): (0.0098, 5.0)}
    results = {"configs": {tool.config_name(c): entry(c, r, tau) for c, (r, tau) in cfgs.items()}}
    assert set(tool.measured_rounds(results["configs"])) == set(cfgs)
    bench = {"advice": {"candidates": [{"num_steps": s, "topk": k, "num_draft_tokens": w, "predicted_tau": tau}
                                       for (s, k, w), (_, tau) in {**cfgs, (5, 1, 6): (0, 3.6)}.items()]}}
    out = tool.served_advice(results, bench)
    compared = {row["config"]: row for row in out["predicted_vs_measured"]}
    assert set(compared) == {tool.config_name(c) for c in cfgs}  # 5-1-6 was not served: advised, not compared
    for name, row in compared.items():
        assert row["speedup_error"] == pytest.approx(row["predicted_speedup"] / results["configs"][name]["speedup"] - 1)
        assert row["held_out_speedup"] is not None
    assert out["recommended"]["num_steps"] in (3, 5, 6, 7)


def test_the_advice_pick_is_measured_after_the_first_configurations_not_after_all():
    configs = [(6, 8, 32), (3, 1, 4), (7, 1, 8), (5, 4, 8)]
    assert tool.split_for_advice(configs, configs, 3) == (configs[:3], configs[3:])
    assert tool.split_for_advice(configs, configs[1:], 3) == (configs[1:3], configs[3:])  # resumed: done ones stay done
    assert tool.split_for_advice(configs, configs, None) == (configs, [])  # no bench.json: the plain sweep
    args = tool.parse_args(["--work-dir", "w", "--prompts", "p", "--out", "r", "--advise-from", "b.json", "--advise-after", "2"])
    assert args.advise_from == "b.json" and args.advise_after == 2


def test_the_prefill_graph_switch_keeps_every_other_server_flag():
    off, on = tool.server_args(False), tool.server_args(True)
    assert tool.NO_PREFILL_GRAPH in off and tool.NO_PREFILL_GRAPH not in on
    assert [a for a in off if a != tool.NO_PREFILL_GRAPH] == on
    args = tool.parse_args(["--work-dir", "w", "--prompts", "p", "--out", "r"])
    assert args.prefill_cuda_graph == "off" and not args.prefill_probe  # the sweep gpu_8b.py runs is unchanged
    args = tool.parse_args(["--work-dir", "w", "--prompts", "p", "--out", "r", "--prefill-cuda-graph", "on", "--prefill-probe"])
    assert args.prefill_cuda_graph == "on" and args.prefill_probe


def test_a_batch_keeps_each_request_and_the_probe_asks_for_one_token(monkeypatch):
    asked = []

    class Counting(FakeClient):
        def generate(self, ids, sampling):
            asked.append(sampling["max_new_tokens"])
            return "", GenerateMeta(completion_tokens=ids[0], spec_verify_ct=ids[0] // 2)

    clock = iter(range(0, 100000, 2))  # each perf_counter call advances two seconds
    monkeypatch.setattr(tool.time, "perf_counter", lambda: next(clock))
    batch = tool.run_batch(Counting("s", 0, 0, []), [[10], [20], [30]], {"max_new_tokens": 128}, concurrency=1)
    assert [row[0] for row in batch["request_rows"]] == [10, 20, 30]  # in prompt order: tokens, seconds, rounds
    assert [row[2] for row in batch["request_rows"]] == [5, 10, 15]
    assert all(row[1] > 0 for row in batch["request_rows"])
    asked.clear()
    probe = tool.prefill_probe(Counting("b", 0, 0, []), [[1], [2]], {"max_new_tokens": 128}, [1, 4], repeats=2)
    assert set(probe) == {"1", "4"} and set(asked) == {1}
    assert len(asked) == 2 * 2 * (1 + 2)  # per level: one uncounted batch, then two counted, of two prompts each
    assert probe["1"]["ms_per_request"] == pytest.approx(sum(probe["1"]["repeats_ms"]) / 2)
