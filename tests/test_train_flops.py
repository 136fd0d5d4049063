"""draftlab.train.flops against counts done by hand for a tiny target and draft."""
import pytest

from draftlab.train.draft import DraftConfig
from draftlab.train.flops import Meter, draft_flops, peak_flops, target_flops

# Target: 1 layer, hidden 4, 2 heads of 2 / 1 kv head, MLP 8, vocab 10.
TARGET = {"num_layers": 1, "hidden_size": 4, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 2,
          "intermediate_size": 8, "vocab_size": 10}
DRAFT = DraftConfig(hidden_size=4, intermediate_size=8, num_attention_heads=2, num_key_value_heads=1, head_dim=2,
                    rms_norm_eps=1e-6, vocab_size=10, draft_vocab_size=5, target_hidden_size=4, num_aux_layers=3,
                    max_position_embeddings=64, rope_theta=10000.0)


def test_target_forward_of_one_sequence_of_three_tokens():
    # weights per layer: q 4x4 + k, v 4x2 each + o 4x4 + MLP 3 x 4x8 = 16 + 16 + 16 + 96 = 144
    linear = 2 * 144 * 3  # 3 tokens
    attention = 4 * 2 * 2 * (1 + 2 + 3)  # QK and PV, heads x head_dim, causal keys 1, 2, 3
    labels = 2 * 4 * 10 * 3  # the soft labels' projection onto the full vocab
    assert target_flops(TARGET, [3], online=True) == linear + attention + labels == 1200
    assert target_flops(TARGET, [3], online=False) == labels  # offline: stored states, only the head runs
    assert target_flops({**TARGET, "num_hidden_layers": 2, "num_layers": None}, [3], True) == 2 * (linear + attention) + labels
    assert target_flops(TARGET, [3, 1], True) == 1200 + 2 * 144 + 4 * 2 * 2 * 1 + 2 * 4 * 10


def test_draft_ttt_steps_of_one_sequence_of_three_tokens():
    fc = 2 * (3 * 4) * 4 * 3  # 3 aux states of 4 -> 4, 3 tokens, once
    layer = 8 * 4 + 2 * 8 * 2 + 4 * 4 + 3 * 4 * 8  # q, k, v read the 2H = 8 wide input; o; MLP = 176
    step0 = 2 * layer * 3 + 4 * 2 * 2 * (1 + 2 + 3) + 2 * 4 * 5 * 2  # 2 rows scored through the draft-vocab head
    step1 = 2 * layer * 3 + 4 * 2 * 2 * (2 + 3 + 4) + 2 * 4 * 5 * 1  # each row also sees its step-1 key
    assert draft_flops(DRAFT, [3], [2, 1]) == 3 * (fc + step0 + step1) == 8280


def test_meter_rates_shares_padding_and_no_mfu_without_a_peak():
    m = Meter(TARGET, DRAFT, online=True)
    m.step([3, 1], [2, 1], seconds=0.5, world=1)
    m.step([3], [2, 1], seconds=0.5, world=1)
    s = m.summary(None)
    target, draft = 1200 + 288 + 16 + 80 + 1200, draft_flops(DRAFT, [3, 1], [2, 1]) + 8280
    assert s["tokens"] == 7 and s["tokens_per_s"] == 7.0 and s["steps"] == 2
    assert s["padding_share"] == pytest.approx(2 / 9, abs=1e-4)  # [3, 1] padded to 3: 6 slots, then 3: 2 of 9 padding
    assert s["target_flops_per_s"] == target and s["draft_flops_per_s"] == draft
    assert s["target_flop_share"] == pytest.approx(target / (target + draft), abs=1e-4) and s["mfu"] is None
    assert m.summary(1e4)["mfu"] == pytest.approx((target + draft) / 1e4, abs=1e-4)
    uncountable = Meter({**TARGET, "intermediate_size": None}, DRAFT, online=True)  # e.g. a mixture of experts
    uncountable.step([3], [2, 1], 1.0)
    assert uncountable.summary(1e4)["mfu"] is None and uncountable.summary(1e4)["tokens_per_s"] == 3.0


def test_peak_is_none_on_a_cpu_unless_set(monkeypatch):
    monkeypatch.delenv("DRAFTLAB_PEAK_FLOPS", raising=False)
    assert peak_flops("cpu") is None
    monkeypatch.setenv("DRAFTLAB_PEAK_FLOPS", "1.5e14")
    assert peak_flops("cpu") == 1.5e14


def test_meter_keeps_the_first_steps_seconds_and_each_evaluations_apart_from_the_rates():
    """The first step pays torch.compile and every first use; evaluations are not steps: both are
    reported as they were, and neither moves the steps' rate."""
    m = Meter(TARGET, DRAFT, online=True)
    m.step([3], [3.0], 40.0)
    m.step([3], [3.0], 0.5)
    m.evaluated(1, 21.14)
    m.evaluated(2, 2.2)
    s = m.summary(None)
    assert s["first_step_s"] == 40.0 and s["eval_s_by_epoch"] == {"1": 21.14, "2": 2.2}
    assert s["tokens_per_s"] == round(6 / 40.5, 1)
    assert Meter(TARGET, DRAFT, online=True).summary(None)["first_step_s"] is None
