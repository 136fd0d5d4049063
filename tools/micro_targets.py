"""Tiny random targets, one per model family, that real SGLang can serve as an EAGLE-3 target.

    python tools/micro_targets.py deepseek-v3 runs/targets        # writes runs/targets/deepseek-v3/

Each target has 8 decoder layers, hidden size 256 and a 256-token byte-level tokenizer with the
chat template of models/tiny-target (the same tokenizer as tests/support/micro.py), so the
pipeline's stages run on it unchanged. Weights are random (seeded): the answers are noise, but
the layers SGLang captures can still be matched token for token against transformers.

Some keys SGLang reads are missing from configs that transformers writes; SGLANG_KEYS adds them
(a real checkpoint of the family carries them):
- DeepSeek-V3: moe_layer_freq, topk_method, scoring_func (SGLang 0.5.14 deepseek_v2.py reads them
  as attributes: AttributeError otherwise, measured), num_nextn_predict_layers (its weight loader
  compares it with 0).
- gpt-oss: swiglu_limit (SGLang 0.5.14 gpt_oss.py; transformers hard-codes 7.0).

Kimi-K2.5 is a vision-language model whose text model is a DeepSeek-V3: SGLang serves it as
KimiK25ForConditionalGeneration (language_model.* weights, a vision tower), while transformers
releases that SGLang 0.5.14 accepts have no class for it. So its target is two directories
with the same weights: `pipeline` (a DeepseekV3ForCausalLM the pipeline's stages load) and
`serve` (the KimiK25 checkpoint SGLang is started with).
"""
from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast  # noqa: E402

from draftlab.target.tokenizer import save_tokenizer  # noqa: E402
from draftlab.data.tasks import CHAT_TEMPLATE, EOS, PAD, SPECIAL_TOKENS, THINK_TOKENS  # noqa: E402

NUM_LAYERS = 8
HIDDEN = 256
VOCAB = 256  # one token per byte; every built-in prompt tokenizes
# Shared by every family: 4 query heads of 64, 2 KV heads, a 1024-token context.
COMMON = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=NUM_LAYERS, num_attention_heads=4,
              num_key_value_heads=2, head_dim=64, intermediate_size=512, max_position_embeddings=1024,
              tie_word_embeddings=False, bos_token_id=None, eos_token_id=SPECIAL_TOKENS.index(EOS),
              pad_token_id=SPECIAL_TOKENS.index(PAD))
MOE = dict(num_experts_per_tok=2, moe_intermediate_size=128)  # 8 experts of 128, two per token


@dataclass(frozen=True)
class Family:
    name: str  # the user's word for it (--families)
    label: str  # how the report names it
    architecture: str  # the class SGLang serves (its rules are keyed by this name)
    model_type: str  # transformers' model type of the pipeline target
    config: dict = field(default_factory=dict)  # beyond COMMON
    sglang_keys: dict = field(default_factory=dict)  # keys SGLang needs that transformers does not write


DEEPSEEK_CONFIG = dict(MOE, n_routed_experts=8, n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
                       q_lora_rank=128, kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=64,
                       num_key_value_heads=4)
# noaux_tc + sigmoid is the routing transformers' DeepseekV3 computes (sigmoid scores, a correction bias).
DEEPSEEK_KEYS = dict(moe_layer_freq=1, topk_method="noaux_tc", scoring_func="sigmoid", num_nextn_predict_layers=0)

FAMILIES = {f.name: f for f in (
    Family("llama", "Llama", "LlamaForCausalLM", "llama"),
    Family("qwen3", "Qwen3 dense", "Qwen3ForCausalLM", "qwen3"),
    Family("qwen3-moe", "Qwen3-MoE", "Qwen3MoeForCausalLM", "qwen3_moe",
           dict(MOE, num_experts=8, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True)),
    Family("deepseek-v3", "DeepSeek-V3", "DeepseekV3ForCausalLM", "deepseek_v3", DEEPSEEK_CONFIG, DEEPSEEK_KEYS),
    Family("kimi-k2.5", "Kimi-K2.5", "KimiK25ForConditionalGeneration", "deepseek_v3", DEEPSEEK_CONFIG, DEEPSEEK_KEYS),
    Family("gpt-oss", "gpt-oss", "GptOssForCausalLM", "gpt_oss",
           dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=256, sliding_window=128,
                layer_types=["sliding_attention", "full_attention"] * (NUM_LAYERS // 2),
                rope_parameters={"rope_type": "default", "rope_theta": 150000.0}),
           dict(swiglu_limit=7.0)),
)}
# SGLang's KimiK25VisionConfig, shrunk: the vision tower is built but never run by text prompts.
KIMI_VISION = dict(patch_size=14, init_pos_emb_height=8, init_pos_emb_width=8, init_pos_emb_time=4, num_attention_heads=2,
                   num_hidden_layers=1, hidden_size=64, intermediate_size=128, merge_kernel_size=[2, 2], text_hidden_size=HIDDEN)


def family(name: str) -> Family:
    if name not in FAMILIES:
        raise ValueError(f"unknown family {name!r}; known: {', '.join(FAMILIES)}")
    return FAMILIES[name]


