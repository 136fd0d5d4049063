"""The wiring check: reads what every stage wrote and names each train-vs-serve wiring fault.

    diagnosis = diagnose(Paths(), CheckParams(...))   # what the check stage runs

The checks themselves are pure functions in check.draft (exported draft vs features),
check.serving (algorithm, flags, template/tokenizer, tau) and check.parity (live capture);
this module only reads the files, calls them in order and runs live parity. Live parity alone,
against any server: python -m draftlab.check parity --url http://127.0.0.1:30000
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from draftlab.check.draft import ServedLayers, check_capture, check_d2t, check_draft_shapes, served_layers
from draftlab.check.findings import Finding, by_severity, error, errors, finite, info, warning
from draftlab.check.hardware import check_hardware, hardware_unrecorded, stage_manifests
from draftlab.check.packages import check_package_drift
from draftlab.check.parity import check_live_capture, http_capture, inprocess_capture, reference_states, run_parity, stored_sequences
from draftlab.check.serving import answer_lengths, check_algorithm, check_flags, check_lineage, check_tau, check_tokenizer
from draftlab.errors import UserError
from draftlab.features.dataset import DRAFT_VOCAB_FILE, physical_layers_of
from draftlab.manifest import describe_hardware, safetensors_header, verify_outputs
from draftlab.sglang.checkpoint import ExportedDraft, TensorSpecs, read_exported, tensor_specs
from draftlab.sglang.layers import VERIFIED_VERSIONS, parse_version


@dataclass
class Paths:
    synth: Path = Path("data/synth")
    hidden: Path = Path("data/hidden")
    features: Path = Path("data/features")
    train_metrics: Path = Path("reports/train/metrics.json")
    draft: Path = Path("models/draft")
    bench: Path = Path("reports/bench.json")


@dataclass
class Run:
    """Everything the checks read, parsed; None where a file is absent."""

    paths: Paths
    synth: dict | None = None  # data/synth/manifest.json
    hidden: dict | None = None  # data/hidden/manifest.json
    features: dict | None = None  # data/features/manifest.json
    stats: dict | None = None  # data/features/stats.json
    feature_physical: list[int] | None = None  # physical layers in the features' slot order (shard metadata)
    train_metrics: dict | None = None
    draft: ExportedDraft | None = None  # models/draft (its config.json), read once
    export_manifest: dict | None = None
    tensors: TensorSpecs = field(default_factory=dict)  # exported weights: name -> (shape, dtype)
    d2t: torch.Tensor | None = None
    training_d2t: torch.Tensor | None = None
    bench: dict | None = None
    server_log: str | None = None
    damaged: list[tuple[str, str]] = field(default_factory=list)  # (path, why): an input present but not as its stage wrote it

    @property
    def target(self) -> dict:
        return ((self.features or {}).get("info") or {}).get("target") or {}


def read_json(path: Path) -> dict | None:
    """A JSON object a stage wrote (a manifest, a report), None when absent; UserError naming the
    file when it is not JSON or not an object (a manifest also needs its config_hash)."""
    from draftlab.manifest import MANIFEST, manifest_problem

    try:
        value = json.loads(Path(path).read_bytes())
    except FileNotFoundError:
        return None
    except OSError as e:  # a directory, no permission
        raise UserError(f"{path}: cannot be read ({e.strerror or e}); re-run the stage that writes it") from None
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise UserError(f"{path}: not valid JSON ({e}); re-run the stage that writes it") from None
    problem = manifest_problem(value) if Path(path).name == MANIFEST else (
        None if isinstance(value, dict) else f"a JSON {type(value).__name__}, not an object")
    if problem:
        raise UserError(f"{path}: {problem}; re-run the stage that writes it")
    return value


def load_run(paths: Paths) -> Run:
    run = Run(paths)
    run.synth, run.hidden = read_json(paths.synth / "manifest.json"), read_json(paths.hidden / "manifest.json")
    run.features, run.stats = read_json(paths.features / "manifest.json"), read_json(paths.features / "stats.json")
    features_ok = True
    if run.features is not None:
        try:  # every shard standardize recorded, complete: a missing or cut one is an error, not a smaller check
            verify_outputs(paths.features, run.features)
        except UserError as e:
            run.damaged.append((str(paths.features), str(e)))
            features_ok = False
    try:
        run.feature_physical = physical_layers_of(paths.features) if features_ok else None
    except UserError:  # no shards: diagnose says so
        pass
    if features_ok and (paths.features / DRAFT_VOCAB_FILE).exists():
        with safe_open(str(paths.features / DRAFT_VOCAB_FILE), "pt") as f:
            run.training_d2t = f.get_tensor("d2t")
    run.train_metrics = read_json(paths.train_metrics)
    run.draft = read_exported(paths.draft) if (paths.draft / "config.json").exists() else None
    run.export_manifest = read_json(paths.draft / "manifest.json")
    if run.draft is not None and run.draft.weights.exists():
        try:
            safetensors_header(run.draft.weights)
        except UserError as e:
            run.damaged.append((str(run.draft.weights), f"{e}; re-run the export stage (dvc repro export)"))
            run.draft = None
    if run.draft is not None and run.draft.weights.exists():
        run.tensors = tensor_specs(run.draft.weights)
        if "d2t" in run.tensors:
            with safe_open(str(run.draft.weights), "pt") as f:
                run.d2t = f.get_tensor("d2t")
    run.bench = read_json(paths.bench)
    log = (run.bench or {}).get("server_log")
    if log and Path(log).exists():
        run.server_log = Path(log).read_text(errors="replace")
    return run


def sglang_version(run: Run) -> str:
    """The SGLang release whose layer rule applies: the one benchmarked, else the one exported for."""
    candidates = [(run.bench or {}).get("sglang_version"), run.draft.sglang_version if run.draft else None,
                  (((run.export_manifest or {}).get("params") or {}).get("export") or {}).get("sglang_version")]
    for v in candidates:
        try:
            if v:
                parse_version(v)
                return str(v)
        except UserError:
            continue
    return VERIFIED_VERSIONS[-1]


def serving_side(bench: dict | None) -> tuple[dict | None, list[Finding]]:
    """Template and tokenizer hashes of the target the bench served (loaded here with its tokenizer)."""
    from draftlab.target.load import chat_template_hash, load_tokenizer, tokenizer_hash

    target = (bench or {}).get("target") or {}
    if not target.get("model"):
        return None, []
    try:
        tok = load_tokenizer(target["model"], target.get("revision"))
    except UserError as e:
        return None, [warning("serving_tokenizer_unloadable", {"model": target["model"]}, str(e), "make the served target loadable here")]
    return {"chat_template": chat_template_hash(tok), "tokenizer": tokenizer_hash(tok)}, []


def check_served_target(features_target: dict, bench_target: dict | None) -> list[Finding]:
    """The bench served the target the features were extracted from (same model, revision, shape)."""
    if not bench_target or not features_target:  # said, not skipped in silence
        missing = "reports/bench.json names no served target" if not bench_target else "the features manifest names no target"
        return [warning("served_target_unchecked", {"bench_target": bench_target, "features_target": features_target},
                        f"not checked: whether the bench served the target the features came from ({missing})",
                        "dvc repro bench" if not bench_target else "dvc repro standardize")]
    keys = ("model", "revision", "architecture", "num_layers", "hidden_size", "vocab_size")
    diff = {k: {"features": features_target.get(k), "served": bench_target.get(k)} for k in keys
            if k in bench_target and features_target.get(k) != bench_target.get(k)}
    if not diff:
        return []
    return [error("served_target_differs", diff, "the bench served another target than the features were extracted from: "
                  "the draft reads hidden states of a model it never saw", "set target.model/revision once and dvc repro")]


def load_local_target(model: str, revision: str | None):
    """The target as the reference engine loads it (float32 on CPU, bf16 on CUDA)."""
    from draftlab.params import TargetParams
    from draftlab.parallel import resolve_device
    from draftlab.target.load import load_target

    device = resolve_device("auto")
    target_params = TargetParams(model=model, revision=revision, dtype="float32" if device == "cpu" else "bfloat16", device=device)
    return load_target(target_params, device)[0]


def live_parity(run: Run, check_params, served: ServedLayers, load_model=load_local_target) -> tuple[dict | None, list[Finding]]:
    """Live parity over check.live_parity_samples training sequences: a server (check.server_url) or
    in-process, capturing the layers SGLang will feed the exported draft (`served`)."""
    if check_params.live_parity_samples <= 0:
        return None, [info("live_parity_skipped", {"live_parity_samples": check_params.live_parity_samples}, "live parity is off")]
    try:
        return _live_parity(run, check_params, served, load_model)
    except UserError as e:  # no shards, no target here: the other checks still report
        if check_params.server_url:  # a server was named: not reaching it (or it not answering right) fails the check
            return None, [error("live_parity_failed", {"server_url": check_params.server_url, "reason": str(e)},
                                f"live parity against check.server_url could not run: {e}",
                                "start the server (with --enable-return-hidden-states), or set check.server_url: \"\" for "
                                "in-process parity, or check.live_parity_samples: 0")]
        return None, [warning("live_parity_failed", {"reason": str(e)}, "live parity could not run, so the live capture is unproven",
                              "make the features and the target loadable here, or set check.live_parity_samples: 0")]


def fewer_samples(result: dict | None, asked: int, where) -> list[Finding]:
    """Record in the parity result how many sequences were asked for; a warning when the features
    hold fewer (live parity then ran on all of them, never silently on fewer than the report says)."""
    if result is None:
        return []
    result["sequences_requested"] = asked
    used = len(result.get("sequences") or [])
    if used >= asked:
        return []
    return [warning("live_parity_fewer_samples", {"requested": asked, "used": used, "features": str(where)},
                    f"live parity was asked for {asked} sequences, but {where} holds {used}: it ran on those {used}",
                    f"ask for {used} or fewer (check.live_parity_samples, or --samples)")]


def _live_parity(run: Run, check_params, served: ServedLayers, load_model) -> tuple[dict | None, list[Finding]]:
    result, findings = _live_parity_run(run, check_params, served, load_model)
    return result, findings + fewer_samples(result, check_params.live_parity_samples, run.paths.features / "train")


def _live_parity_run(run: Run, check_params, served: ServedLayers, load_model) -> tuple[dict | None, list[Finding]]:
    seqs, meta = stored_sequences(run.paths.features, check_params.live_parity_samples)
    target = (run.bench or {}).get("target") or run.target
    if check_params.server_url:
        capture = http_capture(check_params.server_url, int(meta["hidden_size"]), check_params.request_timeout_s)
        try:  # every layer of the local target names what a mismatching slot really is
            reference = reference_states(load_model(target["model"], target.get("revision")))
        except (UserError, RuntimeError, KeyError):  # not loadable here (or no memory beside the server)
            reference = None
        return run_parity(seqs, meta, capture, check_params.server_url, reference), []
    if served.physical is None:
        return None, [info("live_parity_skipped", {"reason": served.refused},
                           "the exported ids cannot be captured at all (see the capture findings)")]
    model = load_model(target["model"], target.get("revision"))
    return run_parity(seqs, meta, inprocess_capture(model, served.physical), "in-process (reference engine capture path)",
                      reference_states(model), served.physical), []


@dataclass
class Diagnosis:
    findings: list[Finding]  # worst first
    parity: dict | None  # the live parity result (check.parity.run_parity), None when it did not run
    settings: dict  # key settings for the report's lineage
    run: Run

    @property
    def errors(self) -> list[Finding]:
        return errors(self.findings)


def diagnose(paths: Paths, check_params, load_model=load_local_target) -> Diagnosis:
    """Every check over the pipeline outputs under `paths`; `check_params` is the params section `check`."""
    run = load_run(paths)
    out: list[Finding] = [error("input_damaged", {"path": path}, why, "re-run the stage named above") for path, why in run.damaged]
    if out:
        return Diagnosis(out, None, {}, run)
    for name, ok, path in (("features", run.target, paths.features / "manifest.json"),
                           ("draft", run.draft, paths.draft / "config.json")):
        if not ok:
            out.append(error("input_missing", {"path": str(path)}, f"the {name} output is missing or incomplete", "dvc repro"))
    if run.target and not run.feature_physical:
        out.append(error("input_missing", {"path": str(paths.features / "train")}, "the features hold no shards", "dvc repro standardize"))
    if run.draft is not None and run.draft.layer_ids_problem:
        out.append(error("eagle_config_invalid", {"path": str(paths.draft / "config.json"), "eagle_config": run.draft.config.get("eagle_config")},
                         f"{run.draft.layer_ids_problem}: SGLang cannot read which layers to feed the draft",
                         "re-run the export stage (dvc repro export), or write a list of integer ids"))
    if out:
        return Diagnosis(out, None, {}, run)
    for name, value, path in (("synthesize", run.synth, paths.synth / "manifest.json"), ("extract", run.hidden, paths.hidden / "manifest.json"),
                              ("train", run.train_metrics, paths.train_metrics)):
        if value is None:
            out.append(error("input_missing", {"path": str(path)}, f"the {name} output is missing: the checks that read it cannot run",
                             f"dvc repro {name}"))
    if run.bench is None:
        out.append(warning("bench_not_run", {"path": str(paths.bench)}, "no bench report: served flags, template and tau are unchecked",
                           "dvc repro bench"))
    version = sglang_version(run)
    hashes = {"synth": (run.synth or {}).get("config_hash"), "extract": (run.hidden or {}).get("config_hash"),
              "features": run.features.get("config_hash"), "train": (run.train_metrics or {}).get("config_hash")}
    inputs = lambda m: (m or {}).get("inputs") or {}  # noqa: E731
    out += check_lineage(hashes, [("extract", inputs(run.hidden).get("synth"), "synth"),
                                  ("standardize", inputs(run.features).get("extract"), "extract"),
                                  ("export", inputs(run.export_manifest).get("features"), "features"),
                                  ("export", inputs(run.export_manifest).get("train"), "train")])
    # Which layers SGLang will feed the draft: worked out once, here, for every check below.
    served = served_layers(run.draft, run.target, version)
    out += check_capture(run.feature_physical, served)
    out += check_draft_shapes(run.draft, run.tensors, run.target, len(run.feature_physical), sglang_version=version)
    out += check_d2t(run.draft, run.d2t, run.training_d2t)
    serving, problems = serving_side(run.bench)
    out += problems
    if run.bench is not None:
        out += check_served_target(run.target, run.bench.get("target"))
        out += check_algorithm(run.bench, run.draft.config, run.server_log)
        out += check_flags(run.bench, _log_adjustments(run.bench))
    hidden_info = (run.hidden or {}).get("info") or {}
    synth_info = (run.synth or {}).get("info") or {}
    out += check_tokenizer(_pair(synth_info.get("chat_template_hash"), synth_info.get("tokenizer_hash")),
                           _pair(hidden_info.get("chat_template_sha256"), hidden_info.get("tokenizer_sha256")), serving)
    parity, skipped = live_parity(run, check_params, served, load_model)
    out += skipped + check_live_capture(parity, (run.stats or {}).get("norms"), check_params.parity_rtol, check_params.norm_tolerance)
    manifests = stage_manifests(run)  # read once: the tau, hardware and package checks use them
    if run.bench is not None:
        lengths = answer_lengths(run.synth, manifests["bench"])
        out += check_tau(run.train_metrics, run.bench, check_params.tau_tolerance, lengths)
    out += check_hardware(manifests, describe_hardware()) + hardware_unrecorded(manifests)  # context for a pulled run's small differences
    out += check_package_drift(manifests)  # torch / transformers / sglang releases that differ across stages
    return Diagnosis(by_severity(out), parity, settings_of(run, served, check_params), run)


def report_dict(d: Diagnosis) -> dict:
    """reports/check.json content (before lineage): strict JSON (an infinite error becomes null)."""
    counts = {s: sum(f.severity == s for f in d.findings) for s in ("error", "warning", "ok-info")}
    return finite({"ok": not d.errors, "errors": [f.name for f in d.errors], "counts": counts,
                   "findings": [f.as_dict() for f in d.findings], "parity": d.parity})


def _pair(template: str | None, tokenizer: str | None) -> dict | None:
    return {"chat_template": template, "tokenizer": tokenizer} if template or tokenizer else None


def _log_adjustments(bench: dict) -> list[tuple[str, str]]:
    from draftlab.sglang.launch import read_log

    log = bench.get("server_log")
    if log and Path(log).exists():
        return [(a.rule, a.line) for a in read_log(log).adjustments]
    return [(a["rule"], a["line"]) for a in bench.get("log_adjustments") or []]  # as the bench parsed it


def settings_of(run: Run, served: ServedLayers, check_params) -> dict:
    """The few key settings shown next to config_hash in reports/check.json."""
    eff = ((run.bench or {}).get("flags") or {}).get("effective") or {}
    target = run.target
    return {"target_model": target.get("model"), "target_revision": target.get("revision"), "architecture": target.get("architecture"),
            "trained_physical": sorted(run.feature_physical or []),
            "eagle_aux_hidden_state_layer_ids": served.draft.layer_ids, "sglang_captures": served.physical,
            "sglang_version": served.sglang_version,
            "backend": (run.bench or {}).get("backend"), "algorithm": eff.get("algorithm"), "num_steps": eff.get("num_steps"),
            "topk": eff.get("topk"), "num_draft_tokens": eff.get("num_draft_tokens"),
            "live_parity": check_params.server_url or ("in-process" if check_params.live_parity_samples > 0 else "off")}
