"""Training-free speculation for the reference server: draft tokens looked up in a cache of earlier
text (suffix matching over the request and earlier requests), verified by the target like any draft.

    cache = NgramCache(max_match=18)                 # one per server, shared by every request
    result = generate(target, cache, prompt_ids, num_draft_tokens=12, max_breadth=10, max_new_tokens=128)
    cache.clear()                                    # what the server's /flush_cache does

A round (`generate`): the context's longest suffix (up to `max_match` tokens) that occurred earlier in
the cache, in this request or an earlier one, is looked up; the tokens that followed its occurrences,
most recent first, become a tree of up to num_draft_tokens - 1 nodes (at most `max_breadth` children
per node, filled breadth-first), padded with token 0 under the root to num_draft_tokens, as SGLang
pads. The target verifies the tree in one forward with draftlab.engine.speculative's verify_tree,
accept_path and keep_kv, the functions the EAGLE-3 loop uses, so the greedy output is the target's
own and the counters (spec_verify_ct, accepted drafts per depth) mean what they mean there.

How it differs from SGLang's NGRAM (0.5.14, python/sglang/srt/speculative/ngram_worker.py and
jit_kernel/csrc/ngram_corpus/trie.cpp):
- What is stored. SGLang inserts, after every verify, the last 18 tokens (max trie depth) of each
  running request into a trie: the generated text, and of a prompt only its last 18 tokens. The
  reference stores each request's whole sequence, its prompt included ("prompt lookup"): a
  second turn that quotes the first turn's answer can be drafted from the prompt here, not on SGLang.
- Matching. SGLang walks every suffix length from 1 to 18 that is in the trie and grows the tree
  from each, longest first, with a breadth that shrinks from the maximum (for a 1-token match) to
  the minimum (for an 18-token match) and with depth; children in least-recently-used order. The
  reference takes the longest suffix only, and a fixed breadth per node.
- Capacity. SGLang keeps 10M trie nodes and evicts the least recently used; the reference keeps
  `capacity_tokens` tokens and drops the oldest requests' text.
- The same: a verify of num_draft_tokens tokens every round (zero-padded), no draft forward, one
  cache for every request of a server, emptied by /flush_cache; the target decides every token.
"""
from __future__ import annotations

import time
from typing import Iterable

import numpy as np
import torch

from draftlab.engine import speculative
from draftlab.engine.attention import use_shared_kv
from draftlab.target.attention import attention_kernels

SEP = -1  # between requests in the cache: no match and no continuation crosses it
RECENT = 64  # occurrences of the matched suffix read for continuations, most recent first
PAD = 0  # the token SGLang pads an unfilled tree with (children of the root)


