"""bench.sweep: every configuration served beside one baseline and measured paired against it, on
the reference server with a micro target; and the configurations a user writes, checked before
anything starts."""
import dataclasses
import json
import math
import types
from pathlib import Path

import pytest
import yaml

from draftlab import jsonl, lifecycle
from draftlab.bench import servers as bench, sweep as bench_sweep
from draftlab.data import prompts
from draftlab.bench.stage import bench as bench_stage
from draftlab.errors import UserError
from draftlab.manifest import build_manifest, dir_hash, write_manifest
from draftlab.params import ParamsError, load_params
from draftlab.sglang.checkpoint import export_sglang
from draftlab.sglang.client import Client
from draftlab.sglang.flags import SpecFlags, resolve
from tests.support.drafts import random_draft
from tests.support.micro import save_micro_model

ROOT = Path(__file__).resolve().parents[1]
MEASURED, MAX_NEW = 3, 8  # bench.num_prompts, bench.max_new_tokens (one warm-up prompt before them)
SWEEP = ["1-1-2", "2-1-3", "2-2-4"]  # 2-1-3 is spec.*'s own: measured first, once
ORDER = [(2, 1, 3), (1, 1, 2), (2, 2, 4)]


def make_project(root: Path, **bench_params) -> Path:
    """A micro target, a random draft exported for it, eval prompts and params.yaml (reduced bench)."""
    target = save_micro_model(root / "models/micro", arch="llama", num_layers=6)
    facts = {"architecture": "LlamaForCausalLM", "num_layers": 6, "max_position_embeddings": 512, "model": "models/micro"}
    export_sglang(random_draft(target, 3, draft_vocab=64), root / "models/draft", facts, [1, 3, 5], "0.5.14", dtype="float32")
    write_manifest(root / "models/draft", build_manifest("export", {}, {}))
    out = root / "data/prompts"
    out.mkdir(parents=True)
    rows = prompts.builtin_prompts(40, 1).rows[:MEASURED + 1]
    (out / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    write_manifest(out, build_manifest("prompts", {}, {"outputs_sha256": dir_hash(out)}))
    p = yaml.safe_load((ROOT / "params.yaml").read_text())
    p["target"]["model"] = str(root / "models/micro")
    p["spec"].update(num_steps=2, topk=1, num_draft_tokens=None)
    p["bench"].update({"num_prompts": MEASURED, "warmup": 1, "max_new_tokens": MAX_NEW, "concurrency": [1, 2], "concurrency_repeats": 2,
                       **bench_params})
    (root / "params.yaml").write_text(yaml.safe_dump(p, sort_keys=False))
    return root


class Started:
    """draftlab.bench.servers.start as it is, noting every server started and the URL it gave."""

    def __init__(self, real, log):
        self.real, self.log = real, log

    def __call__(self, *args, speculative, **kw):
        cm = self.real(*args, speculative=speculative, **kw)
        log, flags = self.log, args[4]

        class Noted:
            def __enter__(self):
                url = cm.__enter__()
                log.append((speculative, (flags.num_steps, flags.topk, flags.num_draft_tokens), url))
                return url

            def __exit__(self, *exc):
                return cm.__exit__(*exc)
        return Noted()


class StartedMany:
    """draftlab.bench.servers.start_many as it is, noting every server it started as Started does (an
    error in place of the URL of one that did not start), and per call (servers started, /generate
    requests sent before they were up) in `calls`."""

    def __init__(self, real, log, sent=None, calls=None):
        self.real, self.log, self.sent, self.calls = real, log, sent, calls

    def __call__(self, backend, bench_params, target_params, draft, version, launches, *args, **kw):
        cm = self.real(backend, bench_params, target_params, draft, version, launches, *args, **kw)
        outer = self

        class Noted:
            def __enter__(self):
                got = cm.__enter__()
                for launch, srv in zip(launches, got):
                    f = launch.flags
                    outer.log.append((launch.speculative, (f.num_steps, f.topk, f.num_draft_tokens), getattr(srv, "url", srv)))
                if outer.calls is not None:
                    outer.calls.append((len(launches), len(outer.sent or [])))
                return got

            def __exit__(self, *exc):
                return cm.__exit__(*exc)
        return Noted()


def note_starts(mp, started, sent=None, calls=None):
    """Note every server the bench starts, alone or together (Started, StartedMany)."""
    mp.setattr(bench, "start", Started(bench.start, started))
    mp.setattr(bench, "start_many", StartedMany(bench.start_many, started, sent, calls))


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    """One bench stage with bench.sweep over three configurations, concurrency [1, 2]: (root, report,
    servers started, every /generate request in the order sent, the start_many calls)."""
    root = make_project(tmp_path_factory.mktemp("sweep"), sweep=SWEEP)
    started, sent, calls = [], [], []
    generate = Client.generate

    def noted_generate(self, prompt, sampling_params=None, **body):
        text, meta = generate(self, prompt, sampling_params, **body)
        sent.append((self.url, tuple(prompt), sampling_params["max_new_tokens"], text))
        return text, meta

    with pytest.MonkeyPatch.context() as mp:
        note_starts(mp, started, sent, calls)
        mp.setattr(Client, "generate", noted_generate)
        report = bench_stage(root / "models/draft", root / "data/prompts", root / "reports/bench", root / "reports/bench.json",
                             params_file=root / "params.yaml")
    return root, report, started, sent, calls


def test_the_baseline_and_every_listed_configuration_start_together_before_anything_is_measured(swept):
    _, report, started, _, calls = swept
    assert calls == [(4, 0)]  # one start of four servers, before the first request
    assert [s for s, _, _ in started] == [False, True, True, True]  # the baseline once, first
    assert [key for spec, key, _ in started if spec] == ORDER  # spec.*'s first, then bench.sweep's, 2-1-3 not twice
    base_url = started[0][2]
    assert {c["servers"]["baseline"] for c in report["configurations"]} == {base_url}
    assert len({c["servers"]["speculative"] for c in report["configurations"]} | {base_url}) == 4
    assert [c["configuration"] for c in report["configurations"]] == ["2-1-3", "1-1-2", "2-2-4"]
    assert report["configurations"][0]["roles"] == ["spec", "listed"]


def test_each_configuration_is_paired_abba_over_the_same_prompts_at_bs1_and_in_flight(swept):
    _, report, started, sent, _ = swept
    base_url = started[0][2]
    # Per pairing, in order: a warm-up request per server; bs=1 ABBA; prompt-only ABBA; at 2 in
    # flight an uncounted batch per server, two ABBA pairs of whole batches, a prompt-only batch each.
    n = MEASURED
    expected = "bs" + "bssbbs" + "BSSBBS" + "b" * n + "s" * n + ("b" * n + "s" * n + "s" * n + "b" * n) + "B" * n + "S" * n
    assert len(sent) == 3 * len(expected)
    for i, (_, _, spec_url) in enumerate(s for s in started if s[0]):
        part = sent[i * len(expected):(i + 1) * len(expected)]
        assert {u for u, *_ in part} == {base_url, spec_url}  # this pairing's two servers only
        letters = "".join(("b" if u == base_url else "s").upper() if m == 1 else ("b" if u == base_url else "s") for u, _, m, _ in part)
        assert letters == expected
        bs1 = part[2:8]
        assert [p for _, p, _, _ in bs1[0::2]] == [p for _, p, _, _ in bs1[1::2]]  # each prompt to both, back to back
        measured = {p for _, p, _, _ in bs1}
        assert len(measured) == n and part[0][1] not in measured  # the warm-up prompt is not measured
        batches = [part[14 + j * n:14 + (j + 1) * n] for j in range(8)]
        assert all({p for _, p, _, _ in b} == measured for b in batches)  # every batch: the same prompts
        # the identical share, from the texts the servers answered
        texts = {(u == base_url, p): t for u, p, _, t in bs1}
        same = sum(texts[(True, p)] == texts[(False, p)] for p in measured) / n
        assert report["configurations"][i]["greedy_identical"] == pytest.approx(same)


def test_every_point_has_the_advice_its_measurement_and_the_error(swept):
    _, report, _, _, _ = swept
    advice = report["advice"]
    candidates = {(c["num_steps"], c["topk"], c["num_draft_tokens"]): c for c in advice["candidates"]}
    assert set(ORDER) <= set(candidates)  # every configuration swept is predicted
    rows = {r["configuration"]: r for r in advice["predicted_vs_measured_by_concurrency"]}
    assert len(advice["predicted_vs_measured_by_concurrency"]) == 6  # 3 configurations x concurrency 1, 2
    for c in report["configurations"]:
        key = (c["num_steps"], c["topk"], c["num_draft_tokens"])
        assert c["predicted_speedup"] == candidates[key]["predicted_speedup"] and c["predicted_tau"] == candidates[key]["predicted_tau"]
        assert c["speedup_error"] == pytest.approx(c["predicted_speedup"] / c["speedup"] - 1.0)
        (point,) = c["concurrency"]
        name = f"num_steps={key[0]} topk={key[1]} num_draft_tokens={key[2]}"
        assert point["predicted_speedup"] == advice["by_concurrency"]["predicted_speedup"]["2"][name]
        assert point["speedup_error"] == pytest.approx(point["predicted_speedup"] / point["speedup"] - 1.0)
        assert point["tau_error"] == pytest.approx(point["predicted_tau"] / point["tau"] - 1.0)
        assert len(point["repeat_speedups"]) == 2  # bench.concurrency_repeats ABBA pairs, each kept
        assert point["repeat_spread"] == pytest.approx(max(point["repeat_speedups"]) / min(point["repeat_speedups"]) - 1.0)
        assert c["configuration"] in rows
    assert [r["num_steps"] for r in advice["predicted_vs_measured"]] == [2, 1, 2]
    # spec.*'s configuration stays the headline: speedup, tau and the advice's own row
    first = report["configurations"][0]
    assert report["speedup"] == first["speedup"] and report["tau"] == first["tau"]
    assert advice["ran"]["num_draft_tokens"] == 3


def test_the_best_configuration_and_the_advice_are_named_and_plotted(swept):
    root, report, _, _, _ = swept
    best = report["best_configuration"]
    top = max(report["configurations"], key=lambda c: c["speedup"])
    assert best["measured"] == top["configuration"] and best["configurations_measured"] == 3
    assert best["advised"] == (report["advice"]["recommendation"] if not report["advice"]["speculate"] else
                               "-".join(str(report["advice"]["recommended"][k]) for k in ("num_steps", "topk", "num_draft_tokens")))
    out = root / "reports/bench"
    lines = (out / "configurations.csv").read_text().splitlines()
    assert lines[0] == "configuration,speedup,predicted_speedup,tau,predicted_tau" and len(lines) == 4
    assert len((out / "concurrency.csv").read_text().splitlines()) == 1 + 6
    assert (out / "configurations.png").stat().st_size > 10_000
    plots = yaml.safe_load((ROOT / "dvc.yaml").read_text())["plots"]
    named = {next(iter(p)) if isinstance(p, dict) else p for p in plots}
    named |= {f for p in plots if isinstance(p, dict) for v in p.values() if isinstance(v.get("y"), dict) for f in v["y"]}
    for path in (p for p in named if p.startswith("reports/bench/")):
        assert (root / path).exists(), f"dvc.yaml plots {path}, which the bench stage did not write"
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["params"]["bench"]["sweep"] == SWEEP and manifest["info"]["configurations"] == ["2-1-3", "1-1-2", "2-2-4"]


# --- what a user writes, checked before anything starts ------------------------------------------


def params_with(tmp_path, **bench_params) -> Path:
    p = yaml.safe_load((ROOT / "params.yaml").read_text())
    p["bench"].update(bench_params)
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(p))
    return path


