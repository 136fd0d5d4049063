"""How the bench's SGLang servers share one GPU: each one's explicit KV pool, and which start together.

bench.sweep serves a baseline and every configuration it lists on one GPU. They start at the same
time, before anything is measured (one SGLang start-up, ~70 s, not one per configuration), when each
has an explicit KV pool (draftlab.sglang.fleet says why SGLang needs one for that):

    layout = draftlab.bench.memory.plan_layout(bench_params, target_params, info, draft, configurations, choices, lengths)
    layout.args    # every server's memory flags: ["--mem-fraction-static", "0.95", "--max-total-tokens", "61440"]
    layout.waves   # [["3-1-4", "7-1-8", "ngram", "advised"]]: the configurations started together, wave by wave
    layout.offline_beside  # True: the in-process offline run decodes while the first wave starts (layout.offline_room: bytes for its copies)

The pool (`pool_tokens`) holds, whole (prompt, bench.max_new_tokens and the draft slots SGLang
reserves), as many requests as the bench keeps in flight, and every request the bench sends a
server at once: its prefix cache then keeps all it was sent, as a pool sized from the free memory
does (the prompt-only probes re-send the measured prompts), so no figure depends on the pool's size.

The servers up at once must fit USABLE of the GPU's free memory: weights (the draft's too), pool
and SERVER_OVERHEAD each. A configuration that does not fit beside the baseline and those before it
starts in a later wave, once those are measured and stopped; `advised` keeps room in its wave for
the pick that starts once the advice is known. Without a GPU to read (or with the target's weights
not in a folder) there is no layout: SGLang sizes each pool itself, and each configuration starts
beside the baseline in turn, one after another, as SGLang needs then.

The bench's in-process offline run (the target and the draft in the bench's own process) needs the
GPU too. Where one copy fits beside the first wave (IN_PROCESS_OVERHEAD more than both models'
weights), it decodes while those servers start (SGLang's start-up, ~60 s, is mostly imports and
graph capture) and the round costs are timed once they are up and idle; else it runs, and frees
its copy, before any server starts. `offline_room` bounds how many processes decode it at once,
one copy each (bench.offline_workers, draftlab.bench.offline_workers).

A --mem-fraction-static in bench.extra_server_args keeps SGLang's meaning, the share of the GPU for
one server's weights and KV pool: the bench checks every server fits it and passes its own fraction
in its place (`profile_fraction`). A --max-total-tokens there is refused: the bench sizes the pools.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from draftlab.errors import UserError
from draftlab.sglang import fleet
from draftlab.target.load import model_path

GIB = 1 << 30
USABLE = 0.9  # of the GPU's free memory, for every server up at once (weights, pools, SERVER_OVERHEAD each)
# Per server, what SGLang holds beside its weights and pool: CUDA context (~0.5 GB), kernels'
# workspaces, CUDA graphs and a prefill chunk's activations. An estimate for the targets the bench
# serves beside a baseline; SGLang's own reserve for a GPU of 80 GB, sized for large models, is 10 GB.
SERVER_OVERHEAD = 3 * GIB
POOL_MARGIN = 1.25  # on the tokens the requests need: tokenizing differences, the pool's page rounding
ANSWER_SLACK = 16  # tokens an answer may gain when a later turn renders its text again (tokenized anew)
# The in-process offline run, beside its two models' weights: CUDA context (~0.5 GB), the decode's
# KV caches (one request at a time) and the cost timing's batches (a few hundred tokens wide).
IN_PROCESS_OVERHEAD = 2 * GIB
BASELINE = "baseline"


@dataclass(frozen=True)
class Layout:
    """The bench's SGLang servers on one GPU: every server's pool and profile fraction, and the waves."""

    tokens: int  # --max-total-tokens of every server
    mem_fraction: float  # --mem-fraction-static of every server (SGLang's start-up check alone reads it)
    waves: list[list[str]]  # configuration names started together beside the baseline, wave by wave; spec.*'s first
    gpu: str
    free: int  # bytes free on the GPU when planned
    sizes: dict[str, int]  # bytes each server holds (weights and pool), by configuration name and BASELINE
    offline_room: int = 0  # bytes left beside the first wave for the offline run's copies of both models (in_process_bytes each)

    @property
    def offline_beside(self) -> bool:
        """The in-process offline run fits beside the first wave: it decodes while they start."""
        return self.offline_room > 0

    @property
    def args(self) -> list[str]:
        return ["--mem-fraction-static", str(self.mem_fraction), "--max-total-tokens", str(self.tokens)]

    def describe(self, names: list[str]) -> str:
        """What the servers of `names` (the baseline among them or not) hold, for the bench's output."""
        held = sum(self.sizes[n] + SERVER_OVERHEAD for n in names)
        return (f"each a KV pool of {self.tokens} tokens; {held / GIB:.1f} GiB with {SERVER_OVERHEAD / GIB:.0f} GiB of "
                f"runtime each, of {self.free / GIB:.1f} GiB free on GPU {self.gpu}")


