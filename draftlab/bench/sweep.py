"""The bench stage's configuration sweep (bench.sweep): one baseline server kept up, every speculative
configuration bench.sweep lists started with it before anything is measured, each measured paired
against it in turn; all stopped at the end.

    configurations, choices = draftlab.bench.sweep.plan_configurations(spec_resolution, bench_params.sweep, resolve_one,
                                                              on_adjust, candidates)
    with draftlab.bench.sweep.servers_up(plan, out) as fleet:
        first = draftlab.bench.sweep.measure_first(plan, fleet)        # spec.*'s configuration
        pick = ...                                                    # the advice, from numbers (bench.run)
        pairings = [first] + draftlab.bench.sweep.measure_rest(plan, fleet, first, pick)   # bench.sweep's, in order
    rows = draftlab.bench.sweep.rows(pairings, bs1_predictions, predictions_by_concurrency)

Starting them together costs one start-up (SGLang: ~70 s) instead of one per configuration, and no
measurement overlaps a start-up. On SGLang each server then has an explicit KV pool
(draftlab.bench.memory, plan.layout); where the GPU cannot hold them all, those that do not fit
start in a later wave, once the ones before are measured and stopped; where the GPU's memory is
unknown, each configuration starts beside the baseline in turn, as SGLang sizes its pools itself.
A configuration whose server does not start is reported with its error (Pairing.error), as one
whose requests fail; the others go on. `advised`, when it picks a configuration not measured yet,
starts then, beside the baseline, and stops after its pairing.

spec.*'s configuration is always measured first: the offline run, the tau triangle, the headline
figures and the check use it, and its pairing calibrates the advice. `advised` in bench.sweep is
the configuration that advice recommends (bs=1), measured unless it was measured already. `ngram`
and `ngram-N-B` are SGLang's NGRAM (drafts looked up in a cache of earlier text, no draft model),
paired against the same baseline; its caches are emptied before every measured pass
(draftlab.bench.servers.measure, fresh), so it never answers prompts its cache has answered already.
Every prompt set of bench.prompts is measured on each configuration's server, in turn, the first
set's figures being the configuration's own (Pairing.baseline, .spec), every set's in Pairing.sets.

A pairing (draftlab.bench.servers.measure with abba): at bs=1 the two servers take the same prompts one
request at a time in ABBA order (baseline first on even prompts, speculative first on odd ones);
prompt-only requests alike; at each concurrency n > 1 whole batches in flight, an uncounted one per
server first, then bench.concurrency_repeats ABBA pairs and a prompt-only batch per server (the
prefill probe). Per configuration (`rows`):

    speedup           = median speculative tokens/s per request / the baseline's (bs=1, as bench's headline)
    speedup at n      = speculative batch tokens/s / baseline batch tokens/s, pooled over the repeats
    repeat_speedups   = that ratio for each ABBA pair of batches; repeat_spread = max / min - 1
    repeat_taus       = the speculative server's tau in each of those batches
    greedy_identical  = share of prompts whose greedy text is the same on both servers
"""
from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from draftlab import lifecycle
from draftlab.bench import passes, servers
from draftlab.bench.memory import BASELINE
from draftlab.errors import UserError
from draftlab.params import ADVISED, is_ngram, parse_configuration, parse_ngram
from draftlab.sglang import startup
from draftlab.sglang.flags import Resolution
from draftlab.sglang.launch import free_port as sglang_free_port

SPEC, LISTED = "spec", "listed"  # the roles of a configuration; ADVISED is the third


NGRAM = "NGRAM"  # the first item of an n-gram configuration's key: ("NGRAM", draft tokens, max BFS breadth)


def name_of(key) -> str:
    """(num_steps, topk, num_draft_tokens) -> '5-1-6'; ("NGRAM", 4, 1) -> 'ngram-4-1'."""
    return "-".join(str(x).lower() for x in key)


def key_of(item: str) -> tuple:
    """A bench.sweep item (not `advised`) as its configuration key."""
    return (NGRAM, *parse_ngram(item)) if is_ngram(item) else parse_configuration(item)


@dataclass
class Configuration:
    """One configuration to serve: its name, why it is measured, and what SGLang will run."""

    name: str  # "5-1-6"; "advised" until the advice names one
    roles: list[str]  # SPEC, LISTED and/or ADVISED
    resolution: Resolution | None = None  # None: the advised placeholder

    @property
    def ngram(self) -> bool:
        """Whether it is n-gram lookup (NGRAM), not the trained draft."""
        return self.resolution is not None and self.resolution.effective.algorithm == NGRAM

    @property
    def key(self) -> tuple:
        """(num_steps, topk, num_draft_tokens) of a draft; ("NGRAM", draft tokens, max BFS breadth) of n-gram lookup."""
        f = self.resolution.effective
        if f.algorithm == NGRAM:
            return NGRAM, f.num_draft_tokens, f.ngram_max_bfs_breadth
        return f.num_steps, f.topk, f.num_draft_tokens


