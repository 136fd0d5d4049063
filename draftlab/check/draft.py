"""Checks of the exported draft against the training features: capture layers, d2t, sizes, tensors.

Pure functions: the exported draft (read once, draftlab.sglang.checkpoint.ExportedDraft), the
layers SGLang will feed it (ServedLayers, worked out once) and parsed manifests/tensors in, a
list of Findings out. The layer rules are draftlab.sglang.layers' (DESIGN.md section 4); the
checkpoint contract is draftlab.sglang.checkpoint's (section 7).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from draftlab.check.findings import Finding, bounded, error, info, warning
from draftlab.check.tensors import check_draft_tensors, served_tensors
from draftlab.errors import UserError
from draftlab.features.dataset import draft_to_target
from draftlab.sglang.checkpoint import ARCHITECTURE, ExportedDraft, TensorSpecs
from draftlab.sglang.loading import LLAMA_DEFAULTS
from draftlab.sglang.layers import (EMBEDDING_CAPTURE_FROM, can_capture_embedding, embedding_failure, default_physical, dropped_ids, family,
                                    ids_for_physical)

REEXPORT = "re-run the export stage"
# How a release fails on the embedding output (draftlab.sglang.layers.embedding_failure).
EMBEDDING_FAILURE_TEXT = {"crash": "its capture loop crashes with a TypeError",
                          "alias": "the server runs, but feeds the draft an overwritten tensor in that slot, with no error"}


@dataclass(frozen=True)
class ServedLayers:
    """Which physical layers SGLang `sglang_version` will feed the exported draft on the target.

    Worked out once (served_layers) and handed to every check that needs the answer.
    """

    draft: ExportedDraft
    architecture: str
    num_layers: int
    sglang_version: str
    physical: list[int] | None  # ascending; None when SGLang cannot serve the ids (see refused)
    refused: str | None = None  # why: the ids make SGLang capture the embedding, or no rule is known


def served_layers(draft: ExportedDraft, target: dict, sglang_version: str) -> ServedLayers:
    """target: the features manifest's `info.target` (architecture, num_layers)."""
    architecture, num_layers = target["architecture"], int(target["num_layers"])
    try:
        physical, refused = draft.served_physical(architecture, num_layers, sglang_version), None
    except UserError as e:
        physical, refused = None, str(e)
    return ServedLayers(draft, architecture, num_layers, sglang_version, physical, refused)


def _expected_ids(arch: str, L: int, physical: list[int], version: str) -> list[int] | None:
    try:
        return ids_for_physical(arch, L, physical, version)
    except UserError:
        return None


