"""A recipe study's report: runs of one profile that differ in their recipe, side by side.

    draftlab exp report RUN [RUN ...] --out DIR [--base NAME]

A RUN is a project root after a run (dvc repro, draftlab exp run, draftlab run-stages), the
unpacked results of tools/offline_gpu_run.sh, one point of a grid (runs/<point>/), or a grid's
folder (runs/: each point in it), or a folder of tools/real_workload_report.py. Each is read from the
files a grid point keeps (grid.KEPT), or that report's copies of them: params.yaml, the train metrics
and the train manifest's history (one entry per epoch; decoded.tsv in a report), the extract
manifest's counts (stage-counts.json) and, where the run served its own draft, bench.json (a run stopped
before the bench keeps an earlier run's: earlier_runs leaves it out).

DIR gets
- points.csv: one row per run: its recipe (RECIPE's keys), its training data (`answers`: which
  synthesis made them, the first 8 hex of train.jsonl's sha256; the eval conversations the training-side figures
  are measured over), the training-side figures (tau
  teacher-forced, tau decoded over the eval first turns at the run's spec.num_steps, a_1, optimizer steps,
  the last epoch's eval loss over its train loss) and, where it was served, served tau, a_1 and speedup of
  the draft and of the best n-gram lookup per prompt set, at bs=1 and at each concurrency measured;
- epochs.png: the decoded first-turn tau after each epoch, one line per run (each on its own lr
  schedule: a 3-epoch run's third epoch ends its decay, an 8-epoch run's does not), and beside it the
  same curves against optimizer steps (runs of other data sizes at equal compute);
- data.png: the decoded first-turn tau against the training answer tokens (once runs differ in their data alone);
- results.md: every run, the spread between seeds (runs that differ in train.seed alone), a table per
  treatment (runs that differ from each other in that key alone, with the tau gained per doubling
  of it where it is a size, and which of them lie within the seeds' spread), the decoded tau after each
  epoch, and each run's step-1 acceptance by kind of token and position band, teacher-forced and
  offline.
The base (--base, a run's name; by default the first RUN) is the recipe the others are measured
against; a treatment made at another setting (a data curve at a higher lr) is measured against its run
nearest the base, and its heading names that run.
"""
from __future__ import annotations

import math
from pathlib import Path

import pandas as pd
import yaml

from draftlab.data.loops import in_band_order
from draftlab.errors import UserError
from draftlab.fsutil import atomic_write_text

# The recipe's keys as params.yaml names them; the column is the key's last part, or its name in NAMED where
# the last part alone says nothing (self_prompts.count: "self_prompts", not "count")
RECIPE = ("prompts.leading_assistant", "self_prompts.count", "synth.max_new_tokens", "extract.train_conversations",
          "extract.train_turns", "extract.loop_tokens", "standardize.draft_vocab_size", "train.epochs", "train.lr", "train.ttt_steps",
          "train.ttt_decay", "train.batch_tokens", "train.warmup_ratio", "train.seed")
NAMED = {"self_prompts.count": "self_prompts"}


def column(key: str) -> str:
    """The study's column for a RECIPE key."""
    return NAMED.get(key, key.split(".")[-1])


# The treatments whose curve has a slope per doubling, and of what: the data's treatments by the answer
# tokens they train on (null, "all", has no number of its own)
SIZES = {"epochs": "epochs", "train_conversations": "train answer tokens", "train_turns": "train answer tokens",
         "leading_assistant": "train answer tokens", "self_prompts": "train answer tokens", "max_new_tokens": "train answer tokens",
         "draft_vocab_size": "draft_vocab_size", "ttt_steps": "ttt_steps"}
DATA = tuple(key for key, size in SIZES.items() if size == "train answer tokens")  # the keys that set the training data
SYNTHESIZED = ("leading_assistant", "self_prompts", "max_new_tokens")  # keys whose runs' train.jsonl differ by design (other prompts or caps)


def read_json(path: Path) -> dict:
    """The object a stage wrote, {} when the run has no such file; a damaged one is named (the check's reader)."""
    from draftlab.check.diagnose import read_json as read_written

    return read_written(path) or {}


