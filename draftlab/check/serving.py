"""Checks of how the draft was served: algorithm, flags, chat template/tokenizer, the tau triangle.

Pure functions over parsed reports/bench.json, manifests, server-log lines and hashes; each
returns a list of Findings (DESIGN.md sections 8-9 state the facts they check).
"""
from __future__ import annotations

import math
import re

from draftlab.check.findings import Finding, bounded, error, info, warning
from draftlab.sglang.flags import SPEC_KEYS

# SGLang prints its resolved ServerArgs at start-up ("speculative_algorithm='EAGLE'"); a logged
# command line reads "--speculative-algorithm EAGLE".
_ALGORITHM_IN_LOG = re.compile(r"speculative[_-]algorithm['\"]?(?:\s*[=:]\s*|\s+)['\"]?([A-Za-z0-9_]+)")


def _flags(bench: dict, which: str) -> dict:
    return ((bench or {}).get("flags") or {}).get(which) or {}


def check_algorithm(bench: dict | None, draft_config: dict, server_log: str | None = None) -> list[Finding]:
    """Fault 2: an EAGLE-3 draft served with --speculative-algorithm EAGLE (runs, skips fc, tau ~1).

    draft_config: the exported draft's config.json (ExportedDraft.config)."""
    arch = (draft_config.get("architectures") or [""])[0]
    if not arch.endswith("Eagle3"):
        return []
    seen = {}
    for which in ("requested", "effective", "served"):
        if _flags(bench, which).get("algorithm") == "EAGLE":
            seen[f"bench.json flags.{which}.algorithm"] = "EAGLE"
    logged = sorted(set(_ALGORITHM_IN_LOG.findall(server_log or "")))
    if "EAGLE" in logged:
        seen["server log"] = "speculative_algorithm=EAGLE"
    if not seen:
        return []
    return [error("eagle_instead_of_eagle3", {"draft_architecture": arch, **seen},
                  "the draft is an EAGLE-3 checkpoint but the server runs EAGLE: it starts without error, skips fc (the draft "
                  "is fed one hidden state instead of the aux layers) and acceptance collapses (SGLang 0.5.14 served "
                  "the embedded default at tau 1.6 instead of 3.3); SGLang never infers EAGLE3 from the checkpoint",
                  "set spec.algorithm: EAGLE3 (--speculative-algorithm EAGLE3)")]


def check_flags(bench: dict, log_adjustments: list[tuple[str, str]] = ()) -> list[Finding]:
    """Fault 7: each flag SGLang changes or fills in, from bench.json and the server log's own lines.

    log_adjustments: (rule, line) pairs, e.g. from draftlab.sglang.launch.read_log(path).adjustments.
    """
    req, eff = _flags(bench, "requested"), _flags(bench, "effective")
    flags = (bench or {}).get("flags") or {}
    if not req and not eff:  # said, not skipped in silence
        return [warning("flags_not_checked", {"flags": bounded(flags)},
                        "not checked: the speculative flags SGLang ran (reports/bench.json holds no flags.requested / flags.effective)",
                        "dvc repro bench")]
    changed = {k: {"requested": req[k], "effective": eff[k]} for k in req if k in eff and req[k] != eff[k]}
    listed = flags.get("findings") or flags.get("adjustments") or []  # findings: every rule that fired, defaults included
    out: list[Finding] = []
    for a in listed:
        ev = {"rule": a.get("rule"), "what": a.get("what"), "on_adjust": flags.get("on_adjust"), "changed": changed}
        fix = a.get("fix") or ""
        if a.get("kind") == "adjusted":
            out.append(warning("flag_adjusted", ev, f"SGLang does not run the flags as requested: {a.get('what')}; the bench "
                               "figures belong to the effective flags", fix))
        elif a.get("kind") == "error":
            out.append(error("flag_error", ev, f"SGLang refuses or breaks on these flags: {a.get('what')}", fix))
        else:
            out.append(info("flag_default", ev, f"SGLang fills in an unset flag: {a.get('what')}", fix))
    kinds = {a.get("kind") for a in listed}
    surprising = {k: v for k, v in changed.items() if v["requested"] is not None}
    if surprising and "adjusted" not in kinds:
        out.append(warning("flag_adjusted", {"changed": surprising},
                           "requested and effective flags differ but the bench lists no adjustment for it",
                           "set the spec.* flags to the effective values"))
    served = _flags(bench, "served")
    differ = {k: {"effective": eff.get(k), "served": served[k]} for k in SPEC_KEYS
              if served.get(k) is not None and eff.get(k) is not None and served[k] != eff[k]}
    if differ:
        out.append(warning("served_flags_differ", {"flags": differ, "source": "the server's /server_info"},
                           "the server runs other speculative flags than params.yaml describes: the figures belong to the "
                           "server's flags, and the train-predicted tau to neither", "start the server with the spec.* flags, or set them to what it runs"))
    known = {a.get("rule") for a in listed}
    for rule, line in log_adjustments:
        if rule not in known:
            out.append(error("flag_adjusted", {"rule": rule, "server_log_line": line, "source": "server log"},
                             "the server log shows SGLang changing a flag that the bench did not predict: the reported "
                             "requested/effective flags are not what ran", f"set the flag so that rule {rule} does not fire"))
    return out


