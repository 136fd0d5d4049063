"""The real-workload report: one run of configs/real-*.yaml turned into reports/real-workload/NAME/.

    python tools/real_workload_report.py RUN [OUT] [--force] [--prompts FILE]

RUN is a project root after `draftlab exp run configs/real-gpu.yaml` (or `draftlab run-stages ...`),
or the unpacked results.tar.gz of tools/offline_gpu_run.sh. OUT gets the run's measured files
(bench.json, the bench CSVs and plots, the train metrics and curves, the train stage's traced steps
where DRAFTLAB_TRAIN_PROFILE was set, check.md, the stage manifests' counts, the stage times and their
plot, stage-times.png) and
results.md: first "does training pay?" (the baseline, the best n-gram
lookup and the best trained draft at every concurrency, per prompt set of bench.prompts, and the
held-out set against an earlier measurement of the same prompts), then the tau triangle with
acceptance by draft position, every configuration at every concurrency, the advice against the
measurement, every prompt set by turn and category (MT-bench), and tau by kind of prompt.

OUT defaults to a new folder, reports/real-workload/run-YYYYMMDD-HHMMSS (under the current
directory). An OUT that already holds files (a committed report) is refused unless --force is given,
so a re-run never overwrites a committed report by accident.

Stage wall times come from each stage's manifest (info.wall_s, written by every run: dvc repro,
dvc exp run, draftlab run-stages), else from draftlab run-stages' own record (.run-stages.json).

Kind of prompt (a rule, so that anyone can recount): a prompt is "code" when it holds a code fence
(```) or names a language or a programming task (CODE_WORDS as whole words, any case); else "prose".
The bench sends eval.jsonl's first bench.warmup + bench.num_prompts prompts in order and records the
measured ones in requests.jsonl in that order, so the i-th speculative request of a configuration
answers prompt warmup + i.
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import time
from pathlib import Path

import pandas as pd
import yaml

from draftlab import jsonl, metrics
from draftlab.experiments.run_stages import stage_order
from draftlab.experiments.study import earlier_runs, offline_step1, step1_table
from draftlab.bench.report import groups_markdown, headline_markdown
from draftlab.sglang import startup

CODE_WORDS = ("code", "python", "javascript", "typescript", "java", "c\\+\\+", "c#", "sql", "html", "css", "bash", "regex",
              "function", "script", "api", "json", "react", "node\\.js", "golang", "rust", "php", "swift", "kotlin", "class")
CODE = re.compile(r"```|\b(" + "|".join(CODE_WORDS) + r")\b", re.IGNORECASE)
REPORTS = Path("reports/real-workload")  # where a new report folder goes by default
STAGES = tuple(stage_order(yaml.safe_load((Path(__file__).resolve().parents[1] / "dvc.yaml").read_text())))  # the DAG's order
FIELD = {"3-1-4": 2.90}  # SpecForge's Llama-3.1-8B draft, MT-bench, bs=1 (its SpecBundle dashboard)
# An earlier measurement with SGLang 0.5.14 on one H200: SmolLM2-135M-Instruct (bf16, triton attention,
# CUDA graphs), the 32 held-out bench prompts of reports/real-workload/real-gpu/bench-prompts.jsonl after
# its 2 warm-up prompts, 256 new tokens, greedy, bs=1: (served tau, speedup).
EARLIER = {"ngram": (2.06, 0.84), "ngram-4-1": (1.77, 0.74), "3-1-4": (1.83, 0.66), "7-1-8": (1.91, 0.72)}
COPIED = ("reports/bench.json reports/check.md reports/train/metrics.json reports/train/plots/accept.png "
          "reports/train/plots/loss.png reports/train/plots/accept.tsv reports/train/plots/loss.tsv reports/train/plots/decoded.tsv reports/train/plots/decoded.png reports/bench/configurations.csv reports/bench/concurrency.csv "
          "reports/bench/acceptance.csv reports/bench/configurations.png reports/bench/bench.png "
          "reports/bench/requests.jsonl reports/bench/report.md reports/bench/categories.png reports/bench/categories.csv "
          "reports/train/step-profile.json params.yaml").split()


def kind(row: dict) -> str:
    """"code" or "prose" for an eval.jsonl row, by its user turns' text."""
    text = "\n".join(m["content"] for m in row.get("messages", []) if m.get("role") == "user") or row.get("prompt", "")
    return "code" if CODE.search(text) else "prose"


