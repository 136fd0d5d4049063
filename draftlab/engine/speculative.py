"""EAGLE-3 speculative decoding over a transformers target, the way SGLang runs it (DESIGN.md 8-9).

One request at a time (batch 1). `generate` is the whole algorithm in one function:

    prefill  the target runs over the prompt -> first token x, and the aux hidden states at
             `physical_layers`; the draft runs over the prompt, row t = (aux[t], token t+1)
    loop     draft a tree rooted at x (topk == 1: a chain of num_steps tokens)
             verify the whole tree in ONE target forward (tree attention mask, position n + depth)
             accept the longest path the target agrees with, plus the target's own bonus token
             keep only the accepted path in the target's KV cache; re-run the draft over the
             accepted rows with the target's fresh aux states (the draft's own tree rows never
             stay in its cache, as in SGLang's draft extend)

Positions: n = tokens in the target's KV cache; the pending token x sits at position n. A draft
row that embeds the token at position p runs at rope position p - 1 (it pairs that token with
the target's state at p - 1), as draftlab/train/objective.py trains it and as SGLang's draft extend runs it.
(SGLang's draft decode steps ran one position further until sgl-project/sglang#25015.)

Trees, as SGLang's flags mean them: the root's topk children are the first frontier; each later
step runs the draft once on the frontier and keeps the topk best of its topk*topk children (by
cumulative draft log-prob) as the next frontier; num_steps steps in all (num_steps - 1 draft
forwards after the draft extend). Of all nodes made, the num_draft_tokens - 1 best plus the root
are verified. topk == 1 gives a chain of num_steps drafts, num_draft_tokens = num_steps + 1.

Acceptance. Greedy (temperature ~0): follow the target's argmax down the tree, so the output is
the target's own greedy decoding whatever the draft proposes. Sampling: the draft's proposals are
deterministic (its top-k), so its proposal distribution is one-hot and speculative sampling's
min(1, p/q) becomes p(token): at each node the children are tried in turn, each accepted with its
probability under the target's remaining distribution, a rejected token's mass is removed; if all
are rejected the bonus token is drawn from what remains. That samples exactly from the target,
chain or tree: the distribution SGLang's tree_speculative_sampling_target_only draws at its
default thresholds.

Counting, as SGLang: spec_verify_ct = verify forwards; tau = output tokens / spec_verify_ct (the
prefill's first token and every bonus token included); accept_hist[a] = verify steps whose kept
output was a drafts + 1 bonus (a step cut by EOS or max_new_tokens counts the tokens kept).
proposed[i] / accepted[i] (depth i + 1) count what verification decided before any such cut:
steps that reached depth i + 1 with a draft there, and those that accepted it; they are the
counts behind a_i in draftlab.metrics.

Length: over 400 lines because the algorithm (generate), its steps (draft, verify, accept,
keep_kv) and the sampler they share are read together, top to bottom, like gpt-fast's generate.py.
"""
from __future__ import annotations

import functools
import inspect
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch
from transformers import DynamicCache

from draftlab.engine.attention import use_shared_kv
from draftlab.train.draft import KVCache
from draftlab.errors import UserError
from draftlab.features.extract import AuxCapture
from draftlab.metrics import conditional_acceptance, pooled_tau
from draftlab.sglang.flags import tree_candidates
from draftlab.target.attention import attention_kernels

GREEDY_BELOW = 1e-5  # SGLang treats a temperature below this as greedy


@dataclass
class SpecResult:
    output_ids: list[int]  # generated tokens, the stop token included (as SGLang counts them)
    finish_reason: dict  # SGLang's shape: {"type": "stop", "matched": id} | {"type": "length", "length": n}
    spec_verify_ct: int  # target verify forwards
    accept_hist: list[int]  # [num_steps + 1]: verify steps that kept 0, 1, ..., num_steps drafts
    proposed: list[int]  # [num_steps]: steps that reached depth i + 1 and had a draft there
    accepted: list[int]  # [num_steps]: of those, steps whose draft at depth i + 1 was accepted
    prefill_s: float  # target prefill, seconds
    draft_s: float  # draft prefill + tree drafting + draft extends, seconds
    verify_s: float  # target verify forwards, seconds
    total_s: float  # the whole request, seconds
    # per verify round, in order: (the answer position its first draft token predicts, drafts accepted);
    # what the acceptance by position in the answer and by kind of token is counted from (bench offline)
    rounds: list[tuple[int, int]] = field(default_factory=list)

    @property
    def tau(self) -> float:
        """SGLang's spec_accept_length: completion tokens / verify steps."""
        return pooled_tau([len(self.output_ids)], [self.spec_verify_ct])

    @property
    def acceptance(self) -> list[float]:
        """a_i = P(draft i accepted | drafts 1..i-1 accepted), per depth."""
        return conditional_acceptance(self.accepted, self.proposed)

    @property
    def tokens_per_s(self) -> float:
        return len(self.output_ids) / self.total_s if self.total_s > 0 else float("nan")

    def meta(self) -> dict:
        """The speculative counters of SGLang's /generate meta_info."""
        return {"completion_tokens": len(self.output_ids), "spec_verify_ct": self.spec_verify_ct, "spec_accept_length": self.tau}


