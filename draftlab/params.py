"""One typed loader for params.yaml.

Each stage loads only the sections it reads: `load_params(["target", "train"])`. Every key of a
loaded section must be known, present and of the declared type, else the stage stops with a
message naming the file, the key and the expected type. A typo such as `spec.num_step=5` must
never be silently ignored, so unknown keys are errors with a "did you mean" hint.

`dvc exp run -S key=value` writes Hydra-typed values into params.yaml (unquoted `5` is an int,
`true` a bool, `null` None, `0.5` a float). The rules below coerce only where nothing can be
lost (int -> float, integral float -> int, "true"/"false" -> bool, numeric string -> number) and
reject everything else with the fix.

Length: over 400 lines because every section's typed fields and every key's allowed range
live here, next to the one loader that checks them; split, they would drift apart.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence, Union

import yaml

from draftlab.errors import UserError

PARAMS_FILE = "params.yaml"


class ParamsError(UserError):
    pass


def choice(*values: str, **kw) -> Any:
    """A str field restricted to `values` (checked by the loader)."""
    return field(metadata={"choices": values}, **kw)


# ---------------------------------------------------------------------------------------------
# Sections. Field docs live in params.yaml next to the values; these classes give names and types.


@dataclass(frozen=True)
class TargetParams:
    model: str  # hub id or local path of the target LLM
    revision: str | None  # hub revision (commit/tag); None for a local path
    dtype: str = choice("float32", "bfloat16", "float16")
    device: str = choice("auto", "cpu", "cuda")


@dataclass(frozen=True)
class PromptsParams:
    source: str  # "builtin" or a path to a .jsonl / .parquet file
    num_prompts: int  # how many prompts the built-in generator draws
    seed: int
    eval_fraction: float  # share of prompts (by content hash) held out for eval/bench
    on_bad_row: str = choice("error", "skip")


@dataclass(frozen=True)
class SynthParams:
    base_url: str  # openai backend: server URL up to /v1
    model_name: str | None  # openai backend: served model name; None = the server's first
    api_key_env: str  # NAME of the env var holding the API key (the key is never stored)
    max_new_tokens: int  # tokens per answer
    temperature: float  # 0 = greedy
    top_p: float
    seed: int  # sampling seed; each row's seed derives from it and the row id
    batch_size: int  # hf backend: prompts per generate() call
    concurrency: int  # openai backend: requests in flight
    timeout_s: float  # openai backend: seconds per request attempt
    max_retries: int  # openai backend: retries after the first attempt
    retry_backoff_s: float  # openai backend: first retry delay, doubled each retry
    backend: str = choice("hf", "openai")
    reasoning: str = choice("keep", "drop")


@dataclass(frozen=True)
class CaptureParams:
    # decoder-layer outputs, 0-based, and optionally the word "embedding" (the embedding output);
    # or the word "default". Checked by _check_capture_layers.
    layers: Union[list[Union[int, str]], str]


@dataclass(frozen=True)
class ExtractParams:
    max_length: int
    batch_size: int
    shard_tokens: int
    dtype: str = choice("bfloat16", "float16", "float32")
    online_sample_sequences: int = 64  # train.features online: rows per split captured for stats and check


@dataclass(frozen=True)
class StandardizeParams:
    draft_vocab_size: int


@dataclass(frozen=True)
class TrainParams:
    seed: int  # draft init and data order
    epochs: int  # passes over the train split
    batch_size: int  # sequences per optimizer step, all processes together
    max_length: int  # tokens per sequence seen by the draft (longer ones are cut)
    lr: float  # peak AdamW learning rate
    min_lr_ratio: float  # cosine decays to lr * this
    warmup_ratio: float  # share of optimizer steps with linear warmup
    weight_decay: float
    grad_clip: float  # max global grad norm; 0 = off
    ttt_steps: int  # training-time-test unroll length (draft steps fed back)
    ttt_decay: float  # loss weight of step i is ttt_decay**i
    intermediate_size: int | None  # draft MLP width; None = the target's
    checkpoint_every: int  # optimizer steps between resumable checkpoints; 0 = epoch ends only
    device: str = choice("auto", "cpu", "cuda")
    autocast: str = choice("auto", "bfloat16", "none")
    # offline: read stored hidden states; online: run the target on every batch (nothing stored).
    # The default lets code that builds TrainParams directly (tests, tools) keep working; the
    # params.yaml loader still requires the key.
    features: str = choice("offline", "online", default="offline")


@dataclass(frozen=True)
class ExportParams:
    sglang_version: str  # the layer-id rule depends on it (DESIGN.md section 4)
    formats: list[str]  # "sglang" (the only one written today)
    dtype: str = choice("bfloat16", "float16", "float32")


@dataclass(frozen=True)
class SpecParams:
    num_steps: int | None
    topk: int | None
    num_draft_tokens: int | None
    algorithm: str = choice("EAGLE3", "EAGLE")
    on_adjust: str = choice("error", "allow")


@dataclass(frozen=True)
class BenchParams:
    num_prompts: int
    max_new_tokens: int
    ignore_eos: bool
    warmup: int
    concurrency: list[int]
    concurrency_repeats: int  # ABBA pairs of whole batches (one per server) at each concurrency > 1
    sweep: list[str]  # more configurations STEPS-TOPK-DRAFT_TOKENS and/or "advised", after spec.*'s; checked by check_sweep
    side_by_side: bool  # sglang: both servers up at once, requests alternating
    url: str
    server_log: str  # backend url: path of the running server's log ("" = none)
    port: int
    startup_timeout_s: float
    tp_size: int
    extra_server_args: list[str]
    max_running_requests: int | None  # SGLang --max-running-requests; None = SGLang's (48 when speculating)
    page_size: int | None  # SGLang --page-size (tokens per KV page); None = SGLang's default
    attention_backend: str | None  # SGLang --attention-backend; None = SGLang picks from the GPU
    request_timeout_s: float  # seconds one /generate request may take
    backend: str = choice("reference", "sglang", "url")
    dtype: str = choice("auto", "bfloat16", "float16", "float32")  # SGLang --dtype


@dataclass(frozen=True)
class CheckParams:
    tau_tolerance: float  # relative gap allowed between train-predicted, offline and served tau
    fail_on_error: bool  # exit non-zero when a finding is an error
    live_parity_samples: int  # training sequences sent through the serving capture path; 0 = no live parity
    parity_rtol: float  # relative error ||live - stored|| / ||stored|| a captured layer may show
    norm_tolerance: float  # live vs training mean L2 norm of a layer may differ by this share
    server_url: str  # "" = in-process capture; else a server started with --enable-return-hidden-states
    request_timeout_s: float  # seconds one /generate request of the live parity may take


SECTIONS: dict[str, type] = {
    "target": TargetParams,
    "prompts": PromptsParams,
    "synth": SynthParams,
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
# Allowed ranges, checked after the types, so that a value no stage can use (a batch size of 0, a
# negative lr) stops at load with the key and the range instead of a traceback or, worse, a run
# that trains nothing. (low, high, low excluded, high excluded); None = unbounded; a list's items
# are checked one by one and the list must not be empty; None values (where allowed) are skipped.

def _at_least(low):
    return (low, None, False, False)


def _above(low):
    return (low, None, True, False)


POSITIVE_INT = _at_least(1)
COUNT = _at_least(0)
POSITIVE = _above(0.0)
SHARE = (0.0, 1.0, False, False)

RANGES: dict[str, tuple] = {
    "prompts.num_prompts": POSITIVE_INT,
    "prompts.eval_fraction": (0.0, 1.0, True, True),
    "synth.max_new_tokens": POSITIVE_INT,
    "synth.temperature": COUNT,
    "synth.top_p": (0.0, 1.0, True, False),
    "synth.batch_size": POSITIVE_INT,
    "synth.concurrency": POSITIVE_INT,
    "synth.timeout_s": POSITIVE,
    "synth.max_retries": COUNT,
    "synth.retry_backoff_s": COUNT,
    "extract.max_length": _at_least(2),
    "extract.batch_size": POSITIVE_INT,
    "extract.shard_tokens": POSITIVE_INT,
    "extract.online_sample_sequences": POSITIVE_INT,
    "standardize.draft_vocab_size": POSITIVE_INT,
    "train.epochs": POSITIVE_INT,
    "train.batch_size": POSITIVE_INT,
    "train.max_length": _at_least(2),
    "train.lr": POSITIVE,
    "train.min_lr_ratio": SHARE,
    "train.warmup_ratio": (0.0, 1.0, False, True),
    "train.weight_decay": COUNT,
    "train.grad_clip": COUNT,
    "train.ttt_steps": POSITIVE_INT,
    "train.ttt_decay": (0.0, 1.0, True, False),
    "train.intermediate_size": POSITIVE_INT,
    "train.checkpoint_every": COUNT,
    "spec.num_steps": POSITIVE_INT,
    "spec.topk": POSITIVE_INT,
    "spec.num_draft_tokens": POSITIVE_INT,
    "bench.num_prompts": POSITIVE_INT,
    "bench.max_new_tokens": POSITIVE_INT,
    "bench.warmup": COUNT,
    "bench.concurrency": POSITIVE_INT,
    "bench.concurrency_repeats": POSITIVE_INT,
    "bench.port": (1, 65535, False, False),
    "bench.startup_timeout_s": POSITIVE,
    "bench.tp_size": POSITIVE_INT,
    "bench.max_running_requests": POSITIVE_INT,
    "bench.page_size": POSITIVE_INT,
    "bench.request_timeout_s": POSITIVE,
    "check.tau_tolerance": COUNT,
    "check.live_parity_samples": COUNT,
    "check.parity_rtol": POSITIVE,
    "check.norm_tolerance": COUNT,
    "check.request_timeout_s": POSITIVE,
}


def _range_text(low, high, low_open, high_open) -> str:
    if high is None:
        return f"{'>' if low_open else '>='} {low}"
    return f"in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"


def _check_range(path: str, key: str, value) -> None:
    for v in value if isinstance(value, list) else [value]:
        if isinstance(v, float) and not math.isfinite(v):
            raise ParamsError(f"{path}: key {key} must be a finite number, got {value!r}")
    if key not in RANGES or value is None:
        return
    low, high, low_open, high_open = RANGES[key]
    items = value if isinstance(value, list) else [value]
    if isinstance(value, list) and not value:
        raise ParamsError(f"{path}: key {key} must list at least one value ({_range_text(*RANGES[key])}), got []")
    for v in items:
        if (v < low or (low_open and v == low)) or (high is not None and (v > high or (high_open and v == high))):
            raise ParamsError(f"{path}: key {key} must be {_range_text(*RANGES[key])}, got {value!r}")


# ---------------------------------------------------------------------------------------------


CAPTURE_WORDS = ("embedding",)  # the one word capture.layers may list besides layer numbers


def _check_capture_layers(path: str, key: str, value) -> None:
    """capture.layers: "default", or a list of decoder layer numbers (>= 0) and the word embedding.
    Whether the target and the SGLang release can serve them is draftlab.sglang.layers' question."""
    if isinstance(value, str):
        if value != "default":
            raise ParamsError(f"{path}: key {key} must be a list of decoder layer numbers (0-based; the word embedding for "
                              f"the embedding output) or the word default, got {value!r}")
        return
    for item in value:
        if isinstance(item, str) and item not in CAPTURE_WORDS:
            raise ParamsError(f"{path}: key {key} must be list of int or str: decoder layer numbers (0-based) and the word "
                              f"embedding (the embedding output), e.g. [embedding, 3, 5]; {item!r} is neither")
        if isinstance(item, int) and item < 0:
            raise ParamsError(f"{path}: key {key} lists layer {item}; layers count from 0 (the output of the first decoder "
                              f"layer); for the embedding output write the word embedding")
    if value.count("embedding") > 1:
        raise ParamsError(f"{path}: key {key} names embedding twice")


