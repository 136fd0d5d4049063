"""The EAGLE-3 draft model, in SGLang's `LlamaForCausalLMEagle3` layout (DESIGN.md sections 6-7).

    h      = fc(cat(aux states))                  first step: [.., k*H_t] -> [.., H]
             or the previous step's state         later steps (already H wide)
    x      = cat(input_layernorm(embed(token)), hidden_norm(h))      2H wide, embedding first
    r      = h + o_proj(attention(x))             residual = h, as in SGLang
    state  = r + mlp(post_attention_layernorm(r)) the pre-norm sum: fed to the next draft step
    logits = lm_head(norm(state))                 over the draft vocab; target id = id + d2t[id]

Parameter names equal SGLang's checkpoint names (fc, midlayer.*, norm, lm_head, d2t, t2d), so
the state dict is the export. The embedding is the target's, frozen, kept as a non-persistent
buffer: never trained, never saved, never exported (SGLang shares the target's).

Attention goes through a cache object that owns the pattern: `KVCache` for decoding (causal over
everything cached, or an explicit mask) and `TTTCache` for training-time test.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from draftlab.errors import UserError
from draftlab.train.ttt_flex import TILE, extend_block_mask, flex_kernel, ttt_block_mask, ttt_flex_attend


@dataclass
class DraftConfig:
    hidden_size: int  # draft width H; must equal the target's (the embedding is shared)
    intermediate_size: int  # MLP width
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    vocab_size: int  # the target's vocab (embedding rows, t2d length)
    draft_vocab_size: int  # lm_head rows
    target_hidden_size: int  # H_t of the captured aux states
    num_aux_layers: int  # k: fc reads k * target_hidden_size
    max_position_embeddings: int  # >= the target's context (SGLang refuses less)
    rope_theta: float
    rope_scaling: dict | None = None  # as the target's (llama3, yarn, linear, ...)
    hidden_act: str = "silu"

    def __post_init__(self):
        if self.hidden_size != self.target_hidden_size:
            raise UserError(
                f"draft hidden size {self.hidden_size} != target hidden size {self.target_hidden_size}: "
                "the draft shares the target's embedding, so they must be equal"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise UserError(f"num_attention_heads {self.num_attention_heads} is not a multiple of num_key_value_heads {self.num_key_value_heads}")

    @classmethod
    def from_target(cls, target: dict, num_aux_layers: int, draft_vocab_size: int, intermediate_size: int | None = None) -> "DraftConfig":
        """Sizes and rope from the target's facts (features manifest `info.target`)."""
        rope_theta, rope_scaling = rope_of(target)
        H = target["hidden_size"]
        return cls(
            hidden_size=H,
            intermediate_size=intermediate_size or target.get("intermediate_size") or 4 * H,
            num_attention_heads=target["num_attention_heads"],
            num_key_value_heads=target.get("num_key_value_heads") or target["num_attention_heads"],
            head_dim=target.get("head_dim") or H // target["num_attention_heads"],
            rms_norm_eps=target.get("rms_norm_eps") or 1e-6,
            vocab_size=target["vocab_size"],
            draft_vocab_size=draft_vocab_size,
            target_hidden_size=H,
            num_aux_layers=num_aux_layers,
            max_position_embeddings=target["max_position_embeddings"],
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
        )

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def rope_of(target: dict) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) from either spelling: legacy keys or transformers 5's rope_parameters."""
    params = dict(target.get("rope_parameters") or {})
    theta = target.get("rope_theta") or params.pop("rope_theta", None) or 10000.0
    scaling = target.get("rope_scaling") or ({k: v for k, v in params.items() if k != "rope_theta"} or None)
    if scaling and scaling.get("rope_type", scaling.get("type")) == "default":
        scaling = None
    return float(theta), scaling


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Rotary(nn.Module):
    """cos/sin of the target's rope. Plain rope is computed here; scaled variants (llama3, yarn,
    linear, ...) by transformers' own rope functions, so they match the target exactly.

    The frequencies are a plain attribute, not a buffer, so draft.to(bfloat16) cannot round them.
    """

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        dim = cfg.head_dim
        self.scaling = 1.0
        self.inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)).float()
        if cfg.rope_scaling:
            from transformers import LlamaConfig
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            kind = cfg.rope_scaling.get("rope_type", cfg.rope_scaling.get("type"))
            if kind not in ROPE_INIT_FUNCTIONS:
                raise UserError(f"rope_scaling type {kind!r} is not supported (known: {', '.join(ROPE_INIT_FUNCTIONS)})")
            lc = LlamaConfig(hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads, head_dim=dim,
                             max_position_embeddings=cfg.max_position_embeddings, rope_theta=cfg.rope_theta, rope_scaling=cfg.rope_scaling)
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[kind](lc)
            self.inv_freq, self.scaling = inv_freq.detach().float().clone(), float(scaling)

    def forward(self, position_ids):
        freqs = position_ids[..., None].float() * self.inv_freq.to(position_ids.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos() * self.scaling, emb.sin() * self.scaling  # each [B, T, head_dim], float32


def rotate(x, cos, sin):
    """Rotary embedding, rotate-half (neox) style as Llama in transformers and SGLang.

    rotate_half(x) * sin == swap_halves(x) * cat(-sin_1, sin_2) bit for bit (the sign moves from
    x to sin): one flip of x instead of neg + cat, whose backward zero-pads each half.
    cos, sin: [B or 1, T, head_dim]; x: [B, heads, T, head_dim].
    """
    half = x.shape[-1] // 2
    signed_sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)  # h times smaller than x
    swapped = x.unflatten(-1, (2, half)).flip(-2).flatten(-2)  # [x_2, x_1]
    return x * cos[:, None] + swapped * signed_sin[:, None]


