"""The benchmark's serving side: prompts, servers started alike, one client for every server.

    with start(backend, bench_params, target_params, draft, flags, version, log, speculative=True) as url:
        figures = measure({"speculative": url}, bench_params, prompt_ids, sampling, warmup)["speculative"]

`start` launches the project's reference server (backend `reference`), SGLang (`sglang`), or
gives back a server already running (`url`); `start_many` launches several at the same time (a
sweep's baseline and configurations); `measure` sends the same token ids to each.

Figures (DESIGN.md section 9, formulas in draftlab.metrics):
  tokens/s per request  = completion tokens / client-side wall time of the request
  served tau            = sum completion tokens / sum spec_verify_ct over the measured requests
  a_i                   = P(draft i accepted | drafts 1..i-1 accepted), pooled over requests
  speedup               = median tokens/s with speculation / median tokens/s of the baseline
The offline run and the costs are in draftlab.bench.offline, the advice in draftlab.bench.advice.
"""
from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from draftlab import jsonl, lifecycle, progress
from draftlab.engine import server
from draftlab.errors import UserError
from draftlab.metrics import conditional_acceptance, pooled_tau
from draftlab.sglang import startup
from draftlab.sglang.client import Client, GenerateMeta, flags_from_server_info, server_accept_length
from draftlab.sglang.flags import SPEC_KEYS, SpecFlags
from draftlab.sglang.fleet import check_fa3, without_flag
from draftlab.sglang.launch import free_port as sglang_free_port
from draftlab.sglang.launch import launch_argv, serve
from draftlab.target.load import model_path


def read_eval_prompts(prompts: Path, n: int) -> list[dict]:
    """The first `n` rows of the prompts stage's eval.jsonl."""
    path = prompts / "eval.jsonl"
    if not path.exists():
        raise UserError(f"{path} not found; run the prompts stage first (dvc repro prompts)")
    rows = [row for _, row in jsonl.read(path, "re-run the prompts stage (dvc repro -f prompts)")]
    if not rows:
        raise UserError(f"{path}: no eval prompts; raise prompts.eval_fraction")
    return rows[:n]


def render_prompts(tokenizer, rows: list[dict]) -> list[list[int]]:
    """Token ids of each prompt as the chat template renders it for generation.

    The client sends ids, not text, so every server sees exactly the same tokens.
    """
    return [tokenizer.apply_chat_template(r["messages"], add_generation_prompt=True, tokenize=True, return_dict=False) for r in rows]


def start(backend: str, bench_params, target_params, draft: Path | None, flags: SpecFlags, version: str, log: Path,
          speculative: bool, hidden: bool = False, port: int | None = None, memory_args: Sequence[str] = (),
          startups: dict | None = None, name: str = ""):
    """Context manager yielding the base URL of a started (or given) server, stopped on exit.

    speculative False: a baseline server (no speculation; `flags` still gives the server-wide
    settings). hidden: start it with --enable-return-hidden-states (live parity). port: None = bench.port
    for SGLang, a free one for the reference server. memory_args: SGLang's memory flags when it
    starts beside others (draftlab.bench.memory), in place of any in bench.extra_server_args.
    startups: where a started server's start-up went is put there under `name` (draftlab.sglang.startup).
    """
    if backend == "url":
        if not bench_params.url:
            raise UserError("bench.backend is 'url' but bench.url is empty; give the base URL of a running server")
        return _given(bench_params.url)
    port = port or (bench_params.port if backend == "sglang" else lifecycle.free_port())
    argv, url = server_argv(backend, bench_params, target_params, draft, flags, version, speculative, port, hidden, memory_args)
    if backend == "sglang":
        return _url(serve(argv, log, bench_params.startup_timeout_s), url, startups, name)
    return _url(lifecycle.serve(argv, url, log, startup_timeout_s=bench_params.startup_timeout_s), url, startups, name)


@dataclass(frozen=True)
class Launch:
    """One server of start_many."""

    flags: SpecFlags
    log: Path
    speculative: bool
    optional: bool = False  # its failure to start is reported in its place and the others go on


@contextlib.contextmanager
def start_many(backend: str, bench_params, target_params, draft: Path | None, version: str, launches: list[Launch],
               together: bool = True, memory_args: Sequence[str] = (), meanwhile=None):
    """Several servers as `start` starts one, all at the same time (together; else one after another,
    each once the one before is healthy, for SGLang servers that size their memory pools themselves);
    yields per launch its lifecycle.Server, or for an optional one that did not start the UserError
    saying why. A baseline gets bench.port (SGLang), every other server a free port of its own.
    meanwhile: lifecycle.serve_many's, work of this process run while the servers start."""
    ports = _ports(backend, bench_params, launches)
    specs = []
    for launch, port in zip(launches, ports):
        argv, url = server_argv(backend, bench_params, target_params, draft, launch.flags, version, launch.speculative, port,
                                memory_args=memory_args)
        specs.append((argv, url, launch.log, None))
    with lifecycle.serve_many(specs, bench_params.startup_timeout_s, groups=None if together else [0] * len(specs),
                              optional=[launch.optional for launch in launches], meanwhile=meanwhile) as servers:
        yield servers


