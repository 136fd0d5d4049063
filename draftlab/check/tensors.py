"""What a draft folder is, tensor by tensor: an EAGLE-3 draft SGLang loads whole, or not.

check_draft_tensors reads the draft's config.json (as transformers 4 or 5 wrote it: `torch_dtype`
or `dtype`) and the names, shapes and dtypes of its tensors, and names each tensor SGLang would
leave random (missing), drop (unexpected), or fail on (another shape), plus what the folder is when
it is no draft at all (a whole target model). What SGLang loads, release by release, is
draftlab.sglang.loading's; the tensor contract is draftlab.sglang.checkpoint's.
"""
from __future__ import annotations

from draftlab.check.findings import Finding, bounded, error, info, warning
from draftlab.dtypes import TORCH_DTYPES
from draftlab.errors import UserError, shown
from draftlab.sglang.checkpoint import ARCHITECTURE, ExportedDraft, TensorSpecs, expected_tensors, tensor_problems
from draftlab.sglang.layers import VERIFIED_VERSIONS
from draftlab.sglang.loading import (LAYERS_NAMED_FROM, LLAMA_DEFAULTS, SHARED, config_dtype, decoder_layers, layers_named,
                                     served_name, variants_read)

MAX_PROBLEMS = 40  # tensor problems listed in one finding's evidence (a whole model has hundreds)
SINCE = ".".join(map(str, LAYERS_NAMED_FROM))


def served_tensors(tensors: TensorSpecs, version: str | None) -> tuple[TensorSpecs, list[str]]:
    """The tensors under the names SGLang `version` loads them as (draftlab.sglang.loading.served_name),
    and a problem for each pair of stored names SGLang loads into one parameter (the later one wins)."""
    out, clashes, source = {}, [], {}
    for name, spec in tensors.items():
        served = served_name(name, version)
        if served in out:
            clashes.append(f"{source[served]} and {name} both load into {served} (SGLang keeps whichever it reads last)")
            continue
        out[served], source[served] = spec, name
    return out, clashes


def _layer_count(config: dict) -> tuple[object, bool]:
    """(num_hidden_layers as SGLang reads it, whether config.json states it)."""
    if "num_hidden_layers" in config:
        return config["num_hidden_layers"], True
    return LLAMA_DEFAULTS["num_hidden_layers"], False


def _dtype_findings(config: dict) -> tuple[list[Finding], object]:
    """(findings about the dtype keys, the torch dtype the float weights should have or None)."""
    key, name = config_dtype(config)
    both = {k: config.get(k) for k in ("torch_dtype", "dtype") if config.get(k) is not None}
    if key is None:
        return [warning("draft_dtype_missing", {"torch_dtype": None, "dtype": None},
                        "not checked: the weights' dtype. config.json has neither dtype (transformers 5) nor torch_dtype "
                        "(transformers 4); tensor names and shapes are checked all the same",
                        "write the dtype the weights are stored in, e.g. \"dtype\": \"bfloat16\"")], None
    out = []
    if len(both) == 2 and both["torch_dtype"] != both["dtype"]:
        out.append(warning("draft_dtype_conflict", {k: bounded(v) for k, v in both.items()}, f"config.json has torch_dtype {shown(both['torch_dtype'])} and dtype "
                           f"{shown(both['dtype'])}; transformers 5 reads dtype, transformers 4 torch_dtype",
                           "keep one key, with the dtype the weights are stored in"))
    dtype = TORCH_DTYPES.get(name) if isinstance(name, str) else None
    if dtype is None:
        out.append(warning("draft_dtype_unknown", {key: bounded(name)},
                           f"not checked: the weights' dtype. config.json {key} is {shown(name)}, not one of "
                           f"{', '.join(TORCH_DTYPES)}; tensor names and shapes are checked all the same",
                           f"set {key} to the dtype the weights are stored in"))
    return out, dtype


