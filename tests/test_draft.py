import math

import pytest
import torch

from draftlab.train.draft import DraftConfig, KVCache, Rotary, TTTCache, rotate
from draftlab.errors import UserError
from draftlab.sglang.checkpoint import expected_tensors
from tests.support.micro import make_micro_model
from tiny_features import H, K, V, VD, make_draft

def test_parameters_are_exactly_sglangs_names_and_shapes_without_the_embedding():
    draft = make_draft()
    state = draft.state_dict()
    expected = expected_tensors(draft.config, torch.float32)
    assert {k: tuple(v.shape) for k, v in state.items()} == {k: shape for k, (shape, _) in expected.items()}
    assert not any("embed" in k for k in state)
    assert not draft.embed_tokens.requires_grad


def test_hidden_size_must_equal_the_targets():
    with pytest.raises(UserError, match="shares the target's embedding"):
        DraftConfig(64, 128, 4, 2, 16, 1e-6, 256, 128, 32, 3, 512, 1e4)


@torch.no_grad()
def test_training_time_test_equals_step_by_step_drafting():
    """Row t of TTT step i must be what serving computes: extend on the prefix ending at t, then
    draft i tokens, each step feeding back the previous state with a KV cache."""
    draft = make_draft()
    B, T, steps = 2, 12, 3
    torch.manual_seed(1)
    ids, aux = torch.randint(0, V, (B, T + steps + 1)), torch.randn(B, T, K * H)
    cache, state, states = TTTCache(), draft.project(aux), []
    positions = torch.arange(T).expand(B, T)
    for i in range(steps):
        state = draft.step(ids[:, 1 + i : T + 1 + i], state, positions + i, cache)
        states.append(state)
    for b in range(B):
        for t in (0, 4, T - 1):
            kv = KVCache()
            s = draft.step(ids[b : b + 1, 1 : t + 2], draft.project(aux[b : b + 1, : t + 1]), torch.arange(t + 1)[None], kv)
            h = s[:, -1:]
            assert torch.allclose(h[0, 0], states[0][b, t], atol=1e-5)
            for i in range(1, steps):
                h = draft.step(ids[b : b + 1, t + 1 + i : t + 2 + i], h, torch.tensor([[t + i]]), kv)
                assert torch.allclose(h[0, 0], states[i][b, t], atol=1e-5), (b, t, i)


def plain_ttt_attention(q, ks, vs):
    """TTT step i written out: every query head its own copy of its key head, the keys of steps
    0..i side by side, and an explicit [T, (i+1)T] mask (row t: step-0 keys 0..t, row t of each later step)."""
    groups, T, i = q.shape[1] // ks[0].shape[1], q.shape[2], len(ks) - 1
    keys = torch.cat([k.repeat_interleave(groups, dim=1) for k in ks], dim=2)
    values = torch.cat([v.repeat_interleave(groups, dim=1) for v in vs], dim=2)
    allowed = torch.cat([torch.ones(T, T, dtype=torch.bool).tril()] + [torch.eye(T, dtype=torch.bool)] * i, dim=1)
    scores = (q @ keys.transpose(2, 3) / math.sqrt(q.shape[-1])).masked_fill(~allowed, float("-inf"))
    return torch.softmax(scores, dim=-1) @ values


@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["MHA", "GQA", "MQA"])
def test_ttt_attention_equals_the_plain_masked_attention_with_its_gradients(kv_heads):
    B, heads, T, hd, steps = 2, 4, 9, 8, 4
    g = torch.Generator().manual_seed(kv_heads)
    qs = [torch.randn(B, heads, T, hd, generator=g, requires_grad=True) for _ in range(steps)]
    ks = [torch.randn(B, kv_heads, T, hd, generator=g, requires_grad=True) for _ in range(steps)]
    vs = [torch.randn(B, kv_heads, T, hd, generator=g, requires_grad=True) for _ in range(steps)]
    weights = [torch.randn(B, heads, T, hd, generator=g) for _ in range(steps)]  # a loss that reaches every output

    def outputs_and_grads(attend):
        outs = [attend(i) for i in range(steps)]
        grads = torch.autograd.grad(sum((o * w).sum() for o, w in zip(outs, weights)), qs + ks + vs)
        return outs, grads

    cache = TTTCache()
    got_out, got_grad = outputs_and_grads(lambda i: cache.attend(qs[i], ks[i], vs[i]))
    want_out, want_grad = outputs_and_grads(lambda i: plain_ttt_attention(qs[i], ks[: i + 1], vs[: i + 1]))
    for i, (a, b) in enumerate(zip(got_out, want_out)):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), f"step {i} output"
    for n, (a, b) in enumerate(zip(got_grad, want_grad)):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-5), f"gradient of {'qkv'[n // steps]} at step {n % steps}"


@torch.no_grad()
def test_kv_cache_crop_forgets_rejected_drafts_and_explicit_mask_matches_default():
    draft = make_draft()
    ids, aux = torch.randint(0, V, (1, 9)), torch.randn(1, 8, K * H)
    kv = KVCache()
    s = draft.step(ids[:, 1:], draft.project(aux), torch.arange(8)[None], kv)
    first = draft.step(ids[:, 3:4], s[:, -1:], torch.tensor([[8]]), kv)
    draft.step(ids[:, 4:5], first, torch.tensor([[9]]), kv)
    kv.crop(8)
    again = draft.step(ids[:, 3:4], s[:, -1:], torch.tensor([[8]]), kv)
    assert len(kv) == 9 and torch.allclose(first, again, atol=1e-6)
    kv2 = KVCache()
    mask = torch.ones(8, 8, dtype=torch.bool).tril()[None]
    s2 = draft.step(ids[:, 1:], draft.project(aux), torch.arange(8)[None], kv2, mask=mask)
    assert torch.allclose(s, s2, atol=1e-6)


def test_rope_is_the_targets_own():
    target = make_micro_model("llama", num_layers=1, hidden_size=64, num_heads=4)
    draft = make_draft()
    cfg = DraftConfig(64, 64, 4, 2, 16, 1e-6, 256, 256, 64, 3, 512, target.config.rope_parameters["rope_theta"])
    pos = torch.arange(300)[None]
    cos, sin = Rotary(cfg)(pos)
    ref_cos, ref_sin = target.model.rotary_emb(torch.zeros(1), pos)
    assert torch.allclose(cos, ref_cos, atol=1e-6) and torch.allclose(sin, ref_sin, atol=1e-6)
    scaled = make_draft(rope_scaling={"rope_type": "linear", "factor": 4.0}).rotary
    assert torch.allclose(scaled.inv_freq, draft.rotary.inv_freq / 4)


def test_rotation_is_transformers_rotate_half_bit_for_bit():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    cfg, g = make_draft().config, torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 4, 7, cfg.head_dim, generator=g), torch.randn(2, 2, 7, cfg.head_dim, generator=g)
    cos, sin = Rotary(cfg)(torch.arange(3, 10).expand(2, 7))
    want_q, want_k = apply_rotary_pos_emb(q, k, cos, sin)
    assert torch.equal(rotate(q, cos, sin), want_q) and torch.equal(rotate(k, cos, sin), want_k)


def test_draft_ids_map_to_target_ids_through_d2t():
    draft = make_draft()
    target_ids = torch.arange(VD) * 1 + (V - VD)  # the top VD ids of the target vocab
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[target_ids] = True
    draft.set_vocab(target_ids - torch.arange(VD), t2d)
    assert draft.to_target(torch.tensor([0, 5, VD - 1])).tolist() == [V - VD, V - VD + 5, V - 1]
