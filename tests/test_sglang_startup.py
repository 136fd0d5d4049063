"""Where a server's start-up went: the phases read from SGLang's log lines, and the times a real launch records."""
import sys
import textwrap
import time

from draftlab import lifecycle
from draftlab.sglang import startup


def stamp(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def sglang_log(t0: float, lines: list[tuple[float, str]], prefix: str = " TP0") -> str:
    """A log as SGLang 0.5.x writes it: "[YYYY-mm-dd HH:MM:SS TP0] message", unstamped lines between."""
    out = ["/usr/lib/python3/site-packages/torch/cuda/__init__.py: UserWarning: an unstamped warning"]
    out += [f"[{stamp(t0 + dt)}{prefix}] {msg}" for dt, msg in lines]
    return "\n".join(out) + "\n"


def test_a_speculative_servers_log_is_cut_into_phases_that_sum_to_its_start_up():
    t0 = float(int(time.time()))  # whole seconds, as SGLang stamps its lines
    text = sglang_log(t0, [
        (52, "server_args=ServerArgs(model_path='models/target')"),
        (82, "Load weight begin. avail mem=78.20 GB"),
        (86, "Load weight end. elapsed=3.21 s, type=LlamaForCausalLM, avail mem=77.90 GB, mem usage=0.30 GB."),
        (87, "Memory pool end. avail mem=62.00 GB"),
        (88, "Capture target decode CUDA graph begin. backend=full, bs=[1, 2, 4], avail mem=61.90 GB"),
        (150, "Capture target decode CUDA graph end. elapsed=61.50 s, mem usage=0.40 GB, avail mem=61.50 GB."),
        (151, "Load weight begin. avail mem=61.50 GB"),  # the draft's worker: counted in cuda_graphs
        (171, "Capture draft decode CUDA graph end. elapsed=19.30 s, mem usage=0.10 GB, avail mem=61.40 GB."),
        (180, "The server is fired up and ready to roll!"),
    ])
    got = startup.phases(text, launched=t0, healthy_at=t0 + 181.5)
    assert got["phases_s"] == {"imports": 52.0, "init": 30.0, "weights": 4.0, "kv_pool": 1.0, "cuda_graphs": 84.0,
                               "warmup": 9.0, "health": 1.5}
    assert got["total_s"] == 181.5 == sum(got["phases_s"].values())
    assert got["cuda_graph_capture_s"] == 80.8  # both captures' own elapsed= figures


def test_a_missing_line_lands_its_time_in_the_next_phase_and_no_phase_runs_backwards():
    t0 = float(int(time.time()))
    text = sglang_log(t0, [  # no "Memory pool end" (another version); milliseconds in the stamp's own format
        (10, "Load weight begin. avail mem=78.20 GB"),
        (12, "Load weight end. elapsed=1.00 s"),
        (40, "Capture decode CUDA graph end. elapsed=27.00 s"),
    ], prefix="")
    text = text.replace(f"[{stamp(t0 + 40)}]", f"[{stamp(t0 + 40)}.500]")
    got = startup.phases(text, launched=t0 + 0.6, healthy_at=t0 + 45)  # launched within the first stamped second
    assert list(got["phases_s"]) == ["imports", "init", "weights", "cuda_graphs", "health"]
    assert got["phases_s"]["cuda_graphs"] == 28.5  # the missing pool line: its time is with the graphs, 12 -> 40.5
    assert min(got["phases_s"].values()) >= 0 and round(sum(got["phases_s"].values()), 1) == got["total_s"] == 44.4


def test_lines_stamped_in_the_launch_second_still_end_their_phases():
    """Stamps are whole seconds, so a fast start's lines can read earlier than the launch: they are
    taken in the log's order, each phase at least 0 s."""
    t0 = float(int(time.time()))
    text = sglang_log(t0, [(0, "server_args=ServerArgs()"), (0, "Load weight begin. avail mem=1.00 GB"),
                           (0, "Load weight end. elapsed=0.10 s")])
    got = startup.phases(text, launched=t0 + 0.6, healthy_at=t0 + 2.0)
    assert got["phases_s"] == {"imports": 0.0, "init": 0.0, "weights": 0.0, "health": 1.4}


def test_a_log_without_sglangs_lines_gives_the_start_up_whole():
    got = startup.phases("reference server listening\n", launched=100.0, healthy_at=102.2)
    assert got == {"total_s": 2.2, "ready_s": None, "phases_s": {"health": 2.2}, "cuda_graph_capture_s": None}
    assert startup.summary([got]) == "1 server up in 2 s"
    assert startup.summary([None]) == ""


def test_the_summary_names_the_slowest_servers_phases():
    fast = {"total_s": 95.0, "phases_s": {"imports": 40.0, "cuda_graphs": 50.0, "health": 5.0}}
    slow = {"total_s": 170.0, "phases_s": {"imports": 52.0, "cuda_graphs": 113.0, "health": 5.0}}
    line = startup.summary([fast, slow, None])
    assert line == "2 servers up in 95-170 s; the slowest: imports 52 s, cuda graphs 113 s, health 5 s"


def test_time_the_caller_spent_on_its_own_work_is_not_the_servers():
    """The bench decodes its offline run while its servers start and polls /health after it: a
    server ready long before is not slow to start, and the record says so."""
    t0 = float(int(time.time()))
    text = sglang_log(t0, [(20, "Load weight begin. avail mem=78.20 GB"), (21, "Load weight end. elapsed=1.00 s"),
                           (60, "Capture decode CUDA graph end. elapsed=38.00 s"), (65, "The server is fired up and ready to roll!")])
    got = startup.phases(text, launched=t0, healthy_at=t0 + 171.0, polled_from=t0 + 170.5)
    assert got["ready_s"] == 65.0 and got["total_s"] == 171.0
    assert got["phases_s"]["this_process_busy"] == 105.5 and got["phases_s"]["health"] == 0.5
    assert round(sum(got["phases_s"].values()), 1) == got["total_s"]
    polled_early = startup.phases(text, launched=t0, healthy_at=t0 + 66.0, polled_from=t0 + 1.0)
    assert "this_process_busy" not in polled_early["phases_s"] and polled_early["phases_s"]["health"] == 1.0
    line = startup.summary([got, {**got, "total_s": 173.0, "ready_s": 77.0}])
    assert line.startswith("2 servers up in 171-173 s, ready by their logs in 65-77 s; the slowest: ")
    assert "this process busy 106 s" in line


SLOW_STARTER = textwrap.dedent('''
    import http.server, sys, time
    port = int(sys.argv[1])
    def log(msg):
        print(time.strftime("[%Y-%m-%d %H:%M:%S TP0] ") + msg, flush=True)
    log("Load weight begin. avail mem=1.00 GB")
    time.sleep(2.5)
    log("Load weight end. elapsed=2.50 s")
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
        def log_message(self, *a):
            pass
    log("The server is fired up and ready to roll!")
    http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
''')


def test_a_launched_server_records_when_it_started_and_became_healthy(tmp_path):
    script = tmp_path / "server.py"
    script.write_text(SLOW_STARTER)
    port = lifecycle.free_port()
    before = time.time()
    with lifecycle.serve([sys.executable, str(script), str(port)], f"http://127.0.0.1:{port}", tmp_path / "server.log",
                         startup_timeout_s=30) as srv:
        after = time.time()
        got = startup.server_startup(srv)
    assert before <= srv.launched <= srv.healthy_at <= after
    assert got["total_s"] >= 2.5 and 1.5 <= got["phases_s"]["weights"] <= 3.5  # the sleep between its lines, to a second
    assert round(sum(got["phases_s"].values()), 1) == got["total_s"]


def test_servers_started_beside_work_of_this_process_record_when_it_began_to_poll(tmp_path):
    script = tmp_path / "server.py"
    script.write_text(SLOW_STARTER)
    ports = [lifecycle.free_port(), lifecycle.free_port()]
    while ports[1] == ports[0]:
        ports[1] = lifecycle.free_port()
    specs = [([sys.executable, str(script), str(p)], f"http://127.0.0.1:{p}", tmp_path / f"server-{p}.log", None) for p in ports]
    with lifecycle.serve_many(specs, 30, meanwhile=lambda: time.sleep(5.0)) as servers:
        got = [startup.server_startup(srv) for srv in servers]
    for srv, g in zip(servers, got):
        assert srv.launched + 5.0 <= srv.polled_from <= srv.healthy_at
        assert g["ready_s"] <= 4.0 and g["total_s"] >= 5.0  # ready after its 2.5 s sleep, healthy to us after ours
        assert g["phases_s"]["this_process_busy"] >= 0.5


def test_the_phases_sum_to_the_total_to_the_tenth_whatever_the_fractions():
    """Each boundary is rounded from the launch, so the phases telescope to total_s (phases rounded
    one by one could miss it by 0.1 s)."""
    import random

    rng = random.Random(0)
    t0 = float(int(time.time()))
    for _ in range(300):
        offs = sorted(rng.uniform(0, 5) for _ in range(3))
        text = "\n".join(f"[{stamp(t0 + o)}.{int(o % 1 * 1000):03d}] {msg}"
                         for o, msg in zip(offs, ["Load weight begin", "Load weight end. elapsed=1.00 s", "The server is fired up"]))
        got = startup.phases(text, t0 + rng.random(), healthy_at=t0 + 6 + rng.random(), polled_from=t0 + 5.5 + rng.random())
        assert round(sum(got["phases_s"].values()), 1) == got["total_s"]
