import pytest

from draftlab.data import tasks
from draftlab.data.tasks import FAMILIES, check_answer, extract_answer, generate, solve, split_of


@pytest.fixture(scope="module")
def heldout():
    return generate(len(FAMILIES) * 30, seed=0, split="heldout")


@pytest.fixture(scope="module")
def train():
    return generate(len(FAMILIES) * 30, seed=0, split="train")


def test_same_seed_same_problems_other_seed_other_problems():
    assert generate(40, seed=3, split="train") == generate(40, seed=3, split="train")
    assert generate(40, seed=3, split="train") != generate(40, seed=4, split="train")


def test_every_family_appears_in_turn(heldout):
    assert [p.family for p in heldout[:len(FAMILIES)]] == list(FAMILIES)
    assert len(FAMILIES) >= 8


def test_splits_are_disjoint_by_prompt_hash(heldout, train):
    assert all(split_of(p.prompt) == "heldout" for p in heldout)
    assert all(split_of(p.prompt) == "train" for p in train)
    assert not {p.prompt for p in heldout} & {p.prompt for p in generate(5000, seed=1, split="train")}
    # the split ignores case and spacing, so a reworded copy cannot cross over
    assert split_of(heldout[0].prompt.upper().replace(" ", "  ")) == "heldout"


def test_heldout_prompts_are_distinct(heldout):
    assert len({p.prompt for p in heldout}) == len(heldout)


def test_prompt_alone_gives_back_the_problem(heldout, train):
    for p in heldout + train:
        assert solve(p.prompt) == p  # exactly one family parses it, with the same answer


def test_checker_accepts_the_right_answer_and_rejects_wrong_ones(heldout):
    for p in heldout:
        assert check_answer(p, p.response)
        assert check_answer(p.prompt, p.response + tasks.EOS)  # from the prompt text alone
        wrong = p.response.replace(f"The answer is {p.answer}.", f"The answer is {p.answer}0.")
        assert not check_answer(p, wrong)
        assert not check_answer(p, p.reasoning)  # no closed think span, no answer
    with pytest.raises(ValueError):
        check_answer("Tell me a joke.", "<think>\n</think>\nThe answer is 1.")


def test_answers_are_right():
    def one(prompt):
        return solve(prompt).answer

    assert one("What is 4827 + 395?") == "5222"
    assert one("Subtract 395 from 4827.") == "4432"
    assert one("What is 47 times 8?") == "376"
    assert one("Sort these numbers from largest to smallest: 3, 42, 7.") == "42, 7, 3"
    assert one("How many times does the letter 'r' appear in 'strawberry'?") == "3"
    assert one("Reverse the word 'planet'.") == "tenalp"
    assert one("Convert 3 km 250 m to meters.") == "3250 m"
    assert one("Evaluate 3 + 4 * (5 - 2).") == "15"
    assert one("What does this program print?\nx = 2\nfor i in range(3):\n    x = x + 4\nprint(x)") == "14"


def test_reasoning_is_step_by_step():
    p = solve("What is 4827 + 395?")
    assert p.reasoning.splitlines()[1:3] == ["7 + 5 + 0 = 12, write 2, carry 1.", "2 + 9 + 1 = 12, write 2, carry 1."]
    assert p.response == f"<think>\n{p.reasoning}\n</think>\nThe answer is 5222."


def test_extract_answer_reads_only_after_think():
    assert extract_answer("<think>\nThe answer is 3.\n</think>\nThe answer is 4.<|end|>") == "4"
    assert extract_answer("<think>\nThe answer is 3.") is None


def test_a_large_heldout_set_keeps_its_first_problems_and_stays_distinct():
    # 'mul' runs out of distinct held-out prompts near 410; the other families take its turns.
    big = generate(4800, seed=1234, split="heldout")
    assert big[:480] == generate(480, seed=1234, split="heldout")
    assert len({p.prompt for p in big}) == 4800
    assert {p.family for p in big[-90:]} == set(FAMILIES) - {"mul"}


def test_when_every_family_runs_out_the_error_says_how_many_there_are():
    with pytest.raises(ValueError, match=r"there are 410 \(asked for 500\)"):
        generate(500, seed=1234, split="heldout", families=("mul",))


def test_builtin_prompts_beyond_the_supply_name_the_param(monkeypatch):
    from draftlab.errors import UserError
    from draftlab.data.prompts import builtin_prompts

    only_mul = tasks.generate
    monkeypatch.setattr(tasks, "generate", lambda n, seed, split, **kw: only_mul(n, seed, split, families=("mul",), **kw))
    with pytest.raises(UserError, match="prompts.num_prompts 500: .*there are 410"):
        builtin_prompts(500, seed=1234)
