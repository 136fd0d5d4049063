"""draftlab.bench.servers.concurrency_sweep: throughput with requests in flight, paired between servers."""
import threading

from draftlab.bench import servers as bench
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


def test_one_progress_bar_per_configuration_and_concurrency_counts_every_request(monkeypatch, capsys):
    """bench.measure: a bar named by the configuration and c=1 (warm-up, paired and prompt-only
    requests of both servers), then one per concurrency n > 1 (warm-up, repeats, prompt-only), each
    run to its total."""
    from types import SimpleNamespace

    log = []

    class Served(Recorder):
        def __init__(self, url, timeout):
            super().__init__(url, 10, log)

        def server_info(self):
            return {}

        def close(self):
            pass

    monkeypatch.setattr(bench, "Client", Served)
    params = SimpleNamespace(request_timeout_s=5.0, concurrency=[1, 2, 4], concurrency_repeats=2)
    bench.measure({"baseline": "b", "speculative": "s"}, params, [[1]] * 5, {}, warmup=1, abba=True, label="3-1-4")
    err = capsys.readouterr().err
    finals = {}
    for line in err.replace("\r", "\n").splitlines():
        if line.startswith("bench 3-1-4 c="):
            finals[line.split(":")[0]] = line.split("|")[-1].split()[0]  # the last state drawn: done/total
    # c=1: 2 servers x (1 warm-up + 4 paired + 4 prompt-only); c=n: 2 x 4 prompts x (warm-up + 2 repeats + prompt-only)
    assert finals == {"bench 3-1-4 c=1": "18/18", "bench 3-1-4 c=2": "32/32", "bench 3-1-4 c=4": "32/32"}
    assert len(log) == 18 + 32 + 32  # every request sent is one the bars counted
