"""The SGLang EAGLE-3 checkpoint (DESIGN.md section 7), and the project's own loader of it.

A directory with:
  config.json        LlamaForCausalLMEagle3, one layer, the target's rope and context,
                     eagle_config.eagle_aux_hidden_state_layer_ids ALWAYS (a missing key makes
                     SGLang silently capture its default layers)
  model.safetensors  fc.weight, midlayer.*, norm.weight, lm_head.weight, d2t (int64), t2d (bool);
                     no embedding (SGLang shares the target's)

SGLang drops tensors with unknown names silently and leaves those parameters random, so the
exporter checks the complete name/shape/dtype set before writing, and the loader checks it again.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save as st_save

from draftlab.train.draft import DraftConfig, Eagle3Draft
from draftlab.dtypes import SAFETENSORS_DTYPES, torch_dtype
from draftlab.errors import UserError
from draftlab.fsutil import atomic_replace_dir, atomic_write_bytes, atomic_write_json, canonical_safetensors
from draftlab.manifest import safetensors_header
from draftlab.sglang.loading import config_dtype
from draftlab.sglang.layers import SGLANG_AUX_LAYERS, captured_physical, ids_for_physical

ARCHITECTURE = "LlamaForCausalLMEagle3"
WEIGHTS = "model.safetensors"
TensorSpecs = dict[str, tuple[tuple[int, ...], torch.dtype]]  # tensor name -> (shape, dtype)


def expected_tensors(cfg: DraftConfig, dtype: torch.dtype | None) -> TensorSpecs:
    """Every tensor SGLang loads into LlamaForCausalLMEagle3, with its shape and dtype (None: the
    float weights' dtype is not known, so not checked; d2t and t2d keep theirs)."""
    H, I, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    m = "midlayer."
    return {
        "fc.weight": ((H, cfg.num_aux_layers * cfg.target_hidden_size), dtype),
        m + "self_attn.q_proj.weight": ((q, 2 * H), dtype),
        m + "self_attn.k_proj.weight": ((kv, 2 * H), dtype),
        m + "self_attn.v_proj.weight": ((kv, 2 * H), dtype),
        m + "self_attn.o_proj.weight": ((H, q), dtype),
        m + "mlp.gate_proj.weight": ((I, H), dtype),
        m + "mlp.up_proj.weight": ((I, H), dtype),
        m + "mlp.down_proj.weight": ((H, I), dtype),
        m + "input_layernorm.weight": ((H,), dtype),
        m + "hidden_norm.weight": ((H,), dtype),
        m + "post_attention_layernorm.weight": ((H,), dtype),
        "norm.weight": ((H,), dtype),
        "lm_head.weight": ((cfg.draft_vocab_size, H), dtype),
        "d2t": ((cfg.draft_vocab_size,), torch.int64),
        "t2d": ((cfg.vocab_size,), torch.bool),
    }


def tensor_problems(found: TensorSpecs, expected: TensorSpecs) -> list[str]:
    """Every missing, unexpected, mis-shaped or mis-typed tensor of `found` against `expected`, in
    words; empty when SGLang loads them all. The one statement of the tensor contract's check."""
    problems = [f"missing {name} {list(shape)}" for name, (shape, _) in expected.items() if name not in found]
    problems += [f"unexpected {name} (SGLang would drop it silently)" for name in found if name not in expected]
    for name, (shape, dtype) in expected.items():
        if name not in found:
            continue
        got_shape, got_dtype = found[name]
        if tuple(got_shape) != tuple(shape):
            problems.append(f"{name} has shape {list(got_shape)}, SGLang expects {list(shape)}")
        elif dtype is not None and got_dtype != dtype:
            problems.append(f"{name} has dtype {got_dtype}, expected {dtype}")
    return problems


def specs_of(tensors: dict[str, torch.Tensor]) -> TensorSpecs:
    return {name: (tuple(t.shape), t.dtype) for name, t in tensors.items()}


def tensor_specs(weights: str | Path) -> TensorSpecs:
    """(shape, dtype) of every tensor in a safetensors file, read from its header (no weights loaded);
    None as the dtype of a code torch has no name for here."""
    specs = {}
    with safe_open(str(weights), "pt") as f:
        for name in f.keys():
            tensor = f.get_slice(name)
            specs[name] = (tuple(tensor.get_shape()), SAFETENSORS_DTYPES.get(tensor.get_dtype()))
    return specs


def check_tensors(tensors: dict[str, torch.Tensor], cfg: DraftConfig, dtype: torch.dtype, where: str = "export") -> None:
    """UserError listing every missing, unexpected, mis-shaped or mis-typed tensor."""
    problems = tensor_problems(specs_of(tensors), expected_tensors(cfg, dtype))
    if problems:
        raise UserError(f"{where}: the draft's tensors do not match SGLang's LlamaForCausalLMEagle3: " + "; ".join(problems))


def sglang_config(cfg: DraftConfig, layer_ids: list[int], dtype: str, target: dict, extra: dict | None = None) -> dict:
    config = {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "num_hidden_layers": 1,
        "hidden_act": cfg.hidden_act,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": cfg.rope_scaling,
        # SGLang refuses a draft whose context is shorter than the target's.
        "max_position_embeddings": max(cfg.max_position_embeddings, int(target.get("max_position_embeddings") or 0)),
        "vocab_size": cfg.vocab_size,
        "draft_vocab_size": cfg.draft_vocab_size,
        "tie_word_embeddings": False,  # True would make SGLang use the embedding as lm_head
        "attention_bias": False,
        "torch_dtype": dtype,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(layer_ids), "use_aux_hidden_state": True},
    }
    if cfg.target_hidden_size != cfg.hidden_size:
        config["target_hidden_size"] = cfg.target_hidden_size
    if extra:
        config["draftlab"] = extra
    return config


