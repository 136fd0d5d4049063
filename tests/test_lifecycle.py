"""Starting and stopping servers: healthy before use, a clear error with the log, nothing left running."""
import json
import os
import signal
import sys
import textwrap
import time

import httpx
import pytest

from draftlab.errors import UserError
from draftlab import lifecycle
from draftlab.lifecycle import free_port, serve

# A stand-in server: optional start-up delay, optional child process (like SGLang's scheduler),
# optional refusal of SIGTERM; /health answers 200 once listening.
FAKE_SERVER = textwrap.dedent('''
    import http.server, os, signal, subprocess, sys, time
    port, delay, pids_file, mode = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3], sys.argv[4]
    print("fake server loading, marker LOADING-7f3a", flush=True)
    if mode == "crash":
        print("fatal: marker CRASH-91c2", file=sys.stderr, flush=True)
        sys.exit(3)
    if mode == "ignore_term":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1000)"])
    open(pids_file, "w").write(f"{os.getpid()} {child.pid}")
    time.sleep(delay)
    if mode == "hang":
        time.sleep(1000)
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()
        def log_message(self, *a):
            pass
    http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
''')


def dead(pid: int) -> bool:
    """Gone, or a zombie waiting to be reaped (it runs nothing)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except FileNotFoundError:
        return True
    return stat[stat.rfind(")") + 2] == "Z"


@pytest.fixture
def fake(tmp_path):
    script = tmp_path / "fake_server.py"
    script.write_text(FAKE_SERVER)
    pids = tmp_path / "pids"

    def make(delay=0.0, mode="ok"):
        port = free_port()
        argv = [sys.executable, str(script), port, delay, pids, mode]
        return argv, f"http://127.0.0.1:{port}", tmp_path / "logs" / "server.log"

    def started_pids():
        return [int(p) for p in pids.read_text().split()]

    return make, started_pids


def wait_dead(pids, within_s=5.0):
    deadline = time.monotonic() + within_s
    while not all(dead(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return all(dead(p) for p in pids)


def test_waits_for_health_then_stops_the_whole_process_group(fake):
    make, started_pids = fake
    argv, url, log = make(delay=1.0)
    t0 = time.monotonic()
    with serve(argv, url, log, startup_timeout_s=30) as srv:
        assert time.monotonic() - t0 >= 1.0  # not before the server listens
        assert httpx.get(url + "/health").status_code == 200
        server_pid, child_pid = started_pids()
        assert srv.pid == server_pid and not dead(child_pid)
    assert wait_dead([server_pid, child_pid], within_s=0.5)  # stopped before serve() returned
    assert "LOADING-7f3a" in log.read_text()  # the log is kept


@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
def test_stops_the_group_on_exception_and_ctrl_c(fake, exc):
    make, started_pids = fake
    argv, url, log = make()
    with pytest.raises(exc):
        with serve(argv, url, log, startup_timeout_s=30):
            raise exc()
    assert wait_dead(started_pids(), within_s=0.5)


def test_timeout_error_shows_log_tail_and_kills_the_group(fake):
    make, started_pids = fake
    argv, url, log = make(mode="hang")
    t0 = time.monotonic()
    with pytest.raises(UserError) as e:
        with serve(argv, url, log, startup_timeout_s=1.5):
            pytest.fail("yielded an unhealthy server")
    assert 1.5 <= time.monotonic() - t0 < 10
    assert "not healthy after 1.5 s" in str(e.value) and "LOADING-7f3a" in str(e.value) and str(log) in str(e.value)
    assert wait_dead(started_pids(), within_s=0.5)


def test_server_that_exits_fails_early_with_its_error(fake):
    make, _ = fake
    argv, url, log = make(mode="crash")
    t0 = time.monotonic()
    with pytest.raises(UserError, match="exited with code 3") as e:
        with serve(argv, url, log, startup_timeout_s=60):
            pass
    assert time.monotonic() - t0 < 10  # did not wait for the 60 s timeout
    assert "CRASH-91c2" in str(e.value)  # stderr reaches the log


def test_sigkill_after_grace_when_sigterm_is_ignored(fake):
    make, started_pids = fake
    argv, url, log = make(mode="ignore_term")
    with serve(argv, url, log, startup_timeout_s=30, grace_s=0.5):
        server_pid, child_pid = started_pids()
        t0 = time.monotonic()
    assert wait_dead([server_pid, child_pid], within_s=0.5)
    assert time.monotonic() - t0 >= 0.5


def test_sigterm_to_us_still_stops_the_server(fake):
    if signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        pytest.skip("the test runner handles SIGTERM itself")
    make, started_pids = fake
    argv, url, log = make()
    with pytest.raises(SystemExit):
        with serve(argv, url, log, startup_timeout_s=30):
            os.kill(os.getpid(), signal.SIGTERM)  # e.g. a job scheduler stopping the stage
            time.sleep(5)
    assert wait_dead(started_pids(), within_s=0.5)
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # handler restored


def test_refuses_a_shell_string(tmp_path):
    with pytest.raises(TypeError, match="shell string"):
        with serve("python -m http.server", "http://127.0.0.1:1", tmp_path / "log"):
            pass


def test_free_port_is_bindable_on_loopback():
    import socket

    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


KILLED_RUN = """
import os, signal, sys
from draftlab.lifecycle import serve
argv, url, log = sys.argv[1:-2], sys.argv[-2], sys.argv[-1]
with serve(argv, url, log, startup_timeout_s=30):
    os.kill(os.getpid(), signal.SIGKILL)  # kill -9: no cleanup runs
