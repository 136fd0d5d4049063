"""n-gram lookup (NGRAM) and MT-bench-style prompt sets in the bench stage, on the reference server
with a micro target: NGRAM paired against the same baseline, its caches emptied before every
measured pass; turn 2 the same request on every server; each set by category and turn; and the
headline "does training pay?" table."""
import json
from pathlib import Path

import pytest

from draftlab.bench import servers as bench
from draftlab.bench.stage import bench as bench_stage
from draftlab.errors import UserError
from draftlab.params import load_params
from draftlab.sglang.client import Client
from draftlab.sglang.flags import SpecFlags, resolve
from tests.test_bench_sweep import MAX_NEW, MEASURED, make_project, note_starts

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests/fixtures/bench_prompts/mt_bench_small.jsonl"
TURN2 = ("starts with the letter A", "the last runner", "add 17")  # the second turns of the 3 conversations measured


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One bench stage: spec.*'s 2-1-3 and ngram, on the held-out split and the MT-bench-format
    fixture (3 of its questions, one per category, both turns), concurrency [1, 2]: (root, report,
    servers started, events: ("generate", url, ids, max_new_tokens, text) and ("flush", url), printed)."""
    root = make_project(tmp_path_factory.mktemp("ngram"), sweep=["ngram"], prompts=["heldout", str(FIXTURE)])
    started, events = [], []
    generate, flush = Client.generate, Client.flush_cache

    def noted_generate(self, prompt, sampling_params=None, **body):
        text, meta = generate(self, prompt, sampling_params, **body)
        events.append(("generate", self.url, tuple(prompt), sampling_params["max_new_tokens"], text))
        return text, meta

    def noted_flush(self, *a, **kw):
        events.append(("flush", self.url))
        return flush(self, *a, **kw)

    with pytest.MonkeyPatch.context() as mp:
        note_starts(mp, started)
        mp.setattr(Client, "generate", noted_generate)
        mp.setattr(Client, "flush_cache", noted_flush)
        report = bench_stage(root / "models/draft", root / "data/prompts", root / "reports/bench", root / "reports/bench.json",
                             params_file=root / "params.yaml")
    return root, report, started, events


def test_ngram_is_paired_against_the_same_baseline_and_flushed_before_every_measured_pass(run):
    _, report, started, events = run
    base_url = started[0][2]
    ngram_url = started[2][2]
    assert [s for s, _, _ in started] == [False, True, True] and started[2][1] == (1, 10, 12)  # SGLang: topk := 10, steps := 12 // 10
    row = report["configurations"][1]
    assert row["configuration"] == "ngram" and row["algorithm"] == "NGRAM" and row["servers"]["baseline"] == base_url
    assert row["flags"]["effective"]["num_draft_tokens"] == 12 and row["flags"]["effective"]["ngram_max_bfs_breadth"] == 10
    first_ngram = next(i for i, e in enumerate(events) if e[1] == ngram_url)
    flushes = [(i, e[1]) for i, e in enumerate(events) if e[0] == "flush"]
    assert all(i > first_ngram for i, _ in flushes)  # none while the draft's pairing ran
    # per prompt set: before the bs=1 pass and before each of the 2 ABBA pairs at 2 in flight, both servers
    assert len(flushes) == 2 * 3 * 2 and {u for _, u in flushes} == {base_url, ngram_url}
    # between two flushes the NGRAM server answers each prompt once, but for the uncounted warm-up batch
    # at 2 in flight and the 1-token prefill probes, which come after the measured pass they follow
    segments, current = [], []
    for e in events[first_ngram:]:
        if e[0] == "flush" and e[1] == ngram_url:
            segments.append(current)
            current = []
        elif e[0] == "generate" and e[1] == ngram_url and e[3] > 1:
            current.append(e[2])
    segments.append(current)
    for seg in segments[1:]:
        measured = seg[:len(set(seg))]
        assert len(set(measured)) == len(measured)  # the measured pass opens each segment, no prompt twice


def test_a_repeat_does_not_see_its_own_earlier_answers(run):
    """The repeats at 2 in flight serve tau as the bs=1 pass does; without the flushes the second
    pass over the same prompts drafts its own earlier answers (test_ngram shows the memory directly)."""
    _, report, _, _ = run
    row = report["configurations"][1]
    (point,) = row["concurrency"]
    assert len(point["repeat_taus"]) == 2
    for tau in point["repeat_taus"]:
        assert tau == pytest.approx(row["tau"], rel=0.25)
    for s in report["prompt_sets"]:
        ng = next(c for c in s["configurations"] if c["configuration"] == "ngram")
        assert ng["concurrency"][0]["tau"] == pytest.approx(ng["pooled"]["tau"], rel=0.25)


def test_measure_without_flushes_would_measure_the_caches_memory(tmp_path_factory):
    """The control for the test above: the same pairing measured twice on the same NGRAM server, the
    second time without flushes, serves a far higher tau."""
    root = make_project(tmp_path_factory.mktemp("control"))
    p = load_params(["target", "bench"], root / "params.yaml")
    flags = resolve(SpecFlags("NGRAM", num_draft_tokens=4, ngram_max_bfs_breadth=1), "LlamaForCausalLM", "0.5.14").effective
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(root / "models/micro")
    rows = [json.loads(line) for line in (root / "data/prompts/eval.jsonl").read_text().splitlines()]
    ids = [tok.apply_chat_template(r["messages"], add_generation_prompt=True, tokenize=True, return_dict=False) for r in rows]
    sampling = {"max_new_tokens": MAX_NEW, "temperature": 0.0, "ignore_eos": False}
    with bench.start("reference", p.bench, p.target, None, flags, "0.5.14", root / "base.log", speculative=False) as b, \
         bench.start("reference", p.bench, p.target, None, flags, "0.5.14", root / "ngram.log", speculative=True) as s:
        fresh = bench.measure({"baseline": b, "speculative": s}, p.bench, ids, sampling, 1, abba=True, fresh=True)["speculative"]
        stale = bench.measure({"baseline": b, "speculative": s}, p.bench, ids, sampling, 1, abba=True, fresh=False)["speculative"]
    assert len(ids) - 1 == MEASURED
    assert stale["spec"]["tau"] > 1.3 * fresh["spec"]["tau"]
    assert min(x["tau"] for x in stale["sweep"][0]["batches"]) > 1.3 * max(x["tau"] for x in fresh["sweep"][0]["batches"])


def test_turn_two_is_the_same_request_on_every_server_after_the_baselines_answer(run):
    root, report, started, events = run
    base_url = started[0][2]
    answers = [json.loads(line) for line in (root / "reports/bench/turn-answers-mt_bench_small.jsonl").read_text().splitlines()]
    assert [a["conversation"] for a in answers] == ["81", "101", "111"] and {a["turn"] for a in answers} == {1}
    first_spec = next(i for i, e in enumerate(events) if e[1] != base_url)
    asked = [e for e in events[:first_spec] if e[0] == "generate" and e[3] == MAX_NEW]
    texts = {e[4] for e in asked}
    assert all(a["answer"] in texts for a in answers)  # generated once, by the baseline, before any configuration
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(root / "models/micro")
    second = {}  # turn-2 prompt ids -> the servers it was sent to (measured, max_new_tokens > 1)
    for e in events[first_spec:]:
        if e[0] == "generate" and e[3] > 1 and any(t in tok.decode(list(e[2])) for t in TURN2):
            second.setdefault(e[2], set()).add(e[1])
    assert len(second) == 3  # one turn-2 request per conversation, the same bytes everywhere
    assert all(servers == {u for _, _, u in started} for servers in second.values())
    for ids in second:
        text = tok.decode(list(ids))
        assert any(a["answer"] in text for a in answers)  # after the baseline's own turn-1 answer, in the chat template


def test_each_set_by_category_and_turn_and_the_headline_table_lead_the_report(run, capsys):
    root, report, _, _ = run
    heldout, mt = report["prompt_sets"]
    assert heldout["name"] == "heldout" and heldout["requests"] == MEASURED and heldout["turns"] == 1
    assert mt["name"] == "mt_bench_small" and mt["requests"] == 6 and mt["categories"] == {"writing": 1, "reasoning": 1, "math": 1}
    reqs = [json.loads(line) for line in (root / "reports/bench/requests.jsonl").read_text().splitlines()]
    for c in mt["configurations"]:
        assert {k: g["requests"] for k, g in c["by_category"].items()} == {"writing": 2, "reasoning": 2, "math": 2}
        assert {k: g["requests"] for k, g in c["by_turn"].items()} == {"1": 3, "2": 3}
        metas = [r["meta"] for r in reqs if r["configuration"] == c["configuration"] and r["prompt_set"] == "mt_bench_small"
                 and r["mode"] == "speculative"]
        assert len(metas) == 6
        assert c["pooled"]["tau"] == pytest.approx(sum(m["completion_tokens"] for m in metas) / sum(m["spec_verify_ct"] for m in metas))
        assert c["pooled"]["acceptance"] and c["pooled"]["speedup"] > 0
    # the first set's figures are the configurations' own (bench.json's headline keys unchanged)
    assert heldout["configurations"][0]["pooled"]["tau"] == pytest.approx(report["tau"])
    for s in report["prompt_sets"]:
        rows = s["training_pays"]
        assert [r["concurrency"] for r in rows] == [1, 2]
        for r in rows:
            assert r["best_ngram"]["configuration"] == "ngram" and r["best_draft"]["configuration"] == "2-1-3"
            d, g = r["best_draft"]["speedup"], r["best_ngram"]["speedup"]
            assert r["training_pays"] == (d > max(1.0, g))
    assert report["training_pays"] == heldout["training_pays"]
    md = (root / "reports/bench/report.md").read_text()
    assert md.startswith("# Bench report\n\n## Does training pay?")
    assert md.index("### heldout") < md.index("### mt_bench_small") < md.index("## The advice") < md.index("by turn and category")
    assert (root / "reports/bench/categories.png").stat().st_size > 10_000
    assert "mt_bench_small,ngram,writing,2," in (root / "reports/bench/categories.csv").read_text()


def test_the_advice_weighs_ngram_against_the_draft(run):
    _, report, _, _ = run
    ng = report["advice"]["ngram"]
    assert ng["calibrated_on"] == "ngram"
    (own,) = ng["predicted_vs_measured"]
    assert own["speedup_error"] == pytest.approx(0.0, abs=1e-9)  # calibrated on its own pairing, as spec.*'s is
    row = report["configurations"][1]
    assert row["predicted_speedup"] == pytest.approx(row["speedup"]) and row["concurrency"][0]["predicted_speedup"] is not None
    vs = ng["versus_draft"]
    g, d = vs["best_ngram_predicted_speedup"], vs["best_draft_predicted_speedup"]
    assert vs["winner"] == ("ngram" if g > d else "draft") and vs["ngram_over_draft"] == pytest.approx(g / d)
    margin = g / d - 1 if g > d else d / g - 1
    assert f"by {100 * margin:.0f}%" in vs["text"] and vs["text"] in report["advice"]["advice"]


def test_on_sglang_ngram_is_launched_with_its_flags_and_its_round_scaled_on_the_served_pairing(tmp_path, monkeypatch):
    """The sglang backend's argv and path on a CPU: `python -m sglang.launch_server` is the stand-in
    (tests/fixtures/sglang_standin: the reference server under SGLang's flags)."""
    standin = ROOT / "tests/fixtures/sglang_standin"
    monkeypatch.setenv("PYTHONPATH", f"{standin}:{ROOT}")
    root = make_project(tmp_path, sweep=["ngram-4-1"], backend="sglang", side_by_side=True)
    report = bench_stage(root / "models/draft", root / "data/prompts", root / "reports/bench", root / "reports/bench.json",
                         params_file=root / "params.yaml")
    row = report["configurations"][1]
    assert row["configuration"] == "ngram-4-1" and row["algorithm"] == "NGRAM" and row["served_flags"]["topk"] == 1
    assert row["served_flags"]["ngram_max_bfs_breadth"] == 1 and row["served_flags"]["num_draft_tokens"] == 4  # /server_info
    log = (root / "reports/bench/server-spec-ngram-4-1.log").read_text()
    assert "mixed chunked prefill are disabled because of using ngram" in log
    ng = report["advice"]["ngram"]
    assert ng["scale"]["kappa"] > 0 and ng["scale"]["kappa_from_rounds"] > 0
    assert ng["predicted_vs_measured"][0]["speedup_error"] == pytest.approx(0.0, abs=1e-9)  # calibrated on it
    assert {c["configuration"] for c in ng["candidates"]} == {"ngram-4-1", "ngram-3-1", "ngram-2-1"}


def test_the_bench_answers_replayed_teacher_forced_come_close_to_the_served_tau(run, monkeypatch):
    """tools/replay_answers.py on the bench's own first-turn answers: decoding replayed over them
    (draftlab.train.evaluate.decoded_rounds) gives the tau the draft served on those turns."""
    import sys

    root, report, _, _ = run
    sys.path.insert(0, str(ROOT / "tools"))
    from replay_answers import replay

    monkeypatch.chdir(root)
    params = load_params(["target", "spec"], root / "params.yaml")
    got = replay(root / "models/draft", root / "reports/bench/turn-answers-mt_bench_small.jsonl", FIXTURE,
                 params.target, steps=params.spec.num_steps)
    assert got["answers"] == 3 and got["answer_tokens"] > 0
    sets = {s["name"]: s for s in report["prompt_sets"]}
    served = sets["mt_bench_small"]["configurations"][0]["by_turn"]["1"]  # spec.*'s configuration, first turns
    # the reference server decodes with this engine in float32: the first draft token is hit as often replayed
    assert got["accept"][0] == pytest.approx(served["acceptance"][0], abs=0.05)
    assert all(1.0 <= t <= n + 1 for n, t in enumerate(got["tau_decoded_by_steps"], start=1))
    with pytest.raises(UserError, match="is not in"):  # answers of another set than the questions given
        replay(root / "models/draft", root / "reports/bench/turn-answers-mt_bench_small.jsonl",
               root / "data/prompts/eval.jsonl",
               params.target, steps=1)


def test_the_bench_says_where_its_wall_time_went(run):
    """bench.json and report.md give each phase's seconds: the offline run first (bench.sweep), then the
    servers' start, the serving, their stop; together about the stage's own run."""
    root, report, _, _ = run
    phases = report["phases_s"]
    assert list(phases) == ["offline run and round costs", "servers started",
                            "served and measured (later turns' answers included)", "servers stopped"]
    assert all(s >= 0 for s in phases.values()) and phases["served and measured (later turns' answers included)"] > 0
    md = (root / "reports/bench/report.md").read_text()
    assert "## Where the bench's time went" in md and "servers started: " in md
    # each server's own start-up, launch to healthy: the baseline and every configuration started with it
    startups = report["server_startup"]
    names = [c["configuration"] for c in report["configurations"]]
    assert {"baseline", names[0]} <= set(startups) <= {"baseline", *names}
    assert all(0 < s["total_s"] <= phases["servers started"] + 1 for s in startups.values())
    assert f"Server start-up (launch to a healthy /health, from each server's log): {len(startups)} servers up in" in md
