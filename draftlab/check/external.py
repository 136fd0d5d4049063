"""A verdict on an EAGLE-3 draft made anywhere: this project's export, SpecForge, vLLM's speculators.

    python -m draftlab.check draft PATH --target MODEL [--sglang-version V] [--server URL] [--features DIR] [--json OUT]

PATH is a checkpoint directory: config.json plus model.safetensors (or safetensors shards with
model.safetensors.index.json). The layouts recognised, read from their writers' source:

  draftlab     this project's export (config.json carries a "draftlab" block with the layers)
  sglang       SGLang's own layout, as SpecForge's exporter writes it (specforge/export/to_sglang.py:
               LlamaForCausalLMEagle3, midlayer.* / fc / norm / lm_head / d2t / t2d, embeddings
               dropped; the config is the training draft config, often without eagle_config)
  speculators  vLLM speculators' Eagle3SpeculatorConfig (speculators_model_type "eagle3", sizes under
               transformer_layer_config, top-level eagle_aux_hidden_state_layer_ids that its
               converter leaves null unless given; weights layers.0.*, often embed_tokens.weight)

The checks are check.draft's (the same findings the pipeline's check stage reports), applied to
the config as SGLang reads it; this module adds what only a foreign layout gets wrong. Which
layers the draft was trained on comes from --features when given, else from what the layout
itself implies (a finding says which), so only --features or --server proves it.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from draftlab.check.draft import ServedLayers, check_capture, check_d2t, check_draft_shapes, served_layers
from draftlab.check.findings import ERROR, INFO, WARNING, Finding, bounded, by_severity, error, errors, finite, info, warning
from draftlab.dtypes import TORCH_DTYPES
from draftlab.errors import UserError, clip, shown
from draftlab.features.dataset import draft_to_target
from draftlab.sglang.checkpoint import ARCHITECTURE, WEIGHTS, ExportedDraft, TensorSpecs, tensor_specs
from draftlab.sglang.layers import VERIFIED_VERSIONS, default_physical, ids_for_physical, parse_version, physical_from_user_layers
from draftlab.sglang.loading import LAYERS_NAMED_FROM, VARIANT_READ_FROM, config_dtype

INDEX = "model.safetensors.index.json"
SPECULATORS_RENAMES = {"layers.0.": "midlayer."}  # speculators' name -> SGLang's (LlamaForCausalLMEagle3.midlayer)
NOT_SERVED = ("embed_tokens.weight",)  # SGLang shares the target's embedding; a draft copy is not what it serves
# Config switches that change the draft's function. SGLang's LlamaForCausalLMEagle3 (llama_eagle3.py, read
# from source) computes the plain EAGLE-3 layer in 0.5.5 and reads none of them; later releases read some
# (draftlab.sglang.loading.VARIANT_READ_FROM: the first release whose llama_eagle3.py reads the flag).
VARIANT_FLAGS = {
    "norm_before_residual": "hidden_norm applied before the residual is stored (speculators)",
    "norm_before_fc": "one RMSNorm over the concatenated aux states before fc (speculators, gpt-oss style)",
    "fc_norm": "an RMSNorm per aux state before fc (speculators, SpecForge)",
}
SPECULATORS_ONLY_FLAGS = {"norm_output": "post-norm states fed back across steps (speculators' Eagle 3.1)"}
REDO = "edit the checkpoint, or export it again from the tool that trained it"


@dataclass
class ForeignDraft:
    """A checkpoint directory read once: its layout, its config as written and as SGLang reads it,
    and its tensors under the names SGLang loads."""

    path: Path
    layout: str  # draftlab | sglang | speculators
    config: dict  # config.json as written
    draft: ExportedDraft  # the config as SGLang reads it (speculators: sizes lifted to the top level)
    files: list[Path]  # the safetensors files holding the weights
    tensors: TensorSpecs  # name -> (shape, dtype), speculators' names renamed to SGLang's
    renamed: dict[str, str] = field(default_factory=dict)  # speculators' name -> SGLang's
    not_served: list[str] = field(default_factory=list)  # tensors SGLang does not serve (the draft's own embedding)

    def tensor(self, name: str) -> torch.Tensor | None:
        """One tensor by its SGLang name, from whichever file holds it."""
        stored = {v: k for k, v in self.renamed.items()}.get(name, name)
        for f in self.files:
            with safe_open(str(f), "pt") as st:
                names = st.keys()  # a safe_open handle has no `in`
                if stored in names:
                    return st.get_tensor(stored)
        return None


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint: the index's shards, model.safetensors, or every *.safetensors."""
    index = path / INDEX
    if index.exists():
        try:
            names = sorted(set(json.loads(index.read_bytes())["weight_map"].values()))
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, AttributeError, TypeError, RecursionError, OSError) as e:
            raise UserError(f"{index}: not a safetensors index (no weight_map: {clip(str(e) or type(e).__name__)}); "
                            "fix or delete it") from None
        if not all(isinstance(n, str) for n in names):
            raise UserError(f"{index}: weight_map values must be shard file names; fix or delete it")
        missing = [n for n in names if not (path / n).exists()]
        if missing:
            raise UserError(f"{index} names shard(s) {missing} that are not in {path}; copy the whole checkpoint")
        return [path / n for n in names]
    if (path / WEIGHTS).exists():
        return [path / WEIGHTS]
    files = sorted(path.glob("*.safetensors"))
    if files:
        return files
    if any(path.glob("*.bin")) or any(path.glob("*.pt")):
        raise UserError(f"{path} holds only PyTorch .bin/.pt weights; this check reads safetensors: save the draft with "
                        "safe_serialization=True (or convert the .bin with safetensors.torch.save_file) and run it again")
    raise UserError(f"{path} has no weights (no {WEIGHTS}, no {INDEX}, no *.safetensors)")


