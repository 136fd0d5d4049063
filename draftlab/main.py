"""The `draftlab` command: what is not a DVC stage (the stages run through `dvc repro`).

    draftlab check-draft PATH --target MODEL [...]   a verdict on an EAGLE-3 draft trained anywhere
    draftlab parity [--url URL] [...]                live parity: served hidden states vs the training features
    draftlab serve --model-path MODEL [...]          the reference server (SGLang's HTTP API)
    draftlab exp run PROFILE [PROFILE ...] [...]     a params profile (configs/*.yaml) as one dvc exp run
    draftlab exp show-profile PROFILE [...]          what the profiles change: key: old -> new

Exit codes: 0 ok, 1 findings with errors, 2 bad input (one line on stderr, no traceback); exp run
passes on dvc's own, and after a failed run puts params.yaml, dvc.lock and the outputs back as the
run found them (draftlab/experiments/workspace.py; --keep-failed leaves them and lists what changed). `python -m draftlab.check draft|parity` and `python -m draftlab.server` run
the same functions.
"""
from __future__ import annotations

import argparse
import pathlib
import subprocess
import sys

from draftlab.errors import UserError


def check_draft(args) -> int:
    from draftlab.check.__main__ import check_draft

    return check_draft(args)


def parity(args) -> int:
    from draftlab.check.__main__ import parity

    return parity(args)


def serve(argv: list[str]) -> None:
    """python -m draftlab.server's options, passed on as given (its --help lists them)."""
    from draftlab.engine import server  # loads torch: only when serving

    server.main(argv)


def add_profile_arguments(parser, required: bool = True) -> None:
    parser.add_argument("profiles", nargs="+" if required else "*", metavar="PROFILE",
                        help="a YAML file of params (params.yaml's sections, a subset of its keys), or NAME for configs/NAME.yaml; "
                             "later profiles win")
    parser.add_argument("-S", "--set-param", dest="sets", action="append", default=[], metavar="section.key=VALUE",
                        help="one more value, in dvc exp run -S's grammar; wins over the profiles")
    parser.add_argument("--params", default="params.yaml", help="the params file the profiles apply to")


def exp_run(args) -> int:
    from draftlab.experiments.profiles import apply_profiles, command_line, dvc_exp_run

    applied = apply_profiles(args.profiles, args.sets, args.params)
    if args.one_at_a_time:
        return exp_run_one_at_a_time(args, applied)
    argv = dvc_exp_run(applied, args.queue, args.name, args.dvc_args)
    if args.dry_run:
        print(command_line(argv))
        return 0
    in_workspace = not args.queue and "--temp" not in args.dvc_args  # else DVC runs in a copy and the workspace stays
    snapshot = None
    if in_workspace:
        from draftlab.experiments.workspace import Snapshot

        snapshot = Snapshot.take(applied.params_file)
    proc = subprocess.Popen([sys.executable, "-m", "dvc", *argv[1:]])  # the dvc of this Python
    try:
        rc = proc.wait()
    except KeyboardInterrupt:  # dvc got the Ctrl-C too: let it stop its stage, then put things back
        try:
            rc = proc.wait() or 130
        except KeyboardInterrupt:  # a second Ctrl-C: stop dvc now
            proc.kill()
            proc.wait()
            rc = 130
    if snapshot is not None:
        if rc == 0:
            snapshot.discard()
        else:
            print(snapshot.restore(act=not args.keep_failed).text(rc, acted=not args.keep_failed), file=sys.stderr)
    return rc