@dataclass
class BaselineResult:
    output_ids: list[int]
    finish_reason: dict
    prefill_s: float
    total_s: float

    @property
    def tokens_per_s(self) -> float:
        return len(self.output_ids) / self.total_s if self.total_s > 0 else float("nan")


@dataclass
class Tree:
    """Draft tokens to verify. Node 0 is the root (the pending token); parents precede children."""

    tokens: list[int]  # target token ids
    parents: list[int]  # parent node, -1 for the root
    depths: list[int]  # 0 for the root
    children: list[list[int]] = field(init=False)  # in proposal order (best first)

    chain: bool = field(init=False)  # node i's parent is i - 1: a plain causal block

    def __post_init__(self):
        self.children = [[] for _ in self.tokens]
        for node, parent in enumerate(self.parents):
            if parent >= 0:
                self.children[parent].append(node)
        self.chain = self.parents == list(range(-1, len(self.tokens) - 1))


# ---------------------------------------------------------------------------------------------
# The algorithm


@torch.inference_mode()
def emitter(max_new_tokens: int, stops: set):
    """(out, finish, emit) of one request: the tokens it emitted, why it finished (updated in
    place), and emit(tokens), which appends tokens until a stop token or the length limit and
    returns True once the request is finished. Shared by every drafter's decode loop."""
    out: list[int] = []
    finish = {"type": "length", "length": max_new_tokens}

    def emit(tokens) -> bool:
        for t in tokens:
            out.append(t)
            if t in stops:
                finish.clear()
                finish.update({"type": "stop", "matched": t})
                return True
            if len(out) >= max_new_tokens:
                return True
        return False

    return out, finish, emit