def layout_of(config: dict, config_path: Path) -> str:
    if "speculators_model_type" in config:
        kind = config["speculators_model_type"]
        if kind != "eagle3":
            raise UserError(f"{config_path}: speculators_model_type is {kind!r}; this check knows EAGLE-3 drafts only (\"eagle3\")")
        return "speculators"
    return "draftlab" if isinstance(config.get("draftlab"), dict) else "sglang"


def sglang_view(config: dict, layout: str) -> dict:
    """config.json as SGLang's LlamaForCausalLMEagle3 would read it.

    speculators keeps the sizes under transformer_layer_config; lifting them lets the shape
    checks run, while architectures, eagle_config and the top-level ids stay as written (SGLang
    reads those, so the capture and architecture findings describe the file as it is).
    """
    if layout != "speculators":
        return config
    inner = config.get("transformer_layer_config") or {}
    view = {k: v for k, v in inner.items() if v is not None}
    view.update({k: v for k, v in config.items() if k != "transformer_layer_config" and v is not None})
    view["architectures"] = config.get("architectures")
    view["eagle_aux_hidden_state_layer_ids"] = config.get("eagle_aux_hidden_state_layer_ids")
    return view


def read_draft(path: str | Path) -> ForeignDraft:
    """UserError (exit 2) naming the path for anything that is no EAGLE-3 checkpoint directory."""
    path = Path(path)
    if not path.is_dir():
        raise UserError(f"{path}: no such checkpoint directory (give the folder holding config.json and the safetensors)")
    config_path = path / "config.json"
    if not config_path.exists():
        raise UserError(f"{config_path} not found: {path} is not a checkpoint directory")
    try:
        config = json.loads(config_path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{config_path}: not valid JSON text ({clip(str(e))})") from None
    except RecursionError:
        raise UserError(f"{config_path}: JSON nested too deeply to be a model config") from None
    except OSError as e:  # a folder named config.json, no permission
        raise UserError(f"{config_path}: cannot read it ({e.strerror or type(e).__name__})") from None
    if not isinstance(config, dict):
        raise UserError(f"{config_path}: not a JSON object")
    layout = layout_of(config, config_path)
    files = weight_files(path)
    specs: TensorSpecs = {}
    for f in files:
        try:
            specs.update(tensor_specs(f))
        except (SafetensorError, OSError) as e:  # a cut or foreign file
            raise UserError(f"{f}: not a readable safetensors file ({e})") from None
    renamed = {}
    if layout == "speculators":
        for name in specs:
            for old, new in SPECULATORS_RENAMES.items():
                if name.startswith(old):
                    renamed[name] = new + name[len(old):]
    not_served = [n for n in specs if n in NOT_SERVED]
    tensors = {renamed.get(n, n): s for n, s in specs.items() if n not in NOT_SERVED}
    return ForeignDraft(path, layout, config, ExportedDraft(path, sglang_view(config, layout)), files, tensors, renamed, not_served)


# ---------------------------------------------------------------------------------------------
# the layers


@dataclass(frozen=True)
class Intended:
    """The physical layers the draft was trained on, and how this check knows."""

    physical: list[int]
    basis: str  # "training features" | "recorded" | "inferred"
    how: str  # in words


def recorded_layers(d: ForeignDraft) -> list[int] | None:
    """The physical layers this project's export recorded (config.json draftlab.physical_layers), or
    None when absent or not a list of layer numbers (static_findings names that)."""
    block = d.config.get("draftlab") if isinstance(d.config.get("draftlab"), dict) else {}
    layers = block.get("physical_layers")
    ok = isinstance(layers, list) and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in layers)
    return layers if ok and layers else None


