"""The reference server's engines, in-process: spec_engine's decode loop and sampler behind
SGLang's sampling params (stop tokens and strings, seeds, finish reasons)."""
import pytest
import torch

from draftlab.engine import speculative
from draftlab.train.draft import DraftConfig, Eagle3Draft
from draftlab.engine.runners import Engine, SamplingParams, SpecEngine
from draftlab.sglang.checkpoint import export_sglang, read_exported
from tests.support.micro import make_micro_model, make_micro_tokenizer

PROMPT = [5, 9, 200, 3, 77, 12]
PHYSICAL = [1, 2, 3]


@pytest.fixture(scope="module")
def engine():
    model = make_micro_model("llama", num_layers=4, seed=11)
    model.config.architectures = ["LlamaForCausalLM"]
    return Engine(model, make_micro_tokenizer(model.config.vocab_size), "cpu")


@pytest.fixture(scope="module")
def greedy(engine):
    return speculative.baseline_generate(engine.model, PROMPT, 16, ignore_eos=True).output_ids


def test_greedy_is_spec_engines_baseline_and_stops_on_a_stop_token(engine, greedy):
    out = engine.generate(PROMPT, SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True))
    assert out.output_ids == greedy and out.finish_reason == {"type": "length", "length": 16}
    assert out.text == engine.decode(greedy)
    stop = engine.generate(PROMPT, SamplingParams(max_new_tokens=16, temperature=0, stop_token_ids=[greedy[4]]))
    assert stop.output_ids == greedy[: greedy.index(greedy[4]) + 1]  # the stop token kept and counted
    assert stop.finish_reason == {"type": "stop", "matched": greedy[4]}


def test_a_stop_string_ends_the_request_and_is_cut_from_the_text(engine, greedy):
    full = engine.decode(greedy)
    stop = next(full[i:i + 2] for i in range(3, len(full) - 2) if full[i:i + 2].strip())
    out = engine.generate(PROMPT, SamplingParams(max_new_tokens=16, temperature=0, stop=["never-there", stop], ignore_eos=True))
    assert out.finish_reason == {"type": "stop", "matched": stop}
    assert out.text == full[: full.index(stop)]
    assert stop in engine.decode(out.output_ids) and stop not in engine.decode(out.output_ids[:-1])  # stopped at once


def test_a_seed_gives_the_same_sample(engine):
    sampling = SamplingParams(max_new_tokens=12, temperature=1.0, top_p=0.9, top_k=50, seed=7, ignore_eos=True)
    a, b = engine.generate(PROMPT, sampling), engine.generate(PROMPT, sampling)
    c = engine.generate(PROMPT, SamplingParams(max_new_tokens=12, temperature=1.0, top_p=0.9, top_k=50, seed=8, ignore_eos=True))
    assert a.output_ids == b.output_ids != c.output_ids


def test_a_prompt_at_the_context_length_is_refused_naming_both_lengths(engine):
    with pytest.raises(ValueError, match=f"{engine.context_length} tokens"):
        engine.generate([1] * engine.context_length, SamplingParams())


def test_the_spec_engine_serves_an_exported_draft_on_the_layers_sglang_feeds_it(engine, greedy, tmp_path):
    model = engine.model
    c = model.config
    cfg = DraftConfig(hidden_size=c.hidden_size, intermediate_size=2 * c.hidden_size, num_attention_heads=c.num_attention_heads,
                      num_key_value_heads=c.num_key_value_heads, head_dim=c.hidden_size // c.num_attention_heads, rms_norm_eps=1e-6,
                      vocab_size=c.vocab_size, draft_vocab_size=c.vocab_size, target_hidden_size=c.hidden_size, num_aux_layers=3,
                      max_position_embeddings=c.max_position_embeddings, rope_theta=10000.0)
    torch.manual_seed(5)
    draft = Eagle3Draft(cfg, model.get_input_embeddings().weight).eval()
    facts = {"architecture": "LlamaForCausalLM", "num_layers": 4, "max_position_embeddings": c.max_position_embeddings}
    export_sglang(draft, tmp_path / "draft", facts, PHYSICAL, "0.5.14", dtype="float32")

    spec = SpecEngine(model, engine.tokenizer, "cpu", None, str(tmp_path / "draft"), 3, 1, 4, "0.5.14")
    assert spec.physical == read_exported(tmp_path / "draft").served_physical("LlamaForCausalLM", 4, "0.5.14") == PHYSICAL
    out = spec.generate(PROMPT, SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True))
    assert out.output_ids == greedy  # greedy speculation is the target's own output
    assert out.meta["spec_verify_ct"] >= 1 and len(out.meta["spec_correct_drafts_histogram"]) == 4
    assert spec.info()["avg_spec_accept_length"] == pytest.approx(16 / out.meta["spec_verify_ct"])
    assert len(spec.hidden_states(PROMPT)[0]) == 3 * c.hidden_size  # the aux concatenation the draft is fed
    assert len(engine.hidden_states(PROMPT)[0]) == c.hidden_size
    with pytest.raises(ValueError, match="stop strings"):
        spec.generate(PROMPT, SamplingParams(stop=["x"]))
