"""Start a server process, wait until it is healthy, and always stop it: the one way we run servers.

    with serve(["python", "-m", "draftlab.engine.server", "--model-path", m, "--port", str(port)],
               f"http://127.0.0.1:{port}", log_path="logs/server.log", startup_timeout_s=60) as srv:
        httpx.post(srv.url + "/generate", json=...)

The command is an argv list (never a shell string). It runs in its own process group, so that
stopping it also stops the workers it spawned (SGLang starts scheduler and detokenizer
processes), and so that Ctrl-C in the terminal reaches only us: we then stop the group
ourselves. stdout and stderr go to one log file, which is kept. On exit of the `with` block,
normal or not (exception, Ctrl-C, SIGTERM from `dvc` or a job scheduler), the whole group gets
SIGTERM, then SIGKILL after a grace period.

A `kill -9` of this process cannot run any cleanup, and the server keeps running. So each
server's process group and argv are written next to its log (`<log>.pid`), and the next serve()
with the same log stops a server that a killed run left behind before starting its own (only when
that process still runs the recorded argv, so a reused pid is never touched).
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import httpx

from draftlab.errors import UserError

POLL_S = 0.25  # seconds between /health probes while starting
PROBE_TIMEOUT_S = 5.0  # one /health request; a loaded server answers in milliseconds
GRACE_S = 10.0  # seconds between SIGTERM and SIGKILL; SGLang frees GPU memory within a few
LOG_TAIL_LINES = 40  # server log lines shown when it fails to start


EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")  # Linux: the ports bind(port 0) hands out


def ephemeral_low() -> int | None:
    """The lowest port the OS hands out for bind(port 0) (Linux's ip_local_port_range), or None."""
    try:
        return int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def free_port(host: str = "127.0.0.1", highest: int = 65535, lowest: int = 20000) -> int:
    """A TCP port free right now on `host` (another process may still take it), at most `highest`.

    highest < 65535: drawn from lowest..highest, and below the OS's ephemeral range where that
    leaves room. A server binds its port only after loading its model, and servers started
    together take ephemeral ports meanwhile (SGLang: its NCCL port, from bind(port 0)); one of them
    once took the port another was about to bind. highest = 65535: the OS picks (ephemeral range).
    """
    if highest >= 65535:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            return s.getsockname()[1]
    import random

    eph = ephemeral_low()
    top = min(highest, eph - 1) if eph is not None and eph - 1 - lowest >= 1000 else highest
    span = range(lowest, top + 1)
    for port in random.sample(span, min(200, len(span))):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    raise UserError(f"no free TCP port found in {lowest}..{top} on {host}")


def log_tail(path: str | os.PathLike, lines: int = LOG_TAIL_LINES) -> str:
    try:
        with open(path, "rb") as f:
            tail = deque(f, maxlen=lines)
    except OSError:
        return "(no log)"
    text = b"".join(tail).decode("utf-8", "replace").rstrip()
    return text or "(log is empty)"


@dataclass
class Server:
    """A started server: base URL (no trailing slash), process, log file."""

    url: str
    process: subprocess.Popen
    log_path: Path
    stopped: bool = False  # stop() has run: its process group is gone, and the pgid may belong to another now
    launched: float | None = None  # time.time() just before its process started
    healthy_at: float | None = None  # time.time() when its /health first answered 200 (draftlab.sglang.startup)
    polled_from: float | None = None  # time.time() when this process began to poll its /health (after `meanwhile` work)

    @property
    def pid(self) -> int:
        return self.process.pid


def wait_healthy(srv: Server, timeout_s: float) -> None:
    """Poll GET {url}/health until it returns 200; fail early if the process exits."""
    wait_all_healthy([srv], timeout_s)


def wait_all_healthy(servers: list[Server], timeout_s: float, optional: list[bool] | None = None) -> list[UserError | None]:
    """wait_healthy for several servers at once, so that the wait is the slowest start-up, not the
    sum: per server None once healthy, or the UserError saying why not (its process exited, or
    `timeout_s` passed). A server not marked `optional` raises its error as soon as it fails."""
    optional = optional or [False] * len(servers)
    deadline = time.monotonic() + timeout_s
    errors: list[UserError | None] = [None] * len(servers)
    last: list[str | None] = ["no answer yet"] * len(servers)  # what each /health said; None: 200
    pending = list(range(len(servers)))
    for srv in servers:
        srv.polled_from = srv.polled_from or time.time()
    with httpx.Client(timeout=PROBE_TIMEOUT_S, trust_env=False) as client:  # trust_env: no proxy for loopback
        while pending:
            if time.monotonic() >= deadline:
                for i in pending:
                    errors[i] = _not_healthy(servers[i], timeout_s, last[i])
            for i in list(pending):
                if errors[i] is None:
                    try:
                        last[i] = _probe(servers[i], client)
                    except UserError as e:
                        errors[i] = e
                if errors[i] is not None and not optional[i]:
                    raise errors[i]
                if errors[i] is None and last[i] is None:
                    servers[i].healthy_at = time.time()
                if errors[i] is not None or last[i] is None:
                    pending.remove(i)
            if pending:
                time.sleep(POLL_S)
    return errors


def _not_healthy(srv: Server, timeout_s: float, last: str | None) -> UserError:
    return UserError(f"server not healthy after {timeout_s:g} s ({srv.url}/health: {last}): {srv.process.args!r}\n"
                     f"last lines of {srv.log_path}:\n{log_tail(srv.log_path)}")


def _probe(srv: Server, client: httpx.Client) -> str | None:
    """None once GET {url}/health returns 200, else what it answered; UserError when the process has exited."""
    code = srv.process.poll()
    if code is not None:
        raise UserError(
            f"server exited with code {code} while starting: {srv.process.args!r}\n"
            f"last lines of {srv.log_path}:\n{log_tail(srv.log_path)}"
        )
    try:
        r = client.get(srv.url + "/health")
    except httpx.HTTPError as e:
        return type(e).__name__
    return None if r.status_code == 200 else f"HTTP {r.status_code}"


def stop(srv: Server, grace_s: float = GRACE_S) -> None:
    """SIGTERM the server's process group, SIGKILL it after `grace_s`; safe to call twice (the
    second call signals nothing: the group id may have been given to other processes since)."""
    if srv.stopped:
        return
    pgid = srv.process.pid  # leader of its own group: group id == its pid
    _signal_group(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    try:
        srv.process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    # Children may outlive the leader; wait for the rest of the group within the same grace.
    while _group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.05)
    if _group_alive(pgid):
        _signal_group(pgid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        srv.process.wait(timeout=grace_s)
    srv.stopped = True


@contextlib.contextmanager
def serve(
    argv: list[str],
    url: str,
    log_path: str | os.PathLike,
    startup_timeout_s: float = 600.0,
    env: dict | None = None,
    grace_s: float = GRACE_S,
):
    """Run `argv` as a server reachable at `url`; yields a Server once /health returns 200."""
    with serve_many([(argv, url, log_path, env)], startup_timeout_s, grace_s) as servers:
        yield servers[0]


@contextlib.contextmanager
def serve_many(specs: list[tuple[list[str], str, str | os.PathLike, dict | None]], startup_timeout_s: float = 600.0,
               grace_s: float = GRACE_S, groups: list | None = None, optional: list[bool] | None = None,
               meanwhile: Callable[[], None] | None = None):
    """Run several servers, each (argv, url, log_path, env) as `serve` runs one; yields the Servers,
    in the order of `specs`, once every /health returns 200. Any failure stops them all, but that of
    a server marked `optional`: it is stopped, its place in the list holds the UserError saying why,
    and the others go on.

    All start at the same time, so the wait is the slowest start-up rather than the sum (SGLang
    takes 30-70 s). groups: one key per spec; servers of one group start one after the other, each
    once the one before is healthy. That is for servers that size their memory from what is free
    when they start (SGLang without --max-total-tokens: two loading on one GPU at once misjudge its
    free memory, and the second refuses to start); servers given explicit memory pools need no
    group (draftlab.sglang.fleet). None: every server in a group of its own.

    meanwhile: work of this process run once the first round is launched, before waiting on its
    health, so that it overlaps their start-up; if it raises, the servers are stopped."""
    groups = list(range(len(specs))) if groups is None else list(groups)
    optional = [False] * len(specs) if optional is None else list(optional)
    if len(groups) != len(specs) or len(optional) != len(specs):
        raise ValueError("groups and optional need one entry per spec")
    for argv, url, log_path, _ in specs:
        if isinstance(argv, str) or not argv:
            raise TypeError("argv must be a non-empty list of arguments, not a shell string")
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        stop_left_behind(_pidfile(log_path), grace_s)
    for _, url, _, _ in specs:
        refuse_taken_port(url)
    # Round r starts the r-th server of every group, then waits for them all.
    rank = [groups[:i].count(g) for i, g in enumerate(groups)]
    rounds = [[i for i in range(len(specs)) if rank[i] == r] for r in range(max(rank, default=-1) + 1)]
    got: dict[int, Server | UserError] = {}
    with contextlib.ExitStack() as logs, _sigterm_as_exit():
        try:
            for members in rounds:
                for i in members:
                    try:
                        got[i] = _launch(specs[i], logs)
                    except UserError as e:
                        if not optional[i]:
                            raise
                        got[i] = e
                if meanwhile is not None and members is rounds[0]:
                    meanwhile()
                running = [i for i in members if isinstance(got[i], Server)]
                errors = wait_all_healthy([got[i] for i in running], startup_timeout_s, [optional[i] for i in running])
                for i, error in zip(running, errors):
                    if error is not None:  # an optional server that did not start: stopped now, reported in its place
                        stop(got[i], grace_s)
                        _pidfile(got[i].log_path).unlink(missing_ok=True)
                        got[i] = error
            yield [got[i] for i in range(len(specs))]
        finally:
            servers = [srv for srv in got.values() if isinstance(srv, Server)]
            for srv in servers:
                if not srv.stopped:
                    _signal_group(srv.process.pid, signal.SIGTERM)  # all at once: their grace periods overlap
            for srv in servers:
                stop(srv, grace_s)
                _pidfile(srv.log_path).unlink(missing_ok=True)


def _launch(spec: tuple[list[str], str, str | os.PathLike, dict | None], logs: contextlib.ExitStack) -> Server:
    """Start one server of serve_many in its own process group, its output to its log; records its pidfile."""
    argv, url, log_path, env = spec
    log = logs.enter_context(open(log_path, "wb"))
    launched = time.time()
    try:
        proc = subprocess.Popen(
            [str(a) for a in argv],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,  # own process group (and session): killpg reaches its children
        )
    except OSError as e:
        raise UserError(f"cannot start server {argv[0]!r}: {e}") from None
    _pidfile(log_path).write_text(json.dumps({"pgid": proc.pid, "argv": [str(a) for a in argv]}))
    return Server(url.rstrip("/"), proc, Path(log_path), launched=launched)


def _pidfile(log_path: str | os.PathLike) -> Path:
    log_path = Path(log_path)
    return log_path.with_name(log_path.name + ".pid")


def refuse_taken_port(url: str) -> None:
    """Stop before launching when something already listens at `url`'s port: /health would then
    answer for that other server, and every figure would be measured on it."""
    from urllib.parse import urlsplit

    u = urlsplit(url)
    host, port = u.hostname or "127.0.0.1", u.port or (443 if u.scheme == "https" else 80)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        if s.connect_ex((host, port)) == 0:
            raise UserError(f"port {port} on {host} is already in use (another server is listening there); "
                            "stop it, or choose another port (bench.port for SGLang)")


def stop_left_behind(pidfile: Path, grace_s: float = GRACE_S) -> None:
    """Stop the server recorded in `pidfile` if it still runs its recorded argv (a run killed with -9)."""
    try:
        rec = json.loads(pidfile.read_text())
        pgid, argv = int(rec["pgid"]), [str(a) for a in rec["argv"]]
    except (OSError, ValueError, KeyError, TypeError):
        return
    try:
        with open(f"/proc/{pgid}/cmdline", "rb") as f:
            running = [a.decode("utf-8", "replace") for a in f.read().split(b"\0") if a]
    except OSError:
        running = None
    if running == argv and _group_alive(pgid):
        print(f"lifecycle: stopping a server an earlier, killed run left running (pid {pgid}: {' '.join(argv)[:200]})", flush=True)
        _signal_group(pgid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while _group_alive(pgid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if _group_alive(pgid):
            _signal_group(pgid, signal.SIGKILL)
    pidfile.unlink(missing_ok=True)


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _group_alive(pgid: int) -> bool:
    """True while a process of the group runs (a zombie runs nothing: dead, just not reaped yet)."""
    if not os.path.isdir("/proc"):  # not Linux: ask the kernel, which counts zombies as alive
        try:
            os.killpg(pgid, 0)
            return True
        except OSError:
            return False
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                stat = f.read().decode("utf-8", "replace")
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()  # after the command name: state ppid pgrp ...
        if len(fields) >= 3 and int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


@contextlib.contextmanager
def _sigterm_as_exit():
    """Turn SIGTERM into SystemExit while a server runs, so `finally` stops it (main thread only)."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        yield
        return

    def handler(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