def intended_layers(d: ForeignDraft, target: dict, served: ServedLayers, features_physical: list[int] | None) -> Intended:
    L = int(target["num_layers"])
    if features_physical:
        return Intended(list(features_physical), "training features", "the physical layers of the --features shards")
    recorded = recorded_layers(d)
    if d.layout == "draftlab" and recorded:
        return Intended(list(recorded), "recorded", "the physical layers the export recorded in config.json (draftlab.physical_layers)")
    if d.layout == "speculators":
        ids = d.config.get("eagle_aux_hidden_state_layer_ids")
        if ids and all(isinstance(i, int) for i in ids):  # vLLM captures the stream entering layer i: its ids are physical indices
            return Intended(sorted(ids), "inferred", "speculators' eagle_aux_hidden_state_layer_ids, which vLLM reads as physical indices")
        return Intended(default_physical(L), "inferred", "the default speculators and vLLM fall back to when the ids are null")
    if d.draft.layer_ids is None:  # SpecForge trains its default ids [1, L//2-1, L-4] = physical [2, L//2, L-3]
        return Intended(default_physical(L), "inferred", "SpecForge's default training layers (no eagle_config)")
    # A trainer that read the same eagle_config captured what SGLang does (SpecForge's own rule: id k = layer k's output).
    physical = served.physical if served.physical is not None else sorted(physical_from_user_layers(d.draft.layer_ids))
    return Intended(physical, "inferred", "the layers SGLang captures for eagle_config (a trainer that read the same config "
                                          "captured the same layers)")


# ---------------------------------------------------------------------------------------------
# what only a foreign layout gets wrong


def _ids_in_both(arch: str, L: int, physical: list[int], version: str) -> tuple[list[int], list[int] | None]:
    """(vLLM/speculators ids, SGLang eagle_config ids) that capture `physical`."""
    try:
        return list(physical), ids_for_physical(arch, L, physical, version)
    except UserError:
        return list(physical), None