def _head(config: dict, served: TensorSpecs, redo: str) -> tuple[list[Finding], bool]:
    """(findings about lm_head, whether SGLang loads the draft's own lm_head.weight)."""
    has = "lm_head.weight" in served
    if config.get("tie_word_embeddings") is True:
        if has:
            return [error("draft_head_dropped", {"tie_word_embeddings": True},
                          "config.json sets tie_word_embeddings: true, so SGLang serves the draft with the target's embedding "
                          "as its lm_head and drops the trained lm_head.weight without a word",
                          f"set tie_word_embeddings: false ({redo})")], False
        return [info("draft_head_from_target", {"tie_word_embeddings": True},
                     "tie_word_embeddings: true: the draft's lm_head is the target's embedding (no lm_head.weight)")], False
    if "draft_vocab_size" not in config:
        return [error("draft_vocab_size_missing", {"draft_vocab_size": "absent"},
                      "config.json has no draft_vocab_size: SGLang's LlamaForCausalLMEagle3 reads config.draft_vocab_size, "
                      "which transformers' LlamaConfig has no default for, so loading the draft fails (AttributeError)",
                      f"write draft_vocab_size: the rows of lm_head.weight ({redo})")], has
    if config["draft_vocab_size"] is None:
        if has:
            return [error("draft_head_replaced", {"draft_vocab_size": None},
                          "config.json has draft_vocab_size: null, so SGLang serves the target's lm_head in place of the "
                          "draft's lm_head.weight, without a word",
                          f"write draft_vocab_size: the rows of lm_head.weight ({redo})")], False
        return [info("draft_head_from_target", {"draft_vocab_size": None},
                     "draft_vocab_size: null and no lm_head.weight: SGLang serves the target's lm_head")], False
    return [], True


def _layers(config: dict, stored: TensorSpecs, version: str | None, redo: str) -> tuple[list[Finding], set[int]]:
    """(findings about the decoder layer count, the layer indices beyond the first that this check leaves out)."""
    count, stated = _layer_count(config)
    where = (f"config.json num_hidden_layers is {shown(count)}" if stated else
             f"config.json has no num_hidden_layers, so SGLang takes transformers' LlamaConfig default of {count}")
    if count == 1:
        return [], set()
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        return [error("draft_layer_count", {"num_hidden_layers": bounded(count)},
                      f"{where}: not a number of decoder layers SGLang can build", f"write num_hidden_layers: 1 ({redo})")], set()
    if not layers_named(version):
        return [error("draft_layer_count", {"num_hidden_layers": count, "stated": stated, "sglang_version": version},
                      f"{where}; SGLang {version} refuses any other count than 1 (ValueError: EAGLE3 currently only "
                      f"supports 1 layer; more layers load from SGLang {SINCE} on)",
                      f"write num_hidden_layers: 1 for a one-layer draft ({redo}), or serve with SGLang >= {SINCE}")], set()
    held = set(decoder_layers(stored)) | ({0} if any(n.startswith(("midlayer.", "model.midlayer.")) for n in stored) else set())
    lacking = [i for i in range(count) if i not in held]
    if lacking:
        return [error("draft_layer_count", {"num_hidden_layers": count, "stated": stated, "layers_in_weights": sorted(held),
                                            "lacking": lacking[:16]},
                      f"{where}: SGLang {version or VERIFIED_VERSIONS[-1]} builds {count} decoder layers, and the weights hold "
                      f"{len(held)} of them; the other {len(lacking)} stay randomly initialised, without any error",
                      f"write num_hidden_layers: {max(len(held), 1)} ({redo})")], set(range(1, count))
    return [warning("draft_layers_unchecked", {"num_hidden_layers": count, "checked": [0], "not_checked": list(range(1, count))},
                    f"not checked: decoder layers 1..{count - 1}. This check knows the tensors of EAGLE-3's one draft layer; "
                    f"SGLang {version or VERIFIED_VERSIONS[-1]} builds all {count} and the weights hold them",
                    "check the served acceptance against training before use")], set(range(1, count))


def _is_extra_layer(name: str, extra: set[int]) -> bool:
    return any(i in extra for i in decoder_layers([name]))


def not_a_draft(config: dict, stored: TensorSpecs, served: TensorSpecs) -> Finding | None:
    """The folder holds a whole model (many decoder layers, no fc): a target, not an EAGLE-3 draft."""
    count, _ = _layer_count(config)
    layers = decoder_layers(stored)
    many = len(layers) > 1 or (isinstance(count, int) and not isinstance(count, bool) and count > 1)
    if "fc.weight" in served or not many:
        return None
    return error("not_an_eagle3_draft",
                 {"architectures": bounded(config.get("architectures")), "num_hidden_layers": bounded(count),
                  "decoder_layers_in_weights": len(layers), "fc_weight": None, "tensors": len(stored)},
                 f"a target model, not an EAGLE-3 draft: the weights hold {len(layers)} decoder layers and no fc.weight "
                 f"(an EAGLE-3 draft is one decoder layer fed through fc by the target's hidden states), whatever its "
                 f"config.json says ({shown(config.get('architectures'))})",
                 "give the folder the draft's trainer exported (config.json with architectures "
                 f"[\"{ARCHITECTURE}\"], fc.weight, midlayer.*, norm, lm_head, d2t); the model it drafts for goes to --target")


