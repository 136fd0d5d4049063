import time

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.support.micro import make_micro_model, make_micro_tokenizer, save_micro_model
from draftlab.data.tasks import CHAT_TEMPLATE, EOS, THINK


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_builds_fast_with_one_hidden_state_per_layer_plus_embedding(arch):
    make_micro_model(arch)  # first build pays for lazy imports
    t0 = time.perf_counter()
    model = make_micro_model(arch, num_layers=3)
    assert time.perf_counter() - t0 < 1.0
    assert not model.training and model.dtype == torch.float32
    assert model.config.num_key_value_heads < model.config.num_attention_heads
    out = model(torch.arange(10)[None], output_hidden_states=True)
    assert len(out.hidden_states) == 3 + 1
    assert out.logits.shape == (1, 10, 256)


def test_same_seed_same_weights_and_rng_untouched():
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a = make_micro_model(seed=1)
    assert torch.equal(torch.rand(1), before)  # caller's random stream unchanged
    b, c = make_micro_model(seed=1), make_micro_model(seed=2)
    wa, wb, wc = (m.model.layers[0].mlp.up_proj.weight for m in (a, b, c))
    assert torch.equal(wa, wb) and not torch.equal(wa, wc)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_save_load_round_trip_offline(tmp_path, monkeypatch, arch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = save_micro_model(tmp_path, arch=arch, num_layers=2, seed=7)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    tok = AutoTokenizer.from_pretrained(tmp_path)
    ids = tok.apply_chat_template([{"role": "user", "content": "Sort: 3 1 2"}], add_generation_prompt=True,
                                  return_dict=False)
    x = torch.tensor([ids])
    assert torch.allclose(model(x).logits, loaded(x).logits)
    assert loaded.config.model_type == arch and loaded.config.eos_token_id == tok.eos_token_id


def test_tokenizer_speaks_the_target_chat_format():
    tok = make_micro_tokenizer()
    assert tok.chat_template == CHAT_TEMPLATE and tok.eos_token == EOS
    text = tok.apply_chat_template(
        [{"role": "user", "content": "Reverse 'abc' ñ"},
         {"role": "assistant", "content": "cba", "reasoning_content": "c, b, a"}], tokenize=False)
    ids = tok(text)["input_ids"]
    assert tok.decode(ids) == text  # lossless, non-ASCII included
    assert ids[-1] == tok.eos_token_id and tok.convert_tokens_to_ids(THINK) in ids
    assert len(tok) == 256