def read(run: Path, rel: str):
    p = run / rel
    return json.loads(p.read_text()) if p.exists() else None


def learning_curve_md(run: Path, eval_s: dict | None = None, depth: int | None = None) -> list[str]:
    """Per epoch: train and eval loss and the eval split's predicted tau (the train stage's plot files),
    the decoded tau over the eval first turns at `depth` draft tokens where the run wrote decoded.tsv,
    and the seconds each evaluation took where the train manifest has them (throughput.eval_s_by_epoch)."""
    plots = run / "reports/train/plots"
    accept, loss, decoded = plots / "accept.tsv", plots / "loss.tsv", plots / "decoded.tsv"
    if not (accept.exists() and loss.exists()):
        return []
    curve = pd.read_csv(loss, sep="\t").merge(pd.read_csv(accept, sep="\t"), on="epoch")
    column = f"first_turns_{depth}"
    if depth and decoded.exists() and column in (chains := pd.read_csv(decoded, sep="\t")):
        curve = curve.merge(chains[["epoch", column]], on="epoch", how="left")
    chained = column in curve
    eval_s = {int(k): v for k, v in (eval_s or {}).items()}
    timed = bool(eval_s)
    return ["## Learning curve (eval split, teacher-forced, after each epoch)", "",
            table(["epoch", "train loss", "eval loss", "a_1", "predicted tau"]
                  + ([f"decoded tau, first turns, chain of {depth}"] if chained else []) + (["eval (s)"] if timed else []),
                  [[int(r.epoch), round(r.train_loss, 4), round(r.eval_loss, 4), round(r.accept_1, 3), round(r.tau_pred, 3)]
                   + ([round(getattr(r, column), 3)] if chained else [])
                   + ([eval_s.get(int(r.epoch))] if timed else []) for r in curve.itertuples()]), ""]


def step1_md(train: dict, bench: dict | None = None) -> list[str]:
    """The eval split's step-1 acceptance by kind of token, position band and turn, beside the bench's
    offline rounds in the same groups where the bench kept them (study.step1_table), then the decoded tau."""
    offline = (bench or {}).get("offline") or {}
    rows = step1_table(train, offline)
    if not rows:
        return []
    return ["## Step-1 acceptance on the eval split, by kind of token, position in the answer and turn", "", rows, "",
            "A loop token closes an 8-gram already seen in the same answer (draftlab/data/loops.py); the turn is the answer's "
            "in its conversation."
            + (" The offline columns: the bench's offline run over its prompts, at the first draft of each verify round (what "
               "serving sees: rounds start where the draft missed before), grouped by the token that draft predicts." if offline_step1(offline) else ""),
            ""] + first_turns_md(train)


def first_turns_md(train: dict) -> list[str]:
    """Greedy decoding replayed over the eval answers: every answer, and each conversation's first alone."""
    every, first = train.get("tau_decoded_by_steps"), train.get("tau_decoded_first_turns_by_steps")
    if not every or not first:
        return []
    steps = list(every)
    return ["Greedy chain decoding replayed over the eval answers (tau by draft depth):", "",
            table(["answers", *[s.replace("steps_", "depth ") for s in steps]],
                  [["every turn", *[round(every[s], 3) for s in steps]], ["first turns", *[round(first[s], 3) for s in steps]]]), ""]


def stage_times(run: Path, earlier: dict | None = None) -> dict:
    """{stage: wall seconds} in the DAG's order: each stage manifest's info.wall_s, else the seconds
    draftlab run-stages recorded (runs made before manifests held the time); none of a stage an earlier
    run made (`earlier`: earlier_runs(run), read here when not given)."""
    times, earlier = {}, earlier_runs(run) if earlier is None else earlier
    for path in sorted(p for top in ("data", "models", "reports") for p in (run / top).glob("*/manifest.json")):
        try:
            manifest = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        wall = (manifest.get("info") or {}).get("wall_s") if isinstance(manifest, dict) else None
        if isinstance(wall, (int, float)) and manifest.get("stage") and manifest["stage"] not in earlier:
            times[manifest["stage"]] = wall
    for stage, rec in (read(run, ".run-stages.json") or {}).items():
        if isinstance(rec, dict) and "seconds" in rec:
            times.setdefault(stage, rec["seconds"])
    return dict(sorted(times.items(), key=lambda kv: (STAGES.index(kv[0]) if kv[0] in STAGES else len(STAGES), kv[0])))


def read_prompts(path: Path) -> list[dict]:
    return [row for _, row in jsonl.read(path, "remake it with the prompts stage")]


