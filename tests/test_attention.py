"""draftlab.engine.attention: a grouped-query target on the CPU verifies without copying its cache per
head group, and gives the very logits transformers' own sdpa attention gives."""
import pytest
import torch
import torch.nn.functional as F

from draftlab.engine import attention, speculative
from tests.support.micro import make_micro_model

PROMPT = torch.tensor([[5, 9, 200, 3, 77, 12, 40, 41]])


def verify_logits(model, mask_for):
    """Prefill PROMPT, then one 4-token block with the engine's kind of 4D mask."""
    with torch.inference_mode():
        cache = speculative.new_cache(model)
        speculative.target_forward(model, PROMPT, cache)
        n, block = PROMPT.shape[1], torch.tensor([[7, 8, 9, 10]])
        return speculative.target_forward(model, block, cache, attention_mask=mask_for(n, 4))


def chain_mask(n, N):
    mask = torch.zeros(1, 1, N, n + N)
    mask[0, 0, :, n:] = speculative._causal_block(N, torch.float32)
    return mask


def tree_mask(n, N):  # root, two children of the root, a grandchild under the second
    allowed = torch.zeros(N, n + N, dtype=torch.bool)
    allowed[:, :n] = True
    for node, parent in enumerate([-1, 0, 0, 2]):
        if parent >= 0:
            allowed[node, n:] = allowed[parent, n:]
        allowed[node, n + node] = True
    return torch.zeros(1, 1, N, n + N).masked_fill(~allowed, torch.finfo(torch.float32).min)


@pytest.mark.parametrize("mask_for", [chain_mask, tree_mask])
def test_the_switched_target_gives_sdpas_logits(mask_for):
    plain, switched = make_micro_model("llama", seed=3), make_micro_model("llama", seed=3)
    assert plain.config._attn_implementation == "sdpa"
    assert attention.use_shared_kv(switched) and switched.config._attn_implementation == attention.NAME
    assert attention.use_shared_kv(switched)  # idempotent
    torch.testing.assert_close(verify_logits(switched, mask_for), verify_logits(plain, mask_for), rtol=1e-5, atol=1e-5)


def test_a_masked_call_shares_the_key_heads_in_the_kernel(monkeypatch):
    model = make_micro_model("llama", seed=3)  # 4 heads over 2 key/value heads
    attention.use_shared_kv(model)
    seen = []
    real = F.scaled_dot_product_attention

    def spy(q, k, v, **kw):
        seen.append((q.shape[1], k.shape[1], kw.get("enable_gqa", False), kw.get("attn_mask") is not None))
        return real(q, k, v, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    verify_logits(model, chain_mask)
    masked = [s for s in seen if s[3]]
    assert masked and all(s[:3] == (4, 2, True) for s in masked)  # 2 key heads read by 4 query heads, no copy


def test_models_it_cannot_serve_are_left_as_they_are():
    eager = make_micro_model("llama", seed=3)
    eager.set_attn_implementation("eager")
    assert not attention.use_shared_kv(eager) and eager.config._attn_implementation == "eager"

    class NotAModel:
        device = "cpu"

    assert not attention.use_shared_kv(NotAModel())


def test_the_engine_switches_its_target_for_baseline_and_speculative_decoding_alike():
    model = make_micro_model("llama", seed=5)
    speculative.baseline_generate(model, PROMPT[0].tolist(), 4, ignore_eos=True)
    assert model.config._attn_implementation == attention.NAME