def check_capture(trained_physical: list[int], served: ServedLayers, redo: str | None = None) -> list[Finding]:
    """Fault 1: the layers SGLang captures for the exported config vs the layers training used.

    trained_physical: the physical indices in the order the features concatenate them.
    redo: how to rewrite the config, for a draft this project did not export (default: re-export).
    """
    arch, L, sglang_version = served.architecture, served.num_layers, served.sglang_version
    physical = sorted(trained_physical)
    out: list[Finding] = []
    if list(trained_physical) != physical:
        out.append(error("feature_order_wrong", {"feature_physical_order": list(trained_physical), "sglang_feeds": physical},
                         "the training features concatenate the aux states out of ascending layer order; SGLang always feeds them "
                         "ascending, so the draft's fc reads each layer in another layer's slot",
                         "re-run standardize (it concatenates in ascending physical order), then train and export"))
    if 0 in physical:
        try:
            served_embedding = can_capture_embedding(arch, sglang_version)
        except UserError:  # unknown architecture: capture_rule_unknown below says so
            served_embedding = None
        since = ".".join(map(str, EMBEDDING_CAPTURE_FROM.get(arch, ()))) or None
        ev0 = {"trained_physical": physical, "architecture": arch, "sglang_version": sglang_version,
               "embedding_captured_from": since}
        if served_embedding is False:
            out.append(error("embedding_captured", {**ev0, "side": "training features"},
                             f"the draft was trained on physical layer 0, the embedding output; SGLang {sglang_version} cannot "
                             f"capture it on {arch} ({EMBEDDING_FAILURE_TEXT[embedding_failure(arch, sglang_version)]}; SGLang "
                             f"{since} and later capture it)",
                             f"serve with SGLang >= {since} (export.sglang_version: \"{since}\"), or set capture.layers to decoder "
                             f"layers 0..{L - 2} and re-run extract and everything after it"))
        elif served_embedding:
            out.append(info("embedding_served", {**ev0, "side": "training features"},
                            f"the draft was trained on the embedding output (physical 0), which SGLang {sglang_version} captures "
                            f"on {arch} (read from SGLang's source; live parity proves it on the server)"))
    if L in physical:
        out.append(error("final_state_captured", {"trained_physical": physical, "num_layers": L},
                         f"the draft was trained on physical layer {L}, the final state AFTER the norm; SGLang never captures it "
                         "(it captures pre-norm residual streams only)",
                         f"set capture.layers to decoder layers 0..{L - 2} and re-run extract and everything after it"))
    try:
        family(arch)
    except UserError as e:
        return out + [warning("capture_rule_unknown", {"architecture": arch}, str(e), "check the captured layers with live parity")]

    ids, top = served.draft.layer_ids, served.draft.top_level_ids
    exported_for = served.draft.sglang_version
    want = _expected_ids(arch, L, physical, sglang_version)
    ev = {"architecture": arch, "num_layers": L, "sglang_version": sglang_version, "exported_for_sglang": exported_for,
          "trained_physical": physical, "eagle_aux_hidden_state_layer_ids": ids, "ids_for_trained_layers": want}
    how = redo or f"{REEXPORT} with export.sglang_version: \"{sglang_version}\""
    fix = f"set eagle_config.eagle_aux_hidden_state_layer_ids: {want} in the draft's config.json ({how})"
    versions = f"the draft was exported for SGLang {exported_for} but is served by {sglang_version}; " if exported_for and exported_for != sglang_version else ""
    captured = served.physical
    if captured is None:
        return out + [error("embedding_captured", {**ev, "side": "exported config"},
                            f"{versions}these ids make SGLang capture physical 0, the embedding output ({served.refused})", fix)]
    ev["sglang_captures"] = captured

    if ids is None:
        same = captured == physical
        default = default_physical(L)
        tail = ("; that equals the trained layers today only by coincidence (the default differs across architectures)" if same
                else f", not the trained {physical}")
        if top is not None:
            out.append((warning if same else error)(
                "layer_ids_at_top_level", {**ev, "top_level_ids": top},
                f"the ids are a top-level key of config.json, which SGLang ignores; without eagle_config it silently captures "
                f"its default physical {default} for {arch}{tail}", fix))
        else:
            out.append((warning if same else error)(
                "eagle_config_missing", ev,
                f"config.json has no eagle_config.eagle_aux_hidden_state_layer_ids; SGLang silently falls back to its default "
                f"physical {default} for {arch}{tail}", fix))
        return out
    if top is not None and top != ids:
        out.append(warning("layer_ids_at_top_level", {**ev, "top_level_ids": top},
                           "a top-level eagle_aux_hidden_state_layer_ids disagrees with eagle_config's; SGLang ignores it, a reader may not",
                           "delete the top-level key"))
    if list(ids) != sorted(ids):
        out.append(info("layer_ids_unsorted", ev, "SGLang sorts the captured layers (ascending), as the features are: harmless"))

    dropped = dropped_ids(arch, L, ids, sglang_version)
    if dropped:
        valid = f" (valid ids for {arch} with {L} layers: 0..{L - 2})" if family(arch) == "llama" else ""
        out.append(error("layer_id_out_of_range", {**ev, "dropped_ids": dropped},
                         f"{versions}SGLang silently drops id(s) {dropped}: its capture loop never reaches them{valid}; it then feeds the "
                         f"draft {len(captured)} layers instead of {len(physical)} and the draft fails on width", fix))
    elif captured != physical:
        shifts = {c - p for c, p in zip(captured, physical)} if len(captured) == len(physical) else set()
        if shifts == {1}:
            cause = (f"{versions}every id is one too high: on {arch} SGLang captures physical id+1 (id k = output of decoder layer k), "
                     "so the ids were probably written as physical indices, or SGLang's default list was written out explicitly; "
                     "the draft is fed the next layer's output")
        elif shifts == {-1}:
            cause = (f"{versions}every id is one too low: the ids were probably converted from physical indices twice, or by a "
                     "rule that reads ids as physical indices (DeepSeek from SGLang 0.5.13, gpt-oss boundary mode); "
                     "the draft is fed the previous layer's output")
        else:
            cause = f"{versions}SGLang captures physical {captured} but the draft was trained on {physical}"
        name = "capture_layers_shifted" if shifts in ({1}, {-1}) else "capture_layers_mismatch"
        if 0 in captured and 0 not in physical:
            cause = (f"{versions}SGLang captures physical 0, the embedding output, where the draft was trained on "
                     f"{physical} (captures {captured}): a -1 id on {arch}, or a first id 0 read as-is")
            name = "embedding_captured"
        out.append(error(name, {**ev, "shift": shifts.pop() if len(shifts) == 1 else None}, cause, fix))
    return out