def repeat_kv(x, n: int):
    return x if n == 1 else x.repeat_interleave(n, dim=1)


class KVCache:
    """Decoding cache: keys/values of everything drafted so far, [B, n_kv, S, head_dim].

    attend() appends the new keys; by default new query j sees cached keys and new keys up to
    itself. `mask` (bool [B or 1, T, S+T], True = may attend) overrides that, e.g. for a tree.
    Storage is allocated ahead (doubling when full), so appending writes in place and crop()
    only moves the length: no copy of the cache per draft step.
    """

    def __init__(self):
        self._k = self._v = None
        self.length = 0

    @property
    def k(self):
        return None if self._k is None else self._k[:, :, :self.length]

    @property
    def v(self):
        return None if self._v is None else self._v[:, :, :self.length]

    def __len__(self) -> int:
        return self.length

    def crop(self, length: int) -> None:
        """Forget everything after the first `length` positions (e.g. rejected drafts)."""
        self.length = min(self.length, max(0, length))

    def attend(self, q, k, v, mask=None):
        S, T = self.length, k.shape[2]
        if self._k is None or S + T > self._k.shape[2]:
            grow = max(2 * (S + T), 64)
            new_k, new_v = k.new_empty(*k.shape[:2], grow, k.shape[3]), v.new_empty(*v.shape[:2], grow, v.shape[3])
            if S:
                new_k[:, :, :S], new_v[:, :, :S] = self._k[:, :, :S], self._v[:, :, :S]
            self._k, self._v = new_k, new_v
        self._k[:, :, S:S + T], self._v[:, :, S:S + T] = k, v
        self.length = S + T
        if mask is None and T > 1:
            mask = torch.ones(T, S + T, dtype=torch.bool, device=q.device).tril(S)[None]
        # one new row with no mask sees everything cached: no mask at all (the same attention);
        # grouped-query heads share their keys inside the kernel (no repeated copy of the cache)
        return F.scaled_dot_product_attention(q, self.k, self.v, attn_mask=None if mask is None else mask[:, None],
                                              enable_gqa=q.shape[1] != k.shape[1])


