"""Speculative decoding gives the target's own output (greedy) or distribution (sampling), and counts as SGLang."""
import math

import pytest
import torch

from draftlab.engine import speculative
from tests.support.drafts import ScriptedDraft, random_draft
from draftlab.train.draft import Eagle3Draft
from draftlab.sglang.checkpoint import export_sglang, load_exported
from draftlab.sglang.flags import tree_candidates
from tests.support.micro import make_micro_model
from draftlab.sglang.layers import captured_physical

PHYSICAL = [1, 2, 3]  # outputs of decoder layers 0..2 of a 4-layer micro target
PROMPTS = [[17], [5, 9, 200, 3, 77, 12], list(range(40, 57))]
CONFIGS = [(1, 1, 2), (3, 1, 4), (2, 2, 4), (4, 3, 10)]  # (num_steps, topk, num_draft_tokens)


def spec(target, draft, prompt, config, max_new, **kw):
    steps, topk, tokens = config
    kw.setdefault("physical_layers", PHYSICAL)
    return speculative.generate(target, draft, prompt, num_steps=steps, topk=topk, num_draft_tokens=tokens, max_new_tokens=max_new, **kw)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def target(request):
    return make_micro_model(request.param, num_layers=4, seed=11)


@pytest.fixture(scope="module")
def references(target):
    """The target's greedy continuation of each prompt (24 tokens, EOS ignored)."""
    return [speculative.baseline_generate(target, p, 24, ignore_eos=True).output_ids for p in PROMPTS]


# --- greedy: the output is the target's own --------------------------------------------------


def test_baseline_is_transformers_greedy_generate(target, references):
    for prompt, ref in zip(PROMPTS[1:], references[1:]):
        out = target.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert out[0, len(prompt):].tolist() == ref


def test_a_fully_accepted_chain_keeps_the_cache_under_older_transformers_crop(target, references, monkeypatch):
    """transformers 5.8 (the release SGLang 0.5.14 pins) reads cache.crop(0) as "keep 0 tokens":
    a verify step that accepts every draft must not call it, or the next step sees no context."""
    from transformers.cache_utils import DynamicLayer

    def crop_5_8(self, max_length):  # transformers 5.8.1's DynamicLayer.crop
        if max_length < 0:
            max_length = self.get_seq_length() - abs(max_length)
        if self.get_seq_length() > max_length:
            self.keys, self.values = self.keys[..., :max_length, :], self.values[..., :max_length, :]

    monkeypatch.setattr(DynamicLayer, "crop", crop_5_8)
    for prompt, ref in zip(PROMPTS, references):
        perfect = ScriptedDraft(prompt + ref, target.config.vocab_size, hit_rate=1.0, seed=0)
        r = spec(target, perfect, prompt, (3, 1, 4), 24, ignore_eos=True)
        assert r.output_ids == ref and r.accept_hist[-1] > 0  # full acceptances happened


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "steps%d-topk%d-tokens%d" % c)
def test_greedy_output_equals_the_targets_for_any_draft(target, references, config):
    drafts = [random_draft(target, 1), random_draft(target, 2, draft_vocab=64)]
    for prompt, ref in zip(PROMPTS, references):
        noisy = ScriptedDraft(prompt + ref, target.config.vocab_size, hit_rate=0.6, seed=len(prompt))
        for draft in drafts + [noisy]:
            r = spec(target, draft, prompt, config, 24, ignore_eos=True)
            assert r.output_ids == ref, (type(draft).__name__, prompt)
            assert r.finish_reason == {"type": "length", "length": 24}
            assert sum(r.accept_hist) == r.spec_verify_ct
            assert 1 + sum((a + 1) * n for a, n in enumerate(r.accept_hist)) == len(r.output_ids)  # prefill token + steps
        # the noisy draft is right often: long and partial acceptances were both exercised
        if config[0] > 1:
            assert r.accept_hist[0] < r.spec_verify_ct and max(a for a, n in enumerate(r.accept_hist) if n) >= 2