@dataclass
class Pairing:
    """What one configuration measured beside the baseline (figures as draftlab.bench.servers.measure gives them)."""

    configuration: Configuration
    baseline: dict | None  # None: no baseline (bench.backend url); the first prompt set's
    spec: dict | None  # None: it failed (error says why)
    log: Path
    urls: dict = field(default_factory=dict)
    error: str | None = None
    sets: dict = field(default_factory=dict)  # prompt set name -> (baseline, speculative) figures, the first set's included


def plan_configurations(spec_resolution: Resolution, items: list[str], resolve_one, on_adjust: str,
                        candidates) -> tuple[list[Configuration], dict]:
    """(configurations in the order they are measured, {key: Resolution or why it is refused} for
    `advised`): spec.*'s first, then bench.sweep's. resolve_one(key) -> Resolution of that
    configuration (a draft's (s, k, w) or n-gram lookup's ("NGRAM", N, B)) with every other flag as
    spec.* and bench.* give it; every listed one must pass spec.on_adjust here, before anything
    starts. `candidates`: the keys the advice may recommend."""
    first = Configuration(name_of(_key(spec_resolution)), [SPEC], spec_resolution)
    out, by_key = [first], {first.key: first}
    for item in items:
        if item == ADVISED:
            out.append(Configuration(ADVISED, [ADVISED]))
            continue
        key = key_of(item)
        if key in by_key:  # spec.*'s own: measured first already
            by_key[key].roles.append(LISTED)
            continue
        res = resolve_one(key)
        try:
            res.enforce(on_adjust)
        except UserError as e:
            raise UserError(f"bench.sweep lists {item}: {e}") from None
        by_key[key] = Configuration(item if is_ngram(item) else name_of(key), [LISTED], res)
        out.append(by_key[key])
    choices = {}
    if any(c.name == ADVISED for c in out):
        for key in list(candidates) + [k for k in by_key if k not in candidates and k[0] != NGRAM]:
            res = by_key[key].resolution if key in by_key else resolve_one(key)
            try:
                choices[key] = res.enforce(on_adjust)
            except UserError as e:
                choices[key] = str(e)
    return out, choices


def _key(res: Resolution) -> tuple[int, int, int]:
    f = res.effective
    return f.num_steps, f.topk, f.num_draft_tokens


@contextlib.contextmanager
def servers_up(plan, out: Path, meanwhile=None, startups: dict | None = None):
    """The sweep's servers (Fleet): the baseline, up for the whole sweep, and bench.sweep's
    configurations, started with it before anything is measured; the answers that later turns
    follow are taken from the baseline once, on start. Every server is stopped on exit.
    meanwhile: work of this process run while the first wave starts (the offline run's decode).
    startups: where each server's start-up went is put there, by server name (Fleet.startup)."""
    with contextlib.ExitStack() as stack:
        fleet = Fleet(plan, out, stack, startups)
        fleet.start_wave(0, meanwhile)
        plan.answer_turns(fleet.base_url, out)
        yield fleet