class NgramCache:
    """Every token the server has seen, request after request, in one array; a request's own tokens
    are the tail while it runs (the reference server serves one request at a time)."""

    def __init__(self, max_match: int = 18, capacity_tokens: int = 4_000_000):
        if max_match < 1:
            raise ValueError(f"max_match must be >= 1, got {max_match}")
        self.max_match, self.capacity = max_match, capacity_tokens
        self.clear()

    def clear(self) -> None:
        """Forget everything (a fresh server's cache)."""
        self._buf = np.full(4096, SEP, dtype=np.int64)
        self._len = 0
        self._start = 0  # where the running request's tokens begin
        self._at: dict[int, list[int]] = {}  # token -> its positions in the cache, ascending: a lookup reads these, not the cache

    def __len__(self) -> int:
        return self._len

    def start(self, prompt: Iterable[int]) -> None:
        """A new request: its prompt becomes the tail of the cache."""
        if self._len + 1 > self.capacity:  # drop the oldest text, keep whole requests where possible
            self._drop(self._len + 1 - self.capacity // 2)
        self._push([SEP])
        self._start = self._len
        self.extend(prompt)

    def extend(self, tokens: Iterable[int]) -> None:
        """Tokens the running request emitted."""
        self._push(list(tokens))

    def _push(self, tokens: list[int]) -> None:
        need = self._len + len(tokens)
        if need > len(self._buf):
            grown = np.full(max(need, 2 * len(self._buf)), SEP, dtype=np.int64)
            grown[:self._len] = self._buf[:self._len]
            self._buf = grown
        self._buf[self._len:need] = tokens
        for i, t in enumerate(tokens, start=self._len):
            if t != SEP:
                self._at.setdefault(t, []).append(i)
        self._len = need

    def _drop(self, count: int) -> None:
        count = min(count, self._start)  # never the running request's own tokens
        self._buf[:self._len - count] = self._buf[count:self._len].copy()
        self._len -= count
        self._start -= count
        self._at = {}
        for i, t in enumerate(self._buf[:self._len].tolist()):
            if t != SEP:
                self._at.setdefault(t, []).append(i)

    def continuations(self, depth: int) -> list[list[int]]:
        """The tokens (up to `depth`) that followed the earlier occurrences of the longest suffix of
        the running request (up to max_match tokens) found in the cache, most recent first; [] when
        not even its last token occurred before."""
        buf, end = self._buf, self._len
        m = min(self.max_match, end - self._start)
        if m < 1 or depth < 1:
            return []
        tail = buf[end - m:end]
        # positions p (before the tail's own last token) where the last token occurred, with a token after it
        found = np.asarray(self._at.get(int(tail[-1]), ()), dtype=np.int64)
        found = found[found < end - 1]
        found = found[buf[found + 1] != SEP]
        best = found
        for j in range(2, m + 1):  # extend the match backwards one token at a time while some occurrence keeps up
            found = found[found >= j - 1]
            found = found[buf[found - (j - 1)] == tail[-j]]
            if not found.size:
                break
            best = found
        out = []
        for p in best[::-1][:RECENT]:
            cont = buf[p + 1:min(p + 1 + depth, end)]
            stop = np.flatnonzero(cont == SEP)
            out.append(cont[:stop[0]] if stop.size else cont)
        return [c.tolist() for c in out if len(c)]

    def propose(self, root: int, num_draft_tokens: int, max_breadth: int) -> speculative.Tree:
        """The tree to verify: `root` (the pending token, the cache's last) and num_draft_tokens - 1
        nodes from the continuations, breadth-first, at most max_breadth children per node, most
        recent first; the slots left are PAD children of the root."""
        budget = num_draft_tokens - 1
        trie: list[dict] = [{}]  # node -> {token: child node}, insertion order = recency
        tokens_of = [root]
        for cont in self.continuations(budget):
            node = 0
            for t in cont:
                if t not in trie[node]:
                    trie[node][t] = len(trie)
                    trie.append({})
                    tokens_of.append(t)
                node = trie[node][t]
        tokens, parents, depths = [root], [-1], [0]
        queue = [(0, 0)]  # (trie node, tree node)
        while queue and len(tokens) <= budget:
            node, at = queue.pop(0)
            for child in list(trie[node].values())[:max_breadth]:
                if len(tokens) > budget:
                    break
                tokens.append(tokens_of[child])
                parents.append(at)
                depths.append(depths[at] + 1)
                queue.append((child, len(tokens) - 1))
        while len(tokens) < num_draft_tokens:
            tokens.append(PAD)
            parents.append(0)
            depths.append(1)
        return speculative.Tree(tokens, parents, depths)


@torch.inference_mode()
def generate(target, cache: NgramCache, prompt_ids, *, num_draft_tokens: int, max_breadth: int, max_new_tokens: int,
             temperature: float = 0.0, top_k: int = -1, top_p: float = 1.0, eos_token_id: int | Iterable[int] | None = None,
             ignore_eos: bool = False, generator: torch.Generator | None = None) -> speculative.SpecResult:
    """One request decoded with n-gram drafts from `cache` (module docstring), which it extends with
    the request's prompt and output. The counters mean what draftlab.engine.speculative.generate's mean; the
    "draft" seconds are the lookups."""
    if num_draft_tokens < 2 or max_breadth < 1:
        raise ValueError(f"num_draft_tokens must be >= 2 and max_breadth >= 1, got {num_draft_tokens}, {max_breadth}")
    t_start = time.perf_counter()
    device = target.device
    use_shared_kv(target)
    greedy = temperature < speculative.GREEDY_BELOW
    stops = set() if ignore_eos else speculative._ids(eos_token_id)
    depth = num_draft_tokens - 1
    out, finish, emit = speculative.emitter(max_new_tokens, stops)
    hist, proposed, accepted = [0] * (depth + 1), [0] * depth, [0] * depth
    secs = {"prefill": 0.0, "draft": 0.0, "verify": 0.0}
    verify_ct = 0

    if max_new_tokens <= 0:
        return speculative.SpecResult([], finish, 0, hist, proposed, accepted, 0.0, 0.0, 0.0, time.perf_counter() - t_start)
    cache.start(prompt_ids)
    with attention_kernels(device):
        prompt = torch.as_tensor(prompt_ids, dtype=torch.long, device=device).view(1, -1)
        n = prompt.shape[1]
        kv = speculative.new_cache(target)
        with speculative.timed(secs, "prefill", device):
            logits = speculative.target_forward(target, prompt, kv, logits_to_keep=1)
            x = speculative.pick(logits[0, -1], greedy, temperature, top_k, top_p, generator)
        done = emit([x])
        cache.extend([x])
        while not done:
            with speculative.timed(secs, "draft", device):
                tree = cache.propose(x, num_draft_tokens, max_breadth)
            with speculative.timed(secs, "verify", device):
                logits = speculative.verify_tree(target, kv, tree, n)
                path, bonus = speculative.accept_path(tree, logits, greedy, temperature, top_k, top_p, generator)
                speculative.keep_kv(kv, n, path)
            verify_ct += 1
            speculative.count_depths(tree, path, proposed, accepted)
            before = len(out)
            done = emit([tree.tokens[c] for c in path[1:]] + [bonus])
            hist[len(out) - before - 1] += 1
            cache.extend(out[before:])
            n += len(path)
            x = bonus
    return speculative.SpecResult(out, finish, verify_ct, hist, proposed, accepted, secs["prefill"], secs["draft"],
                                  secs["verify"], time.perf_counter() - t_start)
