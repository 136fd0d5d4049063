"""The reference server's engines: a request's token ids and sampling params in, a completion out.

    Engine      plain decoding of a transformers causal LM: draftlab.engine.speculative.baseline_generate
    SpecEngine  EAGLE-3 speculative decoding of an exported draft: draftlab.engine.speculative.generate
    NgramEngine training-free speculation, drafts from a cache of earlier text: ngram.generate

Both run draftlab.engine.speculative's cache, forward and sampler (draftlab.engine.speculative.pick), so the reference
server, the bench's offline run and the parity check decode with one implementation. Greedy
output equals transformers' `model.generate(do_sample=False)` token for token.

The interface the HTTP side uses: `engine.generate(input_ids, SamplingParams) -> Completion`,
`engine.info()`, `engine.hidden_states(input_ids)`, `engine.tokenizer` and `engine.device`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from draftlab.engine import ngram, speculative
from draftlab.errors import UserError, shown
from draftlab.features.extract import AuxCapture, decoder_layers
from draftlab.metrics import pooled_tau
from draftlab.sglang.checkpoint import load_exported, read_exported

DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's /generate default when sampling_params has none


@dataclass
class SamplingParams:
    """SGLang's sampling_params (the subset we serve). temperature 0 = greedy."""

    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 = all tokens
    seed: int | None = None  # SGLang: sampling_seed; OpenAI: seed
    stop: list[str] = field(default_factory=list)  # stop strings, cut from the text
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False  # keep generating past EOS (fixed-length benchmarks)


@dataclass
class Completion:
    output_ids: list[int]  # generated tokens, the stop token included (as SGLang counts them)
    text: str  # decoded without special tokens, cut at a matched stop string
    finish_reason: dict  # SGLang: {"type": "stop", "matched": id|str} or {"type": "length", "length": n}
    meta: dict = field(default_factory=dict)  # extra meta_info (speculative counters)


class ContextLengthError(ValueError):
    """A request the context cannot hold; the message is SGLang 0.5.14's (TokenizerManager._validate_one_request)."""


class Engine:
    """Plain autoregressive decoding of a transformers causal LM with a KV cache."""

    physical: list[int] | None = None  # the target layers a speculative engine feeds its draft
    reserved_tokens = 0  # context slots a request must leave free beside its own (SGLang: the draft tokens of EAGLE)

    def __init__(self, model, tokenizer, device: str, context_length: int | None = None):
        self.model, self.tokenizer, self.device = model, tokenizer, device
        self.text_config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.context_length = context_length or getattr(self.text_config, "max_position_embeddings", None) or tokenizer.model_max_length
        eos = model.generation_config.eos_token_id
        eos = eos if isinstance(eos, list) else [eos]
        self.eos_ids = {i for i in [*eos, tokenizer.eos_token_id] if i is not None}

    def info(self) -> dict:
        return {"context_length": self.context_length, "speculative_algorithm": None}

    def flush(self) -> None:
        """Drop what the engine keeps between requests (the server's /flush_cache); nothing here."""

    @torch.inference_mode()
    def generate(self, input_ids: list[int], sampling: SamplingParams) -> Completion:
        self._check_length(input_ids)
        max_new = min(sampling.max_new_tokens, self.context_length - len(input_ids))
        stop_ids = set(sampling.stop_token_ids) | (set() if sampling.ignore_eos else self.eos_ids)
        result = speculative.baseline_generate(
            self.model, input_ids, max_new, sampling.temperature, eos_token_id=stop_ids, top_k=sampling.top_k,
            top_p=sampling.top_p, generator=self._generator(sampling),
            stop_when=self._stop_strings(sampling.stop) if sampling.stop else None,
        )
        text = self.decode(result.output_ids)
        matched = result.finish_reason.get("matched")
        if isinstance(matched, str):  # a stop string: the text ends before it
            text = text[:text.find(matched)]
        return Completion(result.output_ids, text, result.finish_reason)

    def hidden_states(self, input_ids: list[int]) -> list[list[float]]:
        """What `return_hidden_states` returns per prompt token, as SGLang does: for an EAGLE3 server
        the aux concatenation the draft is fed (k x hidden wide), else the final hidden state."""
        physical = self.physical or [len(decoder_layers(self.model)[1])]
        with torch.inference_mode(), AuxCapture(self.model, physical) as cap:
            self.model(input_ids=torch.tensor([input_ids], device=self.device), use_cache=False)
            return cap.take()[0].float().cpu().tolist()

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def check_request(self, input_ids: list, field: str = "input_ids") -> None:
        """Raise ValueError (the server answers 400 with its message) for a prompt this engine cannot
        serve: no tokens, an entry that is not a token id in [0, vocab_size), or no room in the context.
        Validation only: `generate` is unchanged and assumes a prompt that passed this."""
        if not isinstance(input_ids, list) or not input_ids:
            raise ValueError(f"{field} must be a non-empty list of token ids (integers in [0, {self.vocab_size}))"
                             + ("" if isinstance(input_ids, list) else f", got {short_repr(input_ids)}") + ".")
        for i, t in enumerate(input_ids):
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size:
                raise ValueError(f"{field}[{i}] is {short_repr(t)}: token ids must be integers in [0, {self.vocab_size}) "
                                 f"(the model's vocab_size).")
        self._check_length(input_ids)

    @property
    def vocab_size(self) -> int:
        return int(getattr(self.text_config, "vocab_size", None) or self.model.get_input_embeddings().num_embeddings)

    def _check_length(self, input_ids: list[int]) -> None:
        n = len(input_ids) + self.reserved_tokens  # SGLang counts the reserved draft slots as input
        if n >= self.context_length:
            raise ContextLengthError(f"The input ({n} tokens) is longer than the model's context length ({self.context_length} tokens).")

    def check_total(self, n_input: int, max_new_tokens: int) -> None:
        """SGLang 0.5.14's check of an explicit max_new_tokens (a 400): the input, the reserved
        draft slots and max_new_tokens must fit the context. An absent max_new_tokens is not checked
        there (generation then stops at the context), nor here."""
        n = n_input + self.reserved_tokens
        if max_new_tokens + n > self.context_length:
            raise ContextLengthError(
                f"Requested token count exceeds the model's maximum context length of {self.context_length} tokens. "
                f"You requested a total of {max_new_tokens + n} tokens: {n} tokens from the input messages and "
                f"{max_new_tokens} tokens for the completion. Please reduce the number of tokens in the input messages "
                f"or the completion to fit within the limit.")

    def _generator(self, sampling: SamplingParams) -> torch.Generator:
        generator = torch.Generator(device=self.device)
        generator.manual_seed(sampling.seed if sampling.seed is not None else int(torch.randint(2**62, ())))
        return generator

    def _stop_strings(self, stops: list[str]):
        """For baseline_generate's stop_when: the first stop string in the text so far (earliest
        position, then the smallest string), or None."""

        def matched(ids: list[int]) -> str | None:
            text = self.decode(ids)
            hits = [(text.find(s), s) for s in stops if s and s in text]
            return min(hits)[1] if hits else None

        return matched


