"""What SGLang will really run for a speculative-decoding request (DESIGN.md section 8).

SGLang rewrites some speculative flags at start-up, often with one WARNING line that scrolls
past, and crashes on others. `resolve()` replays those rules offline, in SGLang's order, so the
bench stage knows the effective flags before it launches anything and can record both:

    res = resolve(SpecFlags("EAGLE3", num_steps=1, topk=1, num_draft_tokens=16),
                  target_architecture="LlamaForCausalLM", sglang_version="0.5.14")
    res.effective.num_draft_tokens   # 2
    res.enforce("error")             # UserError: rule chain_draft_tokens: SGLang would run 2 ...

Each rule is a `Rule`: its name, the condition, SGLang's effect, SGLang's own message where it
prints one (the bench also finds these lines in the server log), the fix, and where in SGLang's
source it was read. A rule that fires gives a `RuleOutcome` of one kind (the wiring check
turns the bench's record of them into Findings, draftlab.check.serving.check_flags):
  adjusted  SGLang silently runs something other than what was asked: refused unless
            spec.on_adjust is "allow" (then reported loudly)
  default   SGLang fills a value that was left unset: recorded, never refused
  error     SGLang refuses to start, crashes, or runs a broken setup: always refused

Sources (sgl-project/sglang): the EAGLE rules live in `ServerArgs._handle_speculative_decoding`
(python/sglang/srt/server_args.py) up to 0.5.14, in `_handle_eagle_family`
(python/sglang/srt/arg_groups/speculative_hook.py) in 0.5.17..0.5.23, and in
python/sglang/srt/speculative/spec_info.py on main; the rules below read the same in those
places, except the list of attention backends of rule paged_tree_backend. What changed release
by release from 0.5.18 to 0.5.23 is in reports/sglang-releases.md; the flags that no SpecFlags
field holds (--enable-mixed-chunk, --speculative-use-block-verification, ...) are read from the
extra server arguments (Setup.extra_server_args, bench.extra_server_args).

NGRAM (training-free: draft tokens looked up in a cache of earlier text, no draft model) has rules
of its own, read from SGLang 0.5.14's `_handle_ngram` (python/sglang/srt/arg_groups/speculative_hook.py):
max running requests 48 when unset, mixed chunked prefill off, topk := the maximum BFS breadth
(whatever --speculative-eagle-topk says), 12 draft tokens when unset, num_steps := draft tokens //
topk when unset, and a tree (breadth > 1) on pages > 1 token only on flashinfer. A Rule applies to
the algorithms it lists (`algorithms`); the EAGLE rules never fire for NGRAM.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Callable

from draftlab.errors import UserError
from draftlab.sglang.layers import parse_version

ALGORITHMS = ("EAGLE3", "EAGLE", "NGRAM")
EAGLE_FAMILY = ("EAGLE3", "EAGLE")
NGRAM = "NGRAM"
# SGLang 0.5.14's NGRAM defaults (ServerArgs.speculative_ngram_*, and _handle_ngram's 12 draft tokens)
NGRAM_DRAFT_TOKENS = 12
NGRAM_MIN_BFS_BREADTH = 1
NGRAM_MAX_BFS_BREADTH = 10
NGRAM_MAX_TRIE_DEPTH = 18  # tokens of context matched and stored per window
NGRAM_CAPACITY = 10_000_000  # trie nodes, shared by every request (not a SpecFlags field: memory only)
NGRAM_PAGE_TREE_BACKENDS = ("flashinfer",)  # a breadth > 1 on pages > 1 token: only this backend
SPEC_MAX_RUNNING_REQUESTS = 48  # SGLang's cap on running requests when speculating
# Attention backends that implement topk > 1 trees on pages > 1 token (newest list; older
# releases allowed ["flashinfer"] then ["flashinfer", "fa3"]).
PAGE_TREE_BACKENDS = ("flashinfer", "fa3", "triton")
# Defaults when num_steps is unset: (num_steps, topk, num_draft_tokens), from
# `auto_choose_speculative_params` / `_auto_choose_speculative_params`.
DEFAULTS_CHANGED_IN = (0, 5, 8)
WIDE_DEFAULT = (5, 4, 8)
CHAIN_DEFAULT = (3, 1, 4)
WIDE_ARCHS = ("LlamaForCausalLM", "Grok1ForCausalLM", "Grok1VForCausalLM")  # (5, 4, 8) in every release
# Before 0.5.8 every other architecture got (5, 4, 8) except these (SGLang PR #9470 added gpt-oss).
CHAIN_ARCHS_BEFORE_0_5_8 = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "GptOssForCausalLM")
ALLOW_LONGER_CONTEXT_ENV = "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN"
# Extra server arguments the rules below read (store-true flags: present or not).
MIXED_CHUNK_FLAG = "--enable-mixed-chunk"
BLOCK_VERIFICATION_FLAG = "--speculative-use-block-verification"
REJECTION_SAMPLING_FLAG = "--speculative-use-rejection-sampling"
DETERMINISTIC_FLAG = "--enable-deterministic-inference"
# What SGLang does with --enable-mixed-chunk when speculating with EAGLE/EAGLE3, from the first
# release read with that behaviour (a release between two entries gets the earlier one's):
MIXED_CHUNK_BY_RELEASE = (
    ((0, 5, 5), "adjusted"),  # v0.5.5 python/sglang/srt/server_args.py: turned off with a WARNING
    ((0, 5, 14), "error"),  # v0.5.14 python/sglang/srt/server_args.py check_server_args: bare AssertionError
    ((0, 5, 17), "adjusted"),  # v0.5.17 python/sglang/srt/arg_groups/speculative_hook.py _handle_eagle_family: turned off
    ((0, 5, 19), None),  # v0.5.19 same file: kept, SpeculativeAlgorithm.supports_mixed_chunk() holds EAGLE and EAGLE3
)
# --speculative-use-block-verification exists from 0.5.22 and turns rejection sampling on for
# EAGLE/EAGLE3 (v0.5.22 python/sglang/srt/arg_groups/speculative_hook.py handle_speculative_decoding).
BLOCK_VERIFICATION_FROM = (0, 5, 22)
# Rejection sampling with --enable-deterministic-inference: ValueError up to 0.5.22, allowed on
# CUDA from 0.5.23 (v0.5.23 python/sglang/srt/arg_groups/speculative_hook.py _handle_eagle_family).
DETERMINISTIC_REJECTION_FROM = (0, 5, 23)


@dataclass(frozen=True)
class SpecFlags:
    """SGLang launch flags that decide speculative decoding; None = not passed (SGLang decides)."""

    algorithm: str | None = "EAGLE3"  # --speculative-algorithm; None = no speculation (a baseline server)
    num_steps: int | None = None  # --speculative-num-steps: draft forward passes per verify (tree depth)
    topk: int | None = None  # --speculative-eagle-topk: branching per step; 1 = chain
    num_draft_tokens: int | None = None  # --speculative-num-draft-tokens: tokens verified per step, root included
    max_running_requests: int | None = None  # --max-running-requests
    page_size: int | None = None  # --page-size: tokens per KV-cache page (SGLang's default is 1)
    attention_backend: str | None = None  # --attention-backend; None = SGLang picks from the GPU
    # NGRAM only (None otherwise): --speculative-ngram-{min,max}-bfs-breadth, --speculative-ngram-max-trie-depth
    ngram_min_bfs_breadth: int | None = None
    ngram_max_bfs_breadth: int | None = None  # the widest level of the draft tree; SGLang sets topk to it
    ngram_max_trie_depth: int | None = None  # longest context suffix matched (and window stored), tokens


SPEC_KEYS = ("algorithm", "num_steps", "topk", "num_draft_tokens")  # the flags that decide speculation itself


@dataclass(frozen=True)
class Setup:
    """What else SGLang looks at: the models, its version, its environment; and the benchmark."""

    target_architecture: str  # target config.json architectures[0], e.g. "LlamaForCausalLM"
    sglang_version: str  # e.g. "0.5.14"
    draft_architecture: str | None = None  # draft config.json architectures[0]; None = not checked
    draft_context_length: int | None = None  # draft max_position_embeddings; None = not checked
    target_context_length: int | None = None  # the target's context length (or --context-length)
    allow_longer_context: bool = False  # SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1 in the server's env
    max_concurrency: int | None = None  # most requests the benchmark keeps in flight
    extra_server_args: tuple[str, ...] = ()  # other launch arguments (bench.extra_server_args), read by some rules

    def passes(self, flag: str) -> bool:
        """Whether the extra server arguments pass the store-true `flag`."""
        return flag in self.extra_server_args

    def rejection_sampling(self) -> bool:
        """Whether SGLang verifies by rejection sampling: asked for, or turned on by block verification (0.5.22+)."""
        return self.passes(REJECTION_SAMPLING_FLAG) or (
            self.passes(BLOCK_VERIFICATION_FLAG) and parse_version(self.sglang_version) >= BLOCK_VERIFICATION_FROM)


@dataclass(frozen=True)
class RuleOutcome:
    """What one rule says SGLang will do with the requested flags."""

    rule: str  # the Rule's name
    kind: str  # "adjusted" | "default" | "error"
    what: str  # what SGLang will do with this request
    sglang_message: str | None  # SGLang's own words, when it prints any
    fix: str | None

    def __str__(self) -> str:
        said = f" ({self.sglang_message})" if self.sglang_message else ""
        fix = f"; {self.fix}" if self.fix else ""
        return f"rule {self.rule}: {self.what}{said}{fix}"


@dataclass(frozen=True)
class Rule:
    name: str
    condition: str
    effect: str
    sglang_message: str | None  # SGLang's text (a prefix where the rest varies)
    log_pattern: str | None  # regex that finds this rule's line in the server log
    fix: str
    source: str
    # check(state, setup) -> (kind, what, fix) or None; it may update `state` as SGLang does
    check: Callable[[dict, Setup], tuple[str, str, str] | None]
    algorithms: tuple[str, ...] = EAGLE_FAMILY  # the --speculative-algorithm values this rule is read for

    def apply(self, state: dict, setup: Setup) -> RuleOutcome | None:
        if state["algorithm"] not in self.algorithms:
            return None
        hit = self.check(state, setup)
        if hit is None:
            return None
        kind, what, fix = hit
        return RuleOutcome(self.name, kind, what, self.sglang_message, fix)


# ---------------------------------------------------------------------------------------------
# The rules, one function each, applied in SGLang's order. Each returns (kind, what, fix) or None.


def _eagle_with_eagle3_draft(s, setup):
    draft = setup.draft_architecture or ""
    if s["algorithm"] == "EAGLE" and draft.endswith("Eagle3"):
        what = f"the draft is {draft} but SGLang runs it as EAGLE: fc is skipped and acceptance collapses (tau 1.6 instead of 3.3 on the embedded default, SGLang 0.5.14)"
        return "error", what, "set spec.algorithm: EAGLE3"


def _block_verification(s, setup):
    if not setup.passes(BLOCK_VERIFICATION_FLAG):
        return None
    if parse_version(setup.sglang_version) < BLOCK_VERIFICATION_FROM:
        what = f"SGLang {setup.sglang_version} has no {BLOCK_VERIFICATION_FLAG} (added in 0.5.22): it refuses to start (unrecognized argument)"
        return "error", what, f"remove {BLOCK_VERIFICATION_FLAG} from bench.extra_server_args, or serve with SGLang >= 0.5.22"
    if not setup.passes(REJECTION_SAMPLING_FLAG):
        what = (f"{BLOCK_VERIFICATION_FLAG} turns rejection sampling on for {s['algorithm']} without a word: verification "
                "then samples instead of matching the target's argmax, so acceptance is not comparable with a greedy run")
        return "default", what, f"add {REJECTION_SAMPLING_FLAG} to bench.extra_server_args to ask for it explicitly"


def _mixed_chunk(s, setup):
    if not setup.passes(MIXED_CHUNK_FLAG):
        return None
    v = parse_version(setup.sglang_version)
    kind = None
    for since, effect in MIXED_CHUNK_BY_RELEASE:
        if v >= since:
            kind = effect
    fix = f"remove {MIXED_CHUNK_FLAG} from bench.extra_server_args (or serve with SGLang >= 0.5.19, which keeps it)"
    if kind == "error":
        return "error", f"SGLang {setup.sglang_version} refuses {MIXED_CHUNK_FLAG} with speculative decoding (AssertionError at start-up)", fix
    if kind == "adjusted":
        return "adjusted", f"SGLang {setup.sglang_version} turns {MIXED_CHUNK_FLAG} off when speculating (WARNING)", fix


def _rejection_sampling_topk(s, setup):
    if setup.rejection_sampling() and s["topk"] is not None and s["topk"] != 1:
        what = f"rejection sampling (asked for, or turned on by {BLOCK_VERIFICATION_FLAG}) needs a chain: SGLang refuses topk={s['topk']} (ValueError)"
        return "error", what, "set spec.topk: 1 (and spec.num_draft_tokens: spec.num_steps + 1)"


def _rejection_sampling_deterministic(s, setup):
    if setup.rejection_sampling() and setup.passes(DETERMINISTIC_FLAG) and parse_version(setup.sglang_version) < DETERMINISTIC_REJECTION_FROM:
        what = f"SGLang {setup.sglang_version} refuses rejection sampling with {DETERMINISTIC_FLAG} (ValueError; allowed on CUDA from 0.5.23)"
        return "error", what, f"drop {DETERMINISTIC_FLAG} or rejection sampling, or serve with SGLang >= 0.5.23"


def _max_running_requests_default(s, setup):
    if s["max_running_requests"] is None:
        s["max_running_requests"] = SPEC_MAX_RUNNING_REQUESTS
        what = f"SGLang caps running requests (and CUDA-graph batch sizes) at {SPEC_MAX_RUNNING_REQUESTS}"
        return "default", what, "set bench.max_running_requests to choose the cap"


def _defaults_need_num_steps(s, setup):
    if s["num_steps"] is None and (s["topk"] is not None or s["num_draft_tokens"] is not None):
        what = "SGLang stops at start-up with a bare AssertionError (topk and num_draft_tokens must be unset when num_steps is)"
        return "error", what, "set spec.num_steps too, or unset spec.topk and spec.num_draft_tokens to take SGLang's defaults"


def _defaults_by_architecture(s, setup):
    if s["num_steps"] is None and s["topk"] is None and s["num_draft_tokens"] is None:
        steps, topk, tokens = default_spec_params(setup.target_architecture, setup.sglang_version)
        s.update(num_steps=steps, topk=topk, num_draft_tokens=tokens)
        what = f"SGLang {setup.sglang_version} picks num_steps={steps}, topk={topk}, num_draft_tokens={tokens} for {setup.target_architecture}"
        return "default", what, f"set spec.num_steps: {steps}, spec.topk: {topk}, spec.num_draft_tokens: {tokens} to pin them"


def _topk_unset(s, setup):
    if s["num_steps"] is not None and s["topk"] is None:
        return "error", "SGLang crashes at start-up with a TypeError (it compares the unset topk with 1)", "set spec.topk (1 = chain)"


def _trtllm_mha_topk(s, setup):
    if s["attention_backend"] == "trtllm_mha" and s["topk"] is not None and s["topk"] > 1:
        return "error", "SGLang refuses to start (ValueError)", "set spec.topk: 1 or another bench.attention_backend"


def _chain_draft_tokens(s, setup):
    steps, asked = s["num_steps"], s["num_draft_tokens"]
    if s["topk"] == 1 and steps is not None and asked != steps + 1:
        s["num_draft_tokens"] = steps + 1
        fix = f"set spec.num_draft_tokens: {steps + 1}"
        if asked is None:
            return "default", f"SGLang runs {steps + 1} draft tokens", fix
        return "adjusted", f"SGLang would run {steps + 1} draft tokens", fix


def _paged_tree_backend(s, setup):
    topk, pages, backend = s["topk"], s["page_size"] or 1, s["attention_backend"]
    if topk is None or topk <= 1 or pages <= 1 or backend in PAGE_TREE_BACKENDS:
        return None
    fix = f"set bench.page_size: 1 or bench.attention_backend to one of {', '.join(PAGE_TREE_BACKENDS)} (or spec.topk: 1)"
    if backend is None:
        # SGLang picks the backend from the GPU (fa3 on Hopper, flashinfer elsewhere for most
        # models: both fine); MLA models get backends it refuses. Recorded, not refused.
        what = (f"topk={topk} with page_size={pages} needs a {'/'.join(PAGE_TREE_BACKENDS)} attention backend; "
                "SGLang picks one from the GPU and refuses any other (ValueError)")
        return "default", what, fix
    return "error", f"SGLang refuses topk={topk} with page_size={pages} on attention backend {backend} (ValueError)", fix


def _tree_draft_tokens_unset(s, setup):
    steps, topk = s["num_steps"], s["topk"]
    if topk is not None and topk > 1 and steps is not None and s["num_draft_tokens"] is None:
        what = "SGLang leaves speculative_num_draft_tokens unset for a tree (no default, no check) and fails when it builds the draft tree"
        return "error", what, f"set spec.num_draft_tokens (2 .. {tree_candidates(steps, topk) + 1})"


def _tree_draft_tokens_exceed(s, setup):
    steps, topk, tokens = s["num_steps"], s["topk"], s["num_draft_tokens"]
    if steps is None or topk is None or topk <= 1 or tokens is None:
        return None
    most = tree_candidates(steps, topk) + 1
    if tokens > most:
        what = (f"the draft tree has only {most - 1} candidate tokens for {tokens - 1} verify slots; "
                "SGLang does not check this and its top-k selection fails when decoding starts")
        return "error", what, f"set spec.num_draft_tokens: {most} or less"


def _draft_context_shorter(s, setup):
    draft, target = setup.draft_context_length, setup.target_context_length
    if draft is None or target is None or draft >= target:
        return None
    fix = f"export the draft with max_position_embeddings >= {target}"
    if setup.allow_longer_context:
        what = f"SGLang overrides the draft's max_position_embeddings {draft} -> {target} ({ALLOW_LONGER_CONTEXT_ENV}=1)"
        return "adjusted", what, fix
    what = f"SGLang refuses to start: the draft's context {draft} < the target's {target} (ValueError)"
    return "error", what, f"{fix} (or set {ALLOW_LONGER_CONTEXT_ENV}=1 to let SGLang override it)"


def _concurrency_above_running(s, setup):
    cap, want = s["max_running_requests"], setup.max_concurrency
    if cap is not None and want is not None and want > cap:
        what = f"SGLang runs at most {cap} requests at once; with {want} in flight the rest queue, so that point of the sweep measures queueing"
        return "adjusted", what, f"set bench.max_running_requests: {want} or keep bench.concurrency <= {cap}"


def _ngram_mixed_chunk(s, setup):
    if setup.passes(MIXED_CHUNK_FLAG):
        return "adjusted", "SGLang turns --enable-mixed-chunk off for NGRAM (WARNING)", f"remove {MIXED_CHUNK_FLAG} from bench.extra_server_args"
    return "default", "SGLang runs NGRAM without mixed chunked prefill", None


def _ngram_breadth_defaults(s, setup):
    """The NGRAM settings left unset take SGLang's defaults (recorded, never refused)."""
    filled = []
    for key, value in (("ngram_min_bfs_breadth", NGRAM_MIN_BFS_BREADTH), ("ngram_max_bfs_breadth", NGRAM_MAX_BFS_BREADTH),
                       ("ngram_max_trie_depth", NGRAM_MAX_TRIE_DEPTH)):
        if s[key] is None:
            s[key] = value
            filled.append(f"{key.replace('ngram_', '')} {value}")
    if filled:
        return "default", f"SGLang {setup.sglang_version} takes its NGRAM defaults: {', '.join(filled)}", "name them in the configuration (ngram-N-B)"