def runs_in(paths: list[Path]) -> list[Path]:
    """Each RUN as a folder with params.yaml: a grid's folder stands for its points, in name order."""
    found = []
    for path in paths:
        if (path / "params.yaml").exists():
            found.append(path)
        elif points := sorted(p for p in path.glob("*/") if (p / "params.yaml").exists() and not p.name.endswith(".tmp")):
            # (a point's folder is written as NAME.tmp and renamed once whole: a .tmp one is a point cut short)
            found.extend(points)
        else:
            raise UserError(f"{path}: neither a run (no params.yaml) nor a grid's folder (no */params.yaml): "
                            "give a project root after a run, the unpacked results of tools/offline_gpu_run.sh, or runs/")
    return found


def earlier_runs(root: str | Path) -> dict[str, str]:
    """{stage: why} for each of export (models/draft), bench (reports/bench/, bench.json) and check
    (reports/check.json) under `root` that another run made than the draft trained there: a run stopped
    early (run-stages --until train, a failed stage) leaves an earlier run's in place, in a git checkout
    the committed ones. Told by lineage, where a manifest names its upstream: the export's inputs.train
    against the checkpoint's config_hash (models/draft-ckpt), the bench's inputs.export against the
    export's, the check's inputs.bench against the bench's. An output whose upstream is missing or
    another is an earlier run's; one that names no upstream is taken as this run's. {} when every one
    present is this run's."""
    root = Path(root)

    def other(m: dict, key: str, upstream: dict) -> bool:
        """m names an upstream under inputs[key], and `upstream` is absent ({}) or has another config_hash."""
        named = (m.get("inputs") or {}).get(key)
        return named is not None and named != upstream.get("config_hash")

    ckpt, export, bench, check = (read_json(root / rel) for rel in (  # {} where absent; a damaged one is named
        "models/draft-ckpt/manifest.json", "models/draft/manifest.json", "reports/bench/manifest.json", "reports/check.json"))
    why = {}
    if ckpt and other(export, "train", ckpt):
        why["export"] = "models/draft was exported from another checkpoint than models/draft-ckpt (an earlier run's export)"
    if (bench and "export" in why) or other(bench, "export", export):
        why["bench"] = "reports/bench/ served another export than this run's (an earlier run's bench: this run stopped before it)"
    checked = check or any((root / "reports" / name).exists() for name in ("check.json", "check.md"))
    if (checked and "bench" in why) or other(check, "bench", bench):
        why["check"] = "reports/check.json checked another bench than this run's (an earlier run's check)"
    return why


def recipe(params: dict) -> dict:
    """The run's RECIPE values; a key its params.yaml lacks (a run from before the key) is the key's default,
    which is what such a run did."""
    from draftlab.params import SECTIONS

    def get(key):
        section, name = key.split(".")
        given = params.get(section) if isinstance(params.get(section), dict) else {}
        if name in given:
            return given[name]
        field = SECTIONS[section].__pydantic_fields__.get(name)
        return None if field is None or field.is_required() else field.default
    # as -S writes them (null for None): one type per column whatever the runs hold, so runs compare as text
    return {column(key): "null" if get(key) is None else str(get(key)) for key in RECIPE}


def found(run: Path, *rels: str) -> Path:
    """The first of `rels` under `run` that exists (a run's own path first, then a real-workload report
    folder's copy of it, tools/real_workload_report.py), else the first."""
    return next((run / rel for rel in rels if (run / rel).exists()), run / rels[0])


def decoded_curve(run: Path, depth: int) -> list[tuple[int, float]]:
    """(epoch, decoded first-turn tau at `depth`) after each epoch, from the train manifest's history or the
    train stage's decoded.tsv; [] for a run that recorded neither."""
    history = (read_json(run / "models/draft-ckpt/manifest.json").get("info") or {}).get("history") or []
    curve = [(h["epoch"], h["eval_tau_decoded_first_turns_by_steps"][depth - 1]) for h in history
             if len(h.get("eval_tau_decoded_first_turns_by_steps") or []) >= depth]
    tsv = found(run, "reports/train/plots/decoded.tsv", "decoded.tsv")
    if not curve and tsv.exists() and f"first_turns_{depth}" in (frame := pd.read_csv(tsv, sep="\t")):
        curve = list(zip(frame["epoch"].astype(int), frame[f"first_turns_{depth}"]))
    return curve