def plan_layout(bench_params, target_params, info: dict, draft, configurations: list, choices: dict, lengths: list[int],
                free_memory=None) -> Layout | None:
    """The Layout of a bench.sweep on SGLang, or None: not SGLang, no sweep, or nothing to plan with
    (no GPU visible, its memory unreadable, the target's weights not in a folder), or the baseline
    and spec.*'s server would not fit together (then each server sizes its own pool, one after another).
    info: draftlab.target.load.target_info; draft: the ExportedDraft; configurations and choices:
    draftlab.bench.sweep.plan_configurations'; lengths: request_lengths."""
    if bench_params.backend != "sglang" or not bench_params.sweep:
        return None
    if fleet.flag_value(bench_params.extra_server_args, "--max-total-tokens") is not None:
        raise UserError("bench.extra_server_args: --max-total-tokens is set by the bench when it starts its servers together "
                        "(a pool that holds every request it sends: bench.max_new_tokens, bench.concurrency, the prompts); "
                        "remove it")
    gpus = fleet.visible_gpus()[:bench_params.tp_size]
    target = fleet.footprint(model_path(target_params.model), info, bench_params.dtype, bench_params.tp_size)
    free = [(free_memory or fleet.gpu_free_memory)(g) for g in gpus]
    if not gpus or target is None or None in free:
        return None
    gpu, free = min(zip(gpus, free), key=lambda x: x[1])
    resolutions = [c.resolution for c in configurations if c.resolution is not None]
    resolutions += [r for r in choices.values() if not isinstance(r, str)]  # `advised` may pick any of them
    in_flight = min(max(bench_params.concurrency), bench_params.max_running_requests or max(bench_params.concurrency))
    page = bench_params.page_size or 1
    tokens = pool_tokens(lengths, in_flight, bench_params.max_new_tokens, max(map(reserved_slots, resolutions)), page)
    sizes = {BASELINE: target.weights + tokens * target.per_token}
    draft_layers = int(draft.config.get("num_hidden_layers") or 1)
    draft_weights = fleet.weight_bytes(draft.path) // bench_params.tp_size
    for c in configurations:
        ngram = c.resolution is not None and c.resolution.effective.algorithm == "NGRAM"
        sizes[c.name] = sizes[BASELINE] if ngram else server_bytes(target, tokens, info["num_layers"], draft_weights, draft_layers)
    check_share(bench_params.extra_server_args, sizes, tokens, gpu, free)
    waves = plan_waves(sizes, [c.name for c in configurations], USABLE * free)
    if waves is None:
        print(f"bench: the baseline and spec.*'s server need {(sizes[BASELINE] + sizes[configurations[0].name]) / GIB:.1f} GiB "
              f"with pools of {tokens} tokens, more than GPU {gpu} has free ({free / GIB:.1f} GiB): the servers start one "
              f"after another, each sizing its own pool")
        return None
    room = int(USABLE * free) - first_wave_bytes(sizes, waves[0])
    room = room if room >= in_process_bytes(target_params, draft) else 0
    return Layout(tokens, fleet.profile_fraction(USABLE), waves, gpu, free, sizes, room)


def in_process_bytes(target_params, draft) -> int:
    """Bytes one copy of the offline run's models takes on the GPU: both models' weights and IN_PROCESS_OVERHEAD."""
    return fleet.weight_bytes(model_path(target_params.model)) + fleet.weight_bytes(draft.path) + IN_PROCESS_OVERHEAD


def first_wave_bytes(sizes: dict[str, int], names: list[str]) -> int:
    """Bytes the baseline and the servers of `names` hold together, SERVER_OVERHEAD each."""
    return sum(sizes[n] + SERVER_OVERHEAD for n in [BASELINE, *names])


