"""Grouped-query attention that reads each key/value head once, for a target on the CPU.

transformers' sdpa attention repeats every key and value head `num_key_value_groups` times
(a copy of the whole cache per layer) whenever a mask is given, because CUDA's fast kernels take
no mask with grouped heads. A speculative verify always gives one (the engine's 4D tree or chain
mask), so on a CPU each verify of the tiny target spent about 0.3 ms of its 4.2 ms in those copies.
PyTorch's CPU kernel takes grouped heads and a mask together (`enable_gqa`), which is the same
attention: the logits were bit-identical on the default target. Everything else (no mask, other
devices, position biases, soft-capping) goes to transformers' own sdpa function unchanged.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.integrations.sdpa_attention import sdpa_attention_forward

NAME = "sdpa_shared_kv"  # the attention implementation name registered with transformers


def sdpa_shared_kv(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    groups = getattr(module, "num_key_value_groups", 1)
    plain = all(kwargs.get(k) is None for k in ("position_bias", "softcap", "s_aux")) and not kwargs.get("output_attentions")
    if groups > 1 and attention_mask is not None and plain and query.device.type == "cpu":
        # with a mask transformers passes is_causal=False too: the mask alone says what each row sees
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                             scale=scaling, enable_gqa=True)
        return out.transpose(1, 2).contiguous(), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


def use_shared_kv(model) -> bool:
    """Switch a CPU model that runs transformers' sdpa attention to sdpa_shared_kv (masks built as
    for sdpa); True if it now runs it. Idempotent; other models are left as they are."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if impl == NAME:
        return True
    if impl != "sdpa" or torch.device(model.device).type != "cpu" or not hasattr(model, "set_attn_implementation"):
        return False
    AttentionInterface.register(NAME, sdpa_shared_kv)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    try:
        model.set_attn_implementation(NAME)
    except (ValueError, TypeError, KeyError):  # a model class that refuses custom implementations keeps sdpa
        return False
    return getattr(model.config, "_attn_implementation", None) == NAME