def short_repr(value, limit: int = 60) -> str:
    """repr(value), cut to `limit` characters: error messages never echo a whole hostile payload."""
    return shown(value, limit)


class SpecEngine(Engine):
    """EAGLE-3 speculative decoding (draftlab.engine.speculative) behind the same interface.

    The draft is loaded from the EXPORTED directory with the project's loader, and the target
    layers it is fed are the ones SGLang `sglang_version` would capture for that config: a
    miswired export misbehaves here exactly as it would in SGLang.
    """

    def __init__(self, model, tokenizer, device, context_length, draft_path: str, num_steps: int, topk: int,
                 num_draft_tokens: int, sglang_version: str):
        super().__init__(model, tokenizer, device, context_length)
        exported = read_exported(draft_path)
        embed = model.get_input_embeddings().weight
        self.draft, _ = load_exported(exported.path, embed=embed, dtype=embed.dtype, as_sglang=True)
        self.draft.to(device)
        self.physical = exported.served_physical(model.config.architectures[0], self.text_config.num_hidden_layers, sglang_version)
        want = self.draft.fc.weight.shape[1] // self.text_config.hidden_size
        if len(self.physical) != want:  # SGLang fails on the fc width at the first request
            raise UserError(f"{draft_path}: fc takes {want} target layers but SGLang {sglang_version} would capture "
                            f"{len(self.physical)} (physical {self.physical}) for eagle_config ids {exported.layer_ids}")
        self.flags = {"speculative_algorithm": "EAGLE3", "speculative_num_steps": num_steps,
                      "speculative_eagle_topk": topk, "speculative_num_draft_tokens": num_draft_tokens}
        # SGLang's TokenizerManager.num_reserved_tokens for EAGLE: the drafts sit in the output's slots
        self.reserved_tokens = max(topk * num_steps, num_draft_tokens)
        self.totals = {"completion_tokens": 0, "verify_ct": 0}

    def info(self) -> dict:
        totals = self.totals
        avg = pooled_tau([totals["completion_tokens"]], [totals["verify_ct"]]) if totals["verify_ct"] else None
        return {"context_length": self.context_length, **self.flags, "capture_physical_layers": self.physical,
                "avg_spec_accept_length": avg}

    @torch.inference_mode()
    def generate(self, input_ids: list[int], sampling: SamplingParams) -> Completion:
        self._check_length(input_ids)
        if sampling.stop:
            raise ValueError("stop strings are not supported with speculative decoding by the reference server")
        num_steps = self.flags["speculative_num_steps"]
        # Drafts run up to num_steps positions past the output: keep them inside the context.
        max_new = min(sampling.max_new_tokens, self.context_length - len(input_ids) - num_steps - 1)
        generator = self._generator(sampling)
        stop_ids = set(sampling.stop_token_ids) | self.eos_ids
        result = speculative.generate(
            self.model, self.draft, input_ids, num_steps=num_steps, topk=self.flags["speculative_eagle_topk"],
            num_draft_tokens=self.flags["speculative_num_draft_tokens"], max_new_tokens=max(1, max_new),
            temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p, eos_token_id=stop_ids,
            ignore_eos=sampling.ignore_eos, physical_layers=self.physical, generator=generator,
        )
        self.totals["completion_tokens"] += len(result.output_ids)
        self.totals["verify_ct"] += result.spec_verify_ct
        correct = sum(a * n for a, n in enumerate(result.accept_hist))
        proposed = result.spec_verify_ct * num_steps
        meta = {
            **result.meta(),
            "spec_num_correct_drafts": correct,
            "spec_num_proposed_drafts": proposed,
            "spec_accept_rate": correct / proposed if proposed else 0.0,
            "spec_correct_drafts_histogram": list(result.accept_hist),
            # per depth i+1: steps that reached it with a draft there, and of those how many accepted it
            "spec_proposed_per_depth": list(result.proposed),
            "spec_accepted_per_depth": list(result.accepted),
        }
        if not result.spec_verify_ct:  # one token from the prefill alone: no verify step, tau undefined (JSON has no NaN)
            meta["spec_accept_length"] = None
        return Completion(result.output_ids, self.decode(result.output_ids), result.finish_reason, meta)