class TTTCache:
    """Training-time test attention over K unrolled steps of T rows each.

    Step 0 is ordinary causal attention. Step i at row t attends to the step-0 keys of rows
    0..t plus the keys of steps 1..i at the same row t: exactly what serving does when it
    extends the draft on a prefix ending at t and then drafts i tokens on top of it.

    seq_ids [B, T] (packed rows, draftlab.features.dataset.pack; -1 on padding): the step-0 keys
    are then only those rows 0..t of t's own sequence (block-diagonal causal); the same-row
    terms of later steps need nothing more. None: plain causal, as before.

    kernel "eager": the scores written out (any device; the reference). "flex": one FlexAttention
    call per step over the keys of every step so far (draftlab.train.ttt_flex: same outputs, no
    [T, T] scores in memory; gradients on CUDA only); compiled: under torch.compile (fast on GPUs).
    """

    def __init__(self, seq_ids: torch.Tensor | None = None, kernel: str = "eager", compiled: bool = False):
        if kernel not in ("eager", "flex"):
            raise ValueError(f"TTTCache kernel {kernel!r}: 'eager' or 'flex'")
        self.ks, self.vs = [], []
        self._k0 = self._v0 = self._mask = None
        self.seq_ids, self.kernel, self.compiled = seq_ids, kernel, compiled
        self._block_masks: dict[int, object] = {}  # flex: steps seen -> block mask, for this batch
        self._flex = flex_kernel(compiled) if kernel == "flex" else None
        if kernel == "flex":
            _flex_out_of_graphs()

    # The flex path under torch.compile (train.compile) runs outside the draft layer's graph: it
    # grows self.ks, and a traced list length specializes the layer once per TTT step (7 graphs,
    # each compiled forward and backward, and eval's no-grad pass past dynamo's recompile limit).
    # FlexAttention is compiled on its own (draftlab.train.ttt_flex), so the layer compiles as two
    # pieces, before and after the attention, whatever the TTT depth. True: traced into the layer
    # (benchmarks/train_throughput.py times both).
    trace_flex = False

    def attend(self, q, k, v, mask=None):
        if self.kernel == "flex":
            return (self._attend_flex if self.trace_flex else self._attend_flex_apart)(q, k, v)
        B, h, T, hd = q.shape
        n_kv = k.shape[1]
        groups = h // n_kv
        if not self.ks:  # step 0's keys serve every step: one [B*n_kv, T, hd] copy each, made once per batch
            self._k0, self._v0 = k.reshape(B * n_kv, T, hd), v.reshape(B * n_kv, T, hd)
        self.ks.append(k)
        self.vs.append(v)
        # The query heads that share a key head are folded into the rows ([B*n_kv, groups*T, hd];
        # head groups*j + g reads key head j, as repeat_kv): keys broadcast instead of being copied per
        # head. Scaled once: [B, h, T, hd] is small next to the [T, T] scores.
        q = (q * (1.0 / math.sqrt(hd))).reshape(B * n_kv, groups * T, hd)
        causal = torch.bmm(q, self._k0.transpose(1, 2)).view(B * n_kv, groups, T, T)
        if self.seq_ids is None:
            scores = [(causal + self.causal_mask(causal)).view(B * n_kv, groups * T, T)]
        else:  # per row of the batch: [B, 1, 1, T, T] over [B, n_kv, groups, T, T]
            scores = [(causal.view(B, n_kv, groups, T, T) + self.block_mask(causal)).view(B * n_kv, groups * T, T)]
        q_by_group = q.view(B, n_kv, groups, T, hd)
        for kj in self.ks[1:]:  # step j's key at the row's own position: [B*n_kv, groups*T, 1]
            scores.append((q_by_group * kj[:, :, None]).sum(-1, keepdim=True).view(B * n_kv, groups * T, 1))
        # The [.., T, T + i] softmax dominates this attention's memory traffic: it runs in the
        # scores' own dtype (bf16 under autocast; float32 accumulation inside the kernel), not in
        # a float32 copy, which halves the bytes moved and the activations kept for backward.
        p = torch.softmax(torch.cat(scores, dim=-1), dim=-1, dtype=q.dtype)
        out = torch.bmm(p[..., :T], self._v0).view(B, n_kv, groups, T, hd)
        for j, vj in enumerate(self.vs[1:]):
            out = out + p[..., T + j : T + j + 1].view(B, n_kv, groups, T, 1) * vj[:, :, None]
        return out.view(B, h, T, hd)

    def _attend_flex(self, q, k, v):
        # Rows padded to whole tiles (a real row never sees a padding key: they all come after it):
        # each later step's keys then start on a tile boundary, and its block mask grows from step
        # 0's (draftlab.train.ttt_flex.extend_block_mask) instead of being evaluated whole.
        T = q.shape[2]
        pad = -T % TILE
        if pad:
            q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        self.ks.append(k)
        self.vs.append(v)
        out = ttt_flex_attend(q, self.ks, self.vs, self._block_mask(q.shape[0], T + pad, q.device), self._flex)
        return out[:, :, :T] if pad else out

    _attend_flex_apart = None  # _attend_flex under torch.compiler.disable: set by _flex_out_of_graphs

    def _block_mask(self, B: int, T: int, device):  # under torch.compiler.disable: _flex_out_of_graphs
        """flex: the block mask of the step being attended (made once per step and batch; outside
        any compiled graph, which would otherwise trace the mask's own construction)."""
        n = len(self.ks)
        if n not in self._block_masks:
            first = self._block_masks.get(1)
            mask = extend_block_mask(first, T, n) if first is not None and n > 1 else None  # step 0's, plus diagonals
            if mask is None:  # built whole: step 0's, or rows not on tile boundaries
                seq = None if self.seq_ids is None else F.pad(self.seq_ids.to(device), (0, T - self.seq_ids.shape[1]), value=-1)
                mask = ttt_block_mask(seq, B, T, n, device, self.compiled)
            self._block_masks[n] = mask
        return self._block_masks[n]

    def causal_mask(self, scores):
        """Additive causal mask [T, T] in the scores' dtype (0 on and below the diagonal, -inf
        above), built once per batch: every step has the same T. Added, not masked_fill'ed, so
        backward has no masking pass (the softmax's gradient is already 0 where p is 0)."""
        T = scores.shape[-1]
        m = self._mask
        if m is None or m.shape[0] != T or m.dtype != scores.dtype or m.device != scores.device:
            m = self._mask = torch.full((T, T), float("-inf"), dtype=scores.dtype, device=scores.device).triu_(1)
        return m

    def block_mask(self, scores):
        """Additive block-diagonal causal mask [B, 1, 1, T, T] from seq_ids (0 where the key is of
        the query's sequence and not after it, -inf elsewhere), built once per batch. Padding
        (-1) attends to padding before it: never an all -inf row, whose softmax would be NaN."""
        m = self._mask
        if m is None or m.dtype != scores.dtype or m.device != scores.device:
            seq = self.seq_ids.to(scores.device)
            T = seq.shape[1]
            allowed = (seq[:, :, None] == seq[:, None, :]) & torch.ones(T, T, dtype=torch.bool, device=seq.device).tril()
            m = torch.zeros(allowed.shape, dtype=scores.dtype, device=scores.device).masked_fill_(~allowed, float("-inf"))
            m = self._mask = m[:, None, None]
        return m