ADVISED = "advised"  # the word bench.sweep may list: the configuration the advice recommends


def parse_configuration(text: str) -> tuple[int, int, int]:
    """'5-1-6' -> (num_steps, topk, num_draft_tokens); ValueError saying what to write instead.

    A chain (topk 1) verifies num_steps + 1 tokens (SGLang silently changes any other count); a tree
    verifies at most num_steps * topk + 1 (the root and the tokens its steps keep)."""
    try:
        steps, topk, tokens = (int(x) for x in str(text).split("-"))
    except ValueError:
        raise ValueError(f"{text!r} is not a configuration: write STEPS-TOPK-DRAFT_TOKENS, e.g. 5-1-6 (a chain) or "
                         f"6-8-32 (a tree), or the word {ADVISED}") from None
    if min(steps, topk, tokens) < 1:
        raise ValueError(f"{text!r}: every number must be >= 1, e.g. 5-1-6")
    if topk == 1 and tokens != steps + 1:
        raise ValueError(f"{text!r}: a chain (topk 1) verifies steps + 1 = {steps + 1} tokens (SGLang would change "
                         f"{tokens} silently); write {steps}-1-{steps + 1}")
    if tokens > steps * topk + 1:
        raise ValueError(f"{text!r}: {tokens} draft tokens exceed the tree's steps x topk + 1 = {steps * topk + 1}; "
                         f"write {steps}-{topk}-{steps * topk + 1} or fewer tokens")
    return steps, topk, tokens