def check_tokenizer(synth: dict | None, extraction: dict | None, serving: dict | None) -> list[Finding]:
    """Fault 5: chat template or tokenizer differing between synthesis, extraction and serving.

    Each argument: {"chat_template": hash, "tokenizer": hash} of one side, or None when unknown.
    """
    sides = {k: v for k, v in (("synthesis", synth), ("extraction", extraction), ("serving", serving)) if v}
    out: list[Finding] = []
    for what, name in (("chat_template", "chat_template_differs"), ("tokenizer", "tokenizer_differs")):
        hashes = {side: v.get(what) for side, v in sides.items() if v.get(what)}
        if len(set(hashes.values())) <= 1:
            continue
        groups: dict[str, list[str]] = {}
        for side, h in hashes.items():
            groups.setdefault(h, []).append(side)
        majority = max(groups.values(), key=len)
        odd = [s for s in hashes if s not in majority] if len(majority) > 1 else list(hashes)
        word = "chat template" if what == "chat_template" else "tokenizer"
        out.append(error(name, {"sha256": {s: h[:16] for s, h in hashes.items()}, "differs": odd},
                         f"the {word} of {', '.join(odd)} differs from the others: the draft learned token sequences that "
                         "serving renders differently, so its proposals miss",
                         "synthesize, extract and serve with the same target tokenizer and chat template (dvc repro after changing it)"))
    missing = [s for s in ("synthesis", "extraction", "serving") if s not in sides]
    if missing:
        out.append(info("tokenizer_side_unknown", {"unknown": missing}, f"no template/tokenizer hashes for {', '.join(missing)}"))
    return out


def by_steps(train_metrics: dict, key: str) -> dict[int, float]:
    """A metrics.json figure per draft depth ({"steps_3": 2.6} -> {3: 2.6})."""
    return {int(k.split("_")[-1]): v for k, v in (train_metrics.get(key) or {}).items()}


def predicted_tau(train_metrics: dict, num_steps: int | None) -> tuple[float | None, int | None]:
    """(train-predicted chain tau at `num_steps` draft steps, steps it covers) from reports/train/metrics.json."""
    taus = by_steps(train_metrics, "tau_by_steps")
    trained = max(taus, default=None)
    if num_steps and taus:
        n = min(num_steps, trained)
        return taus.get(n), n
    return train_metrics.get("tau_pred"), trained


def first_turns(train_metrics: dict, num_steps: int | None, bench: dict) -> dict | None:
    """The eval split's first answers against the bench's first turns, when that explains a gap:
    {first_turns_decoded (greedy decoding replayed over each eval conversation's first answer, at
    the served depth), later_turns_share (the eval's scored tokens past the first turn)}; None when
    the eval has no later turns, the metrics lack the figure, or the bench's headline set asks more
    than one turn (then offline answers later turns too)."""
    decoded = by_steps(train_metrics, "tau_decoded_first_turns_by_steps")
    turns = train_metrics.get("step1_by_turn") or {}
    sets = (bench or {}).get("prompt_sets") or [{}]
    if not decoded or not num_steps or sets[0].get("turns") != 1:
        return None
    total = sum(c.get("tokens") or 0 for c in turns.values())
    later = sum(c.get("tokens") or 0 for k, c in turns.items() if k != "1")
    first = _num(decoded.get(min(num_steps, max(decoded))))
    if not total or not later or first is None:
        return None
    return {"first_turns_decoded": round(first, 4), "later_turns_share": round(later / total, 4)}