def check_speculators(d: ForeignDraft, target: dict, served: ServedLayers) -> list[Finding]:
    """speculators' layout: SGLang cannot load it as written; null ids; ids in vLLM's numbering."""
    if d.layout != "speculators":
        return []
    arch, L, version = target["architecture"], int(target["num_layers"]), served.sglang_version
    ids = d.config.get("eagle_aux_hidden_state_layer_ids")
    out = []
    default = default_physical(L)
    vllm_ids, sglang_ids = _ids_in_both(arch, L, sorted(ids) if ids else default, version)
    if ids is None:
        out.append(error(
            "speculators_layer_ids_null",
            {"eagle_aux_hidden_state_layer_ids": None, "architecture": arch, "num_layers": L,
             "vllm_feeds_physical": default, "sglang_feeds_physical": served.physical, "sglang_version": version},
            f"config.json has eagle_aux_hidden_state_layer_ids: null, which speculators' EAGLE-3 converter writes unless it is "
            f"given the ids. vLLM then falls back to its default physical layers {default} (speculators' "
            f"resolve_target_layer_ids: [2, L//2, L-3], with only a warning); SGLang finds no eagle_config and silently "
            f"captures its own default, physical {served.physical}. Either way the draft is fed the default layers, and "
            f"nothing in the checkpoint says it was trained on them",
            f"find the layers the draft was trained on (its training config) and write them: re-run `speculators convert "
            f"<source> --algorithm eagle3 --verifier <target> --algorithm-kwargs '{{\"eagle_aux_hidden_state_layer_ids\": "
            f"[physical ids]}}'` (vLLM reads them as physical indices; for the default layers: {vllm_ids}); for SGLang set "
            f"eagle_config.eagle_aux_hidden_state_layer_ids: {sglang_ids} (SGLang numbering)"))
    elif sglang_ids is not None and sglang_ids != vllm_ids:
        out.append(info(
            "speculators_ids_numbering", {"speculators_ids": ids, "physical": vllm_ids, "sglang_ids": sglang_ids, "architecture": arch},
            f"speculators' ids {ids} are physical indices (vLLM captures the stream entering layer i); SGLang's eagle_config "
            f"numbers the same layers {sglang_ids} on {arch}: copying the ids unchanged would feed SGLang other layers"))
    out.append(error(
        "speculators_layout",
        {"architectures": d.config.get("architectures"), "renamed_for_sglang": dict(list(d.renamed.items())[:4]),
         "tensors_renamed": len(d.renamed), "not_served": d.not_served},
        f"SGLang cannot serve speculators' layout as written: it picks the draft class from architectures "
        f"({d.config.get('architectures')}, not [\"{ARCHITECTURE}\"]), reads the sizes at the top level (here under "
        f"transformer_layer_config), ignores a top-level eagle_aux_hidden_state_layer_ids"
        + (", and loads the decoder layer from midlayer.* only (layers.0.* names are dropped silently before SGLang "
           f"{'.'.join(map(str, LAYERS_NAMED_FROM))})" if parse_version(version) < LAYERS_NAMED_FROM else "")
        + ". The checks below read it as if converted, to judge its shapes",
        f"convert it to SGLang's layout: architectures [\"{ARCHITECTURE}\"], model_type \"llama\", the transformer_layer_config "
        f"keys at the top level, eagle_config.eagle_aux_hidden_state_layer_ids: {sglang_ids}, layers.0.* renamed to "
        f"midlayer.*, embed_tokens.weight dropped; then run this check on the result"))
    return out


def check_variant_flags(d: ForeignDraft, version: str) -> list[Finding]:
    """Config switches of a variant EAGLE-3 layer that SGLang's LlamaForCausalLMEagle3 at `version` does not compute."""
    flags = dict(VARIANT_FLAGS, **(SPECULATORS_ONLY_FLAGS if d.layout == "speculators" else {}))
    served = {k for k, since in VARIANT_READ_FROM.items() if parse_version(version) >= since}
    on = {k: what for k, what in flags.items() if d.config.get(k) is True and k not in served}
    if not on:
        return []
    return [warning("draft_variant_unsupported", {"flags": sorted(on), "meaning": on},
                    f"the draft was built with {', '.join(sorted(on))}; SGLang {version}'s {ARCHITECTURE} (llama_eagle3.py, read "
                    f"from source) reads none of these, so it serves a different function than "
                    f"was trained (extra norm weights, if any, are dropped)",
                    "serve it where the variant is implemented, or check the served acceptance against training before use")]