def _ngram_breadth_range(s, setup):
    low, high = s["ngram_min_bfs_breadth"], s["ngram_max_bfs_breadth"]
    if low < 1 or low > high:
        what = f"SGLang's n-gram cache refuses min BFS breadth {low} with max {high} at start-up (RuntimeError)"
        return "error", what, "keep 1 <= min BFS breadth <= max BFS breadth"


def _ngram_topk(s, setup):
    breadth, asked = s["ngram_max_bfs_breadth"], s["topk"]
    s["topk"] = breadth
    if asked is not None and asked != breadth:
        return "adjusted", f"SGLang would run topk {breadth} (the maximum BFS breadth), not {asked}", "leave topk unset for NGRAM"
    return "default", f"SGLang sets topk to the maximum BFS breadth, {breadth}", None


def _ngram_draft_tokens(s, setup):
    if s["num_draft_tokens"] is None:
        s["num_draft_tokens"] = NGRAM_DRAFT_TOKENS
        return "default", f"SGLang runs {NGRAM_DRAFT_TOKENS} draft tokens", "name the draft tokens (ngram-N-B)"


def _ngram_num_steps(s, setup):
    if s["num_steps"] is None:
        s["num_steps"] = s["num_draft_tokens"] // s["topk"]
        return "default", f"SGLang sets num_steps to draft tokens // topk = {s['num_steps']}", None