def _num(x) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) else None


def answer_lengths(synth_manifest: dict | None, bench_manifest: dict | None) -> dict | None:
    """How long the answers trained on ran against how long the bench's run: {synth_max_new_tokens,
    answers_cut_share (answers that stopped at that cap), bench_max_new_tokens}, or None if unknown."""
    synth = synth_manifest or {}
    cap = ((synth.get("params") or {}).get("synth") or {}).get("max_new_tokens")
    bench_cap = (((bench_manifest or {}).get("params") or {}).get("bench") or {}).get("max_new_tokens")
    info = synth.get("info") or {}
    every = isinstance(info.get("answer_finish_reasons"), dict)  # of every answer, every turn of every row
    reasons = info["answer_finish_reasons"] if every else info.get("finish_reasons") or {}  # else each row's last answer's
    total = sum(v for v in reasons.values() if isinstance(v, int))
    # A manifest without answer_finish_reasons was written when a cut answer ended its conversation, so
    # the answers before each last one all stopped: the share is of every answer (turns_answered).
    turns = info.get("turns_answered")
    if not every and isinstance(turns, int) and not isinstance(turns, bool) and turns >= total:
        total = turns
    if not cap or not bench_cap or not total:
        return None
    return {"synth_max_new_tokens": cap, "answers_cut_share": round(reasons.get("length", 0) / total, 3),
            "bench_max_new_tokens": bench_cap}


# Teacher-forced eval over answers much longer than the bench's counts their tails; a small model's
# greedy tails are often loops, which a draft predicts easily (reports/real-workload).
LONGER_ANSWERS = 1.5  # synth cap / bench cap above which the lengths are named
CUT_SHARE = 0.25  # share of answers stopped at the synth cap above which the lengths are named
TRAIN_GAP_FIX = "compare eval and bench prompts; check the d2t/tensor findings; train on more data"