def served(bench: dict) -> dict:
    """{column: value} of the draft at spec.* and the best n-gram lookup (by tau at bs=1), per prompt set
    and concurrency."""
    out = {}
    for prompt_set in bench.get("prompt_sets") or []:
        name, confs = prompt_set["name"], prompt_set.get("configurations") or []
        draft = [c for c in confs if c.get("algorithm") != "NGRAM" and c["configuration"] == bench_chain(bench)]
        ngram = sorted((c for c in confs if c.get("algorithm") == "NGRAM"), key=lambda c: -((c.get("pooled") or {}).get("tau") or 0))
        for who, c in (("draft", draft[0] if draft else None), ("ngram", ngram[0] if ngram else None)):
            if c is None:
                continue
            pooled = c.get("pooled") or {}
            out[f"{name} {who} tau"] = pooled.get("tau")
            out[f"{name} {who} speedup"] = pooled.get("speedup")
            if who == "draft":
                out[f"{name} draft a_1"] = (pooled.get("acceptance") or [None])[0]
            for at in c.get("concurrency") or []:
                out[f"{name} {who} tau at {at['concurrency']}"] = at.get("tau")
                out[f"{name} {who} speedup at {at['concurrency']}"] = at.get("speedup")
    return out


def bench_chain(bench: dict) -> str:
    s = bench.get("settings") or {}
    return f"{s.get('num_steps')}-{s.get('topk')}-{s.get('num_draft_tokens')}"


def point(run: Path) -> dict:
    """One row of points.csv."""
    return read_run(run)[0]


def read_run(run: Path) -> tuple[dict, list[tuple[int, float]], list[str]]:
    """The run's row of points.csv, its decoded curve and its step-1 table: each of its files read once."""
    params = yaml.safe_load((run / "params.yaml").read_text()) or {}
    depth = (params.get("spec") or {}).get("num_steps")
    train = read_json(found(run, "reports/train/metrics.json", "metrics.json"))
    extract = (read_json(run / "data/hidden/manifest.json").get("info") or {}).get("counts") \
        or (read_json(run / "stage-counts.json").get("extract") or {}).get("counts") or {}
    counts = extract.get("train") or {}
    synth = read_json(run / "data/synth/manifest.json").get("info") or read_json(run / "stage-counts.json").get("synth") or {}
    answers = (((synth.get("files") or {}).get("train.jsonl") or {}).get("sha256") or "")[:8] or None
    bench = {} if "bench" in earlier_runs(run) else read_json(found(run, "reports/bench.json", "bench.json"))
    curve = decoded_curve(run, depth) if depth else []
    row = {"run": run.name, **recipe(params),
           "answers": answers,  # which synthesis made the training answers: the first 8 hex of train.jsonl's sha256
           "train conversations": counts.get("rows"), "train answer tokens": counts.get("answer_tokens"),
           # the conversations the training-side figures are measured over: a prompts treatment moves some into the eval share
           "eval conversations": (extract.get("eval") or {}).get("rows"),
           "tau_pred": train.get("tau_pred"),
           "decoded tau first turns": (train.get("tau_decoded_first_turns_by_steps") or {}).get(f"steps_{depth}")
           or (curve[-1][1] if curve else None),
           "a_1 teacher-forced": (train.get("accept") or {}).get("step_1"),
           # steps and the loss gap tell a data curve's two causes apart: fewer steps, or a draft that learned its
           # own conversations rather than the target (eval loss ever further above train loss as the data shrinks)
           "optimizer steps": train.get("optimizer_steps"),
           "eval/train loss": train["eval_loss"] / train["train_loss"] if train.get("eval_loss") and train.get("train_loss") else None,
           "train s": train.get("seconds"), "train tok/s": train.get("tokens_per_s")}
    if bench.get("config_hash"):
        row |= {"offline tau": bench.get("offline_tau"), **served(bench)}
    if not curve and row["decoded tau first turns"] is not None:  # only its last epoch's figure: one point
        curve = [(int(row["epochs"]), row["decoded tau first turns"])]
    return row, curve, step1_md(run.name, train, bench.get("offline") or {})


def slope_per_doubling(xs: list[float], ys: list[float]) -> float | None:
    """Least-squares tau gained per doubling of x (a straight line in log2 x); None under two distinct x."""
    pts = [(math.log2(x), y) for x, y in zip(xs, ys) if x and y is not None and x > 0]
    if len({x for x, _ in pts}) < 2:
        return None
    mx, my = sum(x for x, _ in pts) / len(pts), sum(y for _, y in pts) / len(pts)
    return sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)