def _ports(backend: str, bench_params, launches: list[Launch]) -> list[int]:
    """Distinct ports: bench.port for an SGLang baseline, else free ones (each free_port() call is free on its own)."""
    fixed = {i: bench_params.port for i, launch in enumerate(launches) if backend == "sglang" and not launch.speculative}
    ports = []
    for i in range(len(launches)):
        port = fixed.get(i)
        while port is None or port in ports or (i not in fixed and port in fixed.values()):
            port = sglang_free_port() if backend == "sglang" else lifecycle.free_port()
        ports.append(port)
    return ports


def server_argv(backend: str, bench_params, target_params, draft: Path | None, flags: SpecFlags, version: str, speculative: bool,
                port: int, hidden: bool = False, memory_args: Sequence[str] = ()) -> tuple[list[str], str]:
    """(argv, base URL) of one server of `backend` (sglang or reference) on `port`."""
    url = f"http://127.0.0.1:{port}"
    if backend == "sglang":
        extra = list(bench_params.extra_server_args)
        if memory_args:  # the bench's memory flags replace the user's share (draftlab.bench.memory)
            extra = without_flag(extra, "--mem-fraction-static") + list(memory_args)
        argv = launch_argv(model_path(target_params.model), port, draft_model=str(draft), flags=flags, baseline=not speculative,
                           tp_size=bench_params.tp_size, dtype=bench_params.dtype, extra_args=extra, return_hidden_states=hidden)
        check_fa3(argv, "bench.attention_backend")  # before the server loads its weights
        return argv, url
    spec = {}
    if speculative and flags.algorithm == "NGRAM":  # no draft model: the n-gram cache's settings
        spec = {"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": flags.num_draft_tokens,
                "speculative_ngram_min_bfs_breadth": flags.ngram_min_bfs_breadth,
                "speculative_ngram_max_bfs_breadth": flags.ngram_max_bfs_breadth,
                "speculative_ngram_max_trie_depth": flags.ngram_max_trie_depth, "sglang_version": version}
    elif speculative:
        spec = {"speculative_algorithm": flags.algorithm, "speculative_draft_model_path": str(draft),
                "speculative_num_steps": flags.num_steps, "speculative_eagle_topk": flags.topk,
                "speculative_num_draft_tokens": flags.num_draft_tokens, "sglang_version": version}
    argv = server.launch_command(target_params.model, port, dtype=target_params.dtype, device=target_params.device,
                                 log_level="warning", enable_return_hidden_states=hidden,
                                 max_running_requests=flags.max_running_requests, **spec)
    return argv, url


class _given:
    def __init__(self, url):
        self.url = url

    def __enter__(self):
        return self.url

    def __exit__(self, *exc):
        return False


class _url:
    def __init__(self, cm, url, startups: dict | None = None, name: str = ""):
        self.cm, self.url, self.startups, self.name = cm, url, startups, name

    def __enter__(self):
        srv = self.cm.__enter__()
        if self.startups is not None:
            self.startups[self.name] = startup.server_startup(srv)
        return self.url

    def __exit__(self, *exc):
        return self.cm.__exit__(*exc)