def exp_run_one_at_a_time(args, applied) -> int:
    """One queued dvc exp run per point of a one-at-a-time grid over the sweeps after --: the base,
    then each swept key's values alone (draftlab.experiments.grid.points)."""
    import yaml

    from draftlab.experiments.grid import point_name, points, split_sets
    from draftlab.experiments.profiles import command_line, dvc_exp_run

    if not args.queue:
        raise UserError("--one-at-a-time queues one experiment per point: add --queue (then dvc queue start runs them)")
    rest, sets, it = [], [], iter(args.dvc_args)
    for a in it:  # the -S values after --: sweeps among them make the points, the rest goes to every run
        if a in ("-S", "--set-param"):
            sets.append(next(it, ""))
        elif a.startswith(("-S=", "--set-param=")):
            sets.append(a.split("=", 1)[1])
        else:
            rest.append(a)
    fixed, swept = split_sets(sets)
    if not swept:
        raise UserError("--one-at-a-time needs a sweep after --: -- -S 'train.ttt_steps=5,9' (several values, a,b / choice(a,b))")
    dvc_file = pathlib.Path(args.params).parent / "dvc.yaml"
    dvc = yaml.safe_load(dvc_file.read_text()) if dvc_file.exists() else {"stages": {}}
    grid = points(swept, dvc, one_at_a_time=True)
    for i, point in enumerate(grid):
        name = f"{args.name}-{point_name(i, point)}" if args.name else None
        argv = dvc_exp_run(applied, True, name, rest + [x for o in fixed + point for x in ("-S", o)])
        if args.dry_run:
            print(command_line(argv))
            continue
        rc = subprocess.run([sys.executable, "-m", "dvc", *argv[1:]]).returncode
        if rc:
            print(f"exp run: queuing point {i + 1} of {len(grid)} failed (dvc exit {rc}); the points before it are queued",
                  file=sys.stderr)
            return rc
    if not args.dry_run:
        print(f"exp run: {len(grid)} experiments queued (the base, then each swept key alone); dvc queue start runs them")
    return 0


def exp_show_profile(args) -> int:
    from draftlab.experiments.profiles import apply_profiles, show

    print(show(apply_profiles(args.profiles, args.sets, args.params)))
    return 0


def exp_report(args) -> int:
    from draftlab.experiments.study import report

    rows = report(args.runs, args.out, args.base)
    written = [name for name in ("results.md", "points.csv", "epochs.png", "data.png") if (args.out / name).exists()]
    print(f"exp report: {len(rows)} runs -> {args.out}/: {', '.join(written)}")
    return 0


def run_stages(args) -> int:
    from draftlab.experiments.grid import run_grid, split_sets
    from draftlab.experiments.run_stages import run_stages as run

    if split_sets(args.sets)[1]:  # a sweep among the -S values: every point of the grid in turn
        run_grid(args.profiles, args.sets, args.until, args.force, args.params, "dvc.yaml", args.runs, args.one_at_a_time)
    else:
        if args.one_at_a_time:
            raise UserError("--one-at-a-time varies swept keys: give at least one -S with several values (a,b / choice(a,b))")
        run(args.profiles, args.sets, args.until, args.force, args.params)
    return 0