def generate(target, draft, prompt_ids, *, num_steps: int, topk: int, num_draft_tokens: int, max_new_tokens: int,
             temperature: float = 0.0, top_k: int = -1, top_p: float = 1.0, eos_token_id: int | Iterable[int] | None = None,
             ignore_eos: bool = False, physical_layers: list[int], generator: torch.Generator | None = None) -> SpecResult:
    """Speculative decoding of one request; the flags mean what SGLang's --speculative-* flags mean.

    target: a transformers causal LM; draft: an Eagle3Draft (from sglang.checkpoint.load_exported,
    embedding set) or any object with its project/step/logits/to_target; physical_layers: the target
    hidden states the draft was trained on (DESIGN.md section 4), e.g. ExportedDraft.served_physical()
    of the exported directory. Flags are taken as given (topk == 1 needs num_draft_tokens ==
    num_steps + 1): resolve SGLang's adjustments before calling.
    """
    check_flags(num_steps, topk, num_draft_tokens)
    t_start = time.perf_counter()
    device = target.device
    use_shared_kv(target)  # the verify's masked attention without copies of the cache (the same logits)
    greedy = temperature < GREEDY_BELOW
    stops = set() if ignore_eos else _ids(eos_token_id)
    out, finish, emit = emitter(max_new_tokens, stops)
    hist, proposed, accepted = [0] * (num_steps + 1), [0] * num_steps, [0] * num_steps
    secs = {"prefill": 0.0, "draft": 0.0, "verify": 0.0}  # seconds per phase
    verify_ct, rounds = 0, []

    if max_new_tokens <= 0:
        return SpecResult([], finish, 0, hist, proposed, accepted, 0.0, 0.0, 0.0, time.perf_counter() - t_start)

    with AuxCapture(target, physical_layers) as aux, attention_kernels(device):  # the draft's attention too
        # Prefill: the target over the prompt; its last logits give the first token.
        prompt = torch.as_tensor(prompt_ids, dtype=torch.long, device=device).view(1, -1)
        n = prompt.shape[1]  # tokens in the target's KV cache; the pending token sits at position n
        cache = new_cache(target)
        with timed(secs, "prefill", device):
            logits = target_forward(target, prompt, cache, logits_to_keep=1)
            x = pick(logits[0, -1], greedy, temperature, top_k, top_p, generator)
        done = emit([x])

        # Draft prefill: row t pairs the target's aux state at t with token t+1 (the last row with x).
        draft_cache = KVCache()
        if not done:
            with timed(secs, "draft", device):
                rows = draft.step(torch.cat([prompt[:, 1:], _tensor([[x]], device)], 1), draft.project(aux.take()),
                                  torch.arange(n, device=device)[None], draft_cache)
                root_state = rows[:, -1:]

        while not done:
            with timed(secs, "draft", device):
                if topk == 1:
                    tree = draft_chain(draft, draft_cache, root_state, x, n, num_steps)
                else:
                    tree = draft_tree(draft, draft_cache, root_state, x, n, num_steps, topk, num_draft_tokens)
            with timed(secs, "verify", device):
                logits = verify_tree(target, cache, tree, n)
                path, bonus = accept_path(tree, logits, greedy, temperature, top_k, top_p, generator)
                keep_kv(cache, n, path)
            verify_ct += 1
            count_depths(tree, path, proposed, accepted)
            new = [tree.tokens[c] for c in path[1:]] + [bonus]
            rounds.append((len(out), len(path) - 1))  # out ends with the root: its first draft predicts out[len(out)]
            before = len(out)
            done = emit(new)
            hist[len(out) - before - 1] += 1
            if done:
                break
            # Draft extend: the accepted rows again, now with the target's aux states (SGLang:
            # forward_draft_extend_after_decode). The tree's own rows were dropped by draft_tree.
            with timed(secs, "draft", device):
                positions = torch.arange(n, n + len(path), device=device)[None]
                kept = aux.take()[:, :len(path)] if tree.chain else aux.take()[:, path]  # a chain's path is a prefix
                rows = draft.step(_tensor([new], device), draft.project(kept), positions, draft_cache)
                root_state = rows[:, -1:]
            n += len(path)
            x = bonus

    return SpecResult(out, finish, verify_ct, hist, proposed, accepted, secs["prefill"], secs["draft"], secs["verify"],
                      time.perf_counter() - t_start, rounds)


@torch.inference_mode()
def baseline_generate(target, prompt_ids, max_new_tokens: int, temperature: float = 0.0, eos_token_id: int | Iterable[int] | None = None,
                      ignore_eos: bool = False, *, top_k: int = -1, top_p: float = 1.0, generator: torch.Generator | None = None,
                      stop_when: Callable[[list[int]], object] | None = None) -> BaselineResult:
    """Plain decoding with the same cache, forward and sampling code as `generate`, to time alike.

    stop_when: called with the output so far after each token that is not a stop token; a return
    other than None ends the request with finish_reason {"type": "stop", "matched": that value}
    (the reference server's stop strings).
    """
    t_start = time.perf_counter()
    device = target.device
    use_shared_kv(target)  # as generate's target: both decode with the same attention code
    greedy = temperature < GREEDY_BELOW
    stops = set() if ignore_eos else _ids(eos_token_id)
    out: list[int] = []
    finish = {"type": "length", "length": max_new_tokens}
    cache = new_cache(target)
    x = torch.as_tensor(prompt_ids, dtype=torch.long, device=device).view(1, -1)
    prefill_s = 0.0
    for _ in range(max_new_tokens):
        t0 = time.perf_counter()
        logits = target_forward(target, x, cache, logits_to_keep=1)
        tok = pick(logits[0, -1], greedy, temperature, top_k, top_p, generator)
        if not out:
            _sync(device)
            prefill_s = time.perf_counter() - t0
        out.append(tok)
        if tok in stops:
            finish = {"type": "stop", "matched": tok}
            break
        matched = stop_when(out) if stop_when is not None else None
        if matched is not None:
            finish = {"type": "stop", "matched": matched}
            break
        x = _tensor([[tok]], device)
    return BaselineResult(out, finish, prefill_s, time.perf_counter() - t_start)