def measure(urls: dict[str, str], bench_params, prompts: list[list[int]], sampling: dict, warmup: int,
            abba: bool = False, label: str = "", fresh: bool = False) -> dict[str, dict]:
    """Figures per server. With several servers up, requests alternate prompt by prompt, so a
    change in the machine's load hits both modes alike and their ratio stays fair; abba: the order
    flips every other prompt (A B, B A, ...), so that neither server always goes first. One
    progress bar per concurrency, named `label` (the configuration) and c=N, counts every request.

    fresh: every server's caches are emptied (/flush_cache) before each measured pass over the
    prompts (the bs=1 pass, each ABBA pair of batches at n in flight), so that an NGRAM server is
    never measured on prompts its n-gram cache has already answered: a second pass over the same
    prompts on one SGLang NGRAM server served tau 4.06 against 2.06 on the first, from memory. Both
    servers are flushed, so that their prefix caches start alike too."""
    clients = {mode: Client(url, bench_params.request_timeout_s) for mode, url in urls.items()}
    label = label or "+".join(clients)

    def flush():
        for client in clients.values() if fresh else ():
            client.flush_cache()

    def order(i):
        return list(clients.items()) if not abba or i % 2 == 0 else list(reversed(clients.items()))

    measured = prompts[warmup:]
    try:
        with progress.bar(len(clients) * (warmup + 2 * len(measured)), f"bench {label} c=1", "req") as bar:
            for client in clients.values():
                run_requests(client, prompts[:warmup], sampling, done=bar.update)  # compile/caches warm; not counted
            records = {mode: [] for mode in clients}
            wall = dict.fromkeys(clients, 0.0)
            flush()
            for i, prompt in enumerate(measured):
                for mode, client in order(i):
                    recs, seconds = run_requests(client, [prompt], sampling, done=bar.update)
                    records[mode] += recs
                    wall[mode] += seconds
            # Prompt-only requests (max_new_tokens 1), alternating too: each server's own per-request cost
            # (prefill, HTTP, the first token), which the advice takes apart from its decode step.
            prompt_only = {mode: [] for mode in clients}
            for i, prompt in enumerate(measured):
                for mode, client in order(i):
                    recs, seconds = run_requests(client, [prompt], {**sampling, "max_new_tokens": 1}, done=bar.update)
                    prompt_only[mode].append(seconds)
        sweeps = concurrency_sweep(clients, measured, sampling, bench_params.concurrency, bench_params.concurrency_repeats, label,
                                   flush if fresh else None)
        out = {}
        for mode, client in clients.items():
            sweep = sweeps[mode]
            metas = [r["meta"] for r in records[mode]]
            info = client.server_info()
            out[mode] = {"speed": speed(records[mode], wall[mode]), "spec": spec_figures(metas), "sweep": sweep,
                         "server_accept_length": server_accept_length(info),
                         "server_flags": flags_from_server_info(info), "metas": [m.raw for m in metas],
                         "request_seconds": [r["seconds"] for r in records[mode]], "prompt_only_seconds": prompt_only[mode],
                         "texts": [r["text"] for r in records[mode]]}
        return out
    finally:
        for client in clients.values():
            client.close()


def concurrency_sweep(clients: dict[str, Client], prompts: list[list[int]], sampling: dict, levels: list[int],
                      repeats: int = 2, label: str = "", fresh=None) -> dict[str, list[dict]]:
    """Per mode, the figures with n > 1 requests in flight (every prompt sent, n at a time). With
    several servers the whole batches alternate in ABBA order, `repeats` per mode, so a drift in
    the machine's load hits every mode alike; each mode's figures pool its batches, and "batches"
    keeps each batch's own (the i-th of every mode make the i-th repeat), tau where it speculated.
    fresh: called before each ABBA pair (every server's caches emptied: `measure`).

    Each mode first gets one whole batch at n that is not counted: on an H200, SGLang's first
    speculative batch at a new concurrency took up to twice as long as the next (kernels compiled
    for the new shapes), enough to move a speedup by 30%."""
    out = {mode: [] for mode in clients}
    label = label or "+".join(clients)
    reps = repeats if len(clients) > 1 else 1
    for n in (n for n in levels if n > 1):
        # one bar per concurrency: the warm-up batch, the repeats and the prompt-only batch of every mode
        with progress.bar(len(clients) * len(prompts) * (reps + 2), f"bench {label} c={n}", "req") as bar:
            for mode, row in _level(clients, prompts, sampling, n, reps, bar.update, fresh).items():
                out[mode].append(row)
    return out


def _level(clients: dict[str, Client], prompts: list[list[int]], sampling: dict, n: int, reps: int, done, fresh=None) -> dict[str, dict]:
    """concurrency_sweep at one concurrency n: {mode: its row}. fresh: called before each ABBA pair."""
    for client in clients.values():
        run_requests(client, prompts, sampling, n, done)  # warm-up at this concurrency: not counted
    got = {mode: [] for mode in clients}  # (records, seconds) of each batch
    for rep in range(reps):
        if fresh:
            fresh()
        for mode in (list(clients) if rep % 2 == 0 else list(reversed(clients))):
            got[mode].append(run_requests(clients[mode], prompts, sampling, n, done))
    rows = {}
    for mode, batches in got.items():
        recs = [r for b, _ in batches for r in b]
        row = {"concurrency": n, **speed(recs, sum(sec for _, sec in batches)),
               "batches": [{"throughput": sum(r["meta"].completion_tokens for r in b) / sec, "seconds": sec, **_batch_tau(b)}
                           for b, sec in batches]}
        spec = [r["meta"] for r in recs if r["meta"].speculative]
        if spec:
            row["tau"] = pooled_tau([m.completion_tokens for m in spec], [m.spec_verify_ct for m in spec])
        rows[mode] = row
    # Prompt-only requests at n in flight: the server's time per admitted request when it only
    # admits (advice.costs_by_concurrency takes the prefills out of the step and the round with it).
    for mode, client in clients.items():
        recs, seconds = run_requests(client, prompts, {**sampling, "max_new_tokens": 1}, n, done)
        rows[mode]["prompt_only_s_per_request"] = seconds / len(recs)
    return rows