def build_parser() -> argparse.ArgumentParser:
    from draftlab.check.__main__ import DRAFT_HELP, PARITY_HELP, add_draft_arguments, add_parity_arguments

    parser = argparse.ArgumentParser(prog="draftlab", description="EAGLE-3 drafts for SGLang: the commands around the DVC pipeline "
                                                                   "(which runs with dvc repro and dvc exp run)")
    verbs = parser.add_subparsers(title="verbs", dest="verb", required=True)

    p = verbs.add_parser("check-draft", help="a verdict on an EAGLE-3 draft trained anywhere", description=DRAFT_HELP)
    add_draft_arguments(p)
    p.set_defaults(func=check_draft)

    p = verbs.add_parser("parity", help="a server's hidden states vs the training features",
                         description=PARITY_HELP)
    add_parity_arguments(p)
    p.set_defaults(func=parity)

    # Listed here for --help only: main() hands `draftlab serve ...` to the server's own parser.
    verbs.add_parser("serve", help="the reference server (SGLang's HTTP API, CPU or GPU)")

    exp = verbs.add_parser("exp", help="params profiles (configs/*.yaml) as DVC experiments",
                           description="params profiles as DVC experiments: exp run, exp show-profile, exp report")
    exp_verbs = exp.add_subparsers(title="verbs", dest="exp_verb", required=True)
    p = exp_verbs.add_parser("run", help="run profiles as one dvc exp run (one -S per key)",
                             description="merge the profiles over params.yaml, check the result with the params loader, and "
                                         "run dvc exp run with one -S per key; arguments after -- go to dvc exp run",
                             usage="draftlab exp run PROFILE [PROFILE ...] [--queue] [--name NAME] [-S section.key=VALUE ...] "
                                   "[--dry-run] [--keep-failed] [--one-at-a-time] [-- dvc exp run args]")
    add_profile_arguments(p)
    p.add_argument("--queue", action="store_true", help="queue the experiment (dvc queue start runs it)")
    p.add_argument("-n", "--name", default=None, help="the experiment's name")
    p.add_argument("--dry-run", action="store_true", help="print the dvc command instead of running it")
    p.add_argument("--one-at-a-time", action="store_true",
                   help="with --queue and sweeps after -- (-S key=a,b): queue the base, then each swept key's values alone "
                        "against it, not every combination (a treatment per key)")
    p.add_argument("--keep-failed", action="store_true",
                   help="when the run fails, leave the workspace as it left it (by default params.yaml, dvc.lock and the "
                        "outputs are put back as the run found them) and list what it changed")
    p.set_defaults(func=exp_run)
    p = exp_verbs.add_parser("show-profile", help="print what profiles change (key: old -> new)",
                             description="merge the profiles over params.yaml, check them, and print each key: old -> new")
    add_profile_arguments(p)
    p.set_defaults(func=exp_show_profile)

    p = exp_verbs.add_parser("report", help="a recipe study's runs side by side (points.csv, curves, results.md)",
                             description="read runs of one profile that differ in their recipe (project roots after a run, "
                                         "unpacked offline_gpu_run.sh results, grid points, or a grid's runs/ folder) and write "
                                         "points.csv, epochs.png, data.png and results.md into --out")
    p.add_argument("runs", nargs="+", type=pathlib.Path, metavar="RUN")
    p.add_argument("--out", type=pathlib.Path, required=True, metavar="DIR")
    p.add_argument("--base", default=None, metavar="NAME", help="the run the others are compared with (default: the first)")
    p.set_defaults(func=exp_report)

    p = verbs.add_parser("run-stages", help="dvc.yaml's stages in order without DVC (a machine with neither git nor DVC)",
                         description="merge the profiles into params.yaml, then run dvc.yaml's stages in dependency order, "
                                     "skipping those whose command, params and deps are unchanged since they last completed here")
    add_profile_arguments(p, required=False)
    p.set_defaults(func=run_stages)
    p.add_argument("--until", default=None, metavar="STAGE", help="stop after this stage")
    p.add_argument("--force", nargs="*", default=[], metavar="STAGE", help="run these stages even when unchanged")
    p.add_argument("--runs", default="runs", metavar="DIR",
                   help="with a sweep in -S (a,b,c / choice(...) / range(...), as dvc exp run --queue reads it): each point's "
                        "reports go to DIR/<point>/, and DIR/grid.csv has one row per finished point there")
    p.add_argument("--one-at-a-time", action="store_true",
                   help="with several swept keys: each key's values alone against the other params, not every combination "
                        "(a treatment per key, as draftlab exp report tables them)")
    return parser


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["serve"]:
        serve(argv[1:])
        return
    dvc_args = []
    if argv[:2] == ["exp", "run"] and "--" in argv:  # the rest goes to dvc exp run as given
        cut = argv.index("--")
        argv, dvc_args = argv[:cut], argv[cut + 1:]
    args = build_parser().parse_args(argv)
    args.dvc_args = dvc_args
    try:
        sys.exit(args.func(args))
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