def check_draft_tensors(draft: ExportedDraft, tensors: TensorSpecs, num_aux_layers: int, version: str | None,
                        redo: str, mismatch_fix: str, fc_checked: bool) -> list[Finding]:
    """Every tensor SGLang `version` would load into the draft, against config.json.

    tensors: name -> (shape, dtype) as stored; redo: how to fix the draft; mismatch_fix: what to do
    about wrong tensors; fc_checked: fc.weight's width was already named wrong (fc_width_mismatch),
    so it is left out here."""
    config = draft.config
    served, clashes = served_tensors(tensors, version)
    target_like = not_a_draft(config, tensors, served)
    out = [target_like] if target_like else []
    dtype_findings, dtype = _dtype_findings(config)
    out += dtype_findings
    layer_findings, extra_layers = _layers(config, tensors, version, redo) if not target_like else ([], set())
    out += layer_findings
    if "fc.weight" not in served and not target_like:
        out.append(error("fc_missing", {"fc_weight": None, "tensors": sorted(served)[:MAX_PROBLEMS]},
                         "the weights have no fc.weight: SGLang's LlamaForCausalLMEagle3 keeps its fc randomly initialised "
                         "and projects the target's hidden states through noise, without any error",
                         f"export the trained fc.weight ({redo})"))
    try:
        cfg = draft.draft_config(num_aux_layers)
    except UserError as e:
        return out + [error("draft_config_incomplete", {"problem": str(e)},
                            f"not checked: tensor names and shapes. {e}: SGLang builds the draft from these sizes, so it "
                            "fails on the weights or leaves them wrongly shaped", f"write the missing sizes ({redo})")]
    head_findings, own_head = _head(config, served, redo)
    out += head_findings
    expected = expected_tensors(cfg, dtype)
    if fc_checked or "fc.weight" not in served:  # its width has a finding, or its absence has
        expected.pop("fc.weight")
    if "d2t" not in served:
        expected.pop("d2t")  # check_d2t says what a missing d2t costs
    if not own_head:
        expected.pop("lm_head.weight")
        served = {k: v for k, v in served.items() if k != "lm_head.weight"}
    read = variants_read(config, version)
    if "fc_norm" in read:
        expected |= {f"fc_norm.{i}.weight": ((cfg.target_hidden_size,), dtype) for i in range(cfg.num_aux_layers)}
    if "norm_before_fc" in read:
        expected["input_norm.weight"] = ((cfg.num_aux_layers * cfg.target_hidden_size,), dtype)
    # The target's embedding replaces the draft's own; variant norms a release ignores have a finding of their own.
    found = {k: v for k, v in served.items() if k != SHARED and not _is_extra_layer(k, extra_layers)
             and not (k.startswith("fc_norm.") and "fc_norm" not in read) and not (k == "input_norm.weight" and "norm_before_fc" not in read)}
    problems = clashes + tensor_problems(found, expected)
    if problems:
        stale = [n for n in tensors if n.startswith(("layers.0.", "model.layers.0.")) and not layers_named(version)]
        names_note = (f" SGLang {version} loads the draft layer from midlayer.* only: its {len(stale)} layers.0.* tensor(s) are "
                      f"dropped (layers.0.* loads from SGLang {SINCE} on)." if stale else "")
        listed = "; ".join(problems[:4]) + (f"; and {len(problems) - 4} more (evidence)" if len(problems) > 4 else "")
        out.append(error("draft_tensors_mismatch", {"problems": problems[:MAX_PROBLEMS], "problems_total": len(problems)},
                         f"{listed}. SGLang loads tensors by name and shape; a missing or renamed one stays randomly initialised "
                         f"without any error, one of another shape fails the load.{names_note}",
                         mismatch_fix))
    return out