def check_t2d(d: ForeignDraft, d2t: torch.Tensor | None) -> list[Finding]:
    """t2d (ignored by SGLang, read by trainers and vLLM) must mark exactly the target ids d2t maps to."""
    t2d = d.tensor("t2d") if "t2d" in d.tensors else None
    if t2d is None or d2t is None or t2d.dtype != torch.bool or t2d.ndim != 1 or d2t.ndim != 1 or d2t.is_floating_point():
        return []  # the tensor check and check_d2t name a t2d or d2t of the wrong shape or dtype
    targets = draft_to_target(d2t.to(torch.int64))
    if len(targets) and (int(targets.min()) < 0 or int(targets.max()) >= len(t2d)):
        return []  # check_d2t names the out-of-range ids
    marked = torch.zeros_like(t2d)
    marked[targets] = True
    if torch.equal(marked, t2d):
        return []
    return [warning("t2d_disagrees_with_d2t", {"t2d_true": int(t2d.sum()), "d2t_targets": len(set(targets.tolist())),
                                               "differing": int((marked != t2d).sum())},
                    "t2d does not mark exactly the target ids that d2t maps the draft vocab to; SGLang ignores t2d, but a "
                    "trainer or vLLM that reads it uses another vocabulary than SGLang serves",
                    "rebuild t2d from d2t (t2d[d + d2t[d]] = True for every draft id d)")]


# ---------------------------------------------------------------------------------------------
# the verdict


@dataclass
class Verdict:
    findings: list[Finding]  # worst first
    settings: dict  # what was checked, in plain sight
    parity: dict | None = None

    @property
    def errors(self) -> list[Finding]:
        return errors(self.findings)


def as_loaded(d: ForeignDraft) -> tuple[TensorSpecs, dict[str, str]]:
    """The tensor specs with float weights in config.json's dtype (or torch_dtype), as SGLang's weight loader
    copies them (a cast, not a fault), and {stored dtype: first tensor} of those it casts."""
    name = config_dtype(d.draft.config)[1]
    dtype = TORCH_DTYPES.get(name) if isinstance(name, str) else None
    if dtype is None:  # check_draft_shapes names a missing or unknown dtype
        return d.tensors, {}
    out, cast = {}, {}
    for name, (shape, stored) in d.tensors.items():
        if stored is not None and stored.is_floating_point and stored != dtype:
            cast.setdefault(str(stored), name)
            stored = dtype
        out[name] = (shape, stored)
    return out, cast