@pytest.mark.parametrize("sweep,message", [
    (["5-1"], r"key bench\.sweep: '5-1' is not a configuration: write STEPS-TOPK-DRAFT_TOKENS, e\.g\. 5-1-6 .*or the word advised"),
    (["best"], r"'best' is not a configuration"),
    (["3-1-8"], r"a chain \(topk 1\) verifies steps \+ 1 = 4 tokens .*write 3-1-4"),
    (["2-2-9"], r"9 draft tokens exceed the tree's steps x topk \+ 1 = 5; write 2-2-5 or fewer"),
    (["0-1-1"], r"every number must be >= 1"),
    (["3-1-4", "6-8-32", "3-1-4"], r"lists '3-1-4' and '3-1-4': the same configuration twice"),
    (["advised", "advised"], r"the same configuration twice"),
])
def test_a_configuration_that_cannot_be_served_names_the_key_and_what_to_write(tmp_path, sweep, message):
    path = params_with(tmp_path, sweep=sweep)
    with pytest.raises(ParamsError, match=message) as e:
        load_params(["bench"], path)
    assert str(path) in str(e.value)


def test_configurations_and_the_word_advised_load_as_written(tmp_path):
    p = load_params(["bench"], params_with(tmp_path, sweep=["3-1-4", "6-8-32", "advised"], concurrency_repeats=4))
    assert p.bench.sweep == ["3-1-4", "6-8-32", "advised"] and p.bench.concurrency_repeats == 4


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A micro project for prepare(): nothing is served."""
    return make_project(tmp_path_factory.mktemp("small"))


def prepare(root: Path, tmp_path: Path, **bench_params):
    from draftlab.bench import run
    from draftlab.sglang.checkpoint import read_exported

    base = yaml.safe_load((root / "params.yaml").read_text())
    base["bench"].update(bench_params)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(base))
    p = load_params(["target", "spec", "bench", "export"], tmp_path / "params.yaml")
    return run.prepare(p.target, p.spec, p.bench, "0.5.14", read_exported(root / "models/draft"), root / "data/prompts")


@pytest.mark.parametrize("bench_params,message", [
    ({"backend": "url", "url": "http://127.0.0.1:1"}, r"(?s)bench\.sweep needs servers the bench starts itself.*bench\.sweep: \[\]"),
    ({"backend": "sglang", "side_by_side": False}, r"set bench\.side_by_side: true"),
    # every listed configuration passes SGLang's rules before anything starts (here a tree on pages)
    ({"backend": "sglang", "side_by_side": True, "page_size": 4, "attention_backend": "torch_native"},
     r"(?s)bench\.sweep lists 2-2-4: SGLang 0\.5\.14 would not run.*rule paged_tree_backend"),
])
def test_a_sweep_the_backend_cannot_run_stops_before_any_server(small, tmp_path, bench_params, message):
    with pytest.raises(UserError, match=message):
        prepare(small, tmp_path, sweep=["1-1-2", "2-2-4"], **bench_params)


def test_every_configuration_is_resolved_before_anything_starts(small, tmp_path):
    plan = prepare(small, tmp_path, sweep=["1-1-2", "advised", "2-2-4"])
    assert [(c.name, c.roles) for c in plan.configurations] == [("2-1-3", ["spec"]), ("1-1-2", ["listed"]), ("advised", ["advised"]),
                                                                 ("2-2-4", ["listed"])]
    assert plan.configurations[3].resolution.effective.num_draft_tokens == 4
    assert {(5, 1, 6), (6, 8, 32), (2, 2, 4)} <= set(plan.advised_choices)  # whatever the advice picks is resolved too
    assert plan.candidates()[-1] == (2, 2, 4)  # the advice predicts the configurations swept


def test_the_advised_pick_is_measured_once_and_only_where_sglang_serves_it(capsys):
    def res(key):
        return resolve(SpecFlags("EAGLE3", *key), "LlamaForCausalLM", "0.5.14")

    first = bench_sweep.Configuration("2-1-3", ["spec"], res((2, 1, 3)))
    later = bench_sweep.Configuration("3-1-4", ["listed"], res((3, 1, 4)))
    plan = types.SimpleNamespace(advised_choices={(5, 1, 6): res((5, 1, 6)), (6, 8, 32): "rule tree_draft_tokens_exceed: ..."})
    assert bench_sweep._advised(plan, None, {first.key: first}, [later]) is None  # don't speculate
    assert bench_sweep._advised(plan, (2, 1, 3), {first.key: first}, [later]) is None and first.roles == ["spec", "advised"]
    assert bench_sweep._advised(plan, (3, 1, 4), {first.key: first}, [later]) is None and later.roles == ["listed", "advised"]
    new = bench_sweep._advised(plan, (5, 1, 6), {first.key: first}, [later])
    assert new.name == "5-1-6" and new.roles == ["advised"] and new.key == (5, 1, 6)
    assert bench_sweep._advised(plan, (6, 8, 32), {first.key: first}, [later]) is None
    assert "advised configuration 6-8-32 is not served: rule tree_draft_tokens_exceed" in capsys.readouterr().out


def test_a_repeat_spread_is_max_over_min_of_the_paired_batches():
    base = {"concurrency": 4, "throughput": 100.0, "batches": [{"throughput": 100.0}, {"throughput": 80.0}]}
    spec = {"concurrency": 4, "throughput": 150.0, "tau": 3.0, "batches": [{"throughput": 160.0}, {"throughput": 140.0}]}
    point = bench_sweep._point(4, base, spec, {"predicted_tau": 3.3, "predicted_speedup": 1.2})
    assert point["repeat_speedups"] == [1.6, 1.75] and math.isclose(point["repeat_spread"], 1.75 / 1.6 - 1.0)
    assert point["speedup"] == 1.5 and math.isclose(point["speedup_error"], 1.2 / 1.5 - 1.0)
    assert math.isclose(point["tau_error"], 0.1)


@pytest.fixture(scope="module")
def waves(tmp_path_factory):
    """One bench stage whose GPU (a stand-in layout, on the reference server) holds the baseline,
    spec.*'s 2-1-3 and 1-1-2 at once, and 2-2-4 only after them; 1-1-2's server cannot start (its
    draft is missing). (report, servers started, start_many calls, events: ("start", n) and
    ("stop", url) in order)."""
    from draftlab.bench import memory, run as bench_run

    root = make_project(tmp_path_factory.mktemp("waves"), sweep=["1-1-2", "2-2-4"], concurrency=[1])
    started, sent, calls, events = [], [], [], []
    names = ["2-1-3", "1-1-2", "2-2-4"]
    layout = memory.Layout(4096, 0.95, [names[:2], names[2:]], "0", 10 * memory.GIB, dict.fromkeys([memory.BASELINE, *names], 1))
    argv_of, start_many, stop, prepare_plan = bench.server_argv, bench.start_many, lifecycle.stop, bench_run.prepare

    def broken_for_1_1_2(backend, bp, target, draft, flags, *args, **kw):
        argv, url = argv_of(backend, bp, target, draft, flags, *args, **kw)
        if (flags.num_steps, flags.topk, flags.num_draft_tokens) == (1, 1, 2):
            argv[argv.index("--speculative-draft-model-path") + 1] = str(root / "models/no-such-draft")
        return argv, url

    def noted_start_many(*args, **kw):
        events.append(("start", len(args[5])))
        return start_many(*args, **kw)

    generate = Client.generate

    def noted_generate(self, prompt, sampling_params=None, **body):
        sent.append(self.url)
        return generate(self, prompt, sampling_params, **body)

    def noted_stop(srv, *args, **kw):
        if not srv.stopped:
            events.append(("stop", srv.url))
        return stop(srv, *args, **kw)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(bench_run, "prepare", lambda *a, **kw: dataclasses.replace(prepare_plan(*a, **kw), layout=layout))
        mp.setattr(bench, "server_argv", broken_for_1_1_2)
        mp.setattr(bench, "start_many", noted_start_many)
        note_starts(mp, started, sent, calls)
        mp.setattr(lifecycle, "stop", noted_stop)
        mp.setattr(Client, "generate", noted_generate)
        report = bench_stage(root / "models/draft", root / "data/prompts", root / "reports/bench", root / "reports/bench.json",
                             params_file=root / "params.yaml")
    return report, started, calls, events


def test_a_configuration_whose_server_does_not_start_is_reported_and_the_sweep_goes_on(waves):
    report, started, calls, _ = waves
    failed = [s for s in started if s[1] == (1, 1, 2)]
    assert len(failed) == 1 and isinstance(failed[0][2], UserError)  # started once, with its wave, and failed there
    rows = {r["configuration"]: r for r in report["configurations"]}
    assert list(rows) == ["2-1-3", "1-1-2", "2-2-4"]
    assert "no-such-draft" in rows["1-1-2"]["error"] and "speedup" not in rows["1-1-2"]
    assert rows["2-1-3"]["speedup"] > 0 and rows["2-2-4"]["speedup"] > 0  # the others measured
    assert report["best_configuration"]["configurations_failed"] == ["1-1-2"]


def test_a_configuration_the_gpu_cannot_hold_with_the_first_ones_starts_once_they_are_measured_and_stopped(waves):
    _, started, calls, events = waves
    assert calls[0] == (3, 0)  # the baseline, 2-1-3 and 1-1-2 together, before any request
    assert calls[1][0] == 1 and calls[1][1] > 0  # 2-2-4 alone, after 2-1-3 was measured
    spec_url = next(url for spec, key, url in started if key == (2, 1, 3) and spec)
    base_url = next(url for spec, _, url in started if not spec)
    second = events.index(("start", 1))
    assert ("stop", spec_url) in events[:second]  # wave one's servers stopped before wave two starts
    assert ("stop", base_url) in events[second:]  # the baseline up to the end
    # every server that started has its start-up in bench.json, the later wave's too; the one that failed has none
    assert set(waves[0]["server_startup"]) == {"baseline", "2-1-3", "2-2-4"}


@pytest.mark.parametrize("workers", [1, 2])
def test_where_the_gpu_holds_the_in_process_copy_too_the_offline_run_decodes_while_the_servers_start(tmp_path, workers, capsys):
    """A stand-in layout (on the reference server) whose one wave leaves room for the offline run's
    copies: it decodes between the servers' launch and their health (in this process, or in two at
    once), its rounds are timed once they are up, before any request; its figures are those of the
    same run made before any server starts."""
    from draftlab.bench import memory, run as bench_run

    root = make_project(tmp_path, sweep=["1-1-2"], concurrency=[1], offline_workers=workers)
    names = ["2-1-3", "1-1-2"]
    layout = memory.Layout(4096, 0.95, [names], "0", 80 * memory.GIB, dict.fromkeys([memory.BASELINE, *names], 1), 8 * memory.GIB)
    events, sent = [], []
    decode, timing, healthy, prepare_plan = bench_run.decode_offline, bench_run.time_offline, lifecycle.wait_all_healthy, bench_run.prepare
    launch, generate = lifecycle._launch, Client.generate

    def noted(name, real):
        def call(*args, **kw):
            events.append(name)
            got = real(*args, **kw)
            events.append(name + " done")
            return got
        return call

    def noted_generate(self, prompt, sampling_params=None, **body):
        sent.append(len(events))
        return generate(self, prompt, sampling_params, **body)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(bench_run, "prepare", lambda *a, **kw: dataclasses.replace(prepare_plan(*a, **kw), layout=layout))
        for module, name, real in [(bench_run, "decode_offline", decode), (bench_run, "time_offline", timing),
                                   (lifecycle, "wait_all_healthy", healthy), (lifecycle, "_launch", launch)]:
            mp.setattr(module, name, noted(name, real))
        mp.setattr(Client, "generate", noted_generate)
        report = bench_stage(root / "models/draft", root / "data/prompts", root / "reports/bench", root / "reports/bench.json",
                             params_file=root / "params.yaml")
    first = events.index("wait_all_healthy")
    assert events.count("_launch") == 3 and max(i for i, e in enumerate(events) if e == "_launch") < events.index("decode_offline")
    assert events.index("decode_offline done") < first < events.index("time_offline")  # decoded while they started
    assert min(sent) > events.index("time_offline done")  # no request before the rounds were timed
    assert list(report["phases_s"])[:2] == ["servers started, the offline run decoding meanwhile", "round costs"]
    assert f"offline run ({'2 processes' if workers == 2 else 'in-process'}, no server), while the servers start" in capsys.readouterr().out

    (tmp_path / "again").mkdir()
    alone = bench_run.measure_offline(prepare(root, tmp_path / "again"))[0]  # the same run, no server beside it
    assert report["offline"]["tau"] == alone["tau"] and report["offline"]["acceptance"] == alone["acceptance"]
    assert report["spec"]["tau"] == report["offline"]["tau"]  # the reference server runs the engine the offline run does


def test_every_measured_pass_is_on_disk_as_it_ends_with_the_report_figures(swept):
    root, report, _, _, _ = swept
    got = [r for _, r in jsonl.read(root / "reports/bench/passes.jsonl", "")]
    assert [(r["configuration"], r["prompt_set"]) for r in got] == [(c["configuration"], "heldout") for c in report["configurations"]]
    for row, c in zip(got, report["configurations"]):
        assert row["tau"] == pytest.approx(c["tau"]) and row["speedup"] == pytest.approx(c["speedup"])
        (point,) = row["by_concurrency"]
        assert point["concurrency"] == 2 and point["speedup"] == pytest.approx(c["concurrency"][0]["speedup"])


def test_a_bench_stopped_mid_sweep_keeps_the_passes_it_finished(tmp_path):
    root = make_project(tmp_path, sweep=SWEEP)
    measure, calls = bench.measure, []

    def stopped_at_the_third(*a, **k):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return measure(*a, **k)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(bench, "measure", stopped_at_the_third)
        with pytest.raises(KeyboardInterrupt):
            bench_stage(root / "models/draft", root / "data/prompts", root / "reports/bench", root / "reports/bench.json",
                        params_file=root / "params.yaml")
    got = [r for _, r in jsonl.read(root / "reports/bench/passes.jsonl", "")]
    assert [r["configuration"] for r in got] == ["2-1-3", "1-1-2"]  # the two measured before the stop
    assert all(r["tau"] > 1.0 and r["speedup"] > 0 for r in got)
    assert not (root / "reports/bench.json").exists()


def test_the_offline_runs_step1_acceptance_is_split_by_kind_and_position_and_adds_up(swept):
    _, report, _, _, _ = swept
    offline = report["offline"]
    kinds, bands = offline["step1_by_kind"], offline["step1_by_position"]
    rounds = sum(c["rounds"] for c in kinds.values())
    assert rounds == sum(c["rounds"] for c in bands.values()) > 0  # every round once in each split
    hits = sum(c["rounds"] * c["a_1"] for c in kinds.values() if c["rounds"])
    assert hits / rounds == pytest.approx(offline["acceptance"][0], abs=1e-3)  # a chain proposes at depth 1 every round
    md = (Path(report["draft_dir"]).parents[1] / "reports/bench/report.md").read_text()
    assert "## Where the offline run's acceptance goes" in md and f"| loop tokens | {kinds['loop']['rounds']} |" in md
