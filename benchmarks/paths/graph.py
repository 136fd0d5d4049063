"""Decode over a static KV cache, eager and as a CUDA graph: what the engine's eager decode leaves
on the table (section decode_graph).

Method: `StaticDecode` runs the target's own modules and weights over a preallocated KV cache,
`graph_new` greedy tokens after a random `spec_prompt`-token prompt. Checked first: its logits
against the engine's forward (draftlab.engine.speculative.target_forward) fed the same tokens, 4 steps,
max relative error. Then timed eagerly and, on CUDA, as one captured CUDA graph replayed per token
(the token read on the host every step, as a real decode loop needs it). Fraction of the bandwidth
floor = tokens/s / (measured copy bandwidth / bytes read per decode step, the embedding excepted).
Runs before the spec section, which rescales the embedding.
"""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from benchmarks.paths.common import copy_rate, decode_bytes, record, sync


class StaticDecode:
    """Greedy 1-token decode of a transformers Llama over a preallocated KV cache.

    Every tensor a step touches has a fixed address and the step never asks the host anything,
    so it can be captured once as a CUDA graph and replayed per token, as SGLang serves. The
    weights and layer modules are the model's own; only the cache and the loop are new. This
    measures what the engine's eager transformers decode leaves on the table; it is not the engine.
    """

    def __init__(self, model, max_len: int):
        c = model.config
        self.model, self.max_len = model, max_len
        self.nh, self.nkv = c.num_attention_heads, c.num_key_value_heads
        self.hd = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        dev, dt = model.device, model.dtype
        self.k = torch.zeros(c.num_hidden_layers, 1, self.nkv, max_len, self.hd, dtype=dt, device=dev)
        self.v = torch.zeros_like(self.k)
        self.pos = torch.zeros(1, dtype=torch.long, device=dev)
        self.tok = torch.zeros(1, 1, dtype=torch.long, device=dev)
        self.logits = torch.zeros(1, c.vocab_size, dtype=torch.float32, device=dev)
        self.slots = torch.arange(max_len, device=dev)
        self.graph = None

    @torch.inference_mode()
    def prefill(self, prompt: list[int]) -> int:
        from draftlab.engine.speculative import new_cache, target_forward

        cache = new_cache(self.model)
        logits = target_forward(self.model, torch.tensor([prompt], device=self.model.device), cache, logits_to_keep=1)
        n = len(prompt)
        for i, layer in enumerate(cache.layers):
            self.k[i, :, :, :n] = layer.keys
            self.v[i, :, :, :n] = layer.values
        self.pos.fill_(n)
        self.tok.copy_(logits[:, -1].argmax(-1).view(1, 1))
        return int(self.tok)

    @torch.inference_mode()
    def step(self) -> None:
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        base = self.model.model
        x = base.embed_tokens(self.tok)
        cos, sin = base.rotary_emb(x, self.pos.view(1, 1))
        mask = (self.slots <= self.pos).view(1, 1, 1, -1)
        g = self.nh // self.nkv
        for i, layer in enumerate(base.layers):
            at = layer.self_attn
            h = layer.input_layernorm(x)
            q = at.q_proj(h).view(1, 1, self.nh, self.hd).transpose(1, 2)
            k = at.k_proj(h).view(1, 1, self.nkv, self.hd).transpose(1, 2)
            v = at.v_proj(h).view(1, 1, self.nkv, self.hd).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            self.k[i].index_copy_(2, self.pos, k)
            self.v[i].index_copy_(2, self.pos, v)
            o = F.scaled_dot_product_attention(q, self.k[i].repeat_interleave(g, 1), self.v[i].repeat_interleave(g, 1), attn_mask=mask)
            x = x + at.o_proj(o.transpose(1, 2).reshape(1, 1, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        self.logits.copy_(self.model.lm_head(base.norm(x))[:, -1].float())
        self.tok.copy_(self.logits.argmax(-1).view(1, 1))
        self.pos.add_(1)

    def capture(self) -> None:
        """Record one step as a CUDA graph (after warm-up steps on a side stream, then undone)."""
        state = (self.k, self.v, self.pos, self.tok, self.logits)
        saved = [t.clone() for t in state]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self.step()
        torch.cuda.current_stream().wait_stream(side)
        for t, s in zip(state, saved):
            t.copy_(s)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.step()

    def decode(self, n: int) -> list[int]:
        out = []
        for _ in range(n):
            self.graph.replay() if self.graph is not None else self.step()
            out.append(int(self.tok))  # the token on the host every step, as a real decode loop needs it
        return out


def decode_graph(P, model) -> None:
    from draftlab.engine import speculative
    from draftlab.target.attention import attention_kernels

    dev, S = P["device"], "decode_graph"
    floor = copy_rate(P) / decode_bytes(model)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(10, model.config.vocab_size, (P["spec_prompt"],), generator=g).tolist()
    new = P["graph_new"]
    ref = speculative.baseline_generate(model, prompt, new + 1, ignore_eos=True)
    sd = StaticDecode(model, -(-(len(prompt) + new + 8) // 64) * 64)  # slots in whole 64s: aligned for the attention kernels
    with attention_kernels(dev), torch.inference_mode():
        # The same computation as the engine: logits of the static step against the engine's own
        # forward, fed the same tokens, for a few steps.
        x = sd.prefill(prompt)
        cache = speculative.new_cache(model)
        speculative.target_forward(model, torch.tensor([prompt], device=dev), cache)
        err = 0.0
        for _ in range(4):
            want = speculative.target_forward(model, torch.tensor([[x]], device=dev), cache, logits_to_keep=1)[0, -1].float()
            sd.tok.fill_(x)
            sd.step()
            err = max(err, float((sd.logits[0] - want).norm() / want.norm()))
            x = int(want.argmax())
        record(S, "eager_logits_rel_err", err, "(static step vs the engine's forward, 4 steps, max)")
        modes = ["eager"] + (["graph"] if dev == "cuda" else [])
        for mode in modes:
            first = sd.prefill(prompt)
            if mode == "graph":
                t0 = time.perf_counter()
                sd.capture()
                record(S, "capture_s", time.perf_counter() - t0, "s")
                first = sd.prefill(prompt)  # the cache as it was before the warm-up
            sync(dev)
            t0 = time.perf_counter()
            toks = sd.decode(new)
            sync(dev)
            ms = (time.perf_counter() - t0) / new * 1e3
            record(S, f"{mode}_matches_engine", int([first] + toks == ref.output_ids), "(same tokens as baseline_generate)")
            record(S, f"{mode}_ms_per_token", ms, "ms")
            record(S, f"{mode}_tokens_per_s", 1e3 / ms, "tok/s")
            record(S, f"{mode}_fraction_of_floor", (1e3 / ms) / floor, f"(floor {floor:.1f} tok/s)")
    record(S, "engine_ms_per_token", (ref.total_s - ref.prefill_s) / max(1, len(ref.output_ids) - 1) * 1e3, "ms (baseline_generate, same prompt)")
