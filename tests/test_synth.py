"""Synthesis: both backends give the same rows, runs resume without loss or duplicates,
failures are listed with reasons, reasoning is kept or dropped, and the API key stays secret."""
import hashlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import yaml

from draftlab.data import synth
from draftlab.errors import UserError
from draftlab.lifecycle import free_port, serve
from tests.support.micro import make_micro_tokenizer, save_micro_model
from draftlab.engine.server import launch_command
from draftlab.data.tasks import END_THINK, THINK

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
# Questions the test target is trained to answer with reasoning: (question, reasoning, answer).
TAUGHT = [("Reverse abc", "c b a", "cba"), ("Sort 3 1 2", "1 < 2 < 3", "1 2 3"), ("Add 2 and 2", "2+2", "4")]
OTHER = ["What is 7 times 6?", "Name a colour", "Count the letters in 'banana'", "Is 17 prime?", "Spell 'cat' backwards"]
SECRET = "sk-test-9d8c7b6a5f4e3d2c"


def reasoned(reasoning, answer):
    return f"{THINK}\n{reasoning}\n{END_THINK}\n{answer}"


def _load_stage():
    spec = importlib.util.spec_from_file_location("stage_synthesize", ROOT / "stages" / "synthesize.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


stage = _load_stage()


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """A micro target taught to answer TAUGHT as '<think>\\nR\\n</think>\\nA' (random text otherwise)."""
    path = tmp_path_factory.mktemp("target")
    model = save_micro_model(path, arch="llama", seed=1)
    tok = make_micro_tokenizer()
    seqs = []
    for q, r, a in TAUGHT:
        p = synth.prompt_ids(tok, [{"role": "user", "content": q}])
        seqs.append((p, p + tok(reasoned(r, a), add_special_tokens=False)["input_ids"] + [tok.eos_token_id]))
    width = max(len(f) for _, f in seqs)
    x = torch.tensor([f + [tok.pad_token_id] * (width - len(f)) for _, f in seqs])
    labels = torch.tensor([[-100] * len(p) + f[len(p):] + [-100] * (width - len(f)) for p, f in seqs])
    torch.manual_seed(0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model.train()
    for _ in range(300):  # converges in ~100 steps
        loss = model(input_ids=x, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if loss.item() < 0.01:
            break
    model.eval()
    for (p, _), (q, r, a) in zip(seqs, TAUGHT):
        out = model.generate(torch.tensor([p]), max_new_tokens=40, do_sample=False, pad_token_id=tok.pad_token_id)
        assert tok.decode(out[0, len(p):], skip_special_tokens=True) == reasoned(r, a), "test target did not learn"
    model.save_pretrained(path)
    return path


def row(text):
    return {"id": hashlib.sha256(text.encode()).hexdigest()[:16], "messages": [{"role": "user", "content": text}], "source": "test"}


def make_prompts(dir, train, evals):
    dir.mkdir(parents=True, exist_ok=True)
    for name, texts in (("train", train), ("eval", evals)):
        (dir / f"{name}.jsonl").write_text("".join(json.dumps(row(t)) + "\n" for t in texts))
    (dir / "manifest.json").write_text(json.dumps({"config_hash": hashlib.sha256(str((train, evals)).encode()).hexdigest()}))
    return dir


def write_params(dir, model, **synth_params):
    base = yaml.safe_load((ROOT / "params.yaml").read_text())
    params = {"target": {**base["target"], "model": str(model), "device": "cpu"},
              "synth": {**base["synth"], "max_new_tokens": 24, "retry_backoff_s": 0.01, **synth_params}}
    (dir / "params.yaml").write_text(yaml.safe_dump(params))


def run_stage(tmp, monkeypatch, prompts, out, model, **synth_params):
    """Run the stage in this process, from `tmp` (where its params.yaml is); returns its output."""
    tmp.mkdir(parents=True, exist_ok=True)
    write_params(tmp, model, **synth_params)
    monkeypatch.chdir(tmp)
    stage.main(prompts, out)
    return read_out(out)


def read_out(out):
    rows = {s: [json.loads(x) for x in (out / f"{s}.jsonl").read_text().splitlines()] for s in synth.SPLITS}
    return rows, json.loads((out / "manifest.json").read_text())


@pytest.fixture(scope="module")
def plain_server(target):
    port = free_port()
    with serve(launch_command(target, port), f"http://127.0.0.1:{port}", target / "plain.log", 120, env=ENV) as srv:
        yield srv.url


@pytest.fixture(scope="module")
def reasoning_server(target):
    port = free_port()
    argv = launch_command(target, port, reasoning_parser="qwen3")
    with serve(argv, f"http://127.0.0.1:{port}", target / "reasoning.log", 120, env=ENV) as srv:
        yield srv.url


# ---------------------------------------------------------------------------------------------


def test_openai_backend_gives_the_same_rows_as_hf_for_greedy(tmp_path, monkeypatch, target, plain_server):
    texts = [q for q, _, _ in TAUGHT] + OTHER
    prompts = make_prompts(tmp_path / "prompts", texts[:6], texts[6:])
    hf_rows, hf_man = run_stage(tmp_path / "hf", monkeypatch, prompts, tmp_path / "hf" / "out", target, batch_size=4)
    monkeypatch.setattr(synth, "WORKERS_PER_CLIENT", 2)  # 3 in flight over two HTTP clients, as 1,024 go over 64
    oa_rows, oa_man = run_stage(tmp_path / "oa", monkeypatch, prompts, tmp_path / "oa" / "out", target,
                                backend="openai", base_url=plain_server + "/v1", concurrency=3)
    assert oa_rows == hf_rows
    assert [r["id"] for r in hf_rows["train"]] == [row(t)["id"] for t in texts[:6]]  # input order
    assert hf_rows["train"][0]["messages"] == row(texts[0])["messages"] + [{"role": "assistant", "content": reasoned(*TAUGHT[0][1:])}]
    for man in (hf_man, oa_man):
        assert (man["info"]["ok"], man["info"]["errors"], man["info"]["input"]) == (8, 0, 8)
        assert man["inputs"]["prompts"] == json.loads((prompts / "manifest.json").read_text())["config_hash"]
    assert hf_man["info"]["tokenizer_hash"] == oa_man["info"]["tokenizer_hash"]
    assert hf_man["info"]["chat_template_hash"] == oa_man["info"]["chat_template_hash"]
    assert oa_man["info"]["served_model"] == str(target)
    assert not list((tmp_path / "oa" / "out").glob("*.partial")) and not (tmp_path / "oa" / "out" / synth.RESUME_FILE).exists()


def test_the_sglang_backend_starts_its_own_server_answers_as_hf_does_and_stops_it(tmp_path, monkeypatch, target):
    """synth.backend sglang on a CPU: `python -m sglang.launch_server` is the stand-in (the reference server)."""
    import httpx

    standin = ROOT / "tests" / "fixtures" / "sglang_standin"
    monkeypatch.setenv("PYTHONPATH", f"{standin}{os.pathsep}{ROOT}")
    texts = [q for q, _, _ in TAUGHT] + OTHER[:2]
    prompts = make_prompts(tmp_path / "prompts", texts[:3], texts[3:])
    hf_rows, _ = run_stage(tmp_path / "hf", monkeypatch, prompts, tmp_path / "hf" / "out", target, batch_size=4)
    out = tmp_path / "sg" / "out"
    sg_rows, man = run_stage(tmp_path / "sg", monkeypatch, prompts, out, target, backend="sglang", concurrency=2,
                             server_args=["--grammar-backend", "none"], startup_timeout_s=120.0)
    assert sg_rows == hf_rows and man["info"]["backend"] == "sglang" and man["info"]["servers"] == 1
    log = (out / ".sglang-server.log").read_text()
    assert "--grammar-backend" in log  # synth.server_args reached the launch
    port = int(log.split("--port ", 1)[1].split(";")[0])
    with pytest.raises(httpx.HTTPError):  # stopped with the stage
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
    with pytest.raises(UserError, match=r"synth.server_args: --port is set from \(a free port\); remove it from synth.server_args"):
        run_stage(tmp_path / "bad", monkeypatch, prompts, tmp_path / "bad" / "out", target, backend="sglang",
                  server_args=["--port", "1234"])
    with pytest.raises(UserError, match=r"--mem-fraction-static is set from synth.mem_fraction_static"):
        run_stage(tmp_path / "bad2", monkeypatch, prompts, tmp_path / "bad2" / "out", target, backend="sglang",
                  server_args=["--mem-fraction-static", "0.3"])


def test_several_servers_of_the_target_share_the_answers_and_all_stop(tmp_path, monkeypatch, target):
    """synth.servers_per_gpu 2: two servers start together, each with half the memory share, requests go to
    both, the answers are those of one server, and both are stopped with the stage."""
    import httpx

    standin = ROOT / "tests" / "fixtures" / "sglang_standin"
    monkeypatch.setenv("PYTHONPATH", f"{standin}{os.pathsep}{ROOT}")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # a CPU machine: the servers keep the environment as it is
    texts = [q for q, _, _ in TAUGHT] + OTHER[:4]
    prompts = make_prompts(tmp_path / "prompts", texts[:5], texts[5:])
    one, _ = run_stage(tmp_path / "one", monkeypatch, prompts, tmp_path / "one" / "out", target, backend="sglang",
                       concurrency=4, startup_timeout_s=120.0)
    out = tmp_path / "two" / "out"
    two, man = run_stage(tmp_path / "two", monkeypatch, prompts, out, target, backend="sglang", concurrency=4,
                         servers_per_gpu=2, mem_fraction_static=0.6, startup_timeout_s=120.0)
    assert two == one
    assert man["info"]["servers"] == 2 and all(n > 0 for n in man["info"]["requests_per_server"])
    logs = sorted(out.glob(".sglang-server-*.log"))
    assert len(logs) == 2
    for log in logs:
        text = log.read_text()
        assert "--mem-fraction-static', '0.3'" in text  # 0.6 shared by two servers
        port = int(text.split("--port ", 1)[1].split(";")[0])
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)


@pytest.mark.parametrize("mode", ["keep", "drop"])
def test_reasoning_keep_and_drop_agree_across_backends(tmp_path, monkeypatch, target, reasoning_server, mode):
    import httpx

    # The server really returns the reasoning separately (its parser strips the markers).
    msg = httpx.post(reasoning_server + "/v1/chat/completions", timeout=60,
                     json={"messages": row(TAUGHT[0][0])["messages"], "max_tokens": 40, "temperature": 0}).json()["choices"][0]["message"]
    assert msg["reasoning_content"].strip() == TAUGHT[0][1] and msg["content"] == TAUGHT[0][2]

    prompts = make_prompts(tmp_path / "prompts", [q for q, _, _ in TAUGHT[:2]], [TAUGHT[2][0]])
    hf, _ = run_stage(tmp_path / "hf", monkeypatch, prompts, tmp_path / "hf" / "out", target, reasoning=mode, max_new_tokens=40)
    oa, _ = run_stage(tmp_path / "oa", monkeypatch, prompts, tmp_path / "oa" / "out", target, reasoning=mode, max_new_tokens=40,
                      backend="openai", base_url=reasoning_server + "/v1")
    assert oa == hf
    contents = [r["messages"][-1]["content"] for r in hf["train"] + hf["eval"]]
    assert contents == [reasoned(r, a) if mode == "keep" else a for _, r, a in TAUGHT]


def test_kill_9_mid_run_then_rerun_loses_and_duplicates_nothing(tmp_path, monkeypatch, target):
    texts = [f"{q} (variant {i})" for i in range(8) for q in OTHER]  # 40 prompts
    prompts = make_prompts(tmp_path / "prompts", texts[:34], texts[34:])
    clean, _ = run_stage(tmp_path / "clean", monkeypatch, prompts, tmp_path / "clean" / "out", target, batch_size=1)

    work, out = tmp_path / "work", tmp_path / "work" / "out"
    work.mkdir()
    write_params(work, target, batch_size=1)
    proc = subprocess.Popen([sys.executable, "-m", "stages.synthesize", "--prompts", str(prompts), "--out", str(out)],
                            cwd=work, env={**ENV, "PYTHONPATH": str(ROOT)}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    partial = out / "train.jsonl.partial"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if partial.exists() and partial.read_text().count("\n") >= 3:
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the run finished before it could be interrupted"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    n_done = partial.read_text().count("\n")
    assert 3 <= n_done < 34
    with open(partial, "a") as f:
        f.write('{"id": "torn-by-the-kill", "mess')  # a row cut off mid-write

    resumed, man = run_stage(work, monkeypatch, prompts, out, target, batch_size=1)
    assert resumed == clean  # every row once, in input order, same answers
    assert man["info"]["counts"]["train"]["resumed"] >= n_done
    assert not partial.exists()


class ListBackend:
    """Answers from a fixed function; raises KeyboardInterrupt after `stop_after` rows."""

    def __init__(self, stop_after=None):
        self.stop_after, self.seen = stop_after, []

    def answer(self, rows, done):
        for r in rows:
            if self.stop_after is not None and len(self.seen) == self.stop_after:
                raise KeyboardInterrupt
            self.seen.append(r["id"])
            done(r, synth.Reply([synth.Answer(f"answer to {r['id']}", "stop", 3)]), None)


def answer_row(prompt, reply):
    """An output row in the shape the synthesize stage writes (what load_partial accepts on resume)."""
    return {"id": prompt["id"], "messages": synth.conversation(prompt, reply),
            "finish_reason": reply.finish_reason, "completion_tokens": reply.completion_tokens}


def test_ctrl_c_then_rerun_answers_only_the_rest(tmp_path):
    splits = {"train": [row(f"q{i}") for i in range(6)], "eval": [row("e0"), row("e1")]}
    make = answer_row
    first = ListBackend(stop_after=4)
    with pytest.raises(KeyboardInterrupt):
        synth.synthesize(splits, first, tmp_path, "key-1", make)
    second = ListBackend()
    stats = synth.synthesize(splits, second, tmp_path, "key-1", make)
    assert not set(first.seen) & set(second.seen)
    assert sorted(first.seen + second.seen) == sorted(r["id"] for rows in splits.values() for r in rows)
    for split, rows in splits.items():
        out = [json.loads(x) for x in (tmp_path / f"{split}.jsonl").read_text().splitlines()]
        assert [r["id"] for r in out] == [r["id"] for r in rows]
    assert stats["counts"]["train"]["resumed"] == 4

    # Partial rows from other settings are never mixed in: a new key starts over.
    with pytest.raises(KeyboardInterrupt):
        synth.synthesize(splits, ListBackend(stop_after=2), tmp_path, "key-1", make)
    third = ListBackend()
    synth.synthesize(splits, third, tmp_path, "key-2", make)
    assert len(third.seen) == 8


def test_a_synthesis_stopped_on_one_node_is_finished_on_the_next_from_its_results_pack(tmp_path):
    """A GPU job's time limit stops synthesis midway: the results pack (DRAFTLAB_PACK_ANSWERS=1) carries the
    conversations it finished, and the next node, with the pack unpacked into its tree, answers only the rest."""
    import tarfile

    from draftlab.experiments.grid import pack

    splits = {"train": [row(f"q{i}") for i in range(6)], "eval": [row("e0"), row("e1")]}
    first_node, next_node = tmp_path / "first", tmp_path / "next"
    stopped = ListBackend(stop_after=5)
    with pytest.raises(KeyboardInterrupt):
        synth.synthesize(splits, stopped, first_node / "data/synth", "key-1", answer_row)
    pack(tmp_path / "results.tar.gz", first_node, answers=True)
    with tarfile.open(tmp_path / "results.tar.gz") as tar:
        tar.extractall(next_node, filter="data")

    rest = ListBackend()
    stats = synth.synthesize(splits, rest, next_node / "data/synth", "key-1", answer_row)
    assert len(stopped.seen) == 5 and sorted(stopped.seen + rest.seen) == sorted(r["id"] for rows in splits.values() for r in rows)
    assert stats["counts"]["train"]["resumed"] + stats["counts"]["eval"]["resumed"] == 5
    for split, rows in splits.items():
        out = [json.loads(x) for x in (next_node / f"data/synth/{split}.jsonl").read_text().splitlines()]
        assert [r["id"] for r in out] == [r["id"] for r in rows]


class CallsBackend(ListBackend):
    """Records the rows of each answer() call; answers them in reverse order, as a pool finishes them."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def answer(self, rows, done):
        self.calls.append([r["id"] for r in rows])
        super().answer(list(reversed(rows)), done)


def test_every_split_is_answered_by_one_pool_and_lands_in_its_own_file(tmp_path):
    """The splits share the backend's workers (no split waits for another's tail), yet every answer
    is written to its own split's file, in that split's input order, and counted there."""
    splits = {"train": [row(f"q{i}") for i in range(5)], "eval": [row("e0"), row("e1")]}
    backend = CallsBackend()
    stats = synth.synthesize(splits, backend, tmp_path, "key-1", answer_row)
    assert len(backend.calls) == 1 and sorted(backend.calls[0]) == sorted(r["id"] for rows in splits.values() for r in rows)
    for split, rows in splits.items():
        out = [json.loads(x) for x in (tmp_path / f"{split}.jsonl").read_text().splitlines()]
        assert [r["id"] for r in out] == [r["id"] for r in rows]
        assert stats["counts"][split] == {"input": len(rows), "resumed": 0, "reused": 0, "ok": len(rows), "errors": 0}


FAKE_OPENAI = textwrap.dedent('''
    import http.server, json, sys, time
    port, log = int(sys.argv[1]), sys.argv[2]
    class H(http.server.BaseHTTPRequestHandler):
        def reply(self, code, body):
            data = json.dumps(body).encode() if not isinstance(body, bytes) else body
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        def do_GET(self):
            if self.path == "/health":
                self.reply(200, {})
            elif self.path == "/v1/models":
                self.reply(200, {"object": "list", "data": [{"id": "fake-model"}]})
            else:
                self.reply(404, {})
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            text = body["messages"][-1]["content"]
            auth = self.headers.get("Authorization", "")
            with open(log, "a") as f:
                f.write(json.dumps({"text": text, "auth": auth, "model": body["model"]}) + "\\n")
            if "fail" in text:   # a server error that even echoes the credentials back
                return self.reply(500, f"internal error handling request with {auth}".encode())
            if "reject" in text:
                return self.reply(400, {"error": {"message": "unsupported"}})
            if "slow" in text:
                time.sleep(3)
            self.reply(200, {"choices": [{"message": {"role": "assistant", "content": "ok: " + text},
                                          "finish_reason": "stop"}], "usage": {"completion_tokens": 3}})
        def log_message(self, *a):
            pass
    http.server.ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()
''')


@pytest.fixture
def failing_run(tmp_path, monkeypatch, target, capsys):
    script = tmp_path / "fake_openai.py"
    script.write_text(FAKE_OPENAI)
    requests_log = tmp_path / "server_requests.jsonl"
    train = ["good one", "please fail", "good two", "reject this", "too slow"]
    prompts = make_prompts(tmp_path / "prompts", train, ["good three", "fail again"])
    monkeypatch.setenv("DRAFTLAB_TEST_KEY", SECRET)
    port = free_port()
    with serve([sys.executable, script, port, requests_log], f"http://127.0.0.1:{port}", tmp_path / "fake.log", 30):
        rows, man = run_stage(tmp_path / "run", monkeypatch, prompts, tmp_path / "run" / "out", target, backend="openai",
                              base_url=f"http://127.0.0.1:{port}/v1", api_key_env="DRAFTLAB_TEST_KEY",
                              max_retries=2, timeout_s=0.5, concurrency=4)
    captured = capsys.readouterr()
    requests = [json.loads(x) for x in requests_log.read_text().splitlines()]
    return tmp_path, rows, man, requests, captured.out + captured.err


def test_failed_requests_go_to_errors_jsonl_with_reasons(failing_run):
    tmp, rows, man, requests, _ = failing_run
    errors = {e["id"]: e for e in map(json.loads, (tmp / "run" / "out" / "errors.jsonl").read_text().splitlines())}
    by_text = {t: row(t)["id"] for t in ["please fail", "reject this", "too slow", "fail again"]}
    assert set(errors) == set(by_text.values())
    assert errors[by_text["please fail"]]["error"].startswith("HTTP 500") and "after 3 attempts" in errors[by_text["please fail"]]["error"]
    assert errors[by_text["reject this"]]["error"].startswith("HTTP 400") and "after 1 attempt)" in errors[by_text["reject this"]]["error"]
    assert "timeout_s=0.5" in errors[by_text["too slow"]]["error"]
    assert errors[by_text["fail again"]]["split"] == "eval"
    attempts = {t: sum(r["text"] == t for r in requests) for t in by_text}
    assert attempts == {"please fail": 3, "reject this": 1, "too slow": 3, "fail again": 3}  # 4xx is not retried
    assert [r["messages"][-1]["content"] for r in rows["train"]] == ["ok: good one", "ok: good two"]
    info = man["info"]
    assert info["ok"] + info["errors"] == info["input"] == 7 and info["errors"] == 4
    assert {r["model"] for r in requests} == {"fake-model"}  # asked the server's /v1/models


def test_api_key_is_sent_but_never_written(failing_run):
    tmp, _, _, requests, console = failing_run
    assert {r["auth"] for r in requests} == {f"Bearer {SECRET}"}
    for path in (tmp / "run").rglob("*"):
        if path.is_file():
            assert SECRET not in path.read_text(errors="replace"), path
    assert SECRET not in console
    assert "***" in (tmp / "run" / "out" / "errors.jsonl").read_text()  # the echoed key was masked


def test_a_dead_server_stops_synthesis_after_a_few_connection_failures_naming_the_url(tmp_path, monkeypatch, target):
    # 30 prompts with 4 retries each would be 150 attempts; a refused connection is not worth more
    # than synth.DEAD_SERVER_FAILURES of them in a row.
    prompts = make_prompts(tmp_path / "prompts", [f"q{i}" for i in range(20)], [f"e{i}" for i in range(10)])
    url = f"http://127.0.0.1:{free_port()}/v1"
    attempts = []
    real_post = synth.httpx.AsyncClient.post

    async def counted(self, *a, **kw):
        attempts.append(1)
        return await real_post(self, *a, **kw)

    monkeypatch.setattr(synth.httpx.AsyncClient, "post", counted)
    with pytest.raises(UserError, match=f"cannot connect to {url}.*{synth.DEAD_SERVER_FAILURES} attempts in a row") as e:
        run_stage(tmp_path / "run", monkeypatch, prompts, tmp_path / "run" / "out", target, backend="openai",
                  base_url=url, model_name="m", max_retries=4, concurrency=1)
    assert "ConnectError" in str(e.value) and "re-run" in str(e.value)
    assert len(attempts) == synth.DEAD_SERVER_FAILURES
    assert not (tmp_path / "run" / "out" / "manifest.json").exists()


def test_prompt_too_long_for_the_context_names_the_row(tmp_path, monkeypatch, target):
    long = "x" * 600  # one token per byte: over the micro target's 512-token context
    prompts = make_prompts(tmp_path / "prompts", ["short", long], ["fine"])
    with pytest.raises(UserError, match=f"row {row(long)['id']} \\(train\\)") as e:
        run_stage(tmp_path / "run", monkeypatch, prompts, tmp_path / "run" / "out", target)
    assert row("short")["id"] not in str(e.value) and "synth.max_new_tokens" in str(e.value)


def test_think_layout_comes_from_the_chat_template():
    layout = synth.think_layout(make_micro_tokenizer())
    assert layout == ("<think>\n", "\n</think>\n")
    # Newer SGLang keeps the newlines around the reasoning, older ones strip them: same content.
    for reasoning, answer in (("\nR\n", "A"), ("R\n", "A"), ("R", " A")):
        assert synth.rebuild_content(reasoning, answer, layout, "stop") == "<think>\nR\n</think>\nA"
    assert synth.rebuild_content("\nhalf a thought", "", layout, "length") == "<think>\nhalf a thought"
    assert synth.rebuild_content(None, "inline", layout, "stop") == "inline"
    assert synth.answer_only("<think>\nR\n</think>\nA") == "A"
    assert synth.answer_only("<think>\ncut off") == "" and synth.answer_only("no reasoning") == "no reasoning"


# Resume state that is not what synthesize wrote: named by file:line with the fix, never a traceback.
GOOD = json.dumps(answer_row(row("q0"), synth.Reply([synth.Answer("an answer", "stop", 3)])))
NOT_ROWS = {
    b"5": r":2: a JSON int, not an answer row",
    b"[1, 2]": r":2: a JSON list, not an answer row",
    b"{}": r":2: no 'id'",
    b'{"id": 3}': r":2: no 'id'",
    json.dumps({**json.loads(GOOD), "finish_reason": 7}).encode(): r":2: row \w+: 'finish_reason' must be",
    json.dumps({**json.loads(GOOD), "completion_tokens": "9"}).encode(): r":2: row \w+: 'completion_tokens' must be an integer",
    json.dumps({k: v for k, v in json.loads(GOOD).items() if k != "messages"}).encode(): r":2: row \w+: 'messages' must be",
    json.dumps({**json.loads(GOOD), "messages": [{"role": "user", "content": "q"}]}).encode(): r":2: row \w+: 'messages' must be",
    b'{"id": "\xff"}': r":2: not UTF-8 text",
    b"[" * 100_000 + b"]" * 100_000: r":2: not valid JSON",
}


@pytest.mark.parametrize("line", sorted(NOT_ROWS))
def test_a_partial_line_that_is_not_an_answer_row_is_named_by_file_and_line(tmp_path, line):
    path = tmp_path / "train.jsonl.partial"
    path.write_bytes(GOOD.encode() + b"\n" + line + b"\n" + GOOD.encode() + b"\n")
    with pytest.raises(UserError, match=NOT_ROWS[line] + r".*delete that line, or delete .*train.jsonl.partial"):
        synth.load_partial(path)


def test_resume_keeps_only_answers_to_the_very_prompt(tmp_path):
    """A kept row's id is its prompt's content hash: one holding other prompt messages is named."""
    splits = {"train": [row("q0"), row("q1")], "eval": [row("e0")]}
    synth.prepare_resume(tmp_path, "k")
    other = answer_row({**row("q0"), "messages": [{"role": "user", "content": "something else"}]}, synth.Reply([synth.Answer("a", "stop", 1)]))
    (tmp_path / "train.jsonl.partial").write_text(json.dumps(other) + "\n")
    with pytest.raises(UserError, match=r"train.jsonl.partial: row \w+ holds other prompt messages"):
        synth.synthesize(splits, ListBackend(), tmp_path, "k", answer_row)


@pytest.mark.parametrize("marker", ["[]", "5", "null", '"key"', "{bad"])
def test_a_resume_marker_of_another_shape_starts_the_split_over(tmp_path, marker):
    (tmp_path / synth.RESUME_FILE).write_text(marker)
    (tmp_path / "train.jsonl.partial").write_text("5\n")  # would be refused if kept
    assert synth.prepare_resume(tmp_path, "k") is False
    assert not (tmp_path / "train.jsonl.partial").exists()


def test_a_partial_path_that_is_a_folder_is_named_not_removed(tmp_path):
    (tmp_path / "train.jsonl.partial").mkdir()
    with pytest.raises(UserError, match=r"train.jsonl.partial is not a file.*move or delete it"):
        synth.prepare_resume(tmp_path, "k")
    assert (tmp_path / "train.jsonl.partial").is_dir()


def test_conversations_of_more_turns_are_sent_first_and_written_in_input_order(tmp_path):
    """A conversation's turns run one after another: the longest ones go to the backend first, so
    that they do not run alone at the end; each split's file keeps the prompts' order."""
    def convo(text, later):
        return {**row(text), "next_turns": [f"{text} then {k}" for k in range(later)]}

    splits = {"train": [convo("a", 0), convo("b", 3), convo("c", 1), convo("d", 3)], "eval": [convo("e", 5), convo("f", 0)]}
    backend = CallsBackend()
    synth.synthesize(splits, backend, tmp_path, "key-1", answer_row)
    ids = {r["id"]: r for rows in splits.values() for r in rows}
    sent = [len(ids[i].get("next_turns", [])) for i in backend.calls[0]]
    assert sent == [5, 3, 3, 1, 0, 0]
    assert backend.calls[0][1:3] == [splits["train"][1]["id"], splits["train"][3]["id"]]  # ties keep the input order
    for split, rows in splits.items():
        out = [json.loads(x) for x in (tmp_path / f"{split}.jsonl").read_text().splitlines()]
        assert [r["id"] for r in out] == [r["id"] for r in rows]


def test_a_grown_prompt_set_reuses_the_last_runs_answers_and_answers_only_its_new_conversations(tmp_path):
    """The resume key (target, weights, settings; not the prompts) lets the next run take the last
    finished run's rows for the very same conversations, in either split; the rest is answered."""
    first_splits = {"train": [row("q0"), row("q1"), row("q2")], "eval": [row("e0")]}
    synth.synthesize(first_splits, ListBackend(), tmp_path, "A", answer_row, reuse=True)
    before = {r["id"]: r for s in synth.SPLITS for r in map(json.loads, (tmp_path / f"{s}.jsonl").read_text().splitlines())}
    changed = {**row("q2"), "messages": [{"role": "user", "content": "other text"}]}  # an id whose answer follows other text
    renamed = {**row("q0"), "source": "renamed.json"}  # the same conversation, its file renamed since
    grown = {"train": [renamed, row("new0"), changed], "eval": [row("e0"), row("q1"), row("new1")]}  # q1 moved to eval
    backend = ListBackend()
    stats = synth.synthesize(grown, backend, tmp_path, "A", answer_row, reuse=True)
    assert sorted(backend.seen) == sorted(r["id"] for r in (row("new0"), changed, row("new1")))
    out = {s: [json.loads(x) for x in (tmp_path / f"{s}.jsonl").read_text().splitlines()] for s in synth.SPLITS}
    assert [r["id"] for r in out["train"]] == [r["id"] for r in grown["train"]]  # input order, as ever
    assert out["train"][0] == {**before[row("q0")["id"]], "source": "renamed.json"}  # the answer kept, the source this run's
    assert out["eval"][1] == {**before[row("q1")["id"]], "source": "test"}
    assert synth.follows(out["train"][2], changed) and not synth.follows(before[row("q2")["id"]], changed)  # answered anew
    assert stats["reused"] == 3 and stats["counts"]["train"]["reused"] == 1 and stats["counts"]["eval"]["reused"] == 2
    assert stats["counts"]["train"]["resumed"] == 0

    # Another key reuses nothing, and a run of it cut short leaves no marker behind:
    # the files it may have rewritten are never taken for key A's answers.
    with pytest.raises(KeyboardInterrupt):
        synth.synthesize(grown, ListBackend(stop_after=1), tmp_path, "B", answer_row, reuse=True)
    assert not (tmp_path / synth.ANSWERS_FILE).exists()
    again = ListBackend()
    synth.synthesize(grown, again, tmp_path, "A", answer_row, reuse=True)
    assert len(again.seen) == 6


def test_the_stage_reuses_answers_when_only_the_prompt_set_changed_and_says_so(tmp_path, monkeypatch, target, capsys):
    out = tmp_path / "synth"
    run_stage(tmp_path, monkeypatch, make_prompts(tmp_path / "p1", ["What is 2+2?", "Name a color."], ["Say hi."]), out, target)
    rows, manifest = run_stage(tmp_path, monkeypatch, make_prompts(tmp_path / "p2", ["What is 2+2?", "Name a color.", "Count to 3."],
                                                                   ["Say hi."]), out, target)
    assert manifest["info"]["reused"] == 3 and manifest["info"]["counts"]["train"]["reused"] == 2
    assert "4 answered, 3 of them reused from the last run" in capsys.readouterr().out
    assert [r["messages"][0]["content"] for r in rows["train"]] == ["What is 2+2?", "Name a color.", "Count to 3."]
    _, manifest = run_stage(tmp_path, monkeypatch, make_prompts(tmp_path / "p3", ["Count to 3."], ["Say hi."]), out, target,
                            max_new_tokens=12)  # a setting that changes answers: nothing reused
    assert manifest["info"]["reused"] == 0
    capsys.readouterr()
    def not_now(*_a, **_k):
        raise AssertionError("a model loaded or a server started with every conversation answered")
    monkeypatch.setattr(stage, "load_target", not_now)  # the hf backend's model
    monkeypatch.setattr(stage, "own_servers", not_now)  # the sglang backend's servers
    _, manifest = run_stage(tmp_path, monkeypatch, make_prompts(tmp_path / "p4", ["Count to 3."], ["Say hi."]), out, target,
                            max_new_tokens=12)  # the same answers again: every row reused, no rate made up, nothing started
    assert manifest["info"]["reused"] == 2 and manifest["info"]["tokens_per_s"] is None and manifest["info"]["servers"] == 0
    said = capsys.readouterr().out
    assert "2 answered, 2 of them reused from the last run" in said and "nothing generated" in said
    assert "every conversation is answered already (2 by the last finished run, 0 resumed): no server started" in said