def slope_md(group: pd.DataFrame, x: str, base: str, spread: float | None) -> list[str]:
    """The line under a size treatment: the decoded tau gained per doubling of x, over how many doublings the runs
    span (a slope over a fraction of one magnifies the noise), and whether any run stands out of the seeds' spread."""
    xs, ys = pd.to_numeric(group[x], errors="coerce").tolist(), group["decoded tau first turns"].tolist()
    slope = slope_per_doubling(xs, ys)
    if slope is None:
        return []
    span = math.log2(max(v for v in xs if v and v > 0) / min(v for v in xs if v and v > 0))
    line = (f"Decoded tau gained per doubling of {x} (least squares over these runs, which span {span:.2f} "
            f"doubling{'' if round(span, 2) == 1 else 's'}): {slope:+.3f}.")
    diffs = from_base(group, base)
    if spread is not None and diffs is not None and len(diffs) and (diffs.abs() <= spread).all():
        line += " Every run lies within the seeds' spread of the base, so the slope is not told apart from none."
    return [line + top_md(xs, ys, x, spread), ""]


def top_md(xs: list, ys: list, x: str, spread: float | None) -> str:
    """Whether the curve still rises at its largest size: the gain per doubling between its two largest
    sizes (a slope over all sizes hides a curve that flattens), beside the seeds' spread."""
    at = {}
    for v, y in zip(xs, ys):
        if v and v > 0 and y is not None and not pd.isna(y):
            at.setdefault(v, []).append(y)
    if len(at) < 3:  # two sizes: the slope above is this step already
        return ""
    (lo, y_lo), (hi, y_hi) = [(v, sum(at[v]) / len(at[v])) for v in sorted(at)[-2:]]
    gain = (y_hi - y_lo) / math.log2(hi / lo)
    verdict = "" if spread is None else (" Still rising at the top: more than the seeds' spread." if y_hi - y_lo > spread
                                         else " Flat at the top: within the seeds' spread.")
    return f" Between the two largest {x} ({lo:,.0f} and {hi:,.0f}): {gain:+.3f} per doubling.{verdict}"


def treatments(rows: pd.DataFrame, base: str) -> list[tuple[str, str, pd.DataFrame]]:
    """(recipe column, the treatment's base run, its runs) for each set of runs equal in every other recipe
    column that shows more than one value of it. A set holding the study's base is measured against it;
    another against its run nearest the base (fewest recipe columns apart, the first on a tie), so a curve
    made at another setting (a data curve at another lr) is measured against its own point. Seeds are the
    spread's section, not a treatment."""
    columns = [column(k) for k in RECIPE]
    text = rows[columns].astype(str)
    apart = (text != text[rows["run"] == base].iloc[0]).sum(axis=1)  # recipe columns from the study's base, by row
    out = []
    for col in columns:
        if col == "seed":
            continue
        others = [c for c in columns if c != col]
        sets = [idx for idx in text.groupby(others, sort=False).groups.values() if text.loc[idx, col].nunique() > 1]
        for idx in sets:
            group = rows.loc[idx]
            own = base if base in set(group["run"]) else group.loc[apart[idx].idxmin(), "run"]
            out.append((apart[idx].min(), col, own, group.sort_values(col, key=lambda s: pd.to_numeric(s, errors="coerce").fillna(math.inf))))
    return [t[1:] for t in sorted(out, key=lambda t: t[0])]  # the base's own treatments first


def seed_spread(rows: pd.DataFrame) -> tuple[float | None, list[str]]:
    """The spread between seeds: over each set of runs that share every recipe key but train.seed, the
    range (max - min) of the decoded first-turn tau. (the largest such range, or None where no set has
    two seeds; results.md's section on it)."""
    others = [column(k) for k in RECIPE if k != "train.seed"]
    sized = rows.dropna(subset=["decoded tau first turns"])
    sets = [group for _, group in sized.groupby(others, dropna=False) if group["seed"].nunique() > 1]
    if not sets:
        return None, ["## Spread between seeds", "", "Not measured: no two runs differ in train.seed alone, so each difference "
                      "below is one seed's. Two runs of one recipe with `-S train.seed=0,1` measure it.", ""]
    spread = max(group["decoded tau first turns"].max() - group["decoded tau first turns"].min() for group in sets)
    tables = [markdown(group, ["run", "seed", "decoded tau first turns", "tau_pred", "heldout draft tau", "mt-bench draft tau"])
              for group in sets]
    return spread, ["## Spread between seeds", "", *[line for t in tables for line in (t, "")],
                    f"The largest range of the decoded tau between seeds of one recipe: {spread:.3f}. A treatment's "
                    "difference from its base no larger than this is not told apart from a change of seed.", ""]