def _ngram_paged_tree(s, setup):
    topk, pages, backend = s["topk"], s["page_size"] or 1, s["attention_backend"]
    if topk <= 1 or pages <= 1 or backend in NGRAM_PAGE_TREE_BACKENDS:
        return None
    what = f"SGLang refuses an NGRAM tree (breadth {topk}) with page_size={pages} on attention backend {backend or '(its pick)'} (ValueError)"
    return "error", what, "set bench.page_size: 1, bench.attention_backend: flashinfer, or a breadth of 1 (ngram-N-1)"


_ARGS = ("python/sglang/srt/server_args.py ServerArgs._handle_speculative_decoding (0.5.x up to 0.5.14); "
         "python/sglang/srt/arg_groups/speculative_hook.py _handle_eagle_family (0.5.17..0.5.23); "
         "python/sglang/srt/speculative/spec_info.py _handle_eagle_family (main)")
_HOOK = "sgl-project/sglang v0.5.23 python/sglang/srt/arg_groups/speculative_hook.py"
_NGRAM = "python/sglang/srt/arg_groups/speculative_hook.py _handle_ngram (the sglang 0.5.14 wheel)"
_ALL = ALGORITHMS

RULES: tuple[Rule, ...] = (
    Rule("eagle_with_eagle3_draft",
         condition="spec.algorithm is EAGLE and the draft is an EAGLE-3 checkpoint (architectures ends with Eagle3)",
         effect="runs without error but skips fc; acceptance collapses. EAGLE3 is never inferred from the checkpoint",
         sglang_message=None, log_pattern=None, fix="set spec.algorithm: EAGLE3",
         source="DESIGN.md section 4 (read from SGLang's EAGLE worker and LlamaForCausalLMEagle3)",
         check=_eagle_with_eagle3_draft),
    Rule("block_verification",
         condition=f"{BLOCK_VERIFICATION_FLAG} in bench.extra_server_args",
         effect="up to 0.5.21: unknown argument, SGLang refuses to start; from 0.5.22: EAGLE/EAGLE3 verify by rejection sampling "
                f"({REJECTION_SAMPLING_FLAG} turned on, no message)",
         sglang_message=None, log_pattern=None, fix=f"pass {REJECTION_SAMPLING_FLAG} too, or drop {BLOCK_VERIFICATION_FLAG}",
         source=f"{_HOOK} handle_speculative_decoding (added in v0.5.22)", check=_block_verification, algorithms=_ALL),
    Rule("max_running_requests_default",
         condition="max_running_requests unset",
         effect=f"max_running_requests := {SPEC_MAX_RUNNING_REQUESTS}, which also caps the CUDA-graph batch sizes",
         sglang_message=f"Max running requests is reset to {SPEC_MAX_RUNNING_REQUESTS} for speculative decoding",
         log_pattern=r"Max running requests is reset to \d+ for speculative decoding",
         fix="set bench.max_running_requests", source=f"{_ARGS}; {_NGRAM}", check=_max_running_requests_default,
         algorithms=_ALL),
    Rule("mixed_chunk",
         condition=f"{MIXED_CHUNK_FLAG} in bench.extra_server_args",
         effect="0.5.5: turned off (WARNING); 0.5.14: AssertionError; 0.5.17-0.5.18: turned off (WARNING); from 0.5.19: kept "
                "for EAGLE/EAGLE3",
         sglang_message="Mixed chunked prefill is disabled because of using eagle speculative decoding.",
         log_pattern=r"Mixed chunked prefill is disabled because of using eagle speculative decoding",
         fix=f"drop {MIXED_CHUNK_FLAG}",
         source=f"python/sglang/srt/server_args.py (v0.5.5, v0.5.14); {_HOOK} _handle_eagle_family and "
                "python/sglang/srt/speculative/spec_info.py SpeculativeAlgorithm.supports_mixed_chunk (v0.5.19+)",
         check=_mixed_chunk),
    Rule("ngram_mixed_chunk",
         condition="NGRAM",
         effect="enable_mixed_chunk := False (a WARNING at every NGRAM start-up)",
         sglang_message="The mixed chunked prefill are disabled because of using ngram speculative decoding.",
         log_pattern=r"The mixed chunked prefill are disabled because of using ngram speculative decoding",
         fix=f"drop {MIXED_CHUNK_FLAG}", source=_NGRAM, check=_ngram_mixed_chunk, algorithms=(NGRAM,)),
    Rule("ngram_defaults",
         condition="NGRAM with min/max BFS breadth or trie depth unset",
         effect=f"min BFS breadth {NGRAM_MIN_BFS_BREADTH}, max {NGRAM_MAX_BFS_BREADTH}, trie depth {NGRAM_MAX_TRIE_DEPTH}, "
                f"capacity {NGRAM_CAPACITY} trie nodes, match type BFS",
         sglang_message=None, log_pattern=None, fix="name them", source="python/sglang/srt/server_args.py ServerArgs (0.5.14)",
         check=_ngram_breadth_defaults, algorithms=(NGRAM,)),
    Rule("ngram_breadth_range",
         condition="NGRAM with min BFS breadth < 1 or > max BFS breadth",
         effect="RuntimeError when the n-gram cache is built", sglang_message="min_bfs_breadth must be",
         log_pattern=r"min_bfs_breadth must be", fix="keep 1 <= min <= max",
         source="python/sglang/jit_kernel/csrc/ngram_corpus/ngram.cpp (0.5.14)", check=_ngram_breadth_range, algorithms=(NGRAM,)),
    Rule("ngram_topk",
         condition="NGRAM",
         effect="speculative_eagle_topk := speculative_ngram_max_bfs_breadth (any topk given is overwritten, no message)",
         sglang_message=None, log_pattern=None, fix="leave topk unset", source=_NGRAM, check=_ngram_topk, algorithms=(NGRAM,)),
    Rule("ngram_draft_tokens",
         condition="NGRAM and num_draft_tokens unset",
         effect=f"num_draft_tokens := {NGRAM_DRAFT_TOKENS} (WARNING)",
         sglang_message=f"speculative_num_draft_tokens is set to {NGRAM_DRAFT_TOKENS} by default for ngram speculative decoding.",
         log_pattern=r"speculative_num_draft_tokens is set to \d+ by default for ngram speculative decoding",
         fix="set the draft tokens", source=_NGRAM, check=_ngram_draft_tokens, algorithms=(NGRAM,)),
    Rule("ngram_num_steps",
         condition="NGRAM and num_steps unset",
         effect="num_steps := num_draft_tokens // topk (no message)",
         sglang_message=None, log_pattern=None, fix="none needed", source=_NGRAM, check=_ngram_num_steps, algorithms=(NGRAM,)),
    Rule("ngram_paged_tree",
         condition="NGRAM, topk (max BFS breadth) > 1, page_size > 1, attention backend not flashinfer",
         effect="ValueError at start-up",
         sglang_message="speculative_eagle_topk(K) > 1 with page_size(P) > 1 is unstable and produces incorrect results for paged attention backends.",
         log_pattern=r"speculative_eagle_topk\(\S+\) > 1 with page_size\(\S+\) > 1 is unstable",
         fix="set bench.page_size: 1 or bench.attention_backend: flashinfer", source=_NGRAM, check=_ngram_paged_tree,
         algorithms=(NGRAM,)),
    Rule("defaults_need_num_steps",
         condition="num_steps unset but topk or num_draft_tokens set",
         effect="start-up stops: assert speculative_eagle_topk is None and speculative_num_draft_tokens is None",
         sglang_message=None, log_pattern=None, fix="set spec.num_steps", source=_ARGS, check=_defaults_need_num_steps),
    Rule("defaults_by_architecture",
         condition="num_steps, topk and num_draft_tokens all unset",
         effect="(num_steps, topk, num_draft_tokens) from the TARGET architecture: LlamaForCausalLM and Grok (5,4,8), "
                "others (3,1,4) since 0.5.8; up to 0.5.7 DeepSeek-V2/V3 and gpt-oss (3,1,4), others (5,4,8)",
         sglang_message=None, log_pattern=None, fix="set spec.num_steps, spec.topk, spec.num_draft_tokens",
         source="python/sglang/srt/server_args.py auto_choose_speculative_params (0.5.x); "
                "python/sglang/srt/speculative/spec_info.py _auto_choose_speculative_params (main)",
         check=_defaults_by_architecture),
    Rule("topk_unset",
         condition="num_steps set, topk unset",
         effect="crashes with a Python TypeError ('>' between None and int)",
         sglang_message=None, log_pattern=None, fix="set spec.topk", source=_ARGS, check=_topk_unset),
    Rule("trtllm_mha_topk",
         condition="attention backend trtllm_mha and topk > 1",
         effect="ValueError at start-up",
         sglang_message="trtllm_mha backend only supports topk = 1 for speculative decoding.",
         log_pattern=r"trtllm_mha backend only supports topk = 1 for speculative decoding",
         fix="set spec.topk: 1 or another bench.attention_backend", source=_ARGS, check=_trtllm_mha_topk),
    Rule("rejection_sampling_topk",
         condition=f"rejection sampling ({REJECTION_SAMPLING_FLAG}, or {BLOCK_VERIFICATION_FLAG} from 0.5.22) and topk != 1",
         effect="ValueError at start-up",
         sglang_message="--speculative-use-rejection-sampling requires --speculative-eagle-topk=1.",
         log_pattern=r"--speculative-use-rejection-sampling requires --speculative-eagle-topk=1",
         fix="set spec.topk: 1", source=f"{_HOOK} _handle_eagle_family (read in v0.5.17..v0.5.23)", check=_rejection_sampling_topk),
    Rule("rejection_sampling_deterministic",
         condition=f"rejection sampling and {DETERMINISTIC_FLAG}, SGLang before 0.5.23",
         effect="ValueError at start-up (0.5.23 allows it on CUDA)",
         sglang_message="--speculative-use-rejection-sampling is incompatible with --enable-deterministic-inference",
         log_pattern=r"--speculative-use-rejection-sampling is incompatible with --enable-deterministic-inference",
         fix=f"drop {DETERMINISTIC_FLAG}, or serve with SGLang >= 0.5.23",
         source=f"python/sglang/srt/arg_groups/speculative_hook.py _handle_eagle_family (v0.5.17..v0.5.22; changed in v0.5.23)",
         check=_rejection_sampling_deterministic),
    Rule("chain_draft_tokens",
         condition="topk == 1 and num_draft_tokens != num_steps + 1 (unset included)",
         effect="num_draft_tokens := num_steps + 1 (WARNING, once)",
         sglang_message="speculative_num_draft_tokens is adjusted to speculative_num_steps + 1 when speculative_eagle_topk == 1",
         log_pattern=r"speculative_num_draft_tokens is adjusted to speculative_num_steps \+ 1 when speculative_eagle_topk == 1",
         fix="set spec.num_draft_tokens: num_steps + 1", source=_ARGS, check=_chain_draft_tokens),
    Rule("paged_tree_backend",
         condition=f"topk > 1, page_size > 1, attention backend not {'/'.join(PAGE_TREE_BACKENDS)}",
         effect="ValueError at start-up",
         sglang_message="speculative_eagle_topk > 1 with page_size > 1 is",  # "unstable ..." or "only supported on ...", by release
         log_pattern=r"speculative_eagle_topk > 1 with page_size > 1 is",
         fix="set bench.page_size: 1 or a supported bench.attention_backend", source=_ARGS, check=_paged_tree_backend),
    Rule("tree_draft_tokens_unset",
         condition="topk > 1 and num_draft_tokens unset (num_steps set)",
         effect="SGLang keeps None (no default, no check); the draft-tree code then fails",
         sglang_message=None, log_pattern=None, fix="set spec.num_draft_tokens",
         source=_ARGS + " (no branch sets it)", check=_tree_draft_tokens_unset),
    Rule("tree_draft_tokens_exceed",
         condition="topk > 1 and num_draft_tokens - 1 > topk + (num_steps - 1) * topk**2",
         effect="no server check; torch.topk over the candidate scores fails when decoding starts",
         sglang_message=None, log_pattern=None, fix="lower spec.num_draft_tokens",
         source="python/sglang/srt/speculative/eagle_utils.py organize_draft_results (torch.topk(score_list, num_draft_token - 1))",
         check=_tree_draft_tokens_exceed),
    Rule("draft_context_shorter",
         condition="draft max_position_embeddings < target context length",
         effect=f"ValueError unless {ALLOW_LONGER_CONTEXT_ENV}=1; with it, SGLang overrides the draft's max_position_embeddings",
         sglang_message="Target model's context_length (T) is greater than the derived context_length (D)",
         log_pattern=r"Target model's context_length \(\d+\) is greater than the derived context_length \(\d+\)",
         fix="export the draft with max_position_embeddings >= the target's context",
         source="python/sglang/srt/configs/model_config.py ModelConfig._derive_context_length", check=_draft_context_shorter),
    Rule("concurrency_above_running",
         condition="bench concurrency > effective max_running_requests (the project's rule, not SGLang's)",
         effect="requests beyond the cap wait in SGLang's queue; the sweep point measures queueing",
         sglang_message=None, log_pattern=None, fix="raise bench.max_running_requests or lower bench.concurrency",
         source="this project: bench", check=_concurrency_above_running, algorithms=_ALL),
)
RULES_BY_NAME = {r.name: r for r in RULES}