def tau_by_kind(run: Path, rows: list[dict], bench_params: dict) -> dict:
    """{configuration: {kind: {"prompts": n, "tau": served tau over that kind's rounds}}}; rows: the
    bench's prompt file in order (eval.jsonl or bench-prompts.jsonl)."""
    measured = rows[bench_params["warmup"]: bench_params["warmup"] + bench_params["num_prompts"]]
    groups: dict = {}  # (configuration, kind) -> [(tokens, rounds) per request]
    seen: dict = {}  # configuration -> speculative requests so far (the i-th answers measured[i])
    first = ((read(run, "reports/bench.json") or {}).get("prompt_sets") or [{"name": "heldout"}])[0]["name"]
    for _, r in jsonl.read(run / "reports/bench/requests.jsonl", "it is the bench stage's own record: re-run the bench"):
        if r["mode"] == "speculative" and r.get("prompt_set", first) == first:  # the first prompt set's requests
            i = seen[r["configuration"]] = seen.get(r["configuration"], -1) + 1
            groups.setdefault((r["configuration"], kind(measured[i])), []).append(
                (r["meta"]["completion_tokens"], r["meta"]["spec_verify_ct"]))
    out: dict = {}
    for (name, k), reqs in sorted(groups.items()):
        out.setdefault(name, {})[k] = {"prompts": len(reqs), "tau": metrics.pooled_tau(*zip(*reqs))}
    return out


def pyplot():
    """matplotlib's pyplot drawing to files (no display), imported only when a plot is made."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_triangle(out: Path, trained: list[float], offline: list[float], served: list[float]) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5, 3.2))
    pos = range(1, len(served) + 1)
    for name, a, m in (("train-predicted", trained, "o"), ("offline", offline, "s"), ("served", served, "^")):
        ax.plot(pos, a, marker=m, label=name)
    ax.set(xlabel="draft position", ylabel="acceptance (given the one before)", ylim=(0, 1), xticks=list(pos))
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "acceptance-by-position.png", dpi=120)
    plt.close(fig)


def plot_stage_times(out: Path, times: dict) -> None:
    """stage-times.png: where the run's wall time went, one bar per stage in the DAG's order."""
    plt = pyplot()
    names, secs = list(times), [float(v) for v in times.values()]
    fig, ax = plt.subplots(figsize=(6, 0.35 * len(names) + 1.2))
    ax.barh(names, secs, color="tab:blue")
    for y, v in enumerate(secs):
        ax.text(v, y, f" {v:.0f} s", va="center", fontsize=8)
    ax.invert_yaxis()  # the first stage on top
    ax.set(xlabel="wall time (s)", title=f"stage wall times: {sum(secs):.0f} s ({sum(secs) / 60:.1f} min) in all",
           xlim=(0, max(secs) * 1.2 if secs else 1))
    fig.tight_layout()
    fig.savefig(out / "stage-times.png", dpi=120)
    plt.close(fig)


def table(header: list[str], rows: list[list]) -> str:
    fmt = lambda v: f"{v:.3f}" if isinstance(v, float) else ("" if v is None else str(v))  # noqa: E731
    return "\n".join(["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] +
                     ["| " + " | ".join(fmt(v) for v in r) + " |" for r in rows])


def training_pays_md(bench: dict) -> list[str]:
    """"Does training pay?" per prompt set, and the held-out set against the earlier measurement (EARLIER)."""
    sets = bench.get("prompt_sets") or []
    if not sets:
        return []
    out = ["## Does training pay?", "",
           "The baseline, the best n-gram lookup (SGLang's NGRAM, no draft model) and the best trained-draft configuration, each "
           "paired against the same baseline server (bs=1: median tokens/s per request; more in flight: whole batches).", ""]
    for s in sets:
        out += [f"### {s['name']} ({s['conversations']} conversations, {s['requests']} requests)", "", headline_markdown(s["training_pays"]), ""]
    held = next((s for s in sets if s["name"] == "heldout"), None)
    if held:
        rows = [[c["configuration"], c["pooled"]["tau"], EARLIER[c["configuration"]][0], c["pooled"]["speedup"], EARLIER[c["configuration"]][1]]
                for c in held["configurations"] if c["configuration"] in EARLIER]
        if rows:
            out += ["### The held-out set against an earlier measurement of the same prompts (SGLang 0.5.14, one H200, bs=1)", "",
                    table(["configuration", "served tau", "earlier tau", "speedup", "earlier speedup"], rows), ""]
    return out


def by_group_md(bench: dict) -> list[str]:
    """Every prompt set by turn and category (tau, a_i, speedup at bs=1)."""
    out = []
    for s in bench.get("prompt_sets") or []:
        if s["turns"] > 1 or s.get("categories"):
            out += [f"## {s['name']}: every configuration by turn and category", "", groups_markdown(s), ""]
    return out


def first_step(throughput: dict) -> str:
    """The first optimizer step's seconds (torch.compile and every first use), where the train manifest has them."""
    seconds = throughput.get("first_step_s")
    return "" if seconds is None else f"; the first step {seconds} s (compiling and first uses included)"