class Fleet:
    """The servers of a sweep: the baseline, and the speculative ones wave by wave (`waves`)."""

    def __init__(self, plan, out: Path, stack: contextlib.ExitStack, startups: dict | None = None):
        self.plan, self.out, self.stack = plan, out, stack
        self.waves = waves(plan)
        self.current: int | None = None  # the wave up
        self.up: dict[str, object] = {}  # configuration name -> its lifecycle.Server, or the UserError its start gave
        self.base_url: str | None = None
        # server name -> where its start-up went (draftlab.sglang.startup); the caller's dict when given
        self.startup: dict[str, dict | None] = {} if startups is None else startups

    def log(self, config: Configuration) -> Path:
        first = config is self.plan.configurations[0]
        return self.out / ("server-spec.log" if first else f"server-spec-{config.name}.log")

    def start_wave(self, k: int, meanwhile=None) -> None:
        """Start wave k's servers together (the baseline with the first); the first wave's
        spec.*'s server must start, a later one's failure is its configuration's error.
        meanwhile: run while they start (after their launch, before their health)."""
        plan, bp, layout = self.plan, self.plan.bench_params, self.plan.layout
        configs = [c for c in plan.configurations if c.name in self.waves[k] and c.resolution is not None]
        launches = [servers.Launch(c.resolution.effective, self.log(c), True, optional=c is not plan.configurations[0]) for c in configs]
        if self.base_url is None:
            launches.insert(0, servers.Launch(plan.flags, self.out / "server-baseline.log", False))
        self.current = k
        if not launches:
            if meanwhile is not None:
                meanwhile()
            return
        together = layout is not None or bp.backend == "reference"  # the reference server pre-allocates nothing
        self._announce(configs, together)
        got = self.stack.enter_context(servers.start_many(bp.backend, bp, plan.target_params, plan.draft.path, plan.sglang_version,
                                                          launches, together, layout.args if layout else (), meanwhile))
        names = ([] if self.base_url is not None else [BASELINE]) + [c.name for c in configs]
        started = {name: startup.server_startup(srv) for name, srv in zip(names, got) if isinstance(srv, lifecycle.Server)}
        self.startup.update(started)
        startup.announce("bench", started.values())
        if self.base_url is None:
            self.base_url, got = got[0].url, got[1:]
        for config, srv in zip(configs, got):
            self.up[config.name] = srv
            if isinstance(srv, UserError):
                print(f"bench: warning: configuration {config.name} failed to start: {str(srv).splitlines()[0]}")

    def _announce(self, configs: list[Configuration], together: bool) -> None:
        baseline = self.base_url is None
        names = (["a baseline server (no speculation), kept up for every configuration"] if baseline else []) + \
            [f"{c.name}'s speculative server" for c in configs]
        how = "together" if together else "one after another (each sizing its own KV pool)"
        layout = self.plan.layout
        memory = f" ({layout.describe(([BASELINE] if baseline else []) + [c.name for c in configs])})" if layout else ""
        print(f"bench: starting {', '.join(names)}, {how}{memory}")

    def reach(self, name: str) -> None:
        """Have the wave that holds configuration `name` up, the one before it stopped (nothing
        when it is up already, or when no wave holds `name`)."""
        k = next((i for i, wave in enumerate(self.waves) if name in wave), None)
        if k is None or k == self.current:
            return
        for other in self.waves[self.current]:
            if isinstance(self.up.get(other), lifecycle.Server):
                lifecycle.stop(self.up[other])
        self.start_wave(k)

    @contextlib.contextmanager
    def serving(self, config: Configuration):
        """The URL of `config`'s speculative server: started with its wave, or (the advised pick,
        which no wave holds) started now beside what is up and stopped after."""
        self.reach(config.name)
        srv = self.up.get(config.name)
        if isinstance(srv, UserError):
            raise srv
        if srv is not None:
            yield srv.url
            return
        bp, layout = self.plan.bench_params, self.plan.layout
        port = sglang_free_port() if bp.backend == "sglang" else None  # the baseline has bench.port
        with servers.start(bp.backend, bp, self.plan.target_params, self.plan.draft.path, config.resolution.effective,
                           self.plan.sglang_version, self.log(config), speculative=True, port=port,
                           memory_args=layout.args if layout else (), startups=self.startup, name=config.name) as url:
            yield url


def waves(plan) -> list[list[str]]:
    """The configurations started together, wave by wave: plan.layout's (SGLang servers with explicit
    pools); all at once on the reference server; else one at a time (SGLang sizing its own pool)."""
    names = [c.name for c in plan.configurations]
    if plan.layout is not None:
        return plan.layout.waves
    if plan.bench_params.backend == "reference":
        return [names]
    return [[n] for n in names]


def measure_first(plan, fleet: Fleet) -> Pairing:
    """spec.*'s configuration beside the baseline: the pairing that calibrates the advice."""
    config = plan.configurations[0]
    with fleet.serving(config) as url:
        return _pair(plan, fleet, config, url)


def measure_rest(plan, fleet: Fleet, first: Pairing, pick: tuple[int, int, int] | None) -> list[Pairing]:
    """Every other configuration of plan.configurations beside the same baseline, in order; `pick`:
    the key the advice recommends (for `advised`), or None. A configuration that fails (its server
    does not start, a request fails) is recorded with its error and the sweep goes on."""
    rest = plan.configurations[1:]
    measured, pairings = {first.configuration.key: first.configuration}, []
    for config in rest:
        fleet.reach(config.name)  # its wave up (for `advised`: the wave that keeps room for the pick)
        if config.name == ADVISED:
            config = _advised(plan, pick, measured, [c for c in rest if c.resolution is not None])
            if config is None:
                continue
        if config.key in measured:
            continue
        measured[config.key] = config
        try:
            with fleet.serving(config) as url:
                pairings.append(_pair(plan, fleet, config, url))
        except UserError as e:
            print(f"bench: warning: configuration {config.name} failed: {str(e).splitlines()[0]}")
            pairings.append(Pairing(config, None, None, fleet.log(config), error=str(e)))
    return pairings


