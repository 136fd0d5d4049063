"""draftlab's GPU paths measured against the machine's own ceilings; `benchmarks/paths_vs_ceilings.py` runs them.

One module per measured path, each a section of results.json (its docstring states the method):
  ceilings     bf16 matmul rate and device copy bandwidth: the floors every other figure is a fraction of
  extraction   draftlab.features.extract.capture and the extract stage's extract_shard: tokens/s vs the compute floor
  decode       one baseline decode step: host vs GPU time, the profiler's top operators (section decode_profile)
  cudnn        the engine's decode with SDPA's cuDNN backend cold, warm and avoided (section decode_profile)
  graph        the same decode over a static KV cache, eager and as a CUDA graph (section decode_graph)
  spec         draftlab.engine.speculative: baseline decode vs the bandwidth floor, oracle / null drafts
  training     one draftlab.train.objective.TTT optimizer step: MFU, the GEMM share, soft labels fp32 vs bf16
  embedded     models/tiny-target with models/draft: tau and speedup on held-out prompts
common holds the recording (results.json rewritten after every figure), timing helpers, the shapes
of each mode and the 8B-shaped random target.
"""