def make_model(name: str, seed: int = 0):
    """The family's random causal LM (the pipeline target), float32, eval mode; same seed, same weights."""
    fam = family(name)
    config = AutoConfig.for_model(fam.model_type, **{**COMMON, **fam.config})
    with torch.random.fork_rng(devices=[]):  # building a target must not shift the caller's random stream
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.eval()


def make_tokenizer(vocab_size: int = VOCAB, model_max_length: int = COMMON["max_position_embeddings"]) -> PreTrainedTokenizerFast:
    """Byte-level, one token per byte: special tokens at ids 0..6, then printable ASCII and
    whitespace, then other bytes while they fit (tests/support/micro.py's tokenizer is this one)."""
    table = _bytes_to_unicode()
    first = [ord(c) for c in "\t\n\r"] + list(range(32, 127))
    rest = [b for b in range(256) if b not in first]
    specials = SPECIAL_TOKENS + THINK_TOKENS
    if vocab_size - len(specials) < len(first):
        raise ValueError(f"vocab_size must be >= {len(specials) + len(first)}, got {vocab_size}")
    chars = [table[b] for b in (first + rest)[:vocab_size - len(specials)]]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(specials + chars)}, merges=[], ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in THINK_TOKENS])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=PAD, chat_template=CHAT_TEMPLATE,
                                   model_max_length=model_max_length)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table, the alphabet of ByteLevel tokenizers."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def _patch_config(path: Path, keys: dict) -> None:
    config = json.loads(path.read_text())
    path.write_text(json.dumps({**config, **keys}, indent=2) + "\n")


def weights_sha256(directory: Path) -> str:
    """sha256 over the safetensors files (name and bytes): a rebuilt target is the same one."""
    h = hashlib.sha256()
    for f in sorted(Path(directory).glob("*.safetensors")):
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return h.hexdigest()


def build(name: str, out: str | Path, seed: int = 0) -> dict:
    """Write the family's target under `out` (bf16 weights, tokenizer, SGLang's keys); returns
    {"pipeline": dir the stages load, "serve": dir SGLang is started with, "architecture",
    "num_layers", "weights_sha256"}. Already written (same config) -> nothing is rebuilt."""
    fam, out = family(name), Path(out)
    pipeline = out / "pipeline" if fam.architecture == "KimiK25ForConditionalGeneration" else out
    serve = out / "serve" if pipeline != out else out
    info_path = out / "target.json"
    if info_path.exists():
        return {k: (Path(v) if k in ("pipeline", "serve") else v) for k, v in json.loads(info_path.read_text()).items()}
    model = make_model(name, seed).to(torch.bfloat16)  # what SGLang serves; halves the bytes
    tokenizer = make_tokenizer()
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = tokenizer.eos_token_id, tokenizer.pad_token_id
    model.save_pretrained(pipeline)
    save_tokenizer(tokenizer, pipeline)
    _patch_config(pipeline / "config.json", fam.sglang_keys)
    if serve != pipeline:
        _write_kimi(tokenizer, pipeline, serve)
    info = {"family": name, "architecture": fam.architecture, "num_layers": NUM_LAYERS, "seed": seed,
            "pipeline": str(pipeline), "serve": str(serve), "weights_sha256": weights_sha256(pipeline)}
    info_path.write_text(json.dumps(info, indent=1) + "\n")
    return {**info, "pipeline": pipeline, "serve": serve}


def _write_kimi(tokenizer, pipeline: Path, serve: Path) -> None:
    """The KimiK25 checkpoint of the same language model: config.json with text_config (the
    DeepSeek-V3 config, SGLang's keys included) and vision_config; weights renamed under
    language_model. (SGLang's kimi_k25.py strips that prefix and loads the rest into its
    DeepseekV3ForCausalLM; the vision tower gets no weights and is never run by text)."""
    from safetensors.torch import load_file, save_file

    serve.mkdir(parents=True, exist_ok=True)
    text = json.loads((pipeline / "config.json").read_text())
    config = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25", "text_config": text,
              "vision_config": KIMI_VISION, "pad_token_id": text["pad_token_id"], "eos_token_id": text["eos_token_id"],
              "dtype": "bfloat16", "torch_dtype": "bfloat16", "tie_word_embeddings": False}
    (serve / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    # From the saved file, not model.state_dict(): transformers 5 fuses the experts in memory
    # (experts.gate_up_proj) and writes them per expert (experts.0.gate_proj), the names SGLang loads.
    state = {f"language_model.{k}": v for f in sorted(pipeline.glob("*.safetensors")) for k, v in load_file(f).items()}
    save_file(state, str(serve / "model.safetensors"), metadata={"format": "pt"})
    (serve / "generation_config.json").write_text((pipeline / "generation_config.json").read_text())
    save_tokenizer(tokenizer, serve)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(f"usage: {sys.argv[0]} FAMILY OUT_DIR   (families: {', '.join(FAMILIES)})")
    print(json.dumps({k: str(v) for k, v in build(sys.argv[1], Path(sys.argv[2]) / sys.argv[1]).items()}, indent=1))
