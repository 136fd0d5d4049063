"""draftlab.bench.concurrency_sweep: throughput with requests in flight, paired between servers."""
import threading

from draftlab import bench
from draftlab.sglang.client import GenerateMeta


class Recorder:
    def __init__(self, name, tokens, log):
        self.name, self.tokens, self.log, self.lock = name, tokens, log, threading.Lock()

    def generate(self, ids, sampling):
        with self.lock:  # a prompt-only request (max_new_tokens 1) logs in capitals
            self.log.append(self.name.upper() if sampling.get("max_new_tokens") == 1 else self.name)
        return "", GenerateMeta(completion_tokens=1 if sampling.get("max_new_tokens") == 1 else self.tokens)


def test_batches_alternate_abba_after_an_uncounted_warm_up_and_each_mode_pools_its_batches():
    log = []
    clients = {"baseline": Recorder("b", 10, log), "speculative": Recorder("s", 30, log)}
    out = bench.concurrency_sweep(clients, [[1]] * 4, {}, [1, 4, 8])
    # Level 1 is the paired single-stream figure measured elsewhere; 4 and 8 each: a warm-up batch
    # per server (not counted), then B S S B, then one prompt-only batch per server.
    level = ["b"] * 4 + ["s"] * 4 + ["b"] * 4 + ["s"] * 4 + ["s"] * 4 + ["b"] * 4 + ["B"] * 4 + ["S"] * 4
    assert log == level + level
    assert all(p["prompt_only_s_per_request"] > 0 for p in out["baseline"] + out["speculative"])
    assert [p["concurrency"] for p in out["baseline"]] == [4, 8]
    # two counted batches of 4 requests each: the warm-up's 4 are not in the figures
    assert out["speculative"][0]["completion_tokens"] == 240 and out["speculative"][0]["requests"] == 8


def test_one_server_runs_each_level_once_after_its_warm_up():
    log = []
    out = bench.concurrency_sweep({"speculative": Recorder("s", 5, log)}, [[1]] * 3, {}, [2])
    assert log == ["s"] * 6 + ["S"] * 3 and out["speculative"][0]["completion_tokens"] == 15