def count_depths(tree: Tree, path: list[int], proposed: list[int], accepted: list[int]) -> None:
    """Add one verify's decisions, before any EOS/length cut: per depth i + 1 on the accepted path,
    whether a draft was there to accept or reject (proposed[i]) and whether it was accepted (accepted[i])."""
    for depth in range(1, len(path) + 1):
        if tree.children[path[depth - 1]]:
            proposed[depth - 1] += 1
            accepted[depth - 1] += len(path) > depth


def check_flags(num_steps: int, topk: int, num_draft_tokens: int) -> None:
    if num_steps < 1 or topk < 1:
        raise ValueError(f"num_steps and topk must be >= 1, got num_steps={num_steps}, topk={topk}")
    if topk == 1 and num_draft_tokens != num_steps + 1:
        raise ValueError(f"topk 1 drafts a chain: num_draft_tokens must be num_steps + 1 = {num_steps + 1}, got {num_draft_tokens} "
                         "(SGLang would change it silently)")
    most = 1 + tree_candidates(num_steps, topk)  # the root plus every node the tree search makes
    if not 2 <= num_draft_tokens <= most:
        raise ValueError(f"num_draft_tokens {num_draft_tokens} must be in 2..{most} for num_steps={num_steps}, topk={topk}")


# ---------------------------------------------------------------------------------------------
# Steps of the loop


def draft_chain(draft, cache: KVCache, root_state, root: int, n: int, num_steps: int) -> Tree:
    """draft_tree for topk == 1: the draft's argmax, num_steps deep, as a chain under `root`.

    The same tokens as draft_tree's (top-1 of the log-softmax is the argmax of the logits), with
    none of its bookkeeping: each row sees every row before it (the default causal attention),
    and the tokens stay on the device until the one transfer at the end.
    """
    start, state = len(cache), root_state
    positions = torch.arange(n, n + num_steps, device=root_state.device)[None]
    drafted = [draft.to_target(draft.logits(state).argmax(-1))]  # [1, 1] target ids, depth 1
    for step in range(num_steps - 1):
        state = draft.step(drafted[-1], state, positions[:, step:step + 1], cache)
        drafted.append(draft.to_target(draft.logits(state).argmax(-1)))
    cache.crop(start)
    tokens = [root] + torch.cat(drafted, 1)[0].tolist()
    return Tree(tokens, list(range(-1, num_steps)), list(range(num_steps + 1)))


def draft_tree(draft, cache: KVCache, root_state, root: int, n: int, num_steps: int, topk: int, num_draft_tokens: int) -> Tree:
    """Grow the draft tree under `root` (the pending token, at position n) and pick the nodes to verify.

    root_state [1, 1, H]: the draft state of the row that embeds `root`. The draft cache ends as
    it began: the frontier rows are appended while drafting and cropped afterwards.
    """
    start = len(cache)
    tokens, parents, depths, scores = [root], [-1], [0], [0.0]  # every node made; scores: cumulative log-prob
    state_of = {0: root_state[0, 0]}  # node -> the draft state of its own row (the hidden for its children)
    slot: dict[int, int] = {}  # node -> index of its row in the draft cache
    frontier, logp = [0], torch.log_softmax(draft.logits(root_state).float().view(1, -1), -1)
    for step in range(num_steps):
        top = logp.topk(topk, dim=-1)
        ids, vals = draft.to_target(top.indices).tolist(), top.values.tolist()
        made = []
        for f, node in enumerate(frontier):
            for j in range(topk):
                tokens.append(ids[f][j])
                parents.append(node)
                depths.append(depths[node] + 1)
                scores.append(scores[node] + vals[f][j])
                made.append(len(tokens) - 1)
        if step == num_steps - 1:
            break
        frontier = sorted(made, key=lambda c: -scores[c])[:topk]  # stable: ties keep proposal order
        # One draft forward over the frontier: each row sees the prefix, its ancestors' rows, itself.
        S, F = len(cache), len(frontier)
        mask = torch.zeros(1, F, S + F, dtype=torch.bool)  # built on the CPU, moved once
        mask[..., :start] = True
        for r, node in enumerate(frontier):
            mask[0, r, S + r] = True
            a = parents[node]
            while a > 0:
                mask[0, r, slot[a]] = True
                a = parents[a]
        rows = draft.step(_tensor([[tokens[c] for c in frontier]], root_state.device),
                          torch.stack([state_of[parents[c]] for c in frontier])[None],
                          _tensor([[n + depths[c] - 1 for c in frontier]], root_state.device), cache, mask.to(root_state.device))
        for r, node in enumerate(frontier):
            slot[node], state_of[node] = S + r, rows[0, r]
        logp = torch.log_softmax(draft.logits(rows[0]).float(), -1)
    cache.crop(start)

    keep = best_subtree(scores, parents, num_draft_tokens)
    order = sorted(keep)
    new_index = {old: i for i, old in enumerate(order)}
    return Tree([tokens[c] for c in order], [new_index.get(parents[c], -1) for c in order], [depths[c] for c in order])



