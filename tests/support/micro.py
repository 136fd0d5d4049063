"""Randomly initialised micro models, built in memory, for tests that must not need a real model.

make_micro_model() gives a transformers causal LM in eval mode (float32) in milliseconds;
save_micro_model() writes it with a small byte-level tokenizer that has the same special tokens
(same ids) and chat template as the shipped target models/tiny-target, so pipeline code that
loads a directory with AutoModelForCausalLM / AutoTokenizer behaves the same on both, offline.
"""
from __future__ import annotations

import os

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerFast

from draftlab.target.tokenizer import save_tokenizer
from draftlab.data.tasks import EOS, PAD, SPECIAL_TOKENS
from tests.support.tools import load_tool

ARCHS = ("llama", "qwen2", "qwen3")


def make_micro_model(
    arch: str = "llama",
    *,
    num_layers: int = 4,
    hidden_size: int = 64,
    vocab_size: int = 256,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    max_position_embeddings: int = 512,
    seed: int = 0,
    tie_word_embeddings: bool = False,
) -> PreTrainedModel:
    """A random `arch` causal LM; same seed and sizes give the same weights."""
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")
    config = AutoConfig.for_model(
        arch,
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=hidden_size // num_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=None,
        eos_token_id=SPECIAL_TOKENS.index(EOS),
        pad_token_id=SPECIAL_TOKENS.index(PAD),
    )
    # fork_rng: building a test model must not shift the caller's random stream
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.eval()


def make_micro_tokenizer(vocab_size: int = 256) -> PreTrainedTokenizerFast:
    """Byte-level tokenizer with one token per byte (no merges): special tokens at ids 0..6,
    then printable ASCII and whitespace, then other bytes while they fit in vocab_size
    (tools/micro_targets.py's, which the families' tiny targets ship with)."""
    return load_tool("micro_targets").make_tokenizer(vocab_size, model_max_length=512)


def save_micro_model(dir: str | os.PathLike, arch: str = "llama", **kw) -> PreTrainedModel:
    """Write a micro model plus its tokenizer to `dir` (loadable offline); returns the model."""
    model = make_micro_model(arch, **kw)
    tokenizer = make_micro_tokenizer(model.config.vocab_size)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(dir)
    save_tokenizer(tokenizer, dir)
    return model
