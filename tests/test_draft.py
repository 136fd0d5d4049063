import pytest
import torch

from draftlab.train.draft import DraftConfig, KVCache, Rotary, TTTCache
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


def test_draft_ids_map_to_target_ids_through_d2t():
    draft = make_draft()
    target_ids = torch.arange(VD) * 1 + (V - VD)  # the top VD ids of the target vocab
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[target_ids] = True
    draft.set_vocab(target_ids - torch.arange(VD), t2d)
    assert draft.to_target(torch.tensor([0, 5, VD - 1])).tolist() == [V - VD, V - VD + 5, V - 1]
