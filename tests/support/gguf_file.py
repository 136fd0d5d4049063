"""Write a small Llama model as a GGUF file the way llama.cpp's converter lays it out, so tests of
the GGUF target path need no download: tensor names (blk.N.attn_q ...), the q/k row permutation,
a gpt2-style tokenizer with its chat template, and optionally quantized tensors (Q8_0, Q4_1)."""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
         "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
         "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's rotary layout for q/k rows (transformers' GGUF loader undoes it)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(model, tokenizer, path: str | Path, quant: str = "F32", architecture: str = "llama") -> Path:
    """`model`: a transformers LlamaForCausalLM; `quant`: F32, Q8_0 or Q4_1 for the 2-D weights
    (norms stay F32, as llama.cpp keeps them). `architecture` is the general.architecture written."""
    cfg, path = model.config, Path(path)
    w = gguf.GGUFWriter(str(path), architecture)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(float((getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", 10000.0)))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    special = set(tokenizer.added_tokens_decoder)  # the chat markers and EOS/pad: kept whole
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types([gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL for _, i in vocab])
    w.add_token_scores([0.0] * len(vocab))  # no merges (one token per byte): the loader derives none from these
    w.add_eos_token_id(tokenizer.eos_token_id)
    w.add_pad_token_id(tokenizer.pad_token_id)
    w.add_add_bos_token(False)
    w.add_chat_template(tokenizer.chat_template)
    qtype = getattr(gguf.GGMLQuantizationType, quant)

    def add(name: str, t):
        a = t.detach().float().numpy().astype(np.float32)
        if a.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, gguf.quants.quantize(a, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, a)

    sd = model.state_dict()
    add("token_embd.weight", sd["model.embed_tokens.weight"])
    for i in range(cfg.num_hidden_layers):
        for hf, gg in NAMES.items():
            t = sd[f"model.layers.{i}.{hf}.weight"]
            if gg == "attn_q":
                t = type(t)(_permute(t.numpy(), cfg.num_attention_heads))
            elif gg == "attn_k":
                t = type(t)(_permute(t.numpy(), cfg.num_key_value_heads))
            add(f"blk.{i}.{gg}.weight", t)
    add("output_norm.weight", sd["model.norm.weight"])
    if not cfg.tie_word_embeddings:
        add("output.weight", sd["lm_head.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
