"""One bench run, the body of the bench stage: the exported draft served against a baseline,
then the same draft offline, the costs, the advice, and the report (reports/bench.json).

    plan = draftlab.bench.run.prepare(target_params, spec_params, bench_params, sglang_version, read_exported(draft_dir), prompts_dir)
    result = draftlab.bench.run.run(plan, out)      # result.report, result.figures, result.key

`prepare` settles everything before a server starts: the flags SGLang would really run for
spec.* and for every configuration of bench.sweep (draftlab.sglang.flags; with spec.on_adjust:
error a request SGLang would silently change stops there), and the prompts as token ids. `run`
starts the servers (draftlab.bench.servers.start), measures them (draftlab.bench.servers.measure), stops them, and
only then loads the target's weights for the offline run (draftlab.bench.offline), so that a GPU
holds one copy of the target at a time. With bench.sweep the offline run comes first instead, its
copy of the target freed before any server starts, so that the advice is known while the baseline
stays up for every configuration (draftlab.bench.sweep); bench.sweep's servers start together with
the baseline, each with its own KV pool on SGLang (draftlab.bench.memory, settled in `prepare`).

bench.prompts (draftlab.bench.prompts) may name several prompt sets: each is measured on every
server, the first giving the headline figures, the offline run and the advice. A set of several
turns (MT-bench) has its later turns rendered after the baseline server's answers, generated once
(`BenchPlan.answer_turns`); the offline run answers the turns itself (in-process, greedy). Per set,
bench.json has each configuration's figures by category and by turn (draftlab.bench.report) and
the headline "does training pay?" table; n-gram lookup (NGRAM) configurations get their own advice
(draftlab.bench.ngram_advice), set against the draft's.
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import platform
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from draftlab import jsonl, progress
from draftlab.bench import advice, servers, prompts as bench_prompts, report as bench_report, sweep as bench_sweep, offline as cost_timing, ngram_advice, fits
from draftlab.bench import memory, offline_workers, passes
from draftlab.bench.memory import BASELINE
from draftlab.engine import speculative as spec_engine
from draftlab.errors import UserError
from draftlab.params import HELDOUT, BenchParams, SpecParams, TargetParams
from draftlab.sglang import startup
from draftlab.sglang.checkpoint import ExportedDraft
from draftlab.sglang.client import Client
from draftlab.sglang.flags import Resolution, SpecFlags, requested_from_params, resolve
from draftlab.sglang.launch import free_port as sglang_free_port
from draftlab.sglang.launch import read_log
from draftlab.parallel import resolve_device
from draftlab.target.load import load_config, load_tokenizer, target_info

TARGET_KEYS = ("model", "revision", "architecture", "num_layers", "hidden_size", "vocab_size", "max_position_embeddings")


@dataclass
class BenchPlan:
    """What a bench run does, settled before any server starts."""

    target_params: TargetParams
    spec_params: SpecParams
    bench_params: BenchParams
    sglang_version: str  # whose rules apply (params export.sglang_version)
    draft: ExportedDraft
    device: str
    tokenizer: object
    target: dict  # draftlab.target.load.target_info of the target's config
    resolution: Resolution
    prompt_ids: list[list[int]]  # bench.warmup prompts first, then the first set's measured ones (its first turns)
    configurations: list = dataclasses.field(default_factory=list)  # draftlab.bench.sweep.Configuration: spec.*'s, then bench.sweep's
    advised_choices: dict = dataclasses.field(default_factory=dict)  # bench.sweep `advised`: {key: Resolution or why refused}
    sets: list = dataclasses.field(default_factory=list)  # draftlab.bench.prompts.BenchSet of bench.prompts, in order
    layout: memory.Layout | None = None  # bench.sweep on SGLang: every server's KV pool and the waves they start in

    @property
    def warmup_ids(self) -> list[list[int]]:
        return self.prompt_ids[:self.bench_params.warmup]

    def set_prompt_ids(self, bset) -> list[list[int]]:
        """The warm-up prompts, then every measured request of `bset` (its later turns rendered
        after the baseline's answers: `answer_turns` first)."""
        return self.warmup_ids + bset.render(self.tokenizer)

    def answer_turns(self, url: str, out: Path) -> None:
        """The answers that later turns follow, generated once, greedy, by the server at `url` (the
        baseline), for every set of several turns; written to out/turn-answers-SET.jsonl. Then every
        request must fit the target's context (check_context), as the first turns did in prepare."""
        for bset in self.sets:
            if bset.turns < 2 or bset.answers:
                continue
            print(f"bench: {bset.name}: the baseline answers the turns that later turns follow (once, greedy)")
            with Client(url, self.bench_params.request_timeout_s) as client:
                bench_prompts.answer_earlier_turns(bset, self.tokenizer, lambda ids: client.generate(ids, self.sampling)[0])
            jsonl.write(out / f"turn-answers-{bset.name}.jsonl",
                        ({"conversation": bset.conversations[i].id, "turn": t, "answer": text} for (i, t), text in sorted(bset.answers.items())))
            ids = bset.render(self.tokenizer)
            rows = [{"id": f"{bset.conversations[i].id} turn {t}"} for i, t in bset.requests]
            for c in self.configurations:
                if c.resolution is not None:
                    check_context(ids, rows, self.bench_params, c.resolution.effective, self.target["max_position_embeddings"],
                                  Path(bset.source).parent, Path(bset.source))

    @property
    def offline_baselines(self) -> bool:
        """Whether the offline run also decodes each prompt without speculation: for the reference backend,
        whose step is the in-process engine's; another engine's server is scaled on its own rounds
        instead (draftlab.bench.fits.round_scale)."""
        return self.bench_params.backend == "reference"

    @property
    def flags(self) -> SpecFlags:
        """The flags the speculative server runs."""
        return self.resolution.effective

    @property
    def sweep(self) -> bool:
        """Whether bench.sweep asks for more configurations than spec.*'s."""
        return bool(self.bench_params.sweep)

    def candidates(self, trees: bool = True) -> list[tuple[int, int, int]]:
        """The configurations the advice predicts: chains of 1..8, the trees (unless `trees` is off),
        the one that ran and those bench.sweep lists."""
        out = advice.CHAINS + (advice.TREES if trees else [])
        ran = (self.flags.num_steps, self.flags.topk, self.flags.num_draft_tokens)
        for key in [ran] + [c.key for c in self.configurations[1:] if c.resolution is not None and not c.ngram]:
            if key not in out:
                out.append(key)
        return out

    @property
    def sampling(self) -> dict:
        bench_params = self.bench_params
        return {"max_new_tokens": bench_params.max_new_tokens, "temperature": 0.0, "ignore_eos": bench_params.ignore_eos}


@dataclass
class BenchResult:
    report: dict  # reports/bench.json, less the figures
    figures: dict  # the headline figures: bench.json's top level and the manifest's info
    key: dict  # the settings that identify the run (bench.json "settings")


def prepare(target_params: TargetParams, spec_params: SpecParams, bench_params: BenchParams, sglang_version: str,
            draft: ExportedDraft, prompts: Path) -> BenchPlan:
    """Check everything that can be checked before a server starts; UserError naming what to change."""
    device = resolve_device(target_params.device)
    # The config and tokenizer only: the weights load after every server has stopped, so that a
    # GPU holds one copy of the target at a time (SGLang sizes its KV pool from free memory).
    tokenizer = load_tokenizer(target_params.model, target_params.revision)
    info = target_info(load_config(target_params), target_params)
    requested = requested_from_params(spec_params, bench_params)

    def resolve_flags(flags: SpecFlags) -> Resolution:
        return resolve(flags, info["architecture"], sglang_version, draft_architecture=(draft.config.get("architectures") or [None])[0],
                       draft_context_length=draft.config.get("max_position_embeddings"),
                       target_context_length=info["max_position_embeddings"], max_concurrency=max(bench_params.concurrency),
                       extra_server_args=bench_params.extra_server_args)

    res = resolve_flags(requested)

    def resolve_key(key) -> Resolution:
        if key[0] == bench_sweep.NGRAM:  # no draft: SGLang derives topk and num_steps (rule ngram_topk)
            return resolve_flags(dataclasses.replace(requested, algorithm="NGRAM", num_steps=None, topk=None, num_draft_tokens=key[1],
                                                     ngram_max_bfs_breadth=key[2]))
        return resolve_flags(dataclasses.replace(requested, num_steps=key[0], topk=key[1], num_draft_tokens=key[2]))

    if bench_params.sweep and bench_params.backend == "url":
        raise UserError("bench.sweep needs servers the bench starts itself; with bench.backend: url only the server at "
                        "bench.url is measured. Set bench.backend: sglang (with bench.side_by_side: true) or reference to "
                        "sweep, or bench.sweep: [] and one experiment per configuration (dvc exp run -S spec.num_steps=...)")
    if bench_params.sweep and bench_params.backend == "sglang" and not bench_params.side_by_side:
        raise UserError("bench.sweep keeps one baseline server up beside the speculative ones: set bench.side_by_side: true "
                        "(on a GPU the bench then gives each server its own KV pool and starts them together), or bench.sweep: []")
    if bench_params.backend == "url":
        # The server already runs with whatever flags it was given: measure it and report, refuse nothing.
        for f in res.errors + res.adjustments:
            print(f"bench: warning: {f}")
        if bench_params.server_log and not Path(bench_params.server_log).exists():
            raise UserError(f"bench.server_log: {bench_params.server_log} not found; give the log file of the server at "
                            f"{bench_params.url}, or \"\"")
    else:
        res.enforce(spec_params.on_adjust)  # before anything starts
    flags = res.effective
    if bench_params.backend == "reference" and (flags.algorithm != "EAGLE3" or flags.topk is None):
        raise UserError(f"the reference backend runs EAGLE3 with explicit num_steps/topk; got {dataclasses.asdict(flags)}")
    configurations, choices = bench_sweep.plan_configurations(res, bench_params.sweep, resolve_key, spec_params.on_adjust,
                                                              advice.CHAINS + advice.TREES)
    if bench_params.backend == "sglang" and any(c.ngram for c in configurations) and not host_compiler():
        print("bench: warning: SGLang's NGRAM builds a C++ extension when its server starts (tvm-ffi and ninja) and no C++ "
              "compiler was found (CXX, c++, g++, clang++): install one, or its configurations will fail to start")
    warmup_rows, sets = bench_prompts.load(bench_params.prompt_sets, prompts, bench_params.warmup, bench_params.num_prompts)
    rows = servers.read_eval_prompts(prompts, bench_params.num_prompts + bench_params.warmup)
    if len(rows) <= bench_params.warmup:
        raise UserError(f"{prompts / 'eval.jsonl'} has {len(rows)} prompts, not more than bench.warmup={bench_params.warmup}")
    if HELDOUT in bench_params.prompt_sets:
        check_sizes(bench_params, rows, prompts)
    for bset in sets:
        check_set_size(bench_params, bset)
    warmup_ids = servers.render_prompts(tokenizer, warmup_rows)
    for bset in sets:  # each configuration's server reserves its own draft slots; later turns are checked once answered
        ids = bset.render(tokenizer, turn=1)
        firsts = [{"id": bset.conversations[i].id} for i, t in bset.requests if t == 1]
        for c in configurations:
            if c.resolution is not None:
                check_context(ids, firsts, bench_params, c.resolution.effective, info["max_position_embeddings"],
                              prompts, Path(bset.source))
    prompt_ids = warmup_ids + sets[0].render(tokenizer, turn=1)
    layout = None
    if bench_params.backend == "sglang" and bench_params.sweep:  # every server's KV pool, settled before any starts
        lengths = memory.request_lengths(tokenizer, sets, warmup_ids, bench_params.max_new_tokens)
        layout = memory.plan_layout(bench_params, target_params, info, draft, configurations, choices, lengths)
    return BenchPlan(target_params, spec_params, bench_params, sglang_version, draft, device, tokenizer, info, res,
                     prompt_ids, configurations, choices, sets, layout)


def host_compiler() -> str | None:
    """The C++ compiler a build on this machine would find: $CXX, else c++, g++ or clang++ on PATH."""
    for name in [os.environ.get("CXX", "").split(" ")[0], "c++", "g++", "clang++"]:
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def check_set_size(bench_params: BenchParams, bset) -> None:
    """Refuse a concurrency above the requests a prompt set sends (each batch sends the whole set)."""
    top, requests = max(bench_params.concurrency), len(bset.requests)
    if top > requests:
        raise UserError(f"params.yaml: bench.concurrency {top} asks for more requests in flight than the prompt set {bset.name} "
                        f"sends ({requests}); drop concurrency {top} or measure more of the set (bench.num_prompts)")


def check_sizes(bench_params: BenchParams, rows: list[dict], prompts: Path) -> None:
    """Refuse a bench larger than the prompts it can use: every figure would be of fewer requests
    than bench.json's settings say (no silent clamp)."""
    want, warmup = bench_params.num_prompts + bench_params.warmup, bench_params.warmup
    if len(rows) < want:
        raise UserError(f"params.yaml: bench.num_prompts {bench_params.num_prompts} + bench.warmup {warmup} asks for {want} "
                        f"eval prompts, but {prompts / 'eval.jsonl'} has {len(rows)}; set bench.num_prompts to "
                        f"{len(rows) - warmup} or less, or draw more prompts (prompts.num_prompts, prompts.eval_fraction)")
    top = max(bench_params.concurrency)
    if top > bench_params.num_prompts:
        raise UserError(f"params.yaml: bench.concurrency {top} asks for more requests in flight than bench.num_prompts "
                        f"{bench_params.num_prompts} sends; at most {bench_params.num_prompts} would be: raise bench.num_prompts "
                        f"to {top} or more, or drop concurrency {top}")


def check_context(prompt_ids: list[list[int]], rows: list[dict], bench_params: BenchParams, flags: SpecFlags,
                  context: int | None, prompts: Path, source: Path | None = None) -> None:
    """Every request fits the target's context as SGLang 0.5.14 validates it (TokenizerManager.
    _validate_one_request): the prompt, bench.max_new_tokens and, on a speculative server, the
    reserved draft slots max(topk * num_steps, num_draft_tokens) (none for NGRAM, whose drafts take no
    output slots); else SGLang answers 400."""
    if not context:
        return
    reserved = 0 if flags.algorithm == "NGRAM" else max((flags.topk or 0) * (flags.num_steps or 0), flags.num_draft_tokens or 0)
    bad = [(r["id"], len(ids)) for r, ids in zip(rows, prompt_ids) if len(ids) + reserved + bench_params.max_new_tokens > context]
    if bad:
        listed = ", ".join(f"{i} ({n} tokens)" for i, n in bad[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
        room = context - reserved - max(n for _, n in bad)
        fix = f"lower bench.max_new_tokens to at most {room}, or shorten those prompts" if room >= 1 else "shorten those prompts"
        raise UserError(f"{len(bad)} bench prompt(s) of {source or prompts / 'eval.jsonl'} do not fit the target's context of {context} "
                        f"tokens with bench.max_new_tokens {bench_params.max_new_tokens} and the {reserved} draft tokens a "
                        f"speculative server reserves: {listed}; {fix}")


def run(plan: BenchPlan, out: Path) -> BenchResult:
    """Serve and measure, then the offline run and the advice (with bench.sweep: the offline run
    first, then every configuration beside one baseline); writes the server logs and
    requests.jsonl under `out` and returns the report."""
    out.mkdir(parents=True, exist_ok=True)
    passes.start(out)
    phases, since = {}, time.perf_counter()  # where the bench's wall time goes, in seconds
    startups = {}  # each started server's start-up, by name (draftlab.sglang.startup)

    def lap(name: str) -> None:
        nonlocal since
        phases[name] = round(time.perf_counter() - since, 1)
        since = time.perf_counter()

    if plan.sweep:
        # The advice must be known while the baseline stays up (`advised`), so the in-process run
        # comes before any measurement. Where its copy of the target fits beside the first wave's
        # pools (draftlab.bench.memory), it decodes while they start and its rounds are timed once
        # they are up and idle; else it runs, and frees its copy, before any server starts (SGLang
        # without a planned pool sizes it from the memory free at start-up).
        with contextlib.ExitStack() as up:
            if plan.layout is not None and plan.layout.offline_beside:
                decoded = []
                fleet = up.enter_context(bench_sweep.servers_up(
                    plan, out, meanwhile=lambda: decoded.append(decode_offline(plan, "while the servers start")), startups=startups))
                lap("servers started, the offline run decoding meanwhile")
                offline, costs, physical, ranks = time_offline(plan, decoded[0])
                decoded.clear()
                release_memory(plan.device)
                lap("round costs")
            else:
                offline, costs, physical, ranks = measure_offline(plan)
                release_memory(plan.device)
                lap("offline run and round costs")
                fleet = up.enter_context(bench_sweep.servers_up(plan, out, startups=startups))  # the baseline and bench.sweep's, together
                lap("servers started")
            first = bench_sweep.measure_first(plan, fleet)
            adv = advise(plan, first.baseline, first.spec, offline, costs, ranks)  # numbers in, numbers out
            pick = adv["advised"]["recommended"]
            pick = (pick["num_steps"], pick["topk"], pick["num_draft_tokens"]) if pick else None
            pairings = [first] + bench_sweep.measure_rest(plan, fleet, first, pick)
            lap("served and measured (later turns' answers included)")
        lap("servers stopped")
    else:
        sets, log = measure_served(plan, out, startups)
        lap("servers started, served and measured")
        baseline, spec = sets[plan.sets[0].name]
        offline, costs, physical, ranks = measure_offline(plan)
        lap("offline run and round costs")
        pairings = [bench_sweep.Pairing(plan.configurations[0], baseline, spec, log, sets=sets)]
        adv = advise(plan, baseline, spec, offline, costs, ranks)
    print("bench: wall time: " + ", ".join(f"{name} {s:.0f} s" for name, s in phases.items()))
    baseline, spec, log = pairings[0].baseline, pairings[0].spec, pairings[0].log
    server_log = read_log(log) if log.exists() else None
    bench_params, flags, info = plan.bench_params, plan.flags, plan.target
    advised, speedup = adv["advised"], adv["speedup"]
    ngram = ngram_advice.advise(plan.bench_params.backend, [p for p in pairings if p.configuration.ngram and p.spec], costs,
                                advised["candidates"])
    predicted = {**{_key(r): r for r in advised["candidates"]}, **ngram["by_key"]}
    per_n = {n: {_key(r): r for r in a["candidates"]} for n, a in adv["per"]["by_concurrency"].items()} if adv["per"] else {}
    for n, by_key in ngram["by_concurrency_key"].items():
        per_n.setdefault(n, {}).update(by_key)
    rows = bench_sweep.rows(pairings, predicted, per_n or None)
    measured = [{**{k: r[k] for k in ("num_steps", "topk", "num_draft_tokens")}, "where": "served", "measured_tau": r["tau"],
                 "measured_speedup": r["speedup"]} for r in rows if not r.get("error") and r.get("algorithm") != "NGRAM"]
    compared = advice.predicted_vs_measured(advised["candidates"], measured)
    sets_report = bench_report.prompt_sets(plan.sets, pairings)
    advised = {**advised, "advice": ngram_advice.advice_text(advised, ngram)}
    res = plan.resolution
    report = {
        "backend": bench_params.backend,
        "sglang_version": plan.sglang_version,
        "target": {k: info[k] for k in TARGET_KEYS},
        "draft_dir": str(plan.draft.path),
        "flags": {**res.as_dict(), "served": servers.served_flags(spec["server_flags"]),
                  "adjustments": [dataclasses.asdict(f) for f in res.adjustments], "on_adjust": plan.spec_params.on_adjust},
        "baseline": {"tokens_per_s": baseline["speed"]} if baseline else None,
        "spec": {**spec["spec"], "tokens_per_s": spec["speed"]},
        # step1_by_*: the offline rounds' first-draft acceptance by kind of token and answer position (bench.offline)
        "offline": {k: offline[k] for k in ("tau", "acceptance", "tokens_per_s", "step1_by_kind", "step1_by_position") if k in offline},
        "speedup": speedup,
        "server_accept_length": spec["server_accept_length"],
        "server_log": str(log) if log.exists() else None,
        "log_accept_len": [d.accept_len for d in server_log.decode if d.accept_len is not None] if server_log else [],
        "log_adjustments": [dataclasses.asdict(a) for a in server_log.adjustments] if server_log else [],
        "sweep": {"baseline": baseline["sweep"] if baseline else [], "speculative": spec["sweep"]},
        "costs": {**{k: _ms(v) for k, v in costs.items() if k.endswith("_s")}, "tokens_per_request": costs["tokens_per_request"],
                  "round_scale": costs.get("round_scale"), "speedup_scale": costs.get("speedup_scale"),
                  "depth1_rank_shares": ranks, "unit": "ms (keys ending _s hold milliseconds here)"},
        # "ran": the served configuration's row as a dict, so that `dvc exp show` (which leaves lists
        # out) tabulates predicted against measured per experiment
        "advice": {**advised, "predicted_vs_measured": compared, "ran": compared[0] if compared else None,
                   "by_concurrency": adv["by_concurrency"],
                   "predicted_vs_measured_by_concurrency": bench_sweep.predicted_vs_measured_by_concurrency(rows),
                   "served_fit": served_fit([p for p in pairings if not p.configuration.ngram], advised["candidates"]),
                   "ngram": ngram["report"]},
        # spec.*'s configuration first, then bench.sweep's (draftlab.bench.sweep.rows)
        "configurations": rows,
        "best_configuration": bench_sweep.best(rows, advised),
        # per prompt set of bench.prompts: each configuration by category and turn, and "does training pay?"
        # (baseline, the best n-gram lookup and the best draft at every concurrency); the first set's here too
        "prompt_sets": sets_report,
        "training_pays": sets_report[0]["training_pays"],
        "phases_s": phases,  # the bench's wall time by phase, in the order run (the report's own writing after)
        # per server (the baseline, each configuration's): seconds from launch to healthy, by phase (draftlab.sglang.startup)
        "server_startup": startups or None,
        "hardware": {"device": plan.device, "cpu": platform.processor() or platform.machine(), "torch_threads": torch.get_num_threads(),
                     "gpu": torch.cuda.get_device_name(0) if plan.device == "cuda" else None},
    }
    # per configuration, every set's requests in the order sent (the first set's first, as before)
    jsonl.write(out / "requests.jsonl", ({"configuration": p.configuration.name, "prompt_set": name, "mode": mode, "meta": meta}
                                         for p in pairings for name, pair in (p.sets or {plan.sets[0].name: (p.baseline, p.spec)}).items()
                                         for mode, source in zip(("baseline", "speculative"), pair) if source
                                         for meta in source["metas"]))
    key = {"backend": bench_params.backend, "num_steps": flags.num_steps, "topk": flags.topk, "num_draft_tokens": flags.num_draft_tokens,
           "capture_physical_layers": physical, "target": plan.target_params.model, "sglang_version": plan.sglang_version}
    figures = {"tau": report["spec"]["tau"], "offline_tau": offline["tau"], "speedup": speedup,
               "tokens_per_s": spec["speed"]["median"], "baseline_tokens_per_s": baseline["speed"]["median"] if baseline else None,
               "accept_rate": report["spec"]["accept_rate"]}
    return BenchResult(report, figures, key)


def _key(row: dict) -> tuple[int, int, int]:
    return row["num_steps"], row["topk"], row["num_draft_tokens"]


def advise(plan: BenchPlan, baseline: dict | None, spec: dict, offline: dict, costs: dict, ranks: list[float]) -> dict:
    """The advice from spec.*'s pairing: costs (updated in place with the served baseline's step and
    per-request cost, and the scale of the served figures), the bs=1 advice over plan.candidates,
    and, with requests in flight, the advice per concurrency (`per`, and its summary `by_concurrency`)."""
    flags = plan.flags
    if baseline:  # the served baseline's own step and per-request cost (advice.server_costs)
        done = [(m.get("completion_tokens"), sec) for m, sec in zip(baseline["metas"], baseline["request_seconds"])]
        done = [(t, sec) for t, sec in done if t]
        tokens, seconds = [t for t, _ in done], [sec for _, sec in done]
        costs.update(fits.probed_requests(tokens, seconds, baseline.get("prompt_only_seconds") or [])
                     or fits.fit_requests(tokens, seconds) or {})
        if plan.bench_params.backend != "reference":  # another engine than the in-process one: scale (draftlab.bench.fits.round_scale)
            ran = [(m.get("completion_tokens"), m.get("spec_verify_ct"), sec) for m, sec in zip(spec["metas"], spec["request_seconds"])]
            served = fits.served_round(done, [r for r in ran if r[0] and r[1]])
            if served:
                costs["served_round_s"] = served["round_s"]
                costs["round_scale"] = fits.round_scale(costs, served["round_s"])

    acceptance = spec["spec"]["acceptance"] or offline["acceptance"]
    speedup = spec["speed"]["median"] / baseline["speed"]["median"] if baseline else None
    ran_config = (flags.num_steps, flags.topk, flags.num_draft_tokens)
    configs = plan.candidates(trees=costs.get("trees", True))  # no trees timed on a sliding-window target
    if plan.bench_params.backend == "reference" and speedup:
        # The in-process engine serves: its timings, all from one interleaved loop, give the shape
        # across configurations; the served pair gives the scale (draftlab.bench.fits.speedup_scale). Served and
        # in-process figures taken minutes apart on a shared CPU differed by up to 2x in absolute
        # speed, which an additive server overhead turned into a 20% error.
        costs["speedup_scale"] = fits.speedup_scale(costs, speedup, spec["spec"]["tau"], *ran_config)
    advised = advice.advise(acceptance, costs, configs, depth1_ranks=ranks)
    per = by_concurrency = None
    if baseline and spec["sweep"]:  # the advice at each concurrency measured, and where speculation stops paying
        request_s = {r["concurrency"]: r["prompt_only_s_per_request"] for r in baseline["sweep"] if r.get("prompt_only_s_per_request")}
        tokens = sum(r["completion_tokens"] for r in baseline["sweep"]) / max(1, sum(r["requests"] for r in baseline["sweep"]))
        per = advice.advise_by_concurrency(acceptance, advice.costs_by_concurrency(costs, baseline["sweep"], spec["sweep"], spec["spec"]["tau"],
                                                                                   flags.num_draft_tokens, request_s or None, tokens),
                                           configs, depth1_ranks=ranks)
        by_concurrency = {"crossover_concurrency": per["crossover_concurrency"],
                          "recommendation": {str(n): a["recommendation"] for n, a in per["by_concurrency"].items()},
                          "predicted_speedup": {str(n): {advice.config_name(r): r["predicted_speedup"] for r in a["candidates"]}
                                                for n, a in per["by_concurrency"].items()}}
    return {"advised": advised, "speedup": speedup, "per": per, "by_concurrency": by_concurrency}


def served_fit(pairings: list, candidates: list[dict]) -> dict | None:
    """With three or more configurations served beside the baseline: the advice from the server's own
    rounds alone (draftlab.bench.fits.advise_served: round = R0 + d * s + v * w over the rounds measured, each
    configuration also predicted with itself left out). None with fewer."""
    rounds = {p.configuration.key: fits.served_round(*bench_sweep.served_requests(p)) for p in pairings if p.spec and p.baseline}
    rounds = {k: r for k, r in rounds.items() if r}
    if len(rounds) < 3:
        return None
    return fits.advise_served(candidates, rounds)


def release_memory(device: str) -> None:
    """Give back what the in-process target held, so that a server started next finds it free."""
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def measure_served(plan: BenchPlan, out: Path, startups: dict | None = None) -> tuple[dict, Path]:
    """({prompt set name: (baseline figures or None, speculative figures)}, the speculative server's
    log): same prompts and lengths, same run; every server stopped after. startups: each started
    server's start-up is put there (the baseline's, then the configuration's)."""
    bench_params, target_params, flags, version = plan.bench_params, plan.target_params, plan.flags, plan.sglang_version
    backend, draft, sampling = bench_params.backend, plan.draft.path, plan.sampling
    log = out / "server-spec.log"
    base_log = out / "server-baseline.log"
    name = f"{flags.num_steps}-{flags.topk}-{flags.num_draft_tokens}"  # the progress bars' label
    sets = {}
    print(f"bench: speculative server {flags.algorithm} steps={flags.num_steps} topk={flags.topk} draft_tokens={flags.num_draft_tokens}")
    if backend == "reference" or (backend == "sglang" and bench_params.side_by_side):
        # Both servers up at once: requests alternate between them, so a change in the machine's
        # load hits both alike (SGLang: the second server sizes its KV pool from what the first left).
        print("bench: and a baseline server (no speculation); requests alternate between the two")
        spec_port = sglang_free_port() if backend == "sglang" else None  # the baseline has bench.port
        with servers.start(backend, bench_params, target_params, draft, flags, version, base_log, speculative=False,
                           startups=startups, name=BASELINE) as base_url, \
             servers.start(backend, bench_params, target_params, draft, flags, version, log, speculative=True, port=spec_port,
                           startups=startups, name=name) as url:
            startup.announce("bench", (startups or {}).values())
            plan.answer_turns(base_url, out)
            for bset in plan.sets:
                got = servers.measure({"baseline": base_url, "speculative": url}, bench_params, plan.set_prompt_ids(bset), sampling,
                                    bench_params.warmup, label=f"{name} {bset.name}")
                sets[bset.name] = (got["baseline"], got["speculative"])
                passes.record(out, name, bset.name, *sets[bset.name])
    else:
        # One server at a time (bench.side_by_side: false), baseline first.
        baselines = {}
        if backend != "url":
            with servers.start(backend, bench_params, target_params, draft, flags, version, base_log, speculative=False,
                               startups=startups, name=BASELINE) as base_url:
                plan.answer_turns(base_url, out)
                for bset in plan.sets:
                    baselines[bset.name] = servers.measure({"baseline": base_url}, bench_params, plan.set_prompt_ids(bset), sampling,
                                                         bench_params.warmup, label=f"baseline {bset.name}")["baseline"]
        with servers.start(backend, bench_params, target_params, draft, flags, version, log, speculative=True,
                           startups=startups, name=name) as url:
            plan.answer_turns(url, out)  # bench.backend url: no baseline; the server given answers (a no-op after the above)
            for bset in plan.sets:
                sets[bset.name] = (baselines.get(bset.name), servers.measure({"speculative": url}, bench_params, plan.set_prompt_ids(bset),
                                                                           sampling, bench_params.warmup, label=f"{name} {bset.name}")["speculative"])
                passes.record(out, name, bset.name, *sets[bset.name])
    if not sets[plan.sets[0].name][1]["spec"]:
        raise UserError(f"the server at {url} returned no speculative counters (spec_verify_ct): is it running with speculation?")
    if backend == "url" and bench_params.server_log:
        log = Path(bench_params.server_log)  # the running server's own log, read like a launched one's
    return sets, log


def _ms(v):
    return {str(k): _ms(x) for k, x in v.items()} if isinstance(v, dict) else 1e3 * v


@dataclasses.dataclass
class OfflineDecode:
    """The in-process offline run's decode (decode_offline), and the models it ran, for time_offline."""

    target: torch.nn.Module
    draft: torch.nn.Module
    physical: list[int]  # the target's layers fed to the draft, as SGLang would feed them
    prompts: list[list[int]]  # the prompts decoded, in order
    offline: dict  # draftlab.bench.offline.summarize's figures
    workers: int = 1  # processes that decoded at once (bench.offline_workers): above 1, its seconds are not one decode's


def measure_offline(plan: BenchPlan) -> tuple[dict, dict, list[int], list[float]]:
    """(offline figures, costs, physical layers, depth-1 rank shares): the same exported draft
    in-process, fed the layers SGLang would feed it, then what each part of a round costs
    (draftlab.bench.offline), the round loop's own share calibrated on the offline run's rounds."""
    return time_offline(plan, decode_offline(plan))


def offline_worker_count(plan: BenchPlan, beside: bool) -> int:
    """bench.offline_workers for this run: the copies of the target and the draft that fit beside the
    first wave's servers (beside), else in the device's free memory now."""
    copy = memory.in_process_bytes(plan.target_params, plan.draft)
    if beside:
        room = plan.layout.offline_room
    elif torch.device(plan.device).type == "cuda":
        room = int(memory.USABLE * torch.cuda.mem_get_info(torch.device(plan.device))[0])
    else:
        room = None
    return offline_workers.worker_count(plan.bench_params.offline_workers, plan.device, len(plan.sets[0].requests), copy, room)


def decode_offline(plan: BenchPlan, beside: str = "") -> OfflineDecode:
    """The offline run's decode: the exported draft loaded as served and the first prompt set decoded
    by the project's engine, in this process or in bench.offline_workers processes at once. beside:
    what runs meanwhile, for the progress line."""
    info = plan.target
    physical = plan.draft.served_physical(info["architecture"], info["num_layers"], plan.sglang_version)
    workers = offline_worker_count(plan, bool(beside))
    where = f"{workers} processes" if workers > 1 else "in-process"
    print(f"bench: offline run ({where}, no server)" + (f", {beside}" if beside else ""))
    tok_eos = plan.tokenizer.eos_token_id
    if workers > 1:
        with offline_workers.DecodePool(plan.target_params, plan.draft.path, plan.device, workers) as pool:
            prompts, offline = offline_decode(plan, lambda ids, **kw: pool.decode(ids, plan.flags, physical, tokenizer_eos=tok_eos, **kw),
                                              with_baseline=plan.offline_baselines)
        target, draft = offline_workers.load_models(plan.target_params, plan.draft.path, plan.device)  # the workers' copies are freed
    else:
        target, draft = offline_workers.load_models(plan.target_params, plan.draft.path, plan.device)
        eos = offline_workers.stop_ids(target, tok_eos)
        prompts, offline = offline_decode(plan, lambda ids, **kw: cost_timing.decode_each(target, draft, ids, plan.flags, physical,
                                                                                           eos=eos, **kw), with_baseline=plan.offline_baselines)
    return OfflineDecode(target, draft, physical, prompts, offline, workers)


def time_offline(plan: BenchPlan, decoded: OfflineDecode) -> tuple[dict, dict, list[int], list[float]]:
    """measure_offline's figures from a decode already made: what each part of a round costs, timed
    now (with no server measuring beside it), and the loop's share from the decode's rounds."""
    target, draft, physical, prompts, offline = decoded.target, decoded.draft, decoded.physical, decoded.prompts, decoded.offline
    flags = plan.flags
    ran = (flags.num_steps, flags.topk, flags.num_draft_tokens)
    # A sliding-window target (gpt-oss) verifies chains only in-process (draftlab.engine.speculative.verify_tree)
    trees = not spec_engine._sliding(target)
    configs = plan.candidates(trees)
    # Rounds are timed over a cache of the first prompt plus half a typical answer (its own offline
    # output cut there): a round's draft steps and verify attend over the whole cache.
    first = prompts[0]
    context = offline["outputs"][0][:len(first) + int(offline["tokens_per_request"] / 2)]
    costs = cost_timing.measure_costs(target, draft, context, physical, configs, prompt_len=len(first))
    costs["trees"] = trees
    batches = [n for n in plan.bench_params.concurrency if n > 1]
    if batches:  # the target's matmuls over n * w tokens: how a verify grows with requests in flight (advice.batch_growth)
        widths = {w for *_, w in configs}
        costs["gemm_s"] = cost_timing.measure_gemm_s(target, sorted(widths | {n * w for n in batches for w in widths}))
    costs["fit_s"] = advice.fit_costs(costs)  # the model's terms, fitted over every configuration timed
    # The loop: what the offline run's rounds (seconds each) took beyond the fitted parts, at the
    # configuration that ran. It may be negative: where the lines through every configuration's
    # timings overshoot this configuration's measured round, the measured round is the better figure.
    timed = offline
    if decoded.workers > 1:  # the decode's seconds were shared with the other processes: its first prompt again, alone
        eos = offline_workers.stop_ids(target, plan.tokenizer.eos_token_id)
        timed = cost_timing.summarize(prompts[:1], *cost_timing.decode_each(
            target, draft, prompts[:1], flags, physical, plan.bench_params.max_new_tokens, eos, plan.bench_params.ignore_eos,
            plan.offline_baselines))
        offline["tokens_per_s"], offline["baseline_step_s"] = timed["tokens_per_s"], timed["baseline_step_s"]
    round_s = (timed["decode_s"] - timed["requests"] * costs["draft_prefill_s"]) / max(1, timed["verify_ct"])
    parts = advice.round_cost(costs, *ran, offline["tau"])
    costs["offline_round_s"] = round_s
    costs["loop_s"] = round_s - parts["round"]
    costs["tokens_per_request"] = offline["tokens_per_request"]
    costs["baseline_run_step_s"] = offline.pop("baseline_step_s") or costs["baseline_step_s"]
    grams = ngram_advice.timed_configs([c.key for c in plan.configurations if c.ngram])
    if grams:  # n-gram lookup's rounds, over a cache of the other offline answers (not the one the context is cut from)
        costs.update(cost_timing.measure_ngram_costs(target, context, len(first), grams, offline["outputs"][1:]))
    ranks = cost_timing.measure_rank_shares(target, draft, offline.pop("outputs")[:8], [len(p) for p in prompts[:8]], physical)
    return offline, costs, physical, ranks


def offline_decode(plan: BenchPlan, decode_each, with_baseline: bool) -> tuple[list, dict]:
    """(the prompts decoded, draftlab.bench.offline.summarize's figures): the first prompt set, each
    later turn after the engine's own answer to the turn before (greedy: the target's own answer).
    decode_each(ids, max_new_tokens=, ignore_eos=, with_baseline=, done=) -> (results, baselines)."""
    bp = plan.bench_params
    bset = dataclasses.replace(plan.sets[0], answers={})  # its own answers, not the baseline server's
    prompts, results, baselines = [], [], []
    # In-process decoding runs at the engine's pace, not the server's (tens of ms a round on a GPU: minutes)
    with progress.bar(len(bset.requests), f"bench offline {bset.name}", "req") as bar:
        for turn in range(1, bset.turns + 1):
            keys = [i for i, t in bset.requests if t == turn]
            ids = bset.render(plan.tokenizer, turn=turn)
            got, base = decode_each(ids, max_new_tokens=bp.max_new_tokens, ignore_eos=bp.ignore_eos, with_baseline=with_baseline,
                                    done=bar.update)
            for i, r in zip(keys, got):
                bset.answers[(i, turn)] = plan.tokenizer.decode(r.output_ids, skip_special_tokens=True)
            prompts, results, baselines = prompts + ids, results + got, baselines + base
    return prompts, cost_timing.summarize(prompts, results, baselines)


def summary(report: dict) -> str:
    """One line: served and offline tau, speed against the baseline, the advice (the recommended
    configuration, or "don't speculate") and the prediction for the configuration that ran; with
    bench.sweep, the best configuration measured and the advice's."""
    speedup, baseline, advised = report["speedup"], report["baseline"], report["advice"]
    speedup_text = f"{speedup:.2f}x" if speedup else "n/a"
    ran = advised.get("ran")
    ran_text = ""
    if ran and ran.get("predicted_speedup") is not None:
        err = ran.get("speedup_error")
        ran_text = (f"; this configuration predicted {ran['predicted_speedup']:.2f}x"
                    + (f" ({100 * err:+.0f}% against measured)" if err is not None else ""))
    per = advised.get("by_concurrency")
    if per:
        cross = per["crossover_concurrency"]
        ran_text += (f"; speculation pays at every concurrency measured (up to {max(int(n) for n in per['recommendation'])})"
                     if cross is None else f"; from concurrency {cross} on: {advice.DONT_SPECULATE}")
    best = report.get("best_configuration") or {}
    if best.get("configurations_measured", 0) > 1:
        ran_text += (f"; best of {best['configurations_measured']} configurations measured: {best['measured']} "
                     f"({best['measured_speedup']:.2f}x), the advice's: {best['advised']}"
                     + (f" (measured {best['advised_measured_speedup']:.2f}x)" if best.get("advised_measured_speedup") else ""))
    if best.get("configurations_failed"):
        ran_text += f"; failed: {', '.join(best['configurations_failed'])} (their errors: bench.json configurations)"
    pays = bench_report.verdict_line(report.get("training_pays") or [])
    if pays:
        ran_text += f"; does training pay? {pays}"
    return (f"tau {report['spec']['tau']:.2f} served, {report['offline']['tau']:.2f} offline; "
            f"{report['spec']['tokens_per_s']['median']:.1f} tok/s vs "
            f"{baseline['tokens_per_s']['median'] if baseline else float('nan'):.1f} baseline "
            f"(speedup {speedup_text}); advice: {advised['advice']}{ran_text}")