def counted_from(throughput: dict, steps: int) -> str:
    """A resumed run whose checkpoint held no counters: its rates count only the steps from there.
    `throughput.from_step` says where; a manifest written before it existed counts fewer steps
    (`throughput.steps`) than the run made (`steps`), from the difference on."""
    step = throughput.get("from_step") or (steps - throughput["steps"] if 0 < throughput.get("steps", steps) < steps else 0)
    return f" (the steps from step {step} on: a resumed run whose checkpoint held no counters)" if step else ""


def cache_rates(by_states: dict | None) -> str:
    """With train.state_cache: the rates of the steps whose states the target computed and of those read back."""
    if not by_states:
        return ""
    rate = {k: f"{v['tokens_per_s']} tok/s" if v.get("steps") else "none" for k, v in by_states.items()}
    return f": steps with the target {rate['computed']}, from the cache {rate['cached']}"


def step_profile_md(run: Path) -> list[str]:
    """The train stage's traced steps (DRAFTLAB_TRAIN_PROFILE, draftlab.train.profile), where the run traced any."""
    p = read(run, "reports/train/step-profile.json")
    if not p:
        return []
    busy = "no GPU kernels traced" if p["gpu_busy_share"] is None else f"the GPU busy {p['gpu_busy_share']:.1%} of it"
    host = ", ".join(f"`{e['name']}` {e['ms_per_step']} ms ({e['calls_per_step']} calls)" for e in p["host_self_time"][:5])
    gpu = ", ".join(f"`{e['name'][:60]}` {e['ms_per_step']} ms" for e in p["gpu_kernel_time"][:5])
    return [f"Training steps {p['steps'][0]}-{p['steps'][1]} traced (`step-profile.json`): {p['wall_s_per_step'] * 1e3:.0f} ms a "
            f"step, {busy}. Most host time of its own, per step: {host}." + (f" Most GPU time: {gpu}." if gpu else ""), ""]


def startups_md(synth: dict, bench: dict) -> list[str]:
    """The servers' start-ups, launch to a healthy /health, by phase (draftlab.sglang.startup): the
    synthesize stage's and the bench's, where their manifests recorded them."""
    lines = [f"{stage}: {line}" for stage, got in (("synthesize", synth.get("server_startup") or []),
                                                   ("bench", list((bench.get("server_startup") or {}).values())))
             if (line := startup.summary(got))]
    return ["Server start-ups (launch to a healthy /health, by phase from each server's log): " + "; ".join(lines) + ".", ""] \
        if lines else []