def from_base(group: pd.DataFrame, base: str) -> pd.Series | None:
    """Each other run's decoded tau minus the base's, by run (None where the base has none)."""
    figure = "decoded tau first turns"
    at_base = group.loc[group["run"] == base, figure]
    if at_base.empty or pd.isna(at_base.iloc[0]):
        return None
    others = group[(group["run"] != base) & group[figure].notna()]
    return (others[figure] - at_base.iloc[0]).set_axis(others["run"])


def within_spread(group: pd.DataFrame, base: str, spread: float | None) -> list[str]:
    """The line under a treatment table: which runs differ from the base by no more than the seeds' spread."""
    diffs = from_base(group, base)
    if diffs is None:
        return []
    if spread is None:
        return ["One seed per run: the spread between seeds is not measured, so these differences may be noise.", ""]
    close = [f"{run} ({d:+.3f})" for run, d in diffs.items() if abs(d) <= spread]
    return [f"Within the seeds' spread ({spread:.3f}) of the base's decoded tau, so not told apart from it: {', '.join(close)}.", ""] \
        if close else []


def markdown(frame: pd.DataFrame, columns: list[str]) -> str:
    cols = [c for c in columns if c in frame and frame[c].notna().any()]
    def cell(v):
        return "" if v is None or v is pd.NA or (isinstance(v, float) and math.isnan(v)) else f"{v:.3f}" if isinstance(v, float) else str(v)
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(cell(v) for v in r) + " |" for r in frame[cols].itertuples(index=False)]
    return "\n".join(lines)


def steps_per_epoch(rows: pd.DataFrame) -> dict[str, float]:
    """Each run's optimizer steps per epoch (every epoch the same batches' count): epoch e of a run ends at
    step e times this. On that axis runs of other data sizes meet on one measure of compute: at equal
    steps, more data against more epochs. A run without its step count is left out."""
    epochs = pd.to_numeric(rows["epochs"], errors="coerce")  # a recipe key: as params.yaml spells it
    return {r["run"]: float(r["optimizer steps"]) / e for (_, r), e in zip(rows.iterrows(), epochs)
            if pd.notna(r.get("optimizer steps")) and pd.notna(e) and e > 0}