def static_findings(d: ForeignDraft, target: dict, version: str, features_physical: list[int] | None = None,
                    training_d2t: torch.Tensor | None = None) -> tuple[list[Finding], ServedLayers, Intended]:
    """Every check that needs no server and no target weights: layers, config, d2t/t2d, shapes."""
    served = served_layers(d.draft, target, version)
    intended = intended_layers(d, target, served, features_physical)
    out = [info("draft_layout", {"layout": d.layout, "path": str(d.path), "weight_files": [f.name for f in d.files]},
                {"draftlab": "this project's export", "sglang": "SGLang's EAGLE-3 layout (as SpecForge writes it)",
                 "speculators": "vLLM speculators' EAGLE-3 layout"}[d.layout])]
    out += check_speculators(d, target, served)
    written = (d.config.get("draftlab") or {}).get("physical_layers") if d.layout == "draftlab" else None
    if written is not None and recorded_layers(d) is None:
        out.append(warning("recorded_layers_invalid", {"physical_layers": bounded(written)},
                           "config.json's draftlab.physical_layers is not a list of layer numbers: the trained layers are "
                           "inferred instead", "give --features (the training features) to prove them"))
    if d.draft.layer_ids_problem:
        out.append(error("eagle_config_invalid", {"eagle_config": d.config.get("eagle_config")},
                         f"{d.draft.layer_ids_problem}: SGLang cannot read which layers to feed the draft",
                         "write eagle_config.eagle_aux_hidden_state_layer_ids as a list of integer ids"))
    elif intended.physical:
        if intended.basis == "inferred":
            out.append(info("trained_layers_inferred", {"physical": intended.physical, "basis": intended.how},
                            f"the layers the draft was trained on are inferred from {intended.how}, not proven",
                            "give --features (the training features) or --server (live capture) to prove them"))
        out += check_capture(intended.physical, served, redo=REDO)
    d2t = d.tensor("d2t") if "d2t" in d.tensors else None
    tensors, cast = as_loaded(d)
    if cast:
        key, name = config_dtype(d.draft.config)
        out.append(info("weights_cast_on_load", {key: name, "stored": cast},
                        f"some weights are stored in another float dtype than config.json's {key}; SGLang casts them on load"))
    out += check_draft_shapes(d.draft, tensors, target, len(intended.physical) or 3, redo=REDO, sglang_version=version)
    out += check_d2t(d.draft, d2t, training_d2t, redo=REDO)
    out += check_t2d(d, d2t)
    out += check_variant_flags(d, version)
    return out, served, intended


def target_facts(model: str) -> dict:
    """The target's architecture, layers, hidden size, vocab and context from its config.json alone."""
    from draftlab.params import TargetParams
    from draftlab.engine.flag_words import target_error
    from draftlab.target.load import load_config, target_info

    params = TargetParams(model=model, revision=None, dtype="float32", device="cpu")
    try:
        facts = target_info(load_config(params), params)  # an architecture without a capture rule is a finding, not bad input
    except UserError as e:  # the loader speaks of params.yaml's target.model: this command's user typed --target
        raise UserError(target_error(str(e), "--target")) from None
    if re.search(r"ForCausalLMEagle3?$|Speculator$", str(facts["architecture"])):  # SGLang's and speculators' draft classes
        raise UserError(f"--target {shown(model)}: its config.json names {shown(facts['architecture'])}, a draft model, not the "
                        "model it drafts for; give the target LLM the draft was trained against (its folder or hub id)")
    return facts


def settings_of(d: ForeignDraft, target: dict, served: ServedLayers, intended: Intended) -> dict:
    return {"draft": str(d.path), "layout": d.layout, "target_model": target.get("model"), "architecture": target.get("architecture"),
            "num_layers": target.get("num_layers"), "sglang_version": served.sglang_version,
            "eagle_aux_hidden_state_layer_ids": d.draft.layer_ids, "sglang_captures": served.physical,
            "trained_physical": intended.physical, "trained_basis": intended.basis}


def verdict_dict(v: Verdict) -> dict:
    counts = {s: sum(f.severity == s for f in v.findings) for s in (ERROR, WARNING, INFO)}
    return finite({"ok": not v.errors, "errors": [f.name for f in v.errors], "counts": counts, "settings": v.settings,
                   "findings": [f.as_dict() for f in v.findings], "parity": v.parity})