def results_md(run: Path, by_kind: dict, out_dir: Path, earlier: dict) -> str:
    """results.md; a run whose bench is an earlier run's (`earlier`: earlier_runs(run), a run stopped before
    the bench) gets its training figures and a line that says why nothing served is shown."""
    bench = None if "bench" in earlier else read(run, "reports/bench.json")
    train = read(run, "reports/train/metrics.json")
    synth = (read(run, "data/synth/manifest.json") or {}).get("info", {})
    train_info = (read(run, "models/draft-ckpt/manifest.json") or {}).get("info") or {}
    kept = train_info.get("state_cache") or {}
    throughput = train_info.get("throughput") or {}
    by_states = throughput.get("by_states")
    # the meter's rate: steps only (the metrics' own, from a run older than the meter, also counted the
    # tokens of a resumed run's state-cache refill without its seconds)
    rate = throughput.get("tokens_per_s") or train["tokens_per_s"]
    prompts = (read(run, "data/prompts/manifest.json") or {}).get("info", {})
    steps = bench["settings"]["num_steps"] if bench else (yaml.safe_load((run / "params.yaml").read_text())["spec"]["num_steps"])
    times = stage_times(run, earlier)
    if times:
        plot_stage_times(out_dir, times)
    out = ["# Figures of this run (written by tools/real_workload_report.py)", "",
           f"Data: {prompts.get('train')} train and {prompts.get('eval')} eval prompts of {prompts.get('usable')} usable"
           + (f" and {prompts['self_prompts_used']} the target wrote itself (self_prompts)" if prompts.get("self_prompts_used") else "")
           + "; "
           f"{synth.get('completion_tokens')} answer tokens synthesized"
           + (f" at {synth['tokens_per_s']} tok/s" if synth.get("tokens_per_s") else "")
           + (f", {synth['reused']} conversations reused from the run before" if synth.get("reused") else "") + " "
           f"({(synth.get('answer_finish_reasons') or synth.get('finish_reasons') or {}).get('length')} answers cut at "
           "synth.max_new_tokens). "
           f"Training: {train['epochs']} epochs, {train['optimizer_steps']} steps at {rate} tok/s"
           f"{counted_from(throughput, train['optimizer_steps'])}"
           f"{'' if train.get('mfu') is None else ', MFU ' + format(train['mfu'], '.1%')}"
           f"{cache_kept(kept)}"
           f"{cache_rates(by_states)}{first_step(throughput)}.", "",
           *startups_md(synth, bench or {}),
           *step_profile_md(run),
           *learning_curve_md(run, throughput.get("eval_s_by_epoch"), steps),
           *step1_md(train, bench),
           *(served_md(train, bench, by_kind, out_dir, steps) if bench else
             ["## Served", "", f"Nothing served by this run: {earlier.get('bench') or 'it has no reports/bench.json'}.", ""]),
           "## Stage wall times (s)", "", (f"In all {sum(times.values()):.1f} s (`stage-times.png`).\n\n" if times else "")
           + table(["stage", "seconds"], [[s, t] for s, t in times.items()])
           if times else "Not recorded: no stage manifest of this run holds info.wall_s (a run made before they did).", ""]
    # a run from before the self_prompts stage has none to miss
    missing = [s for s in STAGES if s not in times and (s != "self_prompts" or (run / "data/self-prompts").exists())]
    if times and missing:
        out[-1:] = ["", f"Not recorded: {', '.join(missing)} (no manifest with a wall time in this run's files).", ""]
    return "\n".join(out)


def cache_kept(cache: dict) -> str:
    """The data line's words on train.state_cache (the train manifest's info.state_cache): what was kept after the
    first epoch, all of it or the sequences that fit, or that the target ran in every epoch."""
    if not cache.get("bytes"):
        return ""
    whole = cache["bytes"] / 2**30
    if not cache.get("kept"):
        return f"; state cache off ({whole:.1f} GiB of states: the target ran in every epoch)"
    part, kept, seqs = cache.get("kept_bytes"), cache.get("kept_sequences") or {}, cache.get("sequences") or {}
    host = f", {cache['host_bytes'] / 2**30:.1f} GiB of them in host memory" if cache.get("host_bytes") else ""
    if part is None or part >= cache["bytes"]:
        return f"; states kept after the first epoch ({whole:.1f} GiB{host})"
    split = ", ".join(f"{kept.get(name, 0):,} of {n:,} {name}" for name, n in seqs.items())
    return (f"; states of {split} sequences kept after the first epoch ({part / 2**30:.1f} of {whole:.1f} GiB{host}): "
            "the target ran on the rest in every epoch")