@pytest.mark.parametrize("config", [(3, 1, 4), (3, 3, 7)], ids=["chain", "tree"])
def test_eos_stops_inside_an_accepted_block_and_ignore_eos_runs_on(target, references, config):
    prompt, ref = PROMPTS[1], references[1]
    eos = ref[6]
    want = ref[: ref.index(eos) + 1]
    oracle = ScriptedDraft(prompt + ref, target.config.vocab_size)
    base = speculative.baseline_generate(target, prompt, 24, eos_token_id=eos)
    r = spec(target, oracle, prompt, config, 24, eos_token_id=[eos, 99999])
    assert base.output_ids == want and r.output_ids == want
    assert r.finish_reason == base.finish_reason == {"type": "stop", "matched": eos}
    r = spec(target, oracle, prompt, config, 24, eos_token_id=eos, ignore_eos=True)
    assert r.output_ids == ref and r.finish_reason == {"type": "length", "length": 24}


# --- counting, as SGLang ---------------------------------------------------------------------


@pytest.mark.parametrize("config", [(1, 1, 2), (4, 1, 5), (4, 3, 8)], ids=["chain1", "chain4", "tree"])
def test_oracle_draft_accepts_every_draft(target, references, config):
    steps = config[0]
    prompt, ref = PROMPTS[2], references[2]
    k = (24 - 1) // (steps + 1)  # verify steps that fit: the prefill gives the first token
    max_new = 1 + k * (steps + 1)
    r = spec(target, ScriptedDraft(prompt + ref, target.config.vocab_size), prompt, config, max_new, ignore_eos=True)
    assert r.output_ids == ref[:max_new]
    assert r.spec_verify_ct == k and r.accept_hist == [0] * steps + [k]
    assert r.proposed == r.accepted == [k] * steps and r.acceptance == [1.0] * steps
    assert r.tau == pytest.approx(max_new / k)  # SGLang: completion tokens / verify steps
    assert r.meta() == {"completion_tokens": max_new, "spec_verify_ct": k, "spec_accept_length": r.tau}
    assert 0 < r.prefill_s + r.draft_s + r.verify_s <= r.total_s
    # each round's first draft predicts the answer token after the last one emitted: 1, then steps + 1 further each round
    assert r.rounds == [(1 + j * (steps + 1), steps) for j in range(k)]


@pytest.mark.parametrize("config", [(3, 1, 4), (3, 4, 12)], ids=["chain", "tree"])
def test_null_draft_accepts_nothing(target, references, config):
    prompt, ref = PROMPTS[1], references[1]
    r = spec(target, ScriptedDraft(prompt + ref, target.config.vocab_size, never=True), prompt, config, 24, ignore_eos=True)
    assert r.output_ids == ref
    assert r.spec_verify_ct == 23 and r.accept_hist == [23] + [0] * config[0]
    assert r.proposed[0] == 23 and r.accepted == [0] * config[0]
    assert r.tau == pytest.approx(24 / 23)
    assert r.rounds == [(p, 0) for p in range(1, 24)]  # one token a round, nothing accepted


def test_flags_sglang_would_change_or_reject_are_refused(target):
    with pytest.raises(ValueError, match="num_steps \\+ 1"):
        spec(target, None, [1, 2], (3, 1, 8), 4)
    with pytest.raises(ValueError, match="num_draft_tokens 20"):
        spec(target, None, [1, 2], (2, 2, 20), 4)  # a 2-step topk-2 tree makes 6 nodes at most


def test_the_tree_bound_is_sglangs_tree_candidates():
    for steps, topk in [(2, 2), (3, 3), (1, 4)]:
        most = tree_candidates(steps, topk) + 1  # the root and every node the tree search makes
        speculative.check_flags(steps, topk, most)
        with pytest.raises(ValueError, match=f"must be in 2..{most} "):
            speculative.check_flags(steps, topk, most + 1)


def test_baseline_stop_when_ends_the_request_with_what_it_matched(target, references):
    ref = references[1]
    out = speculative.baseline_generate(target, PROMPTS[1], 24, ignore_eos=True, stop_when=lambda ids: "five" if len(ids) == 5 else None)
    assert out.output_ids == ref[:5] and out.finish_reason == {"type": "stop", "matched": "five"}
    stop_token = speculative.baseline_generate(target, PROMPTS[1], 24, eos_token_id=ref[2], stop_when=lambda ids: "late" if len(ids) > 2 else None)
    assert stop_token.finish_reason == {"type": "stop", "matched": ref[2]}  # a stop token first, as the server checks them