def check_d2t(draft: ExportedDraft, d2t: torch.Tensor | None, training_d2t: torch.Tensor | None = None,
              redo: str | None = None) -> list[Finding]:
    """Fault 3: SGLang maps draft ids to target ids with d2t only (target = draft + d2t[draft]).

    redo: how to rewrite the weights, for a draft this project did not export (default: re-export)."""
    V = draft.config.get("vocab_size")
    Vd = draft.config.get("draft_vocab_size") or V
    if not isinstance(V, int) or not isinstance(Vd, int) or isinstance(V, bool) or isinstance(Vd, bool):
        return [warning("d2t_unchecked", {"vocab_size": bounded(V), "draft_vocab_size": bounded(Vd), "d2t": None if d2t is None else list(d2t.shape)},
                        "not checked: d2t. config.json states no usable vocab_size / draft_vocab_size to check it against",
                        "write vocab_size (the target's) and draft_vocab_size (lm_head's rows) into config.json")]
    if d2t is not None and (d2t.ndim != 1 or d2t.dtype == torch.bool or d2t.is_floating_point() or d2t.is_complex()):
        return [error("d2t_malformed", {"shape": list(d2t.shape), "dtype": str(d2t.dtype), "draft_vocab_size": Vd},
                      f"d2t must be an integer vector of draft_vocab_size = {Vd} entries (target id minus draft id, int64); "
                      f"it is {str(d2t.dtype).replace('torch.', '')} of shape {list(d2t.shape)}, which SGLang cannot add to the draft ids",
                      f"write d2t as int64 [{Vd}] ({redo or REEXPORT})")]
    ev = {"vocab_size": V, "draft_vocab_size": Vd}
    fix = (f"export d2t (int64 [{Vd}]) from the features' draft_vocab.safetensors ({REEXPORT})" if redo is None else
           f"write d2t (int64 [{Vd}], target id minus draft id) from the trainer's vocabulary map into the weights ({redo})")
    reduced = Vd < V
    if d2t is None:
        if not reduced:
            return []
        cause = "the draft vocab is reduced but the checkpoint has no d2t: SGLang then takes draft ids as target ids"
        if training_d2t is None:
            return [error("d2t_missing", {**ev, "d2t": None}, cause + ", so every draft id i that stands for another token "
                          "than target id i is proposed as the wrong token", fix)]
        # How much that costs depends on the vocab: draft id i keeps its meaning only where d2t[i] == 0.
        # (The embedded default's draft vocab is 95% target ids 0..1023: SGLang 0.5.14 served the same
        # tau with and without d2t on the same prompts, reports/sglang-h200/.)
        misread = int((training_d2t != 0).sum())
        share = misread / max(1, len(training_d2t))
        impact = ("almost every proposal is a wrong token and acceptance collapses" if share > 0.5 else
                  "their proposals are always rejected, which costs acceptance in proportion to how often the draft proposes them")
        return [error("d2t_missing", {**ev, "d2t": None, "draft_ids_misread": misread, "draft_ids_misread_share": round(share, 4)},
                      f"{cause}: {misread} of the {len(training_d2t)} draft ids ({share:.0%}) stand for other tokens, so {impact}", fix)]
    ev["d2t_nonzero"] = int((d2t != 0).sum())
    # All zeros is right only when the draft vocab is exactly target ids 0..Vd-1 (training says so).
    if reduced and not bool(d2t.any()) and (training_d2t is None or bool(training_d2t.any())):
        cause = ("d2t is all zeros while the draft vocab is reduced: SGLang maps draft id i to target id i, "
                 "so almost every proposal is a wrong token and acceptance collapses")
        if training_d2t is None:
            return [warning("d2t_all_zeros", ev, cause + " (unless the draft vocab is exactly the first ids; no training vocab to compare)", fix)]
        return [error("d2t_all_zeros", {**ev, "training_d2t_nonzero": int((training_d2t != 0).sum())}, cause, fix)]
    targets = draft_to_target(d2t.to(torch.int64))
    if len(targets) and (int(targets.min()) < 0 or int(targets.max()) >= V):
        return [error("d2t_out_of_range", {**ev, "min_target_id": int(targets.min()), "max_target_id": int(targets.max())},
                      "d2t maps some draft ids outside the target vocab", fix)]
    if training_d2t is not None and not torch.equal(d2t.to(torch.int64), training_d2t.to(torch.int64)):
        differ = int((d2t.to(torch.int64) != training_d2t.to(torch.int64)).sum()) if d2t.shape == training_d2t.shape else None
        return [error("d2t_differs_from_training", {**ev, "entries_differing": differ, "exported": list(d2t.shape),
                                                    "training": list(training_d2t.shape)},
                      "the exported d2t is not the draft vocabulary the draft was trained with: its logits map to other tokens",
                      f"{REEXPORT} from the checkpoint trained on these features")]
    return []