def _advised(plan, pick, measured: dict, listed: list[Configuration]) -> Configuration | None:
    """The advice's pick as a configuration to measure; None when it says don't speculate or when
    the pick is measured (or listed) already (that configuration then carries the role)."""
    if pick is None:
        print("bench: advised: the advice says don't speculate; nothing more to measure")
        return None
    for config in list(measured.values()) + listed:
        if config.key == tuple(pick):
            config.roles.append(ADVISED)
            return None
    choice = plan.advised_choices.get(tuple(pick))
    if not isinstance(choice, Resolution):
        print(f"bench: warning: the advised configuration {name_of(pick)} is not served: {choice}")
        return None
    return Configuration(name_of(pick), [ADVISED], choice)


def _pair(plan, fleet: Fleet, config: Configuration, url: str) -> Pairing:
    """Measure `config`'s server at `url` paired against the fleet's baseline, on every prompt set
    (each set's pass recorded as it ends: draftlab.bench.passes)."""
    bp, base_url = plan.bench_params, fleet.base_url
    flags = config.resolution.effective
    print(f"bench: {config.name} ({', '.join(config.roles)}): speculative server {flags.algorithm} steps={flags.num_steps} "
          f"topk={flags.topk} draft_tokens={flags.num_draft_tokens} beside the baseline; requests in ABBA order"
          + ("; both servers' caches emptied before every measured pass" if config.ngram else ""))
    sets = {}
    for bset in plan.sets:
        got = servers.measure({"baseline": base_url, "speculative": url}, bp, plan.set_prompt_ids(bset), plan.sampling,
                              bp.warmup, abba=True, label=f"{config.name} {bset.name}", fresh=config.ngram)
        if not got["speculative"]["spec"]:
            raise UserError(f"the server at {url} returned no speculative counters (spec_verify_ct): is it running with speculation?")
        sets[bset.name] = (got["baseline"], got["speculative"])
        passes.record(fleet.out, config.name, bset.name, *sets[bset.name])
    base, spec = sets[plan.sets[0].name]
    return Pairing(config, base, spec, fleet.log(config), {"baseline": base_url, "speculative": url}, sets=sets)


# ---------------------------------------------------------------------------------------------
# The report's rows


def rows(pairings: list[Pairing], predicted: dict, by_concurrency: dict | None) -> list[dict]:
    """bench.json's `configurations`: per configuration the flags requested and effective, the bs=1
    paired figures, per concurrency n > 1 each repeat and their spread, and the advice's prediction
    at every point with its error. predicted: {key: advice candidate row} (bs=1); by_concurrency:
    {n: {key: candidate row}} (None without requests in flight)."""
    out = []
    for p in pairings:
        c = p.configuration
        res = c.resolution
        eff = res.effective
        row = {"configuration": c.name, "roles": c.roles, "algorithm": eff.algorithm, "num_steps": eff.num_steps, "topk": eff.topk,
               "num_draft_tokens": eff.num_draft_tokens,
               "flags": {"requested": dataclasses.asdict(res.requested), "effective": dataclasses.asdict(eff),
                         "adjustments": [f.rule for f in res.adjustments]},
               "server_log": p.log.name, "servers": p.urls}
        if c.ngram:
            row["ngram"] = {"draft_tokens": eff.num_draft_tokens, "max_bfs_breadth": eff.ngram_max_bfs_breadth}
        if p.error:
            out.append({**row, "error": p.error})
            continue
        base, spec = p.baseline, p.spec
        speedup = spec["speed"]["median"] / base["speed"]["median"] if base else None
        row.update({"speedup": speedup, "tau": spec["spec"]["tau"], "accept_rate": spec["spec"]["accept_rate"],
                    "tokens_per_s": spec["speed"]["median"], "baseline_tokens_per_s": base["speed"]["median"] if base else None,
                    "served_flags": servers.served_flags(spec["server_flags"]), **identical(base, spec),
                    **_predicted(predicted.get(c.key), spec["spec"]["tau"], speedup)})
        row["concurrency"] = [_point(n, b, s, (by_concurrency or {}).get(n, {}).get(c.key))
                              for n, b, s in _batches(base, spec)]
        out.append(row)
    return out