# ---------------------------------------------------------------------------------------------


def default_spec_params(target_architecture: str, sglang_version: str) -> tuple[int, int, int]:
    """SGLang's (num_steps, topk, num_draft_tokens) when none is given, from the TARGET architecture."""
    if target_architecture in WIDE_ARCHS:
        return WIDE_DEFAULT
    if parse_version(sglang_version) >= DEFAULTS_CHANGED_IN:
        return CHAIN_DEFAULT
    return CHAIN_DEFAULT if target_architecture in CHAIN_ARCHS_BEFORE_0_5_8 else WIDE_DEFAULT


def tree_candidates(num_steps: int, topk: int) -> int:
    """Draft tokens an EAGLE tree scores: topk at step 1, topk*topk at each later step (SGLang's
    rule; the most num_draft_tokens - 1 can be, here and in draftlab.engine.speculative.check_flags)."""
    return topk + (num_steps - 1) * topk * topk


@dataclass(frozen=True)
class Resolution:
    requested: SpecFlags
    effective: SpecFlags
    findings: tuple[RuleOutcome, ...]  # every rule that fired, in SGLang's order
    target_architecture: str
    sglang_version: str

    def of_kind(self, kind: str) -> list[RuleOutcome]:
        return [f for f in self.findings if f.kind == kind]

    @property
    def errors(self) -> list[RuleOutcome]:
        return self.of_kind("error")

    @property
    def adjustments(self) -> list[RuleOutcome]:
        return self.of_kind("adjusted")

    def changed(self) -> dict[str, tuple]:
        """{flag: (requested, effective)} for every flag SGLang sets differently from the request."""
        req, eff = dataclasses.asdict(self.requested), dataclasses.asdict(self.effective)
        return {k: (req[k], eff[k]) for k in req if req[k] != eff[k]}

    def as_dict(self) -> dict:
        """Plain form for metrics files and manifests."""
        return {
            "requested": dataclasses.asdict(self.requested),
            "effective": dataclasses.asdict(self.effective),
            "findings": [dataclasses.asdict(f) for f in self.findings],
            "target_architecture": self.target_architecture,
            "sglang_version": self.sglang_version,
        }

    def enforce(self, on_adjust: str = "error") -> "Resolution":
        """Raise UserError for errors always, and for adjustments unless on_adjust == "allow"."""
        if on_adjust not in ("error", "allow"):
            raise ValueError(f"on_adjust must be 'error' or 'allow', got {on_adjust!r}")
        blocking = self.errors + (self.adjustments if on_adjust == "error" else [])
        if not blocking:
            return self
        lines = [f"  {f}" for f in blocking]
        tail = ""
        if on_adjust == "error" and self.adjustments:
            tail = "\n(or set spec.on_adjust: allow to run what SGLang runs; the report then lists requested and effective flags)"
        raise UserError(f"SGLang {self.sglang_version} would not run the speculative flags as requested:\n" + "\n".join(lines) + tail)