def plot_epochs(out: Path, curves: dict[str, list[tuple[int, float]]], served_at: dict[str, tuple[int, float]],
                per_epoch: dict[str, float] | None = None) -> None:
    """epochs.png: the decoded tau after each epoch, one line per run (a star where it was served); beside
    it, where the runs' step counts are known, the same curves against optimizer steps (steps_per_epoch)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("epoch", {name: 1.0 for name in curves})] + ([("optimizer steps", per_epoch)] if per_epoch else [])
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels) + (2 if len(curves) > 4 else 0), 3.8), sharey=True,
                             squeeze=False)
    for ax, (xlabel, scale) in zip(axes[0], panels):
        for name, curve in curves.items():
            if name not in scale:
                continue
            line, = ax.plot([e * scale[name] for e, _ in curve], [t for _, t in curve], marker=".", label=name)
            if name in served_at:
                epoch, tau = served_at[name]
                ax.plot(epoch * scale[name], tau, marker="*", markersize=11, color=line.get_color(), linestyle="none")
        ax.set(xlabel=xlabel)
    axes[0][0].set(ylabel="tau (tokens per round)")
    fig.suptitle("greedy chains replayed over the eval first turns (star: served on the held-out first turns)", fontsize="medium")
    axes[0][-1].legend(fontsize="x-small", **({"loc": "center left", "bbox_to_anchor": (1.01, 0.5)} if len(curves) > 4 else {}))
    fig.tight_layout()
    fig.savefig(out / "epochs.png", dpi=100)
    plt.close(fig)


def plot_data(out: Path, rows: pd.DataFrame) -> None:
    """data.png: a line per set of runs that share every recipe key but the data's (DATA) and differ in
    those: tau against their training answer tokens. None where no such set exists (runs on the same
    data differ a little in tokens when the target's answers were made again, on another GPU)."""
    sized = rows.dropna(subset=["train answer tokens", "decoded tau first turns"])
    rest = [column(key) for key in RECIPE if column(key) not in DATA]
    curves = [group for _, group in sized.groupby(rest, dropna=False) if len(group[list(DATA)].drop_duplicates()) > 1]
    if not curves:
        (out / "data.png").unlink(missing_ok=True)  # of an earlier report into this folder
        return
    varying = [key for key in rest if len({group[key].iloc[0] for group in curves}) > 1]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.8))
    for group in curves:
        group = group.sort_values("train answer tokens")
        label = ", ".join([f"{group['epochs'].iloc[0]} epochs"] + [f"{key} {group[key].iloc[0]}" for key in varying if key != "epochs"])
        line, = ax.plot(group["train answer tokens"], group["decoded tau first turns"], marker="o", label=label)
        unseeded = [key for key in rest if key != "seed"]  # the same recipe at other seeds: the spread at that size
        twins = sized.merge(group[unseeded + list(DATA)].drop_duplicates(), on=unseeded + list(DATA))
        twins = twins[~twins["run"].isin(group["run"])]
        if len(twins):
            ax.scatter(twins["train answer tokens"], twins["decoded tau first turns"], marker="x", color=line.get_color(),
                       label=f"{label}, other seeds")
    ax.set_xscale("log", base=2)
    sizes = sorted({int(v) for group in curves for v in group["train answer tokens"]})
    ax.set_xticks(sizes, [f"{v / 1e6:.2f}M" if v >= 1e6 else f"{v / 1e3:.1f}k" for v in sizes])  # each run's own size
    ax.minorticks_off()
    ax.set(xlabel="training answer tokens", ylabel="tau (tokens per round)", title="decoded tau over the eval first turns")
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(out / "data.png", dpi=100)
    plt.close(fig)