# --- caches stay consistent after partial acceptance ------------------------------------------


def test_target_cache_after_partial_acceptance_equals_a_fresh_forward(target):
    prompt = PROMPTS[2]
    n = len(prompt)

    def fresh(tokens):
        with torch.no_grad():
            return target(torch.tensor([tokens])).logits[0, -1].float()

    #            0    1    2    3    4    5
    tree = speculative.Tree(tokens=[7, 30, 31, 32, 33, 34], parents=[-1, 0, 0, 1, 2, 4], depths=[0, 1, 1, 2, 2, 3])
    for path in ([0, 2, 4, 5], [0, 1, 3], [0]):  # gathered out of the tree / a chain prefix (crop)
        cache = speculative.new_cache(target)
        with torch.no_grad():
            speculative.target_forward(target, torch.tensor([prompt]), cache)
            logits = speculative.verify_tree(target, cache, tree, n)
        for node in range(6):  # tree attention: each node sees exactly its own path
            line, a = [], node
            while a >= 0:
                line.insert(0, tree.tokens[a])
                a = tree.parents[a]
            torch.testing.assert_close(logits[node], fresh(prompt + line), atol=1e-4, rtol=1e-4)
        speculative.keep_kv(cache, n, path)
        assert cache.get_seq_length() == n + len(path)
        accepted = [tree.tokens[c] for c in path]
        with torch.no_grad():
            nxt = speculative.target_forward(target, torch.tensor([[123]]), cache)[0, -1].float()
        torch.testing.assert_close(nxt, fresh(prompt + accepted + [123]), atol=1e-4, rtol=1e-4)


class SpyDraft(Eagle3Draft):
    def step(self, input_ids, hidden, position_ids, cache, mask=None):
        self.cache = cache
        return super().step(input_ids, hidden, position_ids, cache, mask)


