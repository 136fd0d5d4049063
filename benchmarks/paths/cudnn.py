"""The engine's decode with SDPA's cuDNN attention allowed and avoided (section decode_profile).

Method: `draftlab.engine.speculative.baseline_generate` of `decode_new` tokens (ms per decode token, the prefill
excluded), three times in this order, on the same prompt:
  cold     cuDNN allowed, on KV lengths it has not seen in this process: what a fresh process pays,
           since every decode step has a new KV length and cuDNN builds a plan per shape;
  warm     cuDNN allowed again on the same lengths (its plans kept);
  avoided  cuDNN avoided (`draftlab.target.attention.AVOID_CUDNN_ATTENTION`, the default).
The order matters: a best-of-two A/B lets cuDNN reuse its plans and shows no difference.
`engine_decode_cudnn_cold_ratio` = cold / avoided.
"""
from __future__ import annotations

from benchmarks.paths.common import record


def engine_decode_ab(P, model, prompt: list[int], S: str = "decode_profile") -> None:
    from draftlab.engine import speculative
    from draftlab.target import attention

    per = {}
    for name, avoid in (("cold", False), ("warm", False), ("avoided", True)):
        attention.AVOID_CUDNN_ATTENTION = avoid
        r = speculative.baseline_generate(model, prompt, P["decode_new"], ignore_eos=True)
        per[name] = (r.total_s - r.prefill_s) / max(1, len(r.output_ids) - 1)
        record(S, f"engine_decode_ms_cudnn_{name}", per[name] * 1e3, f"ms per token (baseline_generate, {P['decode_new']} tokens)")
    attention.AVOID_CUDNN_ATTENTION = True
    record(S, "engine_decode_cudnn_cold_ratio", per["cold"] / per["avoided"], "(cuDNN allowed, new lengths / avoided)")