def best_subtree(scores, parents: list[int], num_nodes: int) -> set[int]:
    """The root and the num_nodes - 1 best-scored nodes (a child never outscores its parent, so
    they form a tree): SGLang's pruning of the draft tree to num_draft_tokens."""
    keep = {0}
    for c in sorted(range(1, len(parents)), key=lambda c: -scores[c]):
        if len(keep) == num_nodes:
            break
        if parents[c] in keep:
            keep.add(c)
    return keep


def verify_tree(target, cache, tree: Tree, n: int) -> torch.Tensor:
    """One target forward over the tree; returns float32 logits [N, vocab], one row per node.

    Each node attends to the n cached positions, its ancestors and itself, at position n + depth.
    """
    device, N = target.device, len(tree.tokens)
    if tree.chain and (torch.device(device).type == "cuda" or _sliding(target)):
        # A chain on a GPU: the target's own causal attention path (flash kernels, no 4D mask).
        # A target with sliding-window layers (gpt-oss): those layers keep only the window in their
        # cache, so a mask over every cached position does not fit them; the target builds its own.
        return target_forward(target, _tensor([tree.tokens], device), cache)[0].float()
    if not tree.chain and _sliding(target):
        raise UserError(f"a tree (topk > 1) on {type(target).__name__}, whose sliding-window layers keep only "
                        f"the last {target.config.sliding_window} positions: the reference engine verifies chains "
                        "only on such targets; set spec.topk: 1, or bench.backend: sglang")
    if tree.chain:
        # On a CPU the 4D mask made here costs a fraction of transformers' own mask building
        # for a block of new tokens over a cache (the same mask, the same logits).
        mask = torch.zeros(1, 1, N, n + N, dtype=target.dtype, device=device)
        mask[0, 0, :, n:] = _causal_block(N, target.dtype)
        return target_forward(target, _tensor([tree.tokens], device), cache, attention_mask=mask)[0].float()
    allowed = torch.zeros(N, n + N, dtype=torch.bool)  # built on the CPU, moved once
    allowed[:, :n] = True
    for node, parent in enumerate(tree.parents):
        if parent >= 0:
            allowed[node, n:] = allowed[parent, n:]
        allowed[node, n + node] = True
    dtype = target.dtype
    mask = torch.zeros(1, 1, N, n + N, dtype=dtype, device=device).masked_fill(~allowed.to(device), torch.finfo(dtype).min)
    positions = _tensor([[n + d for d in tree.depths]], device)
    return target_forward(target, _tensor([tree.tokens], device), cache, position_ids=positions, attention_mask=mask)[0].float()


def accept_path(tree: Tree, logits: torch.Tensor, greedy: bool, temperature: float, top_k: int, top_p: float,
                generator: torch.Generator | None) -> tuple[list[int], int]:
    """(accepted nodes from the root, bonus token): walk down while the target agrees.

    Greedy: the child equal to the target's argmax. Sampling: children tried in turn, each
    accepted with probability p(token) / (mass not yet rejected); the bonus from the rest.
    """
    path, node = [0], 0
    best = logits.argmax(-1).tolist() if greedy else None  # the target's choice at every node, one transfer
    while True:
        nxt = None
        if greedy:
            bonus = best[node]
            nxt = next((c for c in tree.children[node] if tree.tokens[c] == bonus), None)
        else:
            p = probs(logits[node], temperature, top_k, top_p)
            for c in tree.children[node]:
                t = tree.tokens[c]
                if float(torch.rand((), generator=generator, device=p.device)) * float(p.sum()) < float(p[t]):
                    nxt = c
                    break
                p[t] = 0.0
            if nxt is None:
                bonus = int(torch.multinomial(p, 1, generator=generator))
        if nxt is None:
            return path, bonus
        path.append(nxt)
        node = nxt


