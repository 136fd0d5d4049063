"""Capture engines: what runs the target to give extraction (and online training) its hidden states.

extract.engine picks one. Every engine answers capture(input_ids, attention_mask, physical) with
today's contract of draftlab.features.extract.capture: ({physical index: [B, T, H]}, final hidden
[B, T, H] after the final norm), right-padded rows, the states of padding positions unspecified.
So the shards and tokens records are the same files whatever captured them; the extract manifest
records which engine did (info.engine, info.tp_size, info.dtype).

- transformers: the target loaded by draftlab.target.load on one device (the default).
- sglang: SGLang's own ModelRunner in this process, on this process's GPU, tensor-parallel over
  extract.tp_size ranks; imported only when chosen.
"""
from __future__ import annotations

from draftlab.errors import UserError
from draftlab.parallel import RankLayout


def open_engine(target_params, extract_params, device: str, layout: RankLayout | None = None, layer_ids=None,
                max_tokens: int | None = None):
    """The engine extract.engine names, with its target loaded on `device`.

    max_tokens: the most tokens one capture call holds (the sglang engine sizes its KV pool for them;
    None = SGLang's own share of the GPU).

    layer_ids: draftlab.sglang.layers.ids_for_physical, for the sglang engine (the per-family id rule
    lives in the sglang wing, which features may not import; its callers pass it in).

    The engine has `.config` (the model or its config: what target.load.target_info reads),
    `.tokenizer`, capture(input_ids, attention_mask, physical) and close()."""
    engine = getattr(extract_params, "engine", "transformers")
    if engine == "transformers":
        if getattr(extract_params, "tp_size", 1) != 1:  # params refuse it too; this guards code that builds params itself
            raise UserError("extract.tp_size > 1 needs extract.engine sglang")
        from draftlab.features.engines.transformers_engine import TransformersEngine

        return TransformersEngine.load(target_params, device)
    if engine == "sglang":
        from draftlab.features.engines.sglang_engine import SGLangEngine

        return SGLangEngine.load(target_params, extract_params, device, layout, layer_ids, max_tokens)
    raise UserError(f"extract.engine must be transformers or sglang, got {engine!r}")