def check_draft_shapes(draft: ExportedDraft, tensors: TensorSpecs, target: dict, num_aux_layers: int,
                       redo: str | None = None, sglang_version: str | None = None) -> list[Finding]:
    """Fault 4: architecture, fc width, hidden/vocab/context vs the target, and the tensor set SGLang loads.

    tensors: name -> (shape, dtype) of the exported weights, as stored; num_aux_layers: k of the
    training features; redo: how to fix a draft this project did not export (default: re-export);
    sglang_version: the release that serves it (which tensor names it loads; None: the newest rules).
    A fact missing on either side is a "not checked" finding, never silence.
    """
    redo = redo or REEXPORT
    config = draft.config
    out: list[Finding] = []
    H_t, V, ctx = target.get("hidden_size"), target.get("vocab_size"), target.get("max_position_embeddings")
    unknown = [k for k, v in (("hidden_size", H_t), ("vocab_size", V), ("max_position_embeddings", ctx)) if not v]
    if unknown:
        out.append(warning("target_facts_missing", {"missing": unknown},
                           f"not checked: the draft's {', '.join(unknown)} against the target's, which the target's config does "
                           "not state", "give a target whose config.json states them"))
    archs = config.get("architectures")
    if archs != [ARCHITECTURE]:
        out.append(error("draft_architecture_wrong", {"architectures": bounded(archs), "expected": [ARCHITECTURE]},
                         f"SGLang picks the draft class from config.json architectures; only {ARCHITECTURE} reads the aux states through fc",
                         f"set architectures: [\"{ARCHITECTURE}\"] ({redo})"))
    fc = served_tensors(tensors, sglang_version)[0].get("fc.weight")
    fc_wrong = bool(fc is not None and H_t and fc[0] and fc[0][-1] != num_aux_layers * H_t)
    if fc_wrong:
        out.append(error("fc_width_mismatch", {"fc_weight_shape": list(fc[0]), "aux_layers": num_aux_layers, "target_hidden_size": H_t,
                                               "expected_fc_in": num_aux_layers * H_t},
                         f"fc must read k x target hidden = {num_aux_layers} x {H_t} = {num_aux_layers * H_t} features, the concatenation "
                         f"SGLang feeds; it reads {fc[0][-1]}, so SGLang fails on the matmul or reads the wrong layers",
                         "retrain and export with the capture layers of the features"))
    draft_ht = config.get("target_hidden_size", config.get("hidden_size"))
    if H_t and (config.get("hidden_size") != H_t or draft_ht != H_t):
        out.append(error("draft_hidden_mismatch", {"draft_hidden_size": bounded(config.get("hidden_size")),
                                                   "draft_target_hidden_size": bounded(draft_ht), "target_hidden_size": H_t},
                         "the draft shares the target's embedding and reads its hidden states, so its hidden size must equal the target's",
                         "train the draft against this target"))
    if V and config.get("vocab_size") != V:
        out.append(error("draft_vocab_mismatch", {"draft_vocab_size_config": bounded(config.get("vocab_size")), "target_vocab_size": V},
                         "config.json vocab_size must be the target's vocab (t2d length, shared embedding rows)",
                         "train and export the draft against this target"))
    # transformers' LlamaConfig default when the key is absent, as SGLang reads it
    draft_ctx = config.get("max_position_embeddings", LLAMA_DEFAULTS["max_position_embeddings"])
    if ctx and not (isinstance(draft_ctx, int) and not isinstance(draft_ctx, bool) and draft_ctx >= ctx):
        out.append(error("draft_context_shorter", {"draft_max_position_embeddings": bounded(draft_ctx), "target_context": ctx,
                                                   "stated": "max_position_embeddings" in config},
                         "SGLang refuses a draft whose max_position_embeddings is below the target's context (ValueError) unless "
                         "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1, which then overrides it"
                         + ("" if "max_position_embeddings" in config else
                            f" (config.json has none: transformers' LlamaConfig default {draft_ctx} applies)"),
                         f"export with max_position_embeddings >= {ctx} ({redo})"))
    fix = (f"{REEXPORT}; it checks the full name/shape/dtype set" if redo == REEXPORT else
           f"give every tensor listed SGLang's name and shape ({redo})")
    return out + check_draft_tensors(draft, tensors, num_aux_layers, sglang_version, redo, fix, fc_wrong)