def served_md(train: dict, bench: dict, by_kind: dict, out_dir: Path, steps: int) -> list[str]:
    """results.md's sections of what the bench served: does training pay, the tau triangle (and its plot),
    every configuration, the advice, the prompt sets by group, tau by kind of prompt."""
    trained = [train["accept"][f"step_{i}"] for i in range(1, steps + 1)]
    served = bench["spec"]["acceptance"]
    offline = bench["offline"]["acceptance"]
    plot_triangle(out_dir, trained, offline, served)
    measured = [c for c in bench["configurations"] if not c.get("error")]  # a configuration whose server failed is named below
    return [*training_pays_md(bench),
            f"## The tau triangle at {bench['settings']['num_steps']}-{bench['settings']['topk']}-{bench['settings']['num_draft_tokens']}", "",
            table(["", "tau"] + [f"a_{i}" for i in range(1, steps + 1)],
                  [["train-predicted (eval split, teacher-forced)", train["tau_by_steps"][f"steps_{steps}"], *trained],
                   ["offline (the project's engine, bench prompts)", bench["offline"]["tau"], *offline],
                   [f"served ({'SGLang' if bench['backend'] == 'sglang' else 'the ' + bench['backend'] + ' server'}, the same prompts)", bench["tau"], *served]]), "",
            "## Every configuration, paired against one baseline server", "",
            table(["configuration", "served tau", "predicted tau", "concurrency", "speedup", "predicted speedup", "baseline tok/s",
                   "speculative tok/s", "field tau (SpecForge, Llama-3.1-8B, MT-bench)"],
                  [[c["configuration"], c["tau"], c["predicted_tau"], 1, c["speedup"], c["predicted_speedup"],
                    c["baseline_tokens_per_s"], c["tokens_per_s"], FIELD.get(c["configuration"])] for c in measured] +
                  [[c["configuration"], p["tau"], p["predicted_tau"], p["concurrency"], p["speedup"], p["predicted_speedup"],
                    p["baseline_tokens_per_s"], p["tokens_per_s"], None] for c in measured for p in c["concurrency"]]),
            *[f"Failed: {c['configuration']}: {c['error'].splitlines()[0]}" for c in bench["configurations"] if c.get("error")],
            "", f"Advice: {bench['advice']['advice']}", "",
            *by_group_md(bench),
            "## Served tau by kind of prompt (the rule is in tools/real_workload_report.py)", "",
            table(["configuration", "kind", "prompts", "served tau"],
                  [[name, k, v["prompts"], v["tau"]] for name, kinds in by_kind.items() for k, v in kinds.items()]), ""]


def out_folder(out: Path | None, force: bool) -> Path:
    """OUT, or a new timestamped folder under REPORTS; ValueError for an OUT that holds files (unless
    force) or is a file."""
    if out is None:
        base = out = REPORTS / time.strftime("run-%Y%m%d-%H%M%S")
        n = 1
        while out.exists():  # two reports in one second
            n += 1
            out = base.with_name(f"{base.name}.{n}")
    if out.is_dir() and any(out.iterdir()) and not force:
        held = sum(1 for _ in out.rglob("*") if _.is_file())
        raise ValueError(f"{out} already holds {held} files (a committed report?); a re-run would overwrite them. "
                         f"Give a new folder, leave OUT out for a new one under {REPORTS}/, or add --force to overwrite")
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} is a file; give a folder for the report")
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path, help="the project root (or unpacked results) of a real-workload run")
    ap.add_argument("out", type=Path, nargs="?", default=None,
                    help=f"the report folder (default: a new {REPORTS}/run-YYYYMMDD-HHMMSS); one that holds files needs --force")
    ap.add_argument("--force", action="store_true", help="write into OUT even when it holds files (overwrites a committed report)")
    ap.add_argument("--prompts", type=Path, default=None,
                    help="the bench's prompt file: RUN/data/prompts/eval.jsonl, or a report's bench-prompts.jsonl")
    args = ap.parse_args(argv)
    try:
        args.out = out_folder(args.out, args.force)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    args.out.mkdir(parents=True, exist_ok=True)
    earlier = earlier_runs(args.run)
    for stage, why in earlier.items():
        print(f"left out: {why}")
    for rel in COPIED:
        if (args.run / rel).exists() and not any(rel.startswith(f"reports/{stage}") for stage in earlier):
            shutil.copyfile(args.run / rel, args.out / Path(rel).name)
    counts = {stage: (read(args.run, f"data/{stage}/manifest.json") or {}).get("info") for stage in ("prompts", "synth")}
    counts["extract"] = {"counts": ((read(args.run, "data/hidden/manifest.json") or {}).get("info") or {}).get("counts")}
    (args.out / "stage-counts.json").write_text(json.dumps({"seconds": stage_times(args.run, earlier), **counts}, indent=1) + "\n")
    by_kind = {}
    if "bench" not in earlier and (args.run / "reports/bench.json").exists():
        bench_params = yaml.safe_load((args.run / "params.yaml").read_text())["bench"]
        rows = read_prompts(args.prompts or args.run / "data/prompts/eval.jsonl")
        sent = rows[: bench_params["warmup"] + bench_params["num_prompts"]]
        jsonl.write(args.out / "bench-prompts.jsonl", sent)  # the prompts the bench sent, in order: the kind table's input
        by_kind = tau_by_kind(args.run, rows, bench_params)
    (args.out / "results.md").write_text(results_md(args.run, by_kind, args.out, earlier))
    print(f"real-workload report -> {args.out}")


if __name__ == "__main__":
    main()
