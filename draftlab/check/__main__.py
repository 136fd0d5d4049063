"""The wiring check outside the pipeline (the full check of a pipeline run is python -m stages.check):

  draftlab parity [--url URL] ...             live parity: what a server (or the in-process capture
                                              path) feeds the draft vs the training features
  draftlab check-draft PATH --target MODEL ...   a verdict on any SGLang EAGLE-3 checkpoint (this
                                              project's, SpecForge's, vLLM speculators'), see check.external

`python -m draftlab.check parity|draft ...` runs the same functions.
Exit codes: 0 clean, 1 findings with errors, 2 bad input (a path or features missing, cut or
changed, a malformed config) or an unreachable server; the reason is printed on stderr.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from draftlab.errors import UserError
from draftlab.sglang.layers import VERIFIED_VERSIONS

PARITY_HELP = "compare a server's (or the in-process) captured hidden states with the training features"
DRAFT_HELP = ("a verdict on an SGLang EAGLE-3 draft checkpoint trained anywhere (this project, SpecForge, vLLM speculators): "
              "the layers SGLang feeds it, its config, d2t and shapes")


def positive(kind):
    """argparse type: a number of `kind` above 0 (a bad value is argparse's usage error, exit 2)."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not value > 0 or value != value or value == float("inf"):
            raise argparse.ArgumentTypeError(f"must be a finite number above 0, got {text}")
        return value
    return parse


def add_parity_options(parser, json_help: str) -> None:
    """The live-parity options both commands take."""
    parser.add_argument("--samples", type=positive(int), default=4, help="sequences sent for live parity")
    parser.add_argument("--rtol", type=positive(float), default=0.05, help="relative error a live slot may show")
    parser.add_argument("--norm-tolerance", type=positive(float), default=0.15)
    parser.add_argument("--timeout", type=positive(float), default=120.0, help="seconds per /generate request")
    parser.add_argument("--json", type=Path, default=None, help=json_help)


def add_parity_arguments(parser) -> None:
    parser.add_argument("--url", default="", help="server with --enable-return-hidden-states; empty = in-process capture for --draft")
    parser.add_argument("--features", type=Path, default=Path("data/features"))
    parser.add_argument("--draft", type=Path, default=Path("models/draft"), help="in-process: the exported draft whose ids decide the layers")
    parser.add_argument("--sglang-version", default=None, help="in-process: the layer rule's SGLang release (default: the draft's)")
    parser.add_argument("--target", default=None, help="a local target to name the layers a server really captures (default: none for --url)")
    add_parity_options(parser, "write the full parity result here")


def parity(args) -> int:
    """Live parity from parsed arguments (add_parity_arguments): 0 clean, 1 errors; UserError for bad input."""
    import torch  # here, not at the top: `draftlab --help` should not wait for torch

    from draftlab.check.diagnose import fewer_samples, load_local_target, read_json
    from draftlab.check.findings import errors
    from draftlab.check.parity import check_live_capture, http_capture, inprocess_capture, reference_states, run_parity, stored_sequences
    from draftlab.manifest import read_verified
    from draftlab.sglang.checkpoint import read_exported

    torch.set_num_threads(1)
    features_manifest = read_verified(args.features)  # the shards standardize recorded, complete
    target = (features_manifest.get("info") or {}).get("target") or {}
    if not isinstance(target, dict) or not target.get("model"):
        raise UserError(f"{args.features / 'manifest.json'} names no target (info.target.model); re-run the standardize stage")
    seqs, meta = stored_sequences(args.features, args.samples)
    model = None
    if args.target or not args.url:
        model = load_local_target(args.target or target["model"], None if args.target else target.get("revision"))
    if args.url:
        result = run_parity(seqs, meta, http_capture(args.url, int(meta["hidden_size"]), args.timeout), args.url,
                            reference_states(model) if model is not None else None)
    else:
        try:
            draft = read_exported(args.draft)
        except UserError as e:
            raise UserError(f"{e}; or give --url") from None
        version = args.sglang_version or draft.sglang_version or VERIFIED_VERSIONS[-1]
        live = draft.served_physical(target["architecture"], int(target["num_layers"]), version)
        result = run_parity(seqs, meta, inprocess_capture(model, live), "in-process", reference_states(model), live)
    if (result.get("error") or {}).get("kind") == "unreachable":  # bad input, not a finding about the wiring: exit 2
        raise UserError(f"live parity could not run against {result['source']}: {result['error']['message']}")
    stats = read_json(args.features / "stats.json") or {}
    findings = check_live_capture(result, stats.get("norms"), args.rtol, args.norm_tolerance)
    findings += fewer_samples(result, args.samples, args.features / "train")
    for s in result["slots"]:
        print(f"slot {s['slot']}: trained physical {s['trained_physical']}, rel err {s['rel_err']:.4f}, max abs diff "
              f"{s['max_abs_diff']:.4g}, cos {s['cos']:.4f}, norm ratio {s['norm_ratio']:.3f}, best match {s['best_match']}")
    for f in findings:
        print(f"{f.severity}: {f.name}: {f.cause}" + (f" -> {f.fix}" if f.fix else ""))
    if args.json:
        args.json.write_text(json.dumps({"parity": result, "findings": [f.as_dict() for f in findings]}, indent=2) + "\n")
    return 1 if errors(findings) else 0


def add_draft_arguments(parser) -> None:
    parser.add_argument("path", type=Path, help="the checkpoint directory (config.json + model.safetensors or safetensors shards)")
    parser.add_argument("--target", required=True, help="the target model (local folder or hub id); only its config.json is read, "
                                                        "unless live parity needs it")
    parser.add_argument("--sglang-version", default=None,
                        help=f"the SGLang release that serves it (default: the one the draft records, else {VERIFIED_VERSIONS[-1]})")
    parser.add_argument("--server", default="", help="a running SGLang EAGLE3 server with --enable-return-hidden-states: live parity")
    parser.add_argument("--features", type=Path, default=None, help="this project's training features: the trained layers, d2t, norms")
    add_parity_options(parser, "write the findings (and the parity result) here")


def check_draft(args) -> int:
    """The verdict from parsed arguments (add_draft_arguments): 0 clean, 1 errors; UserError for bad input."""
    import torch

    from draftlab.check.external import check_external, verdict_dict, verdict_text

    torch.set_num_threads(1)
    verdict = check_external(args.path, args.target, args.sglang_version, args.server, args.features, args.samples, args.rtol,
                             args.norm_tolerance, args.timeout)
    print(verdict_text(verdict))
    if args.json:
        args.json.write_text(json.dumps(verdict_dict(verdict), indent=2) + "\n")
    return 1 if verdict.errors else 0


def parity_main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m draftlab.check parity", description=PARITY_HELP)
    add_parity_arguments(parser)
    return parity(parser.parse_args(argv))


def draft_main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m draftlab.check draft", description=DRAFT_HELP)
    add_draft_arguments(parser)
    return check_draft(parser.parse_args(argv))


COMMANDS = {"parity": parity_main, "draft": draft_main}


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        print("usage: python -m draftlab.check parity [--url URL] [options]\n"
              "       python -m draftlab.check draft PATH --target MODEL [--sglang-version V] [--server URL] [--features DIR] [--json OUT]\n"
              "(the same as: draftlab parity, draftlab check-draft; the full check of a pipeline run is: python -m stages.check)",
              file=sys.stderr)
        sys.exit(2)
    try:
        sys.exit(COMMANDS[argv[0]](argv[1:]))
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
