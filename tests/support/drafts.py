"""Drafts for tests: an untrained random one, and scripted stand-ins that know the target's greedy
continuation, for tests and benchmarks that must isolate the target's side of speculation
(perfect or useless drafting at no cost)."""
from __future__ import annotations

import torch

from draftlab.train.draft import DraftConfig, Eagle3Draft
from draftlab.engine.speculative import baseline_generate


def random_draft(target, seed: int, draft_vocab: int | None = None) -> Eagle3Draft:
    """An untrained draft (mostly wrong); with draft_vocab, a reduced vocabulary mapped through d2t."""
    c = target.config
    V = c.vocab_size
    cfg = DraftConfig(hidden_size=c.hidden_size, intermediate_size=2 * c.hidden_size, num_attention_heads=c.num_attention_heads,
                      num_key_value_heads=c.num_key_value_heads, head_dim=c.hidden_size // c.num_attention_heads, rms_norm_eps=1e-6,
                      vocab_size=V, draft_vocab_size=draft_vocab or V, target_hidden_size=c.hidden_size, num_aux_layers=3,
                      max_position_embeddings=c.max_position_embeddings, rope_theta=10000.0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        draft = Eagle3Draft(cfg, target.get_input_embeddings().weight).eval()
        if draft_vocab:
            kept = torch.randperm(V)[:draft_vocab].sort().values
            t2d = torch.zeros(V, dtype=torch.bool)
            t2d[kept] = True
            draft.set_vocab(kept - torch.arange(draft_vocab), t2d)
    return draft



class ScriptedDraft:
    """A stand-in draft that knows the target's greedy continuation `reference` (prompt + output).

    The row at position p embeds token p+1 and proposes reference[p+2] when `right(p)`, else the
    right token only second (a tree with topk >= 2 can still find it). hit_rate 1: an oracle that
    is always right; hit_rate 0 with `never=True`: a null draft the target never accepts.
    Drafting costs next to nothing, so it isolates the target's side of speculation.
    """

    def __init__(self, reference: list[int], vocab_size: int, hit_rate: float = 1.0, never: bool = False, seed: int = 0):
        self.reference, self.vocab_size, self.never = list(reference), vocab_size, never
        g = torch.Generator().manual_seed(seed)
        self.hits = (torch.rand(len(self.reference) + 1, generator=g) < hit_rate).tolist()
        self.decoys = torch.randint(vocab_size, (len(self.reference) + 1,), generator=g).tolist()

    def project(self, aux):
        return aux[..., :1]

    def step(self, input_ids, hidden, position_ids, cache, mask=None):
        B, T = input_ids.shape
        z = torch.zeros(B, 1, T, 1, device=input_ids.device)
        cache.attend(z, z, z)  # keeps the cache as long as a real draft's would be
        return position_ids[..., None].float()  # the state is the row's position

    def logits(self, state):
        pos = state[..., 0].long().flatten().tolist()
        out = torch.zeros(len(pos), self.vocab_size, device=state.device)
        for r, p in enumerate(pos):
            if p + 2 >= len(self.reference):
                continue  # past the known continuation: no opinion
            right = self.reference[p + 2]
            if self.never:
                out[r, right] = -1e4
            elif self.hits[p]:
                out[r, right] = 10.0
            else:
                decoy = self.decoys[p] if self.decoys[p] != right else (right + 1) % self.vocab_size
                out[r, decoy], out[r, right] = 10.0, 5.0
        return out.view(*state.shape[:-1], self.vocab_size)

    def to_target(self, draft_ids):
        return draft_ids


def oracle_draft(target, prompt_ids, max_new_tokens: int, hit_rate: float = 1.0, seed: int = 0) -> ScriptedDraft:
    """A ScriptedDraft right with probability hit_rate per position on this prompt (1.0: always)."""
    ref = baseline_generate(target, prompt_ids, max_new_tokens, ignore_eos=True).output_ids
    return ScriptedDraft(list(prompt_ids) + ref, target.config.vocab_size, hit_rate=hit_rate, seed=seed)


def null_draft(target, prompt_ids, max_new_tokens: int) -> ScriptedDraft:
    """A ScriptedDraft that never proposes the target's greedy token (every draft rejected)."""
    ref = baseline_generate(target, prompt_ids, max_new_tokens, ignore_eos=True).output_ids
    return ScriptedDraft(list(prompt_ids) + ref, target.config.vocab_size, never=True)