@functools.cache
def _flex_out_of_graphs() -> None:
    """TTTCache's flex attention (unless trace_flex) and its block mask run outside any compiled graph
    (torch.compiler.disable), wrapped once per process, on the first flex cache. Not at import: that
    imports torch._dynamo, about 2 s of every process that loads the draft (export, bench, check)."""
    TTTCache._attend_flex_apart = torch.compiler.disable(TTTCache._attend_flex)
    TTTCache._block_mask = torch.compiler.disable(TTTCache._block_mask)


class Attention(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        H, hd = cfg.hidden_size, cfg.head_dim
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, hd
        self.q_proj = nn.Linear(2 * H, self.n_heads * hd, bias=False)
        self.k_proj = nn.Linear(2 * H, self.n_kv * hd, bias=False)
        self.v_proj = nn.Linear(2 * H, self.n_kv * hd, bias=False)
        self.o_proj = nn.Linear(self.n_heads * hd, H, bias=False)

    def forward(self, x, cos, sin, cache, mask=None):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        y = cache.attend(q, k, v, mask)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MidLayer(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, embeds, hidden, cos, sin, cache, mask=None):
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        r = hidden + self.self_attn(x, cos, sin, cache, mask)
        return r + self.mlp(self.post_attention_layernorm(r))


class Eagle3Draft(nn.Module):
    def __init__(self, cfg: DraftConfig, embed_weight: torch.Tensor | None = None):
        super().__init__()
        self.config = cfg
        self.fc = nn.Linear(cfg.num_aux_layers * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.midlayer = MidLayer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.ones(cfg.vocab_size, dtype=torch.bool) if cfg.draft_vocab_size == cfg.vocab_size else torch.zeros(cfg.vocab_size, dtype=torch.bool))
        self.register_buffer("embed_tokens", torch.empty(0), persistent=False)
        self.rotary = Rotary(cfg)
        if embed_weight is not None:
            self.set_embedding(embed_weight)

    def set_embedding(self, weight: torch.Tensor) -> None:
        """Use the target's (frozen) token embedding, [vocab, H]."""
        if tuple(weight.shape) != (self.config.vocab_size, self.config.hidden_size):
            raise UserError(f"target embedding shape {tuple(weight.shape)} != ({self.config.vocab_size}, {self.config.hidden_size})")
        self.embed_tokens = weight.detach().to(self.fc.weight.device)

    def set_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    def embed(self, input_ids):
        if self.embed_tokens.numel() == 0:
            raise RuntimeError("the draft has no token embedding: call set_embedding(target embedding) first")
        return F.embedding(input_ids, self.embed_tokens).to(self.fc.weight.dtype)

    def project(self, aux_hidden):
        """The first step's input: fc over the concatenated aux states, [.., k*H_t] -> [.., H]."""
        return self.fc(aux_hidden.to(self.fc.weight.dtype))

    def step(self, input_ids, hidden, position_ids, cache, mask=None, rope=None):
        """One draft step over T rows; returns the pre-norm state [B, T, H] (feed it back as `hidden`).

        input_ids [B, T]: the tokens whose embeddings enter (the token after each hidden's position);
        hidden [B, T, H]: project(aux) or the previous step's state; position_ids [B, T]: rope positions;
        cache: KVCache (decoding) or TTTCache (training); mask: see KVCache.attend.
        rope: (cos, sin) [B or 1, T, head_dim] of position_ids when the caller has them already
        (training: slices of one table per batch); position_ids is then unused.
        """
        cos, sin = self.rotary(position_ids) if rope is None else rope
        return self.midlayer(self.embed(input_ids), hidden, cos.to(hidden.dtype), sin.to(hidden.dtype), cache, mask)

    def logits(self, state):
        """Draft-vocab logits of a state."""
        return self.lm_head(self.norm(state))

    def forward(self, input_ids, hidden, position_ids, cache, mask=None):
        state = self.step(input_ids, hidden, position_ids, cache, mask)
        return self.logits(state), state

    def to_target(self, draft_ids):
        """Draft ids -> target token ids (SGLang's hot_token_id mapping)."""
        return draft_ids + self.d2t[draft_ids]
