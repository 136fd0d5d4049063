"""The embedded default, models/tiny-target with the exported models/draft: tau and speedup.

Method: the draft as exported (draftlab.sglang.checkpoint.load_exported), num_steps 5, topk 1,
`embedded_prompts` held-out prompts (`tasks.generate(n, seed=5, split="heldout")`, chat template),
max_new_tokens `embedded_new`, EOS honoured; after one warm-up request of each kind, every prompt
runs as `baseline_generate` and as `generate`. tau = output tokens / verify steps (pooled);
speedup = pooled tokens/s ratio. Skipped when models/draft is absent (it is a DVC output).
"""
from __future__ import annotations

import torch

from benchmarks.paths.common import ROOT, free, record


def embedded(P) -> None:
    from transformers import AutoModelForCausalLM

    from draftlab.engine import speculative
    from draftlab.bench.servers import render_prompts
    from draftlab.sglang.checkpoint import load_exported
    from draftlab.target.load import load_tokenizer
    from draftlab.data.tasks import generate as make_tasks

    dev, S = P["device"], "embedded"
    tdir, ddir = ROOT / "models/tiny-target", ROOT / "models/draft"
    if not (ddir / "config.json").exists():
        record(S, "skipped", 1)
        record(S, "note", "models/draft is absent in this working tree (DVC output): nothing measured")
        return
    record(S, "skipped", 0)
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    target = AutoModelForCausalLM.from_pretrained(str(tdir), dtype=dtype).to(dev).eval()
    tok = load_tokenizer(str(tdir))
    embed = target.get_input_embeddings().weight
    draft, config = load_exported(ddir, embed=embed, dtype=embed.dtype)
    draft.to(dev)
    physical = config["draftlab"]["physical_layers"]
    problems = make_tasks(P["embedded_prompts"], seed=5, split="heldout")
    prompts = render_prompts(tok, [{"messages": [{"role": "user", "content": p.prompt}]} for p in problems])
    eos = {target.generation_config.eos_token_id, tok.eos_token_id} - {None}
    eos = {e for x in eos for e in (x if isinstance(x, (list, tuple)) else [x])}
    new = P["embedded_new"]
    steps = 5
    record(S, "target_dtype", str(dtype))
    record(S, "physical", physical)
    record(S, "num_steps", steps)
    record(S, "prompts", len(prompts))
    speculative.baseline_generate(target, prompts[0], 8, eos_token_id=eos)  # warm-ups
    speculative.generate(target, draft, prompts[0], num_steps=steps, topk=1, num_draft_tokens=steps + 1, max_new_tokens=8,
                         eos_token_id=eos, physical_layers=physical)
    bt = bs = 0.0
    bn = sn = ver = 0
    same = 0
    for p in prompts:
        b = speculative.baseline_generate(target, p, new, eos_token_id=eos)
        r = speculative.generate(target, draft, p, num_steps=steps, topk=1, num_draft_tokens=steps + 1, max_new_tokens=new,
                                 eos_token_id=eos, physical_layers=physical)
        bt, bn = bt + b.total_s, bn + len(b.output_ids)
        bs, sn, ver = bs + r.total_s, sn + len(r.output_ids), ver + r.spec_verify_ct
        same += r.output_ids == b.output_ids
    record(S, "baseline_tokens_per_s", bn / bt, "tok/s")
    record(S, "spec_tokens_per_s", sn / bs, "tok/s")
    record(S, "tau", sn / max(1, ver))
    record(S, "speedup", (sn / bs) / (bn / bt), "x")
    record(S, "outputs_equal_baseline", same)
    del target, draft
    free(dev)