class NgramEngine(Engine):
    """NGRAM speculation (draftlab.engine.ngram) behind the same interface: no draft model; one n-gram cache
    shared by every request, emptied by flush(). Flags with SGLang's meaning: num_draft_tokens tokens
    verified per round, max_breadth the widest level of the tree (SGLang's topk), max_match the
    longest suffix matched (SGLang's max trie depth)."""

    def __init__(self, model, tokenizer, device, context_length, num_draft_tokens: int, max_breadth: int,
                 min_breadth: int = 1, max_match: int = 18, num_steps: int | None = None):
        super().__init__(model, tokenizer, device, context_length)
        self.cache = ngram.NgramCache(max_match)
        self.flags = {"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": num_draft_tokens,
                      "speculative_eagle_topk": max_breadth, "speculative_num_steps": num_steps or num_draft_tokens // max_breadth,
                      "speculative_ngram_min_bfs_breadth": min_breadth, "speculative_ngram_max_bfs_breadth": max_breadth,
                      "speculative_ngram_max_trie_depth": max_match}
        self.totals = {"completion_tokens": 0, "verify_ct": 0}  # SGLang reserves no context slots for NGRAM

    def info(self) -> dict:
        totals = self.totals
        avg = pooled_tau([totals["completion_tokens"]], [totals["verify_ct"]]) if totals["verify_ct"] else None
        return {"context_length": self.context_length, **self.flags, "avg_spec_accept_length": avg}

    def flush(self) -> None:
        self.cache.clear()

    @torch.inference_mode()
    def generate(self, input_ids: list[int], sampling: SamplingParams) -> Completion:
        self._check_length(input_ids)
        if sampling.stop:
            raise ValueError("stop strings are not supported with speculative decoding by the reference server")
        width = self.flags["speculative_num_draft_tokens"]
        max_new = min(sampling.max_new_tokens, self.context_length - len(input_ids) - width)  # the verify block stays in the context
        result = ngram.generate(self.model, self.cache, input_ids, num_draft_tokens=width,
                                max_breadth=self.flags["speculative_ngram_max_bfs_breadth"], max_new_tokens=max(1, max_new),
                                temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
                                eos_token_id=set(sampling.stop_token_ids) | self.eos_ids, ignore_eos=sampling.ignore_eos,
                                generator=self._generator(sampling))
        self.totals["completion_tokens"] += len(result.output_ids)
        self.totals["verify_ct"] += result.spec_verify_ct
        correct = sum(a * n for a, n in enumerate(result.accept_hist))
        proposed = result.spec_verify_ct * (width - 1)  # as SGLang counts NGRAM's: every slot of the block
        meta = {**result.meta(), "spec_num_correct_drafts": correct, "spec_num_proposed_drafts": proposed,
                "spec_accept_rate": correct / proposed if proposed else 0.0,
                "spec_correct_drafts_histogram": list(result.accept_hist),
                "spec_proposed_per_depth": list(result.proposed), "spec_accepted_per_depth": list(result.accepted)}
        if not result.spec_verify_ct:
            meta["spec_accept_length"] = None
        return Completion(result.output_ids, self.decode(result.output_ids), result.finish_reason, meta)