def export_sglang(draft: Eagle3Draft, out_dir: str | Path, target: dict, physical: list[int], sglang_version: str,
                  dtype: str = "bfloat16", tensors: dict[str, torch.Tensor] | None = None) -> dict:
    """Write the SGLang checkpoint of `draft` to `out_dir` (swapped in atomically); returns config.json.

    `target`: the features manifest's `info.target` (architecture, num_layers, context, ...);
    `physical`: the capture indices the features were built from. Refuses (UserError) when SGLang
    cannot capture exactly those layers, or cannot load the draft. `tensors` overrides the state
    dict (tests use it to feed a damaged one).
    """
    cfg = draft.config
    if cfg.num_aux_layers != SGLANG_AUX_LAYERS or len(physical) != SGLANG_AUX_LAYERS:
        raise UserError(
            f"the draft reads {len(physical)} aux layers (physical {physical}); SGLang's LlamaForCausalLMEagle3 "
            f"takes exactly {SGLANG_AUX_LAYERS} (its fc is {SGLANG_AUX_LAYERS} x target hidden wide): set capture.layers to 3 layers"
        )
    layer_ids = ids_for_physical(target["architecture"], target["num_layers"], physical, sglang_version)
    weights_dtype = torch_dtype(dtype, "export.dtype")
    if tensors is None:
        tensors = {k: (v if k in ("d2t", "t2d") else v.to(weights_dtype)) for k, v in draft.state_dict().items()}
    tensors = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    check_tensors(tensors, cfg, weights_dtype)
    extra = {"physical_layers": sorted(physical), "sglang_version": sglang_version,
             "target_model": target.get("model"), "target_revision": target.get("revision"),
             "target_architecture": target["architecture"]}
    config = sglang_config(cfg, layer_ids, dtype, target, extra)

    out_dir = Path(out_dir)
    tmp = out_dir.with_name(f".{out_dir.name}.tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    atomic_write_bytes(tmp / WEIGHTS, canonical_safetensors(st_save(tensors, metadata={"format": "pt"})))
    atomic_write_json(tmp / "config.json", config)
    # Read it back the way every later stage will: the same tensors, or no export at all.
    loaded = load_exported(tmp, dtype=weights_dtype)[0].state_dict()
    for name, t in tensors.items():
        if not torch.equal(loaded[name], t):
            shutil.rmtree(tmp)
            raise UserError(f"export: tensor {name} did not survive the round trip through {WEIGHTS}")
    atomic_replace_dir(tmp, out_dir)
    return config


@dataclass(frozen=True)
class ExportedDraft:
    """An exported draft directory as SGLang sees it: its config.json, and the layers SGLang will
    feed it. Read once (read_exported) and passed down; nothing else re-derives the layers."""
    path: Path
    config: dict  # config.json as written

    @property
    def weights(self) -> Path:
        return self.path / WEIGHTS

    @property
    def layer_ids(self) -> list[int] | None:
        """eagle_config.eagle_aux_hidden_state_layer_ids; None when the key is missing (SGLang then
        falls back to its default layers without a word)."""
        eagle = self.config.get("eagle_config")
        ids = eagle.get("eagle_aux_hidden_state_layer_ids") if isinstance(eagle, dict) else None
        return None if ids is None else list(ids)

    @property
    def top_level_ids(self) -> list[int] | None:
        """A top-level eagle_aux_hidden_state_layer_ids: SGLang ignores it (a hand edit's mistake)."""
        return self.config.get("eagle_aux_hidden_state_layer_ids")

    @property
    def sglang_version(self) -> str | None:
        """The SGLang release whose capture rule export applied (None for a draft made elsewhere)."""
        block = self.config.get("draftlab")
        return block.get("sglang_version") if isinstance(block, dict) else None

    @property
    def layer_ids_problem(self) -> str | None:
        """Why eagle_config (or its eagle_aux_hidden_state_layer_ids) is malformed; None when it is
        absent or a list of integers. SGLang would fail on, or misread, anything else."""
        if "eagle_config" not in self.config:
            return None
        eagle = self.config["eagle_config"]
        if not isinstance(eagle, dict):
            return f"eagle_config is {type(eagle).__name__} {eagle!r}, not an object"
        if "eagle_aux_hidden_state_layer_ids" not in eagle:
            return None
        ids = eagle["eagle_aux_hidden_state_layer_ids"]
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            return f"eagle_config.eagle_aux_hidden_state_layer_ids is {ids!r}, not a list of integers"
        return None

    def served_physical(self, architecture: str, num_layers: int, sglang_version: str) -> list[int]:
        """The physical layers SGLang `sglang_version` feeds this draft on that target, ascending."""
        problem = self.layer_ids_problem
        if problem:
            raise UserError(f"{self.path / 'config.json'}: {problem}; re-run the export stage (dvc repro export)")
        return captured_physical(architecture, num_layers, self.layer_ids, sglang_version)

    def draft_config(self, num_aux_layers: int | None = None) -> DraftConfig:
        """The draft's shapes from config.json (see draft_config_of)."""
        return draft_config_of(self.config, num_aux_layers)


def read_exported(path: str | Path) -> ExportedDraft:
    path = Path(path)
    config_path = path / "config.json"
    if not config_path.exists():
        raise UserError(f"{config_path} not found: not an exported draft; run the export stage")
    try:
        config = json.loads(config_path.read_bytes())
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise UserError(f"{config_path}: not valid JSON ({e}); re-run the export stage") from None
    if not isinstance(config, dict):
        raise UserError(f"{config_path}: a JSON {type(config).__name__}, not a config object; re-run the export stage")
    return ExportedDraft(path, config)


def draft_config_of(config: dict, num_aux_layers: int | None = None) -> DraftConfig:
    """The draft's shapes from config.json, read as SGLang reads them (transformers' LlamaConfig
    defaults where a key is missing). The one place a DraftConfig is built from a config.json.

    num_aux_layers: how many target layers fc reads; default: as SGLang loads it, the number of
    eagle_config ids, or its 3 default layers without them (serving it shows the fault, the
    check names it). UserError naming a missing size.
    """
    eagle = config.get("eagle_config")
    ids = eagle.get("eagle_aux_hidden_state_layer_ids") if isinstance(eagle, dict) else None
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size",
                "draft_vocab_size", "target_hidden_size", "max_position_embeddings"):
        value = config.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise UserError(f"the draft's config.json: {key} must be a positive integer, got {value!r}: not a loadable SGLang draft config")
    try:
        return DraftConfig(
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_attention_heads=config["num_attention_heads"],
            num_key_value_heads=config.get("num_key_value_heads") or config["num_attention_heads"],
            head_dim=config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"],
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            vocab_size=config["vocab_size"],
            draft_vocab_size=config.get("draft_vocab_size") or config["vocab_size"],
            target_hidden_size=config.get("target_hidden_size", config["hidden_size"]),
            num_aux_layers=num_aux_layers or (len(ids) if ids else SGLANG_AUX_LAYERS),
            max_position_embeddings=config.get("max_position_embeddings", 2048),
            # transformers 5 writes rope_theta inside rope_parameters
            rope_theta=config.get("rope_theta") or _rope_parameters(config).get("rope_theta") or 10000.0,
            rope_scaling=config.get("rope_scaling"),
            hidden_act=config.get("hidden_act", "silu"),
        )
    except KeyError as e:
        raise UserError(f"the draft's config.json has no {e.args[0]}: not a loadable SGLang draft config") from None
    except (TypeError, ValueError) as e:  # a size that is not a number
        raise UserError(f"the draft's config.json holds a value of the wrong type ({e}): not a loadable SGLang draft config") from None