def verdict_text(v: Verdict) -> str:
    s = v.settings
    lines = [(f"draft {s['draft']} ({s['layout']} layout) on {s['target_model']} ({s['architecture']}, {s['num_layers']} layers), "
              f"SGLang {s['sglang_version']}"),
             (f"  eagle_config ids {s['eagle_aux_hidden_state_layer_ids']} -> SGLang captures physical {s['sglang_captures']}; "
              f"trained on physical {s['trained_physical']} ({s['trained_basis']})")]
    for slot in (v.parity or {}).get("slots") or []:
        lines.append(f"  parity slot {slot['slot']}: expected physical {slot['trained_physical']}, rel err {slot['rel_err']:.4f}, "
                     f"cos {slot['cos']:.4f}, norm ratio {slot['norm_ratio']:.3f}, best match {slot['best_match']}")
    for f in v.findings:
        lines.append(f"{f.severity}: {f.name}: {f.cause}" + (f" -> {f.fix}" if f.fix else ""))
        if f.severity != INFO:
            lines.append(f"    evidence: {json.dumps(finite(f.evidence), default=str)[:600]}")
    n = {sev: sum(f.severity == sev for f in v.findings) for sev in (ERROR, WARNING)}
    lines.append(f"verdict: {'NOT ready for SGLang as is' if v.errors else 'ok'} ({n[ERROR]} error(s), {n[WARNING]} warning(s))")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# live: the training features and a server


@dataclass
class Features:
    """This project's training features (the standardize stage's output), read for the checks."""

    path: Path
    physical: list[int]  # in the features' slot order
    d2t: torch.Tensor | None
    norms: dict | None  # stats.json per-layer norm statistics
    findings: list[Finding]


def read_features(path: str | Path, target: dict) -> Features:
    """UserError (exit 2) when the features are missing, cut or changed since standardize wrote them."""
    from draftlab.check.diagnose import read_json
    from draftlab.features.dataset import DRAFT_VOCAB_FILE, physical_layers_of
    from draftlab.manifest import read_verified

    path = Path(path)
    manifest = read_verified(path)
    physical = physical_layers_of(path)
    d2t = None
    if (path / DRAFT_VOCAB_FILE).exists():
        with safe_open(str(path / DRAFT_VOCAB_FILE), "pt") as f:
            d2t = f.get_tensor("d2t")
    norms = (read_json(path / "stats.json") or {}).get("norms")
    trained_on = (manifest.get("info") or {}).get("target") or {}
    keys = ("architecture", "num_layers", "hidden_size", "vocab_size")
    diff = {k: {"features": trained_on.get(k), "target": target.get(k)} for k in keys if trained_on.get(k) != target.get(k)}
    findings = [] if not diff else [error(
        "features_target_differs", {"features": str(path), **diff},
        "the features were extracted from another target than --target: the draft would read hidden states of a model it never saw",
        "give the --target the features were extracted from (or the features of this target)")]
    return Features(path, physical, d2t, norms, findings)


PROMPTS = ("The capital of France is", "def fibonacci(n):\n    ", "Explain in one sentence why the sky is blue.",
           "Translate to German: good morning, my friend.", "1, 1, 2, 3, 5, 8,", "Write a haiku about the sea.")


def prompt_ids(model: str, vocab_size: int, n: int) -> list[list[int]]:
    """`n` short prompts in the target's tokens; seeded random ids when its tokenizer does not load."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(model)
        ids = [tok(p).input_ids for p in PROMPTS[:n]]
        if all(ids) and max(max(i) for i in ids) < vocab_size:
            return ids
    except Exception:  # noqa: BLE001 - any tokenizer that does not load (a damaged file, an unknown class): random ids
        pass
    g = torch.Generator().manual_seed(0)
    return [torch.randint(vocab_size, (16,), generator=g).tolist() for _ in range(n)]


def target_sequences(model, model_name: str, physical: list[int], n: int):
    """Without training features, the target itself is the reference: its capture path at `physical`
    for `n` prompts, in the shape run_parity takes (StoredSequences and their meta)."""
    from draftlab.check.parity import StoredSequence, inprocess_capture, reference_states

    capture, states = inprocess_capture(model, physical), reference_states(model)
    seqs = [StoredSequence(f"prompt {i}", ids, capture(ids)[0], states(ids)["final"])
            for i, ids in enumerate(prompt_ids(model_name, model.config.vocab_size, n))]
    return seqs, {"physical_layers": list(physical), "hidden_size": int(model.config.hidden_size)}


def server_algorithm(url: str, config: dict) -> list[Finding]:
    """The server's own --speculative-algorithm (/server_info): EAGLE with an EAGLE-3 draft skips fc."""
    from draftlab.check.serving import check_algorithm
    from draftlab.sglang.client import Client

    try:
        with Client(url, 10.0) as client:
            algorithm = client.server_info().get("speculative_algorithm")
    except UserError:
        return []  # parity already reached the server; an old one without /server_info is no fault
    return check_algorithm({"flags": {"served": {"algorithm": algorithm}}}, config)


