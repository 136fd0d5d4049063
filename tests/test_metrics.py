import pytest
import torch

from draftlab.metrics import (accept_rate, acceptance_counts, chain_tau, conditional_acceptance, leviathan_speedup,
                              leviathan_tokens, pooled_tau, speedup)


def test_chain_tau_from_per_position_acceptance():
    assert chain_tau([]) == 1.0  # no drafts: the bonus token only
    assert chain_tau([1.0, 1.0, 1.0]) == 4.0  # every draft accepted, plus the bonus token
    assert chain_tau([0.5, 0.5]) == pytest.approx(1 + 0.5 + 0.25)
    assert chain_tau([0.0, 1.0, 1.0]) == 1.0  # a chain stops at its first rejection
    assert chain_tau([0.9, 0.8, 0.5]) == pytest.approx(1 + 0.9 + 0.72 + 0.36)


def test_chain_tau_agrees_with_leviathan_for_constant_acceptance():
    for a in (0.0, 0.3, 0.8, 1.0):
        for g in (1, 3, 5):
            assert chain_tau([a] * g) == pytest.approx(leviathan_tokens(a, g))
    assert leviathan_speedup(0.8, 4, 0.05) == pytest.approx(leviathan_tokens(0.8, 4) / 1.2)


def test_pooled_tau_is_total_tokens_over_total_verify_steps_not_a_mean_of_ratios():
    assert pooled_tau([10, 2], [2, 1]) == pytest.approx(4.0)  # the mean of ratios would be 3.5
    assert accept_rate(3.0, 4) == pytest.approx(0.5)
    assert speedup(150.0, 100.0) == pytest.approx(1.5)


def test_conditional_acceptance_counts_each_position_given_all_earlier_accepted():
    # 4 chains (columns), 3 positions (rows).
    correct = torch.tensor([[1, 1, 1, 0],
                            [1, 0, 1, 1],
                            [0, 1, 1, 1]], dtype=torch.bool)
    valid = torch.tensor([[1, 1, 1, 1],
                          [1, 1, 1, 1],
                          [1, 1, 0, 1]], dtype=torch.bool)
    accepted, reached = acceptance_counts(correct, valid)
    # position 1: all 4 reached, 3 accepted; position 2: chains 0,1,2 reached, 0 and 2 accepted;
    # position 3: chain 0 reached (chain 2 is not scored there), rejected.
    assert accepted.tolist() == [3, 2, 0] and reached.tolist() == [4, 3, 1]
    assert conditional_acceptance(accepted, reached) == pytest.approx([0.75, 2 / 3, 0.0])
    assert conditional_acceptance([0], [0]) == [0.0]  # nothing reached: no evidence, no credit
