"""benchmarks/synth_profile.py: what it reads from the SGLang servers' torch-profiler traces (the GPU path
itself needs SGLang; its summary is computed here from traces written in the profiler's format)."""
import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import synth_profile  # noqa: E402


def write_trace(path: Path, base_ns: int, kernels, graph_launches: int) -> None:
    """A trace as torch.profiler exports it: event times in us from baseTimeNanoseconds."""
    events = [{"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": 7} for ts, dur, name in kernels]
    events += [{"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 0.0, "dur": 1.0, "pid": 1, "tid": 1}] * graph_launches
    events += [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0.0, "dur": 50.0, "pid": 1, "tid": 1}]  # host side: not GPU time
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt") as f:
        json.dump({"schemaVersion": 1, "baseTimeNanoseconds": base_ns, "traceEvents": events}, f)


def two_servers(tmp_path, gap_filled: bool) -> Path:
    # Server 0's clock starts at 1 s, server 1's at 2 s: on one clock, server 1 runs 5-15 and 25-40 us
    # after server 0's start, beside server 0's 0-10 and 20-30 us.
    write_trace(tmp_path / "server-0" / "a-TP-0.trace.json.gz", 1_000_000_000,
                [(0.0, 10.0, "_fwd_kernel_stage1"), (20.0, 10.0, "nvjet_tst_128x64_TNT")], graph_launches=2)
    second = [(-1e6 + 5, 10.0, "void at::native::elementwise_kernel<128, 4>"), (-1e6 + 25, 15.0, "argmax_kernel")]
    if gap_filled:
        second.append((-1e6 + 15, 5.0, "_fwd_kernel_stage2"))
    write_trace(tmp_path / "server-1" / "b-TP-0.trace.json.gz", 2_000_000_000, second, graph_launches=1)
    return tmp_path


def test_the_gpu_busy_share_is_the_union_of_every_server_kernels_on_one_clock(tmp_path):
    traces = sorted(two_servers(tmp_path, gap_filled=False).rglob("*.trace.json.gz"))
    s = synth_profile.summarize(traces)
    # Both traced from 5 to 30 us: kernels cover 5-15 and 20-30 of those 25 us
    assert s["window"] == "every server traced" and abs(s["window_ms"] - 0.025) < 1e-9
    assert abs(s["gpu_busy_share"] - 0.8) < 1e-9
    # Kernel time inside the window, clipped: attention 5, matmul 10, element-wise 10, sampling 5 (of 30)
    assert s["kernel_groups"] == {"matrix products": round(10 / 30, 4), "element-wise and norms": round(10 / 30, 4),
                                  "attention": round(5 / 30, 4), "sampling": round(5 / 30, 4)}
    first = s["servers"][0]
    assert abs(first["own_busy_share"] - 20 / 30) < 1e-9 and first["graph_launches"] == 2
    assert s["verdict"].startswith("the servers' host side: the GPU idles 20%")


def test_a_gpu_busy_through_the_window_is_named_with_its_largest_kernel_group(tmp_path):
    out = tmp_path / "summary.json"
    r = subprocess.run([sys.executable, "benchmarks/synth_profile.py", "--traces", str(two_servers(tmp_path / "t", gap_filled=True)),
                        "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    s = json.loads(out.read_text())
    assert s["gpu_busy_share"] == 1.0
    assert s["kernel_groups"]["attention"] == round(10 / 35, 4)
    assert s["verdict"].startswith("the GPU: kernels run 100% of the window; the largest group is")
    assert "limit: the GPU" in r.stdout and "CUDA-graph launches/s" in r.stdout


def test_no_traces_says_so(tmp_path):
    r = subprocess.run([sys.executable, "benchmarks/synth_profile.py", "--traces", str(tmp_path)], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "no trace files" in r.stderr


class StandIn:
    """An OpenAI-compatible stand-in that also answers SGLang's /start_profile: a short delay per
    answer, and a trace of two kernels written where it was asked, as SGLang's profiler would."""

    def __init__(self, latency_s: float = 0.05, profile_after_s: float = 0.0):
        import http.server
        import threading
        import time as clock

        stand_in = self
        self.profiled, self.latency_s, self.profile_after_s = [], latency_s, profile_after_s

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def reply(self, body: dict):
                data = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self.reply({"object": "list", "data": [{"id": "stand-in", "object": "model"}]})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
                if self.path == "/start_profile":
                    clock.sleep(stand_in.profile_after_s)  # a scheduler that runs no steps takes it late
                    stand_in.profiled.append(body)
                    now_us = 1.8e15  # every server's kernels at the same wall-clock times: one window, whatever the order
                    threading.Timer(0.2, write_trace, (Path(body["output_dir"]) / "p-TP-0.trace.json.gz", 0,
                                                       [(now_us, 400.0, "_fwd_kernel_stage1"), (now_us + 500, 500.0, "nvjet_gemm")], 3)).start()
                    self.reply({})
                    return
                clock.sleep(stand_in.latency_s)
                self.reply({"choices": [{"message": {"content": "an answer"}, "finish_reason": "stop"}],
                            "usage": {"completion_tokens": 7}})

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"


def test_the_live_run_answers_through_the_stage_client_and_traces_every_server_mid_run(tmp_path, monkeypatch):
    """The GPU path with the servers stood in for: the stage's client answers every turn over both,
    every server is asked for a trace of --profile-steps steps into its own folder, and the summary
    carries the run's tok/s beside the traces' figures."""
    import argparse
    import contextlib

    import yaml

    import stages.synthesize as stage

    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["target"]["model"] = str(ROOT / "models/tiny-target")
    params["synth"].update(backend="sglang", concurrency=4)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    prompts = tmp_path / "data/prompts"
    prompts.mkdir(parents=True)
    rows = [{"id": f"r{i}", "messages": [{"role": "user", "content": f"question {i}"}], "next_turns": [f"and then {i}?"]}
            for i in range(60)]
    (prompts / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    servers = [StandIn(), StandIn()]
    started = []

    @contextlib.contextmanager
    def stood_in(target_params, synth_params, out):
        started.append(synth_params)
        yield [s.url for s in servers]

    monkeypatch.setattr(stage, "own_servers", stood_in)
    monkeypatch.chdir(tmp_path)
    args = argparse.Namespace(prompts=prompts, conversations=50, warmup_s=0.5, profile_steps=5, servers=None, concurrency=None,
                              server_arg=["--enable-mixed-chunk"], traces_dir=str(tmp_path / "traces"), top=5,
                              stop_after_traces=False)
    s = synth_profile.live(args)
    assert started[-1].concurrency == 4  # synth.concurrency unless --concurrency says otherwise
    assert (s["conversations"], s["errors"], s["completion_tokens"]) == (50, 0, 50 * 2 * 7)  # every turn of the first 50
    assert s["servers_started"] == 2 and s["tokens_per_s"] > 0 and s["server_args"][-1] == "--enable-mixed-chunk"
    asked = [p for srv in servers for p in srv.profiled]
    assert [p["num_steps"] for p in asked] == [5, 5] and {p["activities"][1] for p in asked} == {"GPU"}
    assert len({p["output_dir"] for p in asked}) == 2  # one folder per server: each trace is found as its own
    assert s["kernel_groups"] == {"matrix products": round(5 / 9, 4), "attention": round(4 / 9, 4)} and len(s["servers"]) == 2
    # --stop-after-traces: the servers go once traced; the figures count what finished by then
    args.stop_after_traces, args.traces_dir, args.warmup_s, args.concurrency = True, str(tmp_path / "traces-2"), 0.3, 6
    for srv in servers:
        srv.latency_s = 0.2  # 100 turns, 4 at a time: 5 s, well past the traces
    early = synth_profile.live(args)
    assert started[-1].concurrency == 6
    assert early["conversations"] < 50 and early["kernel_groups"] == s["kernel_groups"]


def test_a_server_that_does_not_take_the_trace_request_is_named_not_waited_on(tmp_path):
    """Every server is asked at once; one that runs no scheduler steps (a stalled start, a kernel
    compiling) stops the benchmark with its URL and log instead of hanging it."""
    import time

    quick, stalled = StandIn(), StandIn(profile_after_s=5.0)
    t0 = time.monotonic()
    with pytest.raises(SystemExit, match=r"server 1 at .* did not take /start_profile within 1 s.*its log: .*\.sglang-server-1\.log"):
        synth_profile.profile_servers([quick.url, stalled.url], 3, tmp_path / "traces", ask_timeout_s=1.0, logs=tmp_path)
    assert time.monotonic() - t0 < 4.0
    assert len(quick.profiled) == 1  # the other was asked all the same, beside it