def check_sweep(path: str, key: str, value: list[str]) -> None:
    """bench.sweep: configurations STEPS-TOPK-DRAFT_TOKENS and the word advised, none twice."""
    seen = {}
    for item in value:
        if item == ADVISED:
            config = ADVISED
        else:
            try:
                config = parse_configuration(item)
            except ValueError as e:
                raise ParamsError(f"{path}: key {key}: {e}") from None
        if config in seen:
            raise ParamsError(f"{path}: key {key} lists {seen[config]!r} and {item!r}: the same configuration twice; "
                              "list each once")
        seen[config] = item


CHECKS = {"capture.layers": _check_capture_layers, "bench.sweep": check_sweep}  # checks of one key beyond its type and range


def _type_name(tp) -> str:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        return " or ".join("null" if a is type(None) else _type_name(a) for a in typing.get_args(tp))
    if origin is list:
        return f"list of {_type_name(typing.get_args(tp)[0])}"
    return {int: "int", float: "float", str: "str", bool: "bool"}.get(tp, str(tp))


class _Mismatch(Exception):
    pass


def _coerce(value, tp):
    """Return `value` as type `tp`, coercing only losslessly; raise _Mismatch otherwise."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        for arg in typing.get_args(tp):  # first arm that fits wins: order arms strictest first
            try:
                return _coerce(value, arg)
            except _Mismatch:
                pass
        raise _Mismatch
    if tp is type(None):
        if value is None:
            return None
        raise _Mismatch
    if origin is list:
        if not isinstance(value, list):
            raise _Mismatch
        (item,) = typing.get_args(tp)
        return [_coerce(v, item) for v in value]
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        raise _Mismatch
    if tp in (int, float):
        if isinstance(value, bool):
            raise _Mismatch
        if isinstance(value, str):  # "5" from a hand edit or -S: parsed as the field's type
            try:
                return tp(value.strip())
            except ValueError:
                raise _Mismatch
        if tp is int and isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, int) or (tp is float and isinstance(value, float)):
            return tp(value)
        raise _Mismatch
    if tp is str:
        # A number here means Hydra parsed an unquoted value (0.5 for "0.5", 007 -> 7): converting
        # back could silently change it, so the user must quote it.
        if isinstance(value, str):
            return value
        raise _Mismatch
    raise TypeError(f"unsupported field type {tp}")


def _load_section(name: str, raw, path: str):
    cls = SECTIONS[name]
    if not isinstance(raw, dict):
        raise ParamsError(f"{path}: section '{name}' must be a mapping of keys, got {type(raw).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in raw:
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1, cutoff=0.6)
            hint = f", did you mean {name}.{close[0]}?" if close else f" (known keys: {', '.join(fields)})"
            raise ParamsError(f"{path}: unknown key {name}.{key}{hint}")
    values = {}
    for fname, f in fields.items():
        if fname not in raw:
            raise ParamsError(f"{path}: missing key {name}.{fname} (expected {_type_name(hints[fname])})")
        value = raw[fname]
        try:
            value = _coerce(value, hints[fname])
        except _Mismatch:
            fix = ""
            if hints[fname] is str and isinstance(value, (int, float)):
                fix = f"; quote it, e.g. -S '{name}.{fname}=\"{value}\"'"
            raise ParamsError(
                f"{path}: key {name}.{fname} must be {_type_name(hints[fname])}, "
                f"got {value!r} ({type(value).__name__}){fix}"
            ) from None
        choices = f.metadata.get("choices")
        if choices and value not in choices:
            raise ParamsError(f"{path}: key {name}.{fname} must be one of {', '.join(choices)}, got {value!r}")
        _check_range(path, f"{name}.{fname}", value)
        if f"{name}.{fname}" in CHECKS:
            CHECKS[f"{name}.{fname}"](path, f"{name}.{fname}", value)
        values[fname] = value
    return cls(**values)


def read_yaml(path: str | Path) -> dict:
    path = Path(path)
    if not path.exists():
        raise ParamsError(f"{path}: params file not found (run from the project root)")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ParamsError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ParamsError(f"{path}: top level must be a mapping of sections")
    return data


def load_params(sections: Sequence[str], path: str | Path = PARAMS_FILE) -> types.SimpleNamespace:
    """Load and validate `sections` of params.yaml; returns an object with one attribute per section."""
    data = read_yaml(path)
    for name in data:
        if name not in SECTIONS:
            close = difflib.get_close_matches(str(name), list(SECTIONS), n=1, cutoff=0.6)
            hint = f", did you mean {close[0]}?" if close else ""
            raise ParamsError(f"{path}: unknown section '{name}'{hint}")
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