def check_tau(train_metrics: dict | None, bench: dict, tolerance: float, lengths: dict | None = None) -> list[Finding]:
    """Fault 8: train-predicted vs offline vs served tau, relative tolerance; names the broken link.

    lengths: answer_lengths(...); when training's answers ran much longer than the bench's and many
    stopped at the cap, the train -> offline finding names that first."""
    eff = _flags(bench, "effective")
    steps, topk = eff.get("num_steps"), eff.get("topk")
    pred, covered = predicted_tau(train_metrics or {}, steps)
    pred = _num(pred)
    offline = _num(((bench or {}).get("offline") or {}).get("tau"))
    served = _num(((bench or {}).get("spec") or {}).get("tau"))
    ev = {"train_predicted": pred, "offline": offline, "served": served, "num_steps": steps, "topk": topk,
          "train_steps_covered": covered, "tolerance": tolerance}
    tree = topk is not None and topk > 1  # a tree accepts more than the chain the prediction models
    links = [("train", pred, "offline", offline), ("offline", offline, "served", served)]
    if offline is None:
        links = [("train", pred, "served", served)]
    out: list[Finding] = []
    skipped = []  # links a missing (or non-positive) tau leaves unchecked: said, never silent
    for up_name, up, down_name, down in links:
        if up is None or down is None or up <= 0:
            skipped.append(f"{up_name} -> {down_name} ({up_name} {'unknown' if up is None else up}, "
                           f"{down_name} {'unknown' if down is None else down})")
            continue
        gap = (down - up) / up
        if abs(gap) <= tolerance or (gap > 0 and (tree or up_name == "train")):
            continue  # above a chain prediction is no fault: a tree accepts more, and so may easy bench prompts
        e = {**ev, "link": f"{up_name} -> {down_name}", "relative_gap": round(gap, 4)}
        name = f"tau_{up_name}_vs_{down_name}"
        if gap > 0:
            out.append(warning(name, e, f"{down_name} tau is {gap:.0%} above {up_name} tau: they did not run the same prompts or flags",
                               "run offline and served with the same prompts, flags and sampling"))
        elif up_name == "train" and down_name == "offline" and (mix := first_turns(train_metrics or {}, steps, bench)) \
                and abs(down - mix["first_turns_decoded"]) <= tolerance * mix["first_turns_decoded"]:
            # Measured, not guessed: the eval split's first answers alone decode as the bench's first turns did.
            out.append(info(name, {**e, **mix},
                            f"offline tau is {-gap:.0%} below what training predicted over the eval split, whose answers are every "
                            f"turn of its conversations ({mix['later_turns_share']:.0%} of its tokens after the first turn); over "
                            f"each conversation's first answer alone, the bench's kind of prompt, decoding replayed gives "
                            f"{mix['first_turns_decoded']:.2f}, within {tolerance:.0%} of offline {down:.2f}: the prompts differ, "
                            "not the draft or its export",
                            "read reports/train/metrics.json's tau_decoded_first_turns_by_steps as the forecast for first-turn "
                            "prompts; bench later turns too (bench.prompts: mt-bench) to see the rest"))
        elif up_name == "train" and down_name == "offline":
            causes = ("the draft overfits or the eval split differs from the bench prompts, or the exported draft/loader "
                      "differs from the trained one")
            cause, fix = f"offline tau is below what training predicted: {causes}", TRAIN_GAP_FIX
            if lengths and lengths["synth_max_new_tokens"] >= LONGER_ANSWERS * lengths["bench_max_new_tokens"] \
                    and lengths["answers_cut_share"] >= CUT_SHARE:
                e = {**e, **lengths}
                cause = (f"offline tau is below what training predicted, and training's eval answers ran to "
                         f"synth.max_new_tokens={lengths['synth_max_new_tokens']} ({lengths['answers_cut_share']:.0%} stopped "
                         f"there) while the bench generates {lengths['bench_max_new_tokens']}: teacher-forced acceptance counts "
                         f"those long tails (a greedy small model often loops in them), which the bench never reaches; "
                         f"otherwise: {causes}")
                fix = ("compare like with like: bench.max_new_tokens up to synth.max_new_tokens, or synthesize answers no "
                       f"longer than the bench's; then {TRAIN_GAP_FIX}")
            out.append(warning(name, e, cause, fix))
        else:
            out.append(error(name, e, f"{down_name} tau is {-gap:.0%} below {up_name} tau: the server is "
                             "fed differently than training (capture layers, eagle_config, algorithm, d2t, chat template, dtype)",
                             "see the other findings; run live parity against the server (check.server_url)"))
    if not out and not skipped:
        out.append(info("tau_consistent", ev, "train-predicted, offline and served tau agree within the tolerance"))
    if skipped:
        out.append((warning if len(skipped) == len(links) else info)(
            "tau_not_checked", {**ev, "links": skipped},
            f"not checked: tau link(s) {'; '.join(skipped)}: a tau is missing from reports/train/metrics.json "
            "(tau_pred, tau_by_steps) or reports/bench.json (offline.tau, spec.tau)",
            "re-run the stage whose report lacks it (dvc repro train, dvc repro bench)"))
    if steps and covered and steps > covered:
        out.append(info("tau_steps_beyond_training", ev, f"serving drafts {steps} steps, training unrolled {covered}: "
                        "the prediction covers the first steps only"))
    return out


def check_lineage(hashes: dict[str, str | None], links: list[tuple[str, str | None, str]]) -> list[Finding]:
    """Outputs that do not come from each other: (downstream, the upstream hash it recorded, upstream)."""
    out, unknown = [], []
    for down, recorded, up in links:
        actual = hashes.get(up)
        if not recorded or not actual:  # a manifest without the hash: said below, not passed in silence
            unknown.append(f"{down} <- {up}")
        elif recorded != actual:
            out.append(warning("stale_outputs", {"stage": down, "recorded_input": recorded[:16], "input": up, "current": actual[:16]},
                               f"{down} was built from another {up} run than the one on disk; their figures do not belong together",
                               "dvc repro"))
    if unknown:
        out.append(info("lineage_not_checked", {"links": unknown},
                        f"not checked: whether {', '.join(unknown)} come from each other (a manifest lacks the config hash "
                        "or the input hash it recorded)", "dvc repro --force the stages named, to record them"))
    return out