def test_draft_cache_holds_rows_fed_by_the_target_not_by_the_draft():
    # A 16-token vocabulary: an untrained topk-4 draft is accepted now and then, at several depths.
    target = make_micro_model("llama", num_layers=4, hidden_size=32, vocab_size=16, num_heads=2, num_kv_heads=1, seed=5)
    draft = random_draft(target, 3)
    draft.__class__ = SpyDraft
    prompt = [3, 9, 4, 1, 12]
    r = spec(target, draft, prompt, (3, 4, 10), 40, ignore_eos=True)
    assert r.output_ids == speculative.baseline_generate(target, prompt, 40, ignore_eos=True).output_ids
    assert r.accepted[0] > 3 and r.accepted[1] > 0  # accepted rows at depths 1 and 2
    # What a fresh draft prefill over the committed text, fed by one target forward, would cache.
    rows = len(draft.cache)
    text = torch.tensor([prompt + r.output_ids])
    with speculative.AuxCapture(target, PHYSICAL) as aux, torch.no_grad():
        target(text[:, :rows])
        fresh = speculative.KVCache()
        draft.step(text[:, 1 : rows + 1], draft.project(aux.take()), torch.arange(rows)[None], fresh)
    assert rows >= len(prompt) + len(r.output_ids) - 6  # everything but the last block
    torch.testing.assert_close(draft.cache.k, fresh.k, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(draft.cache.v, fresh.v, atol=1e-4, rtol=1e-4)


def test_an_exported_draft_runs_as_loaded_with_the_layers_sglang_would_capture(tmp_path):
    target = make_micro_model("llama", num_layers=4, seed=11)
    draft = random_draft(target, 5, draft_vocab=64)
    facts = {"architecture": "LlamaForCausalLM", "num_layers": 4, "max_position_embeddings": 512}
    export_sglang(draft, tmp_path / "draft", facts, PHYSICAL, "0.5.14", dtype="float32")
    loaded, config = load_exported(tmp_path / "draft", embed=target.get_input_embeddings().weight)
    physical = captured_physical("LlamaForCausalLM", 4, config["eagle_config"]["eagle_aux_hidden_state_layer_ids"], "0.5.14")
    assert physical == PHYSICAL
    prompt = PROMPTS[1]
    a = spec(target, loaded, prompt, (3, 2, 6), 16, physical_layers=physical, ignore_eos=True)
    b = spec(target, draft, prompt, (3, 2, 6), 16, ignore_eos=True)
    assert a.output_ids == b.output_ids == speculative.baseline_generate(target, prompt, 16, ignore_eos=True).output_ids
    assert (a.accept_hist, a.proposed, a.accepted) == (b.accept_hist, b.proposed, b.accepted)


# --- sampling: the target's distribution ------------------------------------------------------

MEMO: dict[tuple, torch.Tensor] = {}


class ContextDraft:
    """Proposes the target's own most likely tokens for the exact context of every row.

    Its state is the row's context (token ids, -1 padded): committed rows (prefill, extend: no
    mask) read it from the text so far, tree rows extend their parent's. Target logits are memoized.
    """

    W = 32

    def __init__(self, target, prompt):
        self.target, self.text = target, list(prompt)

    def project(self, aux):
        return torch.full((*aux.shape[:-1], self.W), -1.0)

    def step(self, input_ids, hidden, position_ids, cache, mask=None):
        z = torch.zeros(1, 1, input_ids.shape[1], 1)
        cache.attend(z, z, z)
        out = torch.full((*input_ids.shape, self.W), -1.0)
        for r, (tok, p) in enumerate(zip(input_ids[0].tolist(), position_ids[0].tolist())):
            if mask is None:  # row p embeds the committed token p + 1
                del self.text[p + 1 :]
                self.text.append(tok)
                ctx = self.text[: p + 2]
            else:
                ctx = [int(v) for v in hidden[0, r].tolist() if v >= 0] + [tok]
            out[0, r, : len(ctx)] = torch.tensor(ctx, dtype=torch.float)
        return out

    def logits(self, state):
        rows = []
        for row in state.reshape(-1, self.W).tolist():
            ctx = tuple(int(v) for v in row if v >= 0)
            if ctx not in MEMO:
                MEMO[ctx] = self.target(torch.tensor([ctx])).logits[0, -1].float()
            rows.append(MEMO[ctx])
        return torch.stack(rows).view(*state.shape[:-1], -1)

    def to_target(self, ids):
        return ids


def chi2_critical(df: int, z: float = 3.09) -> float:
    """Upper 0.1% point of chi-square (Wilson-Hilferty)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi2(counts: torch.Tensor, p: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic and degrees of freedom; cells expected below 5 are pooled into one."""
    expected = p * counts.sum()
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = exp > 0
    return float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()), int(keep.sum()) - 1


@pytest.mark.parametrize("config,runs", [((3, 1, 4), 600), ((2, 3, 6), 1000)], ids=["chain", "tree"])
def test_sampling_keeps_the_targets_distribution(config, runs):
    V, T = 16, 0.8
    target = make_micro_model("llama", num_layers=2, hidden_size=32, vocab_size=V, num_heads=2, num_kv_heads=1, intermediate_size=64, seed=5)
    with torch.no_grad():
        target.lm_head.weight.mul_(16)  # peaked distributions (top token ~0.5): a biased sampler shows
    prompt = [3, 7, 2, 9]

    def dist(texts):
        with torch.no_grad():
            return torch.softmax(target(torch.tensor(texts)).logits[:, -1].float() / T, -1)

    # Exact marginals of generated tokens 2 and 3 (token 1 comes from the prefill, not speculation).
    p1 = dist([prompt])[0]
    p12 = p1[:, None] * dist([prompt + [a] for a in range(V)])
    p3 = dist([prompt + [a, b] for a in range(V) for b in range(V)]).view(V, V, V)
    exact = [p12.sum(0), (p12[:, :, None] * p3).sum((0, 1))]

    counts = torch.zeros(2, V)
    accepted = 0
    with torch.inference_mode():
        for seed in range(runs):
            r = spec(target, ContextDraft(target, prompt), prompt, config, 3, temperature=T, ignore_eos=True,
                     physical_layers=[0, 1, 2], generator=torch.Generator().manual_seed(seed))
            counts[0, r.output_ids[1]] += 1
            counts[1, r.output_ids[2]] += 1
            accepted += sum(r.accepted)
    assert accepted > runs / 4  # speculation did most of the work, not the fallback
    for c, p in zip(counts, exact):
        stat, df = chi2(c, p)
        assert stat < chi2_critical(df), (stat, df)