def resolve(requested: SpecFlags, target_architecture: str, sglang_version: str, *, draft_architecture: str | None = None,
            draft_context_length: int | None = None, target_context_length: int | None = None,
            allow_longer_context: bool | None = None, max_concurrency: int | None = None,
            extra_server_args: list[str] | tuple[str, ...] = ()) -> Resolution:
    """Apply every rule to `requested`; never raises for a bad combination (see Resolution.enforce).

    allow_longer_context None = read SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN from this
    process's environment (the server inherits it). extra_server_args: the other launch
    arguments (bench.extra_server_args); the rules read the store-true flags among them.
    """
    if requested.algorithm not in ALGORITHMS:
        raise UserError(f"spec.algorithm must be one of {', '.join(ALGORITHMS)}, got {requested.algorithm!r}")
    parse_version(sglang_version)  # a bad version string fails here, naming the key
    if allow_longer_context is None:
        allow_longer_context = os.environ.get(ALLOW_LONGER_CONTEXT_ENV, "").strip().lower() in ("1", "true")
    setup = Setup(target_architecture, sglang_version, draft_architecture, draft_context_length,
                  target_context_length, allow_longer_context, max_concurrency, tuple(extra_server_args or ()))
    state = dataclasses.asdict(requested)
    findings = tuple(f for f in (rule.apply(state, setup) for rule in RULES) if f is not None)
    return Resolution(requested, SpecFlags(**state), findings, target_architecture, sglang_version)


def effective_flags(requested: SpecFlags, target_architecture: str, sglang_version: str, on_adjust: str = "error", **setup) -> Resolution:
    """resolve() then enforce(on_adjust): what SGLang will run, or a UserError naming rule and fix."""
    return resolve(requested, target_architecture, sglang_version, **setup).enforce(on_adjust)


def requested_from_params(spec, bench) -> SpecFlags:
    """SpecFlags from the loaded `spec` and `bench` params sections."""
    return SpecFlags(
        algorithm=spec.algorithm,
        num_steps=spec.num_steps,
        topk=spec.topk,
        num_draft_tokens=spec.num_draft_tokens,
        max_running_requests=bench.max_running_requests,
        page_size=bench.page_size,
        attention_backend=bench.attention_backend,
    )