def report(paths: list[Path], out: Path, base: str | None = None) -> pd.DataFrame:
    runs = runs_in(paths)
    if not runs:
        raise UserError("no runs given")
    points = [read_run(run) for run in runs]
    rows = pd.DataFrame([row for row, _, _ in points])
    for count in ("train conversations", "train answer tokens", "optimizer steps"):  # whole numbers, blank where a run lacks them
        rows[count] = rows[count].astype("Int64")
    if rows["run"].duplicated().any():
        raise UserError(f"two runs are named {rows['run'][rows['run'].duplicated()].iloc[0]!r}: give each run a folder of its own name")
    base = base or rows["run"].iloc[0]
    if base not in set(rows["run"]):
        raise UserError(f"--base {base}: no run of that name; the runs are {', '.join(rows['run'])}")
    out.mkdir(parents=True, exist_ok=True)
    rows.to_csv(out / "points.csv", index=False)
    curves = {row["run"]: curve for row, curve, _ in points if curve}
    served_at = {row["run"]: (int(row["epochs"]), row["heldout draft tau"]) for row, curve, _ in points
                 if curve and pd.notna(row.get("heldout draft tau"))}
    if curves:
        plot_epochs(out, curves, served_at, steps_per_epoch(rows))
    plot_data(out, rows)
    figures = ["tau_pred", "decoded tau first turns", "a_1 teacher-forced", "optimizer steps", "eval/train loss", "heldout draft tau", "heldout draft a_1",
               "heldout draft speedup", "heldout ngram tau", "heldout ngram speedup", "mt-bench draft tau", "mt-bench draft a_1",
               "mt-bench draft speedup", "mt-bench ngram tau", "mt-bench ngram speedup", "heldout draft speedup at 8",
               "heldout ngram speedup at 8", "mt-bench draft speedup at 8", "mt-bench ngram speedup at 8", "train s"]
    recipe_cols = [column(k) for k in RECIPE]
    varying = [c for c in recipe_cols if rows[c].astype(str).nunique() > 1]
    md = ["# A recipe study (written by draftlab exp report)", "",
          f"{len(rows)} runs; the base is `{base}`. The decoded tau replays greedy chains of each run's spec.num_steps over "
          "the eval split's first answers: the training-side figure closest to what a bench of first turns serves. "
          "Served figures are SGLang's, at bs=1 unless a column says otherwise (`at 8`: 8 requests in flight).", "",
          "## Every run", "", markdown(rows, ["run", *varying, "answers", "train conversations", "train answer tokens",
                                             "eval conversations", *figures]), ""]
    spread, spread_md = seed_spread(rows)
    md += spread_md
    for col, own, group in treatments(rows, base):
        md += [f"## Treatment: {col}" + ("" if own == base else f", against `{own}`"), "",
               markdown(group, ["run", col, "answers", "train answer tokens", "eval conversations", *figures]), ""]
        if group["answers"].nunique() > 1 and col not in SYNTHESIZED:
            md += ["These runs trained on answers of different synthesis runs (column `answers`): the target's greedy "
                   "answers change from one synthesis to the next (GPU batching), so part of each difference is the "
                   "data's. Runs that reuse one synthesis (its data/synth/ in the tree) compare the recipe alone.", ""]
        if group["eval conversations"].dropna().nunique() > 1:
            md += ["These runs' eval splits differ (column `eval conversations`: other prompts move conversations into "
                   "the eval share too), so their teacher-forced and decoded tau are measured over other conversations. "
                   "Their served tau, over the bench's prompts, compares them on the same prompts.", ""]
        md += within_spread(group, own, spread)
        if x := SIZES.get(col):
            md += slope_md(group, x, own, spread)
    for name, curve in curves.items():
        md += [f"## After each epoch: {name}", "", "| epoch | " + " | ".join(str(e) for e, _ in curve) + " |",
               "|---|" + "---|" * len(curve), "| decoded tau, first turns | " + " | ".join(f"{t:.3f}" for _, t in curve) + " |", ""]
    for _, _, step1 in points:
        md += step1
    atomic_write_text(out / "results.md", "\n".join(md))
    return rows


def step1_md(name: str, train: dict, offline: dict) -> list[str]:
    """results.md's section of one run's step1_table."""
    table = step1_table(train, offline)
    return [f"## Step-1 acceptance of {name}, by kind of token, position and turn", "", table, ""] if table else []


def step1_table(train: dict, offline: dict | None = None) -> str:
    """The first draft token's hit rate by group (kind of token: a loop token closes an 8-gram already in
    its answer; position band in the answer; turn of the conversation), teacher-forced over the eval split
    (train metrics' step1_by_*), beside the offline run's in the same group where the bench kept them
    (each verify round's first draft over the bench prompts: rounds start where the draft missed before).
    "" for metrics from before the split. The one table of exp report and of the real-workload report."""
    kinds, bands, turns = (train.get(f"step1_by_{key}") or {} for key in ("kind", "position", "turn"))
    if not kinds or not bands:
        return ""
    offline = offline or {}
    groups = [(f"{k} tokens", kinds[k], (offline.get("step1_by_kind") or {}).get(k)) for k in kinds] + \
             [(f"positions {b}", bands[b], (offline.get("step1_by_position") or {}).get(b)) for b in in_band_order(bands)] + \
             [(f"turn {t}", turns[t], None) for t in turns]  # the bench's prompts are not split by turn
    with_offline = offline_step1(offline)
    lines = ["| group | eval tokens | a_1 teacher-forced |" + (" offline rounds | a_1 offline |" if with_offline else ""),
             "|---|---|---|" + ("---|---|" if with_offline else "")]
    for label, cell, at_starts in groups:
        line = f"| {label} | {cell.get('tokens', '')} | {fmt(cell.get('a_1'))} |"
        if with_offline:
            line += f" {(at_starts or {}).get('rounds', '')} | {fmt((at_starts or {}).get('a_1'))} |"
        lines.append(line)
    return "\n".join(lines)


def offline_step1(offline: dict | None) -> bool:
    """Whether the bench's offline run kept its rounds' step-1 acceptance by group (step1_table's offline columns)."""
    return any((offline or {}).get(f"step1_by_{key}") for key in ("kind", "position"))


def fmt(v) -> str:
    return "" if v is None else f"{v:.3f}"