def test_a_sliding_window_target_past_its_window_decodes_its_own_greedy_output_and_refuses_trees():
    """gpt-oss: every other layer attends over the last 128 positions only, and keeps only those in
    its cache. A chain past the window must still give the target's own greedy tokens, with a draft
    that is always right (every round crops nothing) and one that is never right (every round crops
    the whole block); a tree, which needs a mask over every cached position, is refused by name."""
    from draftlab.errors import UserError
    from tests.support.tools import load_tool

    target = load_tool("micro_targets").make_model("gpt-oss").eval()
    assert target.config.sliding_window == 128
    prompt = [(7 * i) % 200 + 20 for i in range(150)]  # longer than the window before the first round
    ref = speculative.baseline_generate(target, prompt, 24, ignore_eos=True).output_ids
    for never in (False, True):
        draft = ScriptedDraft(prompt + ref, target.config.vocab_size, never=never)
        r = spec(target, draft, prompt, (3, 1, 4), 24, ignore_eos=True, physical_layers=[1, 2, 3])
        assert r.output_ids == ref
    with pytest.raises(UserError, match="sliding-window.*spec.topk: 1"):
        spec(target, ScriptedDraft(prompt + ref, target.config.vocab_size), prompt, (3, 4, 12), 24, ignore_eos=True,
             physical_layers=[1, 2, 3])


def test_the_offline_run_decodes_each_prompt_both_ways_unless_a_served_engine_is_scaled_instead():
    """For a server of another engine the advice scales on its served rounds, so the in-process
    baseline decode (a minute of eager 8B) is left out; the speculative figures are the same."""
    from draftlab.bench import offline
    from draftlab.sglang.flags import SpecFlags

    target = make_micro_model("llama", num_layers=4, seed=11)
    draft = random_draft(target, seed=3)
    flags = SpecFlags(algorithm="EAGLE3", num_steps=3, topk=1, num_draft_tokens=4)
    both = offline.offline_run(target, draft, PROMPTS[1:], flags, PHYSICAL, 12, set(), True)
    spec_only = offline.offline_run(target, draft, PROMPTS[1:], flags, PHYSICAL, 12, set(), True, with_baseline=False)
    assert both["baseline_step_s"] > 0 and spec_only["baseline_step_s"] is None
    assert spec_only["tau"] == both["tau"] and spec_only["outputs"] == both["outputs"]


def test_the_offline_rounds_step1_acceptance_splits_by_kind_of_token_and_answer_position():
    """Hand-made results: which rounds land on loop tokens and in which band is known exactly."""
    from draftlab.bench.offline import step1_by_group

    loop = list(range(100, 110)) * 3  # 30 tokens: the gram ending at 17 (position 17 on) repeats one ending at 7
    first = speculative.SpecResult(loop + list(range(200, 270)), {}, 4, [], [], [], 0, 0, 0, 0,
                                   rounds=[(1, 2), (20, 3), (70, 0), (90, 1)])
    second = speculative.SpecResult(list(range(300, 440)), {}, 2, [], [], [], 0, 0, 0, 0, rounds=[(5, 0), (130, 1)])
    got = step1_by_group([first, second])
    assert got["step1_by_kind"] == {"loop": {"rounds": 1, "a_1": 1.0}, "other": {"rounds": 5, "a_1": 0.6}}
    assert got["step1_by_position"]["0-63"] == {"rounds": 3, "a_1": round(2 / 3, 4)}
    assert got["step1_by_position"]["64-127"] == {"rounds": 2, "a_1": 0.5}
    assert got["step1_by_position"]["128-255"] == {"rounds": 1, "a_1": 1.0}
    assert got["step1_by_position"]["512+"] == {"rounds": 0, "a_1": None}
    assert step1_by_group([speculative.SpecResult([1, 2], {}, 0, [], [], [], 0, 0, 0, 0)]) == {}  # NGRAM's: no rounds kept