def live_parity(d: ForeignDraft, target: dict, served: ServedLayers, intended: Intended, server: str, feats: Features | None,
                samples: int, rtol: float, norm_tolerance: float, timeout_s: float, load_model) -> tuple[dict | None, list[Finding]]:
    """Live parity: the server (or, with features only, the in-process capture of the served layers)
    against the features (or, with a server only, against the target run here)."""
    from draftlab.check.diagnose import fewer_samples
    from draftlab.check.parity import check_live_capture, http_capture, inprocess_capture, reference_states, run_parity, stored_sequences

    H = int(target["hidden_size"])
    if not server and served.physical is None:
        return None, [info("live_parity_skipped", {"reason": served.refused}, "the ids cannot be captured at all (see the capture findings)")]
    if feats:
        seqs, meta = stored_sequences(feats.path, samples)
        if server:
            result = run_parity(seqs, meta, http_capture(server, H, timeout_s), server)
        else:
            model = load_model(target["model"], None)
            result = run_parity(seqs, meta, inprocess_capture(model, served.physical), "in-process (the capture path at the layers "
                                "SGLang feeds this draft)", reference_states(model), served.physical)
    else:  # a server and no features: the target run here is the reference
        model = load_model(target["model"], None)
        seqs, meta = target_sequences(model, target["model"], served.physical or intended.physical, samples)
        result = run_parity(seqs, meta, http_capture(server, H, timeout_s), server, reference_states(model))
    if (result.get("error") or {}).get("kind") == "unreachable":  # bad input, not a wiring fault: exit 2
        raise UserError(f"live parity could not run against {result['source']}: {result['error']['message']}")
    findings = check_live_capture(result, feats.norms if feats else None, rtol, norm_tolerance)
    findings += fewer_samples(result, samples, feats.path / "train" if feats else "the built-in prompt set")
    return result, findings + (server_algorithm(server, d.draft.config) if server else [])


def check_external(path: str | Path, model: str, version: str | None = None, server: str = "", features: str | Path | None = None,
                   samples: int = 4, rtol: float = 0.05, norm_tolerance: float = 0.15, timeout_s: float = 120.0,
                   load_model=None) -> Verdict:
    """The whole verdict. UserError for bad input (exit 2); every fault is a finding."""
    from draftlab.check.diagnose import load_local_target

    d = read_draft(path)
    target = target_facts(model)
    if not version and d.draft.sglang_version is not None:
        try:
            parse_version(d.draft.sglang_version)
        except UserError:
            raise UserError(f"{d.path / 'config.json'}: draftlab.sglang_version {shown(d.draft.sglang_version)} is not a "
                            "version like \"0.5.14\"; give --sglang-version (the SGLang that serves the draft)") from None
    version = version or d.draft.sglang_version or VERIFIED_VERSIONS[-1]
    parse_version(version)
    feats = read_features(features, target) if features else None
    findings, served, intended = static_findings(d, target, version, feats.physical if feats else None, feats.d2t if feats else None)
    parity = None
    if feats:
        findings += feats.findings
    if server or feats:
        parity, more = live_parity(d, target, served, intended, server, feats, samples, rtol, norm_tolerance, timeout_s,
                                   load_model or load_local_target)
        findings += more
    return Verdict(by_severity(findings), settings_of(d, target, served, intended), parity)
