"""Dtype names, stated once: the names params and config.json use, and the codes safetensors files use.

    TORCH_DTYPES["bfloat16"]      # torch.bfloat16: params target/extract/export dtype, config.json torch_dtype
    SAFETENSORS_DTYPES["BF16"]    # torch.bfloat16: a safetensors header's dtype code

(draftlab.features.dataset.SHARD_DTYPES is a different thing: the schema of a feature shard.)
"""
from __future__ import annotations

import torch

from draftlab.errors import UserError

TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
SAFETENSORS_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
                      "I64": torch.int64, "I32": torch.int32, "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8}


def torch_dtype(name: str, where: str = "dtype") -> torch.dtype:
    """TORCH_DTYPES[name], or a UserError naming the key and the choices."""
    try:
        return TORCH_DTYPES[name]
    except (KeyError, TypeError):  # TypeError: an unhashable value (a list) from a hand-edited config
        raise UserError(f"{where}: {name!r} is not a dtype (choose one of {', '.join(TORCH_DTYPES)})") from None