def request_lengths(tokenizer, sets: list, warmup_ids: list[list[int]], max_new_tokens: int) -> list[int]:
    """Prompt tokens of every request the bench sends a server: the warm-up ones, then every prompt
    set's. A later turn's answers are not known before the baseline runs: it is rendered after empty
    answers, plus bench.max_new_tokens (and ANSWER_SLACK) for each earlier one."""
    out = [len(ids) for ids in warmup_ids]
    for bset in sets:
        blank = dataclasses.replace(bset, answers={(i, t): "" for i, c in enumerate(bset.conversations) for t in range(1, len(c.turns))})
        for (_, turn), ids in zip(bset.requests, blank.render(tokenizer)):
            out.append(len(ids) + (turn - 1) * (max_new_tokens + ANSWER_SLACK))
    return out


def reserved_slots(resolution) -> int:
    """KV slots a speculative request holds beyond its tokens, as SGLang 0.5.14 reserves them per decode
    step (mem_cache/common.get_alloc_len_per_decode: max(topk x num_steps, num_draft_tokens)), with
    room for page alignment (a page more per branch)."""
    f = resolution.effective
    topk = f.topk or 1
    slots = max(topk * (f.num_steps or 1), f.num_draft_tokens or 1)
    page = f.page_size or 1
    return slots + (page * (topk + 1) if page > 1 else 0)


def pool_tokens(lengths: list[int], in_flight: int, max_new_tokens: int, reserved: int, page: int = 1) -> int:
    """--max-total-tokens of a bench server: room for `in_flight` of its longest requests at once, and
    for every request it is sent (the prefix cache keeps them), each its prompt, max_new_tokens, the
    `reserved` draft slots and a page (SGLang admits a request while prompt + max_new_tokens + a page
    stays below the pool: scheduler.init_req_max_new_tokens); POOL_MARGIN more, whole pages."""
    whole = [n + max_new_tokens + reserved + page for n in lengths]
    need = max(in_flight * max(whole), sum(whole))
    return math.ceil(need * POOL_MARGIN / page) * page


def server_bytes(target: fleet.Footprint, tokens: int, layers: int, draft_weights: int, draft_layers: int) -> int:
    """Bytes a speculative server holds on its GPU: both models' weights and the pool, whose every
    token also holds the draft's layers (SGLang 0.5.14 scales the target's KV bytes by (layers +
    draft layers) / layers: pool_configurator.DefaultPoolConfigurator for EAGLE)."""
    return target.weights + draft_weights + tokens * target.per_token * (layers + draft_layers) // layers


def check_share(extra_args: list[str], sizes: dict[str, int], tokens: int, gpu: str, free: int) -> None:
    """A --mem-fraction-static in bench.extra_server_args is each server's share of the GPU: refuse one
    that does not hold the largest server's weights and pool."""
    given = fleet.flag_value(extra_args, "--mem-fraction-static")
    if given is None:
        return
    try:
        share = float(given)
    except ValueError:
        raise UserError(f"bench.extra_server_args: --mem-fraction-static {given!r} is not a number") from None
    largest = max(sizes.values())
    if largest > share * free:
        raise UserError(f"bench.extra_server_args: --mem-fraction-static {given} gives a server {share * free / GIB:.2f} GiB of "
                        f"the {free / GIB:.1f} GiB free on GPU {gpu}, less than a speculative server's weights and a KV pool of "
                        f"{tokens} tokens take ({largest / GIB:.2f} GiB; the pool holds every request the bench sends it); "
                        f"raise it, or remove it (the bench then sizes each server itself), or lower bench.max_new_tokens "
                        f"or bench.num_prompts")


def plan_waves(sizes: dict[str, int], names: list[str], budget: float) -> list[list[str]] | None:
    """`names` (spec.*'s first, then the rest in the order measured) in waves that fit `budget` bytes
    beside the baseline, each name's server taking its size and SERVER_OVERHEAD; None when the
    baseline and spec.*'s do not fit together."""
    base = sizes[BASELINE] + SERVER_OVERHEAD
    used = base + sizes[names[0]] + SERVER_OVERHEAD
    if used > budget:
        return None
    waves = [[names[0]]]
    for name in names[1:]:
        need = sizes[name] + SERVER_OVERHEAD
        if used + need > budget:
            waves.append([])
            used = base
        waves[-1].append(name)
        used += need
    return waves