def identical(base: dict | None, spec: dict) -> dict:
    """The share of prompts whose greedy text is the same on both servers, and the prompts (0-based,
    after the warm-up) where it differs."""
    if not base or not base.get("texts"):
        return {"greedy_identical": None, "greedy_differs_at": []}
    pairs = list(zip(base["texts"], spec["texts"]))
    differs = [i for i, (a, b) in enumerate(pairs) if a != b]
    return {"greedy_identical": 1.0 - len(differs) / len(pairs) if pairs else None, "greedy_differs_at": differs}


def _predicted(candidate: dict | None, tau: float | None, speedup: float | None) -> dict:
    if candidate is None:
        return {"predicted_tau": None, "predicted_speedup": None, "tau_error": None, "speedup_error": None}
    pt, ps = candidate["predicted_tau"], candidate["predicted_speedup"]
    return {"predicted_tau": pt, "predicted_speedup": ps, "tau_error": pt / tau - 1.0 if tau else None,
            "speedup_error": ps / speedup - 1.0 if speedup else None}


def _batches(base: dict | None, spec: dict):
    """(n, baseline row, speculative row) of each concurrency n > 1 both measured."""
    if not base:
        return []
    at = {r["concurrency"]: r for r in base["sweep"]}
    return [(r["concurrency"], at[r["concurrency"]], r) for r in spec["sweep"] if r["concurrency"] in at]


def _point(n: int, base: dict, spec: dict, candidate: dict | None) -> dict:
    pairs = [s["throughput"] / b["throughput"] for b, s in zip(base.get("batches", []), spec.get("batches", []))]
    speedup = spec["throughput"] / base["throughput"]
    return {"concurrency": n, "speedup": speedup, "repeat_speedups": pairs,
            "repeat_spread": max(pairs) / min(pairs) - 1.0 if pairs else None,
            "repeat_taus": [b.get("tau") for b in spec.get("batches", [])],  # a repeat that saw its own answers: a higher tau
            "baseline_tokens_per_s": base["throughput"], "tokens_per_s": spec["throughput"], "tau": spec.get("tau"),
            "prompt_only_ms_per_request": {"baseline": _ms(base.get("prompt_only_s_per_request")),
                                           "speculative": _ms(spec.get("prompt_only_s_per_request"))},
            **_predicted(candidate, spec.get("tau"), speedup)}


def _ms(seconds):
    return None if seconds is None else 1e3 * seconds


def predicted_vs_measured_by_concurrency(rows_: list[dict]) -> list[dict]:
    """One row per (configuration, concurrency) measured: predicted and measured tau and speedup and
    their errors (concurrency 1: the bs=1 pairing)."""
    out = []
    for r in rows_:
        if r.get("error"):
            continue
        for n, point in [(1, r)] + [(p["concurrency"], p) for p in r["concurrency"]]:
            out.append({"configuration": r["configuration"], "concurrency": n, "predicted_tau": point["predicted_tau"],
                        "measured_tau": point["tau"], "tau_error": point["tau_error"], "predicted_speedup": point["predicted_speedup"],
                        "measured_speedup": point["speedup"], "speedup_error": point["speedup_error"]})
    return out


def best(rows_: list[dict], advised: dict) -> dict:
    """The best draft configuration measured (bs=1 speedup) and the advice's, named side by side
    (n-gram lookup is compared in the headline table, draftlab.bench.report)."""
    done = [r for r in rows_ if r.get("speedup") is not None and r.get("algorithm") != NGRAM]
    top = max(done, key=lambda r: r["speedup"]) if done else None
    rec = advised.get("recommended")
    pick = name_of((rec["num_steps"], rec["topk"], rec["num_draft_tokens"])) if rec else None
    served = next((r for r in done if r["configuration"] == pick), None)
    return {"measured": top["configuration"] if top else None, "measured_speedup": top["speedup"] if top else None,
            "advised": pick or advised.get("recommendation"), "advised_predicted_speedup": rec["predicted_speedup"] if rec else None,
            "advised_measured_speedup": served["speedup"] if served else None,
            "configurations_measured": len(done), "configurations_failed": [r["configuration"] for r in rows_ if r.get("error")]}


def served_requests(pairing: Pairing) -> tuple[list, list]:
    """(baseline (tokens, seconds), speculative (tokens, verify rounds, seconds)) per bs=1 request:
    what draftlab.bench.fits.served_round reads."""
    b, s = pairing.baseline, pairing.spec
    base = [(m.get("completion_tokens"), sec) for m, sec in zip(b["metas"], b["request_seconds"]) if m.get("completion_tokens")]
    spec = [(m.get("completion_tokens"), m.get("spec_verify_ct"), sec) for m, sec in zip(s["metas"], s["request_seconds"])
            if m.get("completion_tokens") and m.get("spec_verify_ct")]
    return base, spec