def keep_kv(cache, n: int, path: list[int]) -> None:
    """Keep the n cached positions plus the verified nodes on `path`, in order, drop the rest.

    A chain's path is a prefix of the verified block: a crop. A tree's path is not: its entries
    are gathered into place (they were computed at positions n + depth, which is where they stay).
    """
    if path[-1] == len(path) - 1:  # nodes are numbered parents first: a path ending at node k-1 is 0..k-1
        drop = cache.get_seq_length() - n - len(path)
        if drop > 0:  # never crop(0): transformers 5.8 (what SGLang 0.5.14 pins) reads it as "keep 0 tokens"
            cache.crop(-drop)  # negative: drop that many from the end (the one meaning all releases share)
        return
    idx = torch.tensor(path, device=cache.layers[0].keys.device) + n
    for layer in cache.layers:
        layer.keys = torch.cat([layer.keys[..., :n, :], layer.keys[..., idx, :]], dim=-2)
        layer.values = torch.cat([layer.values[..., :n, :], layer.values[..., idx, :]], dim=-2)


# ---------------------------------------------------------------------------------------------
# Target plumbing and sampling


def new_cache(target) -> DynamicCache:
    cache = DynamicCache(config=target.config)
    if _sliding(target):
        # A sliding-window layer keeps only the window; a rejected draft must be cropped off without
        # losing the positions it pushed out. Past recording keeps them until the crop.
        if not hasattr(cache, "activate_past_recording"):
            raise UserError(f"{type(target).__name__} has sliding-window layers, and this transformers release cannot "
                            "roll their cache back after a rejected draft; speculative decoding in-process needs a "
                            "transformers release with Cache.activate_past_recording")
        cache.activate_past_recording()
    return cache


def target_forward(target, input_ids, cache, **kw) -> torch.Tensor:
    """Logits of one cached target forward."""
    with attention_kernels(target.device):
        return target(input_ids=input_ids, use_cache=True, **{_cache_arg(type(target)): cache}, **kw).logits


@functools.lru_cache(maxsize=None)
def _cache_arg(cls) -> str:
    """transformers 5 renamed the KV-cache argument `past_key_values` to `cache`."""
    return "cache" if "cache" in inspect.signature(cls.forward).parameters else "past_key_values"


def probs(logits: torch.Tensor, temperature: float, top_k: int = -1, top_p: float = 1.0) -> torch.Tensor:
    """The target's sampling distribution (float32): temperature, then top-k, then top-p, as the server."""
    logits = logits.float() / temperature
    if 0 < top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    p = torch.softmax(logits, dim=-1)
    if top_p < 1.0:
        sorted_p, order = torch.sort(p, descending=True)
        sorted_p[(torch.cumsum(sorted_p, 0) - sorted_p) > top_p] = 0.0  # smallest set with mass >= top_p
        p = torch.zeros_like(p).scatter_(0, order, sorted_p)
    return p


def pick(logits, greedy: bool, temperature: float, top_k: int, top_p: float, generator) -> int:
    if greedy:
        return int(torch.argmax(logits))
    return int(torch.multinomial(probs(logits, temperature, top_k, top_p), 1, generator=generator))


@contextmanager
def timed(seconds: dict, phase: str, device):
    """Add the wall time of the block to seconds[phase]; synchronizes CUDA so it lands in the right phase."""
    t0 = time.perf_counter()
    yield
    _sync(device)
    seconds[phase] += time.perf_counter() - t0


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _sliding(target) -> bool:
    """Whether some layer of the target attends over a sliding window (gpt-oss: every other layer)."""
    return "sliding_attention" in (getattr(target.config, "layer_types", None) or [])


def _tensor(rows, device) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.long, device=device)


@functools.lru_cache(maxsize=64)
def _causal_block(N: int, dtype: torch.dtype) -> torch.Tensor:
    """[N, N]: 0 where row i may attend to new token j <= i, the dtype's minimum elsewhere."""
    return torch.zeros(N, N, dtype=dtype).masked_fill(torch.ones(N, N, dtype=torch.bool).triu(1), torch.finfo(dtype).min)


def _ids(eos) -> set[int]:
    if eos is None:
        return set()
    return {int(eos)} if isinstance(eos, int) else {int(e) for e in eos}