def _rope_parameters(config: dict) -> dict:
    rope = config.get("rope_parameters")
    return rope if isinstance(rope, dict) else {}


def config_from_exported(config: dict) -> DraftConfig:
    """The draft's shapes from an SGLang EAGLE-3 config.json; UserError for another architecture."""
    if config.get("architectures") != [ARCHITECTURE]:
        raise UserError(f"not an SGLang EAGLE-3 draft config: architectures {config.get('architectures')} (want [{ARCHITECTURE!r}])")
    return draft_config_of(config)


def load_exported(path: str | Path, embed: torch.Tensor | None = None, dtype: torch.dtype = torch.float32,
                  as_sglang: bool = False) -> tuple[Eagle3Draft, dict]:
    """(draft, config.json) from an exported directory, checked against the same contract.

    The directory holds no embedding: pass the target's (`embed`, [vocab, H]) or call
    draft.set_embedding() before running it. This is the only way the project loads a draft.
    as_sglang: load what SGLang 0.5.14 would serve rather than refuse it: without d2t, SGLang
    keeps no hot-token map and reads the draft's ids as target ids (LlamaForCausalLMEagle3.
    load_weights sets hot_token_id only from d2t), so d2t becomes all zeros (the identity).
    """
    path = Path(path)
    if not (path / "config.json").exists() or not (path / WEIGHTS).exists():
        raise UserError(f"{path}: not an exported draft (needs config.json and {WEIGHTS}); run the export stage")
    exported = read_exported(path)
    cfg = config_from_exported(exported.config)
    try:  # a damaged file named here, not by the reader's exception
        safetensors_header(exported.weights)
    except UserError as e:
        raise UserError(f"{e}; re-run the export stage (dvc repro -f export)") from None
    with safe_open(str(exported.weights), framework="pt") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    if as_sglang and "d2t" not in tensors:
        tensors["d2t"] = torch.zeros(cfg.draft_vocab_size, dtype=torch.int64)
        tensors.setdefault("t2d", torch.arange(cfg.vocab_size) < cfg.draft_vocab_size)
        print(f"WARNING {exported.weights} has no d2t: draft ids are served as target ids, as SGLang does", flush=True)
    key, name = config_dtype(exported.config)  # transformers 5 writes dtype, 4.x torch_dtype
    weights_dtype = torch_dtype(name or "bfloat16", f"{path / 'config.json'}: {key or 'torch_dtype'}")
    check_tensors(tensors, cfg, weights_dtype, where=str(exported.weights))
    draft = Eagle3Draft(cfg)
    draft.load_state_dict({k: (v if k in ("d2t", "t2d") else v.to(dtype)) for k, v in tensors.items()})
    draft.to(dtype)
    if embed is not None:
        draft.set_embedding(embed.to(dtype))
    return draft.eval(), exported.config