"""


def test_a_server_left_by_a_killed_run_is_stopped_by_the_next_one(fake, tmp_path):
    import subprocess

    make, started_pids = fake
    argv, url, log = make()
    argv = [str(a) for a in argv]
    r = subprocess.run([sys.executable, "-c", KILLED_RUN, *argv, url, str(log)], cwd=os.getcwd(), timeout=60)
    assert r.returncode == -signal.SIGKILL
    orphans = started_pids()
    assert not any(dead(p) for p in orphans) and httpx.get(url + "/health").status_code == 200  # still serving
    assert log.with_name(log.name + ".pid").exists()
    argv2, url2, _ = make()
    with serve(argv2, url2, log, startup_timeout_s=30):
        assert wait_dead(orphans, within_s=0.5)  # stopped before the new one started
    assert not log.with_name(log.name + ".pid").exists()


def test_a_pidfile_naming_another_program_stops_nothing(fake):
    make, started_pids = fake
    argv, url, log = make()
    log.parent.mkdir(parents=True, exist_ok=True)
    log.with_name(log.name + ".pid").write_text(json.dumps({"pgid": os.getpid(), "argv": ["not", "this"]}))
    with serve(argv, url, log, startup_timeout_s=30):
        pass
    assert not dead(os.getpid())


def test_a_port_already_in_use_is_refused_before_launch(fake, tmp_path):
    """Otherwise /health would answer for the other server, and it would be measured instead."""
    make, _ = fake
    argv, url, log = make()
    with serve(argv, url, log, startup_timeout_s=30):
        marker = tmp_path / "started"
        second = [sys.executable, "-c", f"open({str(marker)!r}, 'w')"]
        with pytest.raises(UserError, match=r"port \d+ on 127.0.0.1 is already in use"):
            with serve(second, url, tmp_path / "logs" / "second.log", startup_timeout_s=30):
                pass
        assert not marker.exists()  # nothing was launched


def test_servers_of_one_group_start_one_after_another_and_groups_start_together(tmp_path):
    """serve_many: a server of a group starts only once the one before it is healthy (two SGLang
    servers loading on one GPU at once misjudge its memory); all are stopped at the end."""
    import sys

    script = tmp_path / "slow_server.py"
    script.write_text(
        "import http.server, sys, time\n"
        "port, stamp = int(sys.argv[1]), sys.argv[2]\n"
        "open(stamp, 'w').write(repr(time.time()))\n"
        "time.sleep(0.6)  # a slow start-up\n"
        "class H(http.server.BaseHTTPRequestHandler):\n"
        "    def do_GET(self):\n"
        "        self.send_response(200); self.end_headers()\n"
        "    def log_message(self, *a): pass\n"
        "http.server.HTTPServer(('127.0.0.1', port), H).serve_forever()\n")
    ports = []
    while len(ports) < 3:
        p = lifecycle.free_port()
        if p not in ports:
            ports.append(p)
    specs = [([sys.executable, str(script), str(port), str(tmp_path / f"start{i}")], f"http://127.0.0.1:{port}",
              tmp_path / f"s{i}.log", None) for i, port in enumerate(ports)]
    with lifecycle.serve_many(specs, 30, groups=["gpu0", "gpu0", "gpu1"]) as servers:
        assert [s.url for s in servers] == [f"http://127.0.0.1:{p}" for p in ports]  # in the order given
        started = [float((tmp_path / f"start{i}").read_text()) for i in range(3)]
        assert started[1] - started[0] >= 0.6  # the second of gpu0 waited for the first to be healthy
        assert abs(started[2] - started[0]) < 0.5  # gpu1's server started beside gpu0's first
        procs = [s.process for s in servers]
    assert all(p.poll() is not None for p in procs)


def test_an_optional_server_that_fails_to_start_is_reported_in_its_place_and_the_others_go_on(fake, tmp_path):
    """serve_many(optional=...): the bench's sweep reports a configuration whose server did not start
    and measures the others; a server that is not optional fails them all, without waiting for the
    slower ones."""
    make, _ = fake
    specs = []
    for i, (mode, delay) in enumerate([("ok", 0.3), ("crash", 0.0), ("ok", 0.3)]):
        argv, url, _ = make(delay=delay, mode=mode)
        specs.append((argv, url, tmp_path / "logs" / f"s{i}.log", None))
    with lifecycle.serve_many(specs, 30, optional=[False, True, True]) as got:
        assert isinstance(got[1], UserError) and "CRASH-91c2" in str(got[1])  # its log's tail says why
        assert [httpx.get(got[i].url + "/health", timeout=5).status_code for i in (0, 2)] == [200, 200]
        procs = [got[0].process, got[2].process]
    assert all(p.poll() is not None for p in procs)
    argv, url, _ = make(delay=5.0)
    slow = [(argv, url, tmp_path / "logs" / "slow.log", None), specs[1]]
    t0 = time.monotonic()
    with pytest.raises(UserError, match="CRASH-91c2"):
        with lifecycle.serve_many(slow, 30):
            pass
    assert time.monotonic() - t0 < 4.0  # the crash is reported at once, not after the slow server's start-up


def test_work_given_as_meanwhile_runs_while_the_servers_start_and_a_failure_in_it_stops_them(fake, tmp_path):
    """serve_many(meanwhile=...): the bench decodes its offline run while its servers start; the work
    runs after their launch and before their health, and an error in it leaves nothing running."""
    make, started_pids = fake
    argv, url, _ = make(delay=1.5)
    seen = []

    def decode():
        seen.append(httpx.get(url + "/health", timeout=1).status_code if _listening(url) else "starting")

    t0 = time.monotonic()
    with lifecycle.serve_many([(argv, url, tmp_path / "logs" / "s.log", None)], 30, meanwhile=decode) as got:
        assert seen == ["starting"]  # ran once, before the server was up
        assert httpx.get(got[0].url + "/health", timeout=5).status_code == 200  # and the servers are waited for after it
    assert time.monotonic() - t0 >= 1.5

    (tmp_path / "pids").unlink()
    argv, url, _ = make(delay=0.2)

    def fails():
        deadline = time.monotonic() + 10
        while not (tmp_path / "pids").exists() and time.monotonic() < deadline:  # the server is running
            time.sleep(0.05)
        raise RuntimeError("the offline run failed")

    with pytest.raises(RuntimeError, match="the offline run failed"):
        with lifecycle.serve_many([(argv, url, tmp_path / "logs" / "t.log", None)], 30, meanwhile=fails):
            pass
    assert wait_dead(started_pids())  # the server and its child are stopped


def _listening(url: str) -> bool:
    try:
        httpx.get(url + "/health", timeout=0.2)
        return True
    except httpx.HTTPError:
        return False


def test_server_ports_are_drawn_below_the_range_the_os_hands_out_to_others(tmp_path, monkeypatch):
    """A server started beside others binds its port only after loading its model; meanwhile the
    others take ports from the OS's ephemeral range (SGLang's NCCL port). A port drawn from below
    that range cannot be taken that way."""
    from draftlab import lifecycle
    from draftlab.sglang.launch import free_port as sglang_free_port

    rng = tmp_path / "ip_local_port_range"
    rng.write_text("32768\t60999\n")
    monkeypatch.setattr(lifecycle, "EPHEMERAL_RANGE", rng)
    ports = {sglang_free_port() for _ in range(50)}
    assert all(20000 <= p < 32768 for p in ports), sorted(ports)
    rng.write_text("20500\t60999\n")  # too little room below it: the whole allowed span again
    assert all(20000 <= sglang_free_port() <= 55535 for _ in range(20))
    monkeypatch.setattr(lifecycle, "EPHEMERAL_RANGE", tmp_path / "absent")  # not Linux: the whole span
    assert all(20000 <= sglang_free_port() <= 55535 for _ in range(20))
