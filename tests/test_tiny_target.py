"""The shipped default target, models/tiny-target: loads offline and behaves like a chat target."""
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from draftlab.data import tasks

DIR = Path(__file__).resolve().parents[1] / "models" / "tiny-target"


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(DIR, local_files_only=True)


@pytest.fixture(scope="module")
def model():
    return AutoModelForCausalLM.from_pretrained(DIR, local_files_only=True).eval()


def test_config_meets_the_size_and_shape_requirements(model):
    c = model.config
    assert c.model_type == "llama" and c.num_hidden_layers >= 8
    assert c.num_key_value_heads < c.num_attention_heads  # grouped-query attention
    assert c.tie_word_embeddings is False
    assert not torch.equal(model.get_input_embeddings().weight, model.get_output_embeddings().weight)
    assert sum(f.stat().st_size for f in DIR.rglob("*") if f.is_file()) <= 30 * 2**20


def test_chat_template_renders_a_reasoning_turn_as_the_card_says(tok):
    messages = [{"role": "user", "content": "What is 2 + 3?"},
                {"role": "assistant", "content": "The answer is 5.", "reasoning_content": "2 + 3 = 5."}]
    text = tok.apply_chat_template(messages, tokenize=False)
    assert text == "<|user|>\nWhat is 2 + 3?<|end|><|assistant|>\n<think>\n2 + 3 = 5.\n</think>\nThe answer is 5.<|end|>"
    inline = [messages[0], {"role": "assistant", "content": "<think>\n2 + 3 = 5.\n</think>\nThe answer is 5."}]
    assert tok.apply_chat_template(inline, tokenize=False) == text
    assert tok.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True).endswith("<|assistant|>\n")
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids[-1] == tok.eos_token_id == tok.convert_tokens_to_ids("<|end|>") == 1
    assert [tok.convert_tokens_to_ids(t) for t in ("<think>", "</think>")] == [5, 6]
    assert tok.decode(ids) == text
    # the card shows a held-out problem rendered by this same template
    example = tasks.generate(1, seed=0, split="heldout")[0]
    assert tok.apply_chat_template(example.messages(), tokenize=False) in (DIR / "README.md").read_text()


def test_generation_config_is_greedy_and_stops_at_eos(model, tok):
    g = model.generation_config
    assert g.eos_token_id == tok.eos_token_id and not g.do_sample
    assert g.max_new_tokens >= 150


def test_greedy_answer_to_a_heldout_prompt_is_right_and_ends_with_eos(model, tok):
    problem = tasks.generate(1, seed=0, split="heldout")[0]
    enc = tok.apply_chat_template([{"role": "user", "content": problem.prompt}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one-token steps: extra threads only spin, and on a busy CPU take 20x longer
    try:
        with torch.no_grad():
            out = model.generate(**enc)  # the shipped generation_config: greedy, max_new_tokens
    finally:
        torch.set_num_threads(threads)
    new = out[0, enc["input_ids"].shape[1]:].tolist()
    assert new[-1] == tok.eos_token_id
    text = tok.decode(new)
    assert text.startswith("<think>\n") and tasks.check_answer(problem.prompt, text)


def test_card_and_eval_report_the_acceptance_figures():
    ev = json.loads((DIR / "eval.json").read_text())["eval"]
    assert set(ev["accuracy_per_family"]) == set(tasks.FAMILIES)
    assert ev["accuracy_mean"] >= 0.90 and ev["eos_share"] >= 0.95
    card = (DIR / "README.md").read_text()
    assert f"{ev['accuracy_mean']:.1%}" in card and f"{ev['eos_share']:.1%}" in card
    assert f"{ev['heldout_loss']:.4f}" in card