def _batch_tau(records: list[dict]) -> dict:
    """{"tau": pooled tau of one batch} where it speculated (a repeat that saw its own earlier
    answers would show here as a higher tau than the first), else {}."""
    spec = [r["meta"] for r in records if r["meta"].speculative]
    return {"tau": pooled_tau([m.completion_tokens for m in spec], [m.spec_verify_ct for m in spec])} if spec else {}


def run_requests(client: Client, prompts: list[list[int]], sampling: dict, concurrency: int = 1,
                 done=None) -> tuple[list[dict], float]:
    """Send every prompt; returns per-request records (in the prompts' order) and the wall time of the
    whole batch (s). `done()` is called once per finished request, from this thread."""

    def one(ids):
        t0 = time.perf_counter()
        text, meta = client.generate(ids, sampling)
        return {"seconds": time.perf_counter() - t0, "meta": meta, "text": text}

    t0 = time.perf_counter()
    if concurrency <= 1:
        records = []
        for p in prompts:
            records.append(one(p))
            if done:
                done()
    else:
        with ThreadPoolExecutor(concurrency) as pool:
            futures = [pool.submit(one, p) for p in prompts]
            for f in as_completed(futures):
                f.result()  # a failed request raises here, as pool.map did
                if done:
                    done()
            records = [f.result() for f in futures]
    return records, time.perf_counter() - t0


def speed(records: list[dict], wall_s: float) -> dict:
    """Per-request tokens/s (median and spread) and the batch's total throughput."""
    rates = sorted(r["meta"].completion_tokens / r["seconds"] for r in records)
    q = statistics.quantiles(rates, n=10) if len(rates) > 1 else [rates[0]] * 9
    tokens = sum(r["meta"].completion_tokens for r in records)
    return {"median": statistics.median(rates), "p10": q[0], "p90": q[-1], "throughput": tokens / wall_s,
            "requests": len(records), "completion_tokens": tokens}


def acceptance_from_hist(hist: list[int]) -> list[float]:
    """a_i from an accepted-drafts histogram (hist[a] = steps that kept a drafts)."""
    reached = [sum(hist[i:]) for i in range(1, len(hist))]  # steps that accepted >= i drafts
    return conditional_acceptance(reached, [sum(hist[i - 1:]) for i in range(1, len(hist))])


def spec_figures(metas: list[GenerateMeta]) -> dict:
    """Pooled speculative figures from /generate meta_info, SGLang's fields first."""
    spec = [m for m in metas if m.speculative]
    if not spec:
        return {}
    tau = pooled_tau([m.completion_tokens for m in spec], [m.spec_verify_ct for m in spec])
    hist = None
    if all(m.spec_correct_drafts_histogram for m in spec):
        width = max(len(m.spec_correct_drafts_histogram) for m in spec)
        hist = [sum(m.spec_correct_drafts_histogram[i] if i < len(m.spec_correct_drafts_histogram) else 0 for m in spec) for i in range(width)]
    # Exact per-depth counts when the server gives them (the reference server does); else the histogram.
    if all("spec_proposed_per_depth" in m.raw for m in spec):
        proposed = [sum(x) for x in zip(*(m.raw["spec_proposed_per_depth"] for m in spec))]
        accepted = [sum(x) for x in zip(*(m.raw["spec_accepted_per_depth"] for m in spec))]
        acceptance = conditional_acceptance(accepted, proposed)
    else:
        acceptance = acceptance_from_hist(hist) if hist else None
    correct = sum(m.spec_num_correct_drafts or 0 for m in spec)
    proposed_total = sum(m.spec_num_proposed_drafts or 0 for m in spec)
    return {
        "tau": tau,
        "accept_rate": correct / proposed_total if proposed_total else None,
        "acceptance": acceptance,
        "accept_hist": hist,
        "verify_ct": sum(m.spec_verify_ct for m in spec),
        "completion_tokens": sum(m.completion_tokens for m in spec),
    }


def served_flags(flags: SpecFlags) -> dict | None:
    """The flags the speculative server reports in /server_info; None when it reports none of them."""
    d = dataclasses.asdict(flags)
    return d if any(d[k] is not None for k in SPEC_KEYS) else None
