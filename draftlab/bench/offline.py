"""Timing on this machine, with the engine's own functions: the offline isolation run, what each
part of a speculative round costs, how the target's matmuls grow with tokens, and the draft's
top-k shares. What the cost model (draftlab.bench.advice) is fed; everything here runs the models.

    offline = draftlab.bench.offline.offline_run(target, draft, prompts, flags, physical, max_new_tokens, eos, ignore_eos)
    costs = draftlab.bench.offline.measure_costs(target, draft, context, physical, configs, prompt_len=len(prompt))
    costs["gemm_s"] = draftlab.bench.offline.measure_gemm_s(target, token_counts)
    ranks = draftlab.bench.offline.measure_rank_shares(target, draft, outputs, prompt_lens, physical)
    costs.update(draftlab.bench.offline.measure_ngram_costs(target, context, prompt_len, [(12, 10), (4, 1)], history))

A round's drafting and verify (DV in draftlab.bench.advice) is timed as a round runs it, the draft's
forwards and the target's verify one after the other over a cache of a prompt plus half an answer
(`measure_costs`): the sum of the parts timed apart missed how a round's cost grows with depth. The
terms are interleaved round-robin (`_interleaved_medians`), so a drift in the machine's load shifts
them alike.
"""
from __future__ import annotations

import statistics
import time

import torch

from draftlab.engine import ngram, speculative
from draftlab.bench.advice import CHAINS, TREES
from draftlab.data.loops import POSITION_BANDS, band_names, band_of, loop_flags
from draftlab.train.draft import KVCache
from draftlab.features.extract import AuxCapture
from draftlab.metrics import conditional_acceptance, pooled_tau
from draftlab.target.attention import attention_kernels


def offline_run(target, draft, prompts: list[list[int]], flags, physical: list[int], max_new_tokens: int,
                eos: set[int], ignore_eos: bool, with_baseline: bool = True) -> dict:
    """Every prompt decoded in-process by spec_engine with the served flags: pooled tau, a_i, speed,
    seconds per round (prefills excluded) and the outputs (for the rank shares). with_baseline: also
    decode each prompt without speculation, for the in-process decode step (baseline_step_s, None
    without); a server of another engine is scaled on its own rounds instead (`draftlab.bench.fits.round_scale`), and an
    eager 8B baseline costs a minute."""
    return summarize(prompts, *decode_each(target, draft, prompts, flags, physical, max_new_tokens, eos, ignore_eos, with_baseline))


def decode_each(target, draft, prompts: list[list[int]], flags, physical: list[int], max_new_tokens: int,
                eos: set[int], ignore_eos: bool, with_baseline: bool = True, done=None) -> tuple[list, list]:
    """(spec_engine results, baseline results) of `offline_run`, for callers that decode in parts
    (the turns of a conversation) and `summarize` them together. done(): called after each prompt."""
    results, baselines = [], []
    for p in prompts:  # each prompt decoded both ways, one after the other: a drift in load hits both
        got, base = decode_one(target, draft, p, flags, physical, max_new_tokens, eos, ignore_eos, with_baseline)
        results.append(got)
        if base is not None:
            baselines.append(base)
        if done:
            done()
    return results, baselines


def decode_one(target, draft, prompt: list[int], flags, physical: list[int], max_new_tokens: int, eos: set[int],
               ignore_eos: bool, with_baseline: bool):
    """(spec_engine result, baseline result or None) of one prompt: the engine with the served flags,
    then (with_baseline) the same prompt without speculation, one right after the other so that a
    drift in load hits both."""
    got = speculative.generate(target, draft, prompt, num_steps=flags.num_steps, topk=flags.topk,
                               num_draft_tokens=flags.num_draft_tokens, max_new_tokens=max_new_tokens,
                               eos_token_id=eos, ignore_eos=ignore_eos, physical_layers=physical)
    base = speculative.baseline_generate(target, prompt, max_new_tokens, eos_token_id=eos, ignore_eos=ignore_eos) if with_baseline else None
    return got, base


def summarize(prompts: list[list[int]], results: list, baselines: list) -> dict:
    """offline_run's figures from the results of every prompt (in the order of `prompts`)."""
    base_steps = sum(len(b.output_ids) - 1 for b in baselines)
    proposed = [sum(x) for x in zip(*(r.proposed for r in results))]
    accepted = [sum(x) for x in zip(*(r.accepted for r in results))]
    tokens = sum(len(r.output_ids) for r in results)
    verify_ct = sum(r.spec_verify_ct for r in results)
    return {
        "tau": pooled_tau([len(r.output_ids) for r in results], [r.spec_verify_ct for r in results]),
        "acceptance": conditional_acceptance(accepted, proposed),
        "tokens_per_s": tokens / sum(r.total_s for r in results),
        "tokens_per_request": tokens / len(results),
        # the in-process decode step over the same prompts (prefill excluded), s/token
        "baseline_step_s": sum(b.total_s - b.prefill_s for b in baselines) / base_steps if base_steps else None,
        "draft_s": sum(r.draft_s for r in results),
        "verify_s": sum(r.verify_s for r in results),
        "verify_ct": verify_ct,
        "decode_s": sum(r.total_s - r.prefill_s for r in results),  # the draft prefill included (subtracted by the caller)
        "requests": len(results),
        "outputs": [p + r.output_ids for p, r in zip(prompts, results)],
        **step1_by_group(results),
    }


def step1_by_group(results: list) -> dict:
    """Step-1 acceptance of the decode's rounds, by the kind of the token the round's first draft
    predicts (a loop token of the answer, draftlab.data.loops, or not) and by its position in the
    answer: {"step1_by_kind": {"loop"|"other": {"rounds", "a_1"}}, "step1_by_position": {band: ...}}.
    These are the rounds decoding ran, so they start where the draft missed before: set beside
    training's teacher-forced figures (every answer token), the same groups show where serving's
    acceptance differs. {} where no result kept its rounds (NGRAM's engine)."""
    cells = {("kind", k): [0, 0] for k in ("loop", "other")} | {("band", b): [0, 0] for b in range(len(POSITION_BANDS))}
    for r in results:
        flags = loop_flags(r.output_ids)
        for position, kept in r.rounds:
            for key in (("kind", "loop" if flags[position] else "other"), ("band", band_of(position))):
                cells[key][0] += 1
                cells[key][1] += kept >= 1
    if not any(n for n, _ in cells.values()):
        return {}

    def cell(n, hits):
        return {"rounds": n, "a_1": round(hits / n, 4) if n else None}
    return {"step1_by_kind": {k: cell(*cells[("kind", k)]) for k in ("loop", "other")},
            "step1_by_position": {name: cell(*cells[("band", b)]) for b, name in enumerate(band_names())}}


def _rollback(cache, n: int) -> None:
    """The target's cache back to its first n positions (the prompt)."""
    drop = cache.get_seq_length() - n
    if drop > 0:
        cache.crop(-drop)


def _interleaved_medians(timers: dict, repeats: int) -> dict:
    """{name: median seconds} of `timers` ({name: fn() -> seconds it took}), run round-robin: one
    pass over every timer per repeat, after one warm-up pass. A drift in the machine's load then
    shifts every term alike, rather than all the timings of one configuration (timed one after the
    other, a slow minute made the longer chains look slower per step than the short ones)."""
    for fn in timers.values():
        fn()
    times = {name: [] for name in timers}
    for _ in range(repeats):
        for name, fn in timers.items():
            times[name].append(fn())
    return {name: statistics.median(t) for name, t in times.items()}


def _timed(fn, device):
    """fn as a timer: the seconds one call takes, the device synchronized."""
    def run():
        t0 = time.perf_counter()
        fn()
        speculative._sync(device)
        return time.perf_counter() - t0
    return run


@torch.inference_mode()
def measure_costs(target, draft, prompt: list[int], physical: list[int], configs=None, repeats: int = 15,
                  prompt_len: int | None = None) -> dict:
    """The raw timings of the round model's terms (seconds), on `prompt`, by the engine's own functions:
    baseline_step_s, prefill_s, draft_prefill_s, draft_s {"num_steps-topk": s}, verify_s and
    tree_verify_s {width: s}, extend_s {rows: s}, and draft_verify_s {"num_steps-topk-num_draft_tokens": s}:
    the drafting, verify, acceptance and KV keep of one round of each configuration, timed whole.
    `fit_costs` turns the parts into the model's lines; `round_cost` takes a configuration's whole
    timing where there is one.

    `prompt` is the state the rounds are timed in: give a prompt plus about half an answer (the
    bench passes its offline run's first output cut there), and prompt_len, the prompt's own length
    (the prefills are timed over it). Rounds run over a cache that grows
    from the prompt to the prompt plus the answer, and every draft step and verify attends over
    it: timed over the prompt alone, the deeper chains' rounds came out short of the offline run's by
    about 4% of a baseline decode step per draft step (2-core CPU, the default target and draft).

    Each timing is the median of `repeats`, the terms interleaved (`_interleaved_medians`); a term is
    timed from the state the engine would be in (the prompt prefilled in the target's and the
    draft's caches), and every cache is rolled back after it, so that the next timing starts from
    the same state. The baseline step is one decode step of the target (baseline_generate's body),
    timed among the rest.
    """
    configs = configs or CHAINS + TREES
    device = target.device
    prompt_len = prompt_len or len(prompt)
    n = len(prompt)
    speculative.baseline_generate(target, prompt, 2, ignore_eos=True)  # warm-up

    with AuxCapture(target, physical) as aux, attention_kernels(device):
        def prefilled(tokens):  # (ids, target cache, first token, draft cache, root state, seconds, draft seconds)
            ids = torch.tensor([tokens], device=device)
            cache = speculative.new_cache(target)
            t0 = time.perf_counter()
            x = int(speculative.target_forward(target, ids, cache, logits_to_keep=1)[0, -1].argmax())
            prefill = time.perf_counter() - t0
            dcache = KVCache()
            t0 = time.perf_counter()
            root = draft.step(torch.cat([ids[:, 1:], torch.tensor([[x]], device=device)], 1), draft.project(aux.take()),
                              torch.arange(len(tokens), device=device)[None], dcache)[:, -1:]
            speculative._sync(device)
            return ids, cache, x, dcache, root, prefill, time.perf_counter() - t0

        first = prefilled(prompt[:prompt_len])  # a request's prefills: the prompt alone
        prefill, draft_prefill = first[-2:]
        ids, cache, x, dcache, root, *_ = first if prompt_len == n else prefilled(prompt)  # the state rounds are timed in
        d0 = len(dcache)

        def decode_step():  # the baseline's step (baseline_generate's body), timed among the rest
            logits = speculative.target_forward(target, torch.tensor([[x]], device=device), cache, logits_to_keep=1)
            speculative.pick(logits[0, -1], True, 0.0, -1, 1.0, None)
            _rollback(cache, n)

        timers, trees = {("decode", 1): _timed(decode_step, device)}, {}
        for s, k, ndt in configs:
            if k == 1:
                fn = lambda s=s: speculative.draft_chain(draft, dcache, root, x, n, s)  # noqa: E731
            else:
                fn = lambda s=s, k=k, ndt=ndt: speculative.draft_tree(draft, dcache, root, x, n, s, k, ndt)  # noqa: E731
                trees[ndt] = fn()
            timers[("draft", f"{s}-{k}")] = _timed(fn, device)

        def verify(tree):
            logits = speculative.verify_tree(target, cache, tree, n)
            speculative.accept_path(tree, logits, True, 0.0, -1, 1.0, None)
            _rollback(cache, n)

        chain_widths = sorted({ndt for s, k, ndt in configs if k == 1} | {2})
        chain = lambda w: speculative.Tree([x] + prompt[:w - 1], list(range(-1, w - 1)), list(range(w)))  # noqa: E731
        for w in chain_widths:
            timers[("verify", w)] = _timed(lambda w=w: verify(chain(w)), device)
        for w, t in trees.items():
            timers[("tree_verify", w)] = _timed(lambda t=t: verify(t), device)

        def extend(r):  # the draft over r accepted rows, fed by the verify forward's aux states (not timed)
            def run():
                speculative.verify_tree(target, cache, chain(max(r, 2)), n)
                speculative._sync(device)
                t0 = time.perf_counter()
                draft.step(torch.tensor([prompt[:r]], device=device), draft.project(aux.take()[:, :r]),
                           torch.arange(n, n + r, device=device)[None], dcache)
                speculative._sync(device)
                took = time.perf_counter() - t0
                dcache.crop(d0)
                _rollback(cache, n)
                return took
            return run

        for r in range(1, max(chain_widths) + 1):
            timers[("extend", r)] = extend(r)

        def whole(s, k, ndt):  # drafting, verify, acceptance and the KV keep of one round, as generate runs them
            def run():
                t0 = time.perf_counter()
                if k == 1:
                    tree = speculative.draft_chain(draft, dcache, root, x, n, s)
                else:
                    tree = speculative.draft_tree(draft, dcache, root, x, n, s, k, ndt)
                logits = speculative.verify_tree(target, cache, tree, n)
                path, _ = speculative.accept_path(tree, logits, True, 0.0, -1, 1.0, None)
                speculative.keep_kv(cache, n, path)
                speculative._sync(device)
                took = time.perf_counter() - t0
                _rollback(cache, n)
                return took
            return run

        for s, k, ndt in configs:
            timers[("draft_verify", f"{s}-{k}-{ndt}")] = whole(s, k, ndt)
        med = _interleaved_medians(timers, repeats)
    baseline_step = med.pop(("decode", 1))

    def by(term):
        return {key: t for (name, key), t in med.items() if name == term}

    return {"baseline_step_s": baseline_step, "prefill_s": prefill, "draft_prefill_s": draft_prefill,
            "draft_s": by("draft"), "verify_s": by("verify"), "tree_verify_s": by("tree_verify"), "extend_s": by("extend"),
            "draft_verify_s": by("draft_verify")}


@torch.inference_mode()
def measure_gemm_s(target, token_counts, repeats: int = 5) -> dict[int, float]:
    """{T: seconds} of every dense matmul of the target (each nn.Linear, lm_head included) over T token
    rows, timed as plain matmuls on the target's device and dtype, the counts interleaved, the median
    of `repeats`: what the target's forward costs in its linear layers at T tokens, memory-bound for a
    small T (the weights are read once) and compute-bound for a large one (`batch_growth`). A
    mixture-of-experts layer is counted as if every expert ran: an upper bound."""
    weights = [m.weight for m in target.modules() if isinstance(m, torch.nn.Linear)]
    device, dtype = weights[0].device, weights[0].dtype
    rows = {int(t): {w.shape[1]: torch.randn(int(t), w.shape[1], device=device, dtype=dtype) for w in weights}
            for t in token_counts}

    def timer(t):
        def run():
            xs = rows[t]
            for w in weights:
                torch.matmul(xs[w.shape[1]], w.t())
        return _timed(run, device)

    return _interleaved_medians({t: timer(t) for t in rows}, repeats)


@torch.inference_mode()
def measure_rank_shares(target, draft, sequences: list[list[int]], prompt_lens: list[int], physical: list[int], k: int = 8) -> list[float]:
    """Share of answer positions where the target's next token is the draft's rank-r proposal, r < k
    (the draft at depth 1, fed the target's own states, as after a draft extend)."""
    device = target.device
    counts, total = [0] * k, 0
    for seq, p in zip(sequences, prompt_lens):
        ids = torch.tensor([seq], device=device)
        with AuxCapture(target, physical) as aux:
            target(input_ids=ids, use_cache=False)
            state = draft.step(ids[:, 1:], draft.project(aux.take()[:, :-1]), torch.arange(len(seq) - 1, device=device)[None], KVCache())
        top = draft.to_target(draft.logits(state[0]).topk(k, -1).indices)  # row t predicts token t + 2
        truth = ids[0, 2:]
        rows = top[p - 1:len(seq) - 2]  # the answer tokens a draft proposes (the first comes from the target's prefill)
        hits = rows == truth[p - 1:, None]
        total += rows.shape[0]
        for r, c in enumerate(hits.sum(0).tolist()):
            counts[r] += c
    return [c / total for c in counts] if total else []


@torch.inference_mode()
def measure_ngram_costs(target, prompt: list[int], prompt_len: int, configs, history: list[list[int]], repeats: int = 15) -> dict:
    """What n-gram lookup's rounds cost in-process (draftlab.engine.ngram, seconds): for each (draft tokens,
    max breadth) of `configs`, a whole round (the lookup, the verify of the padded tree, acceptance,
    KV keep) and the lookup alone, over a cache holding `history` (earlier sequences, e.g. the offline
    run's) and `prompt` (a prompt plus about half an answer, as measure_costs'); the target's decode
    step and prefill timed in the same interleaved loop, so that the in-process speedup of n-gram
    lookup is a ratio of timings from one minute (draftlab.bench.ngram_advice). There is no draft forward."""
    device = target.device
    cache = ngram.NgramCache()
    for seq in history:
        cache.start(seq)
    speculative.baseline_generate(target, prompt, 2, ignore_eos=True)  # warm-up
    with attention_kernels(device):
        ids = torch.tensor([prompt], device=device)
        kv = speculative.new_cache(target)
        x = int(speculative.target_forward(target, ids, kv, logits_to_keep=1)[0, -1].argmax())
        cache.start(prompt)
        cache.extend([x])
        n = len(prompt)

        def prefill():
            speculative.target_forward(target, torch.tensor([prompt[:prompt_len]], device=device), speculative.new_cache(target),
                                       logits_to_keep=1)

        def decode_step():
            logits = speculative.target_forward(target, torch.tensor([[x]], device=device), kv, logits_to_keep=1)
            speculative.pick(logits[0, -1], True, 0.0, -1, 1.0, None)
            _rollback(kv, n)

        def whole(width, breadth):
            def run():
                tree = cache.propose(x, width, breadth)
                logits = speculative.verify_tree(target, kv, tree, n)
                path, _ = speculative.accept_path(tree, logits, True, 0.0, -1, 1.0, None)
                speculative.keep_kv(kv, n, path)
                _rollback(kv, n)
            return run

        timers = {("prefill", ""): _timed(prefill, device), ("decode", ""): _timed(decode_step, device)}
        for width, breadth in configs:
            timers[("round", f"{width}-{breadth}")] = _timed(whole(width, breadth), device)
            timers[("lookup", f"{width}-{breadth}")] = _timed(lambda w=width, b=breadth: cache.propose(x, w, b), device)
        med = _interleaved_medians(timers, repeats)
    return {"ngram_prefill_s": med[("prefill", "")], "ngram_decode_step_s": med[("decode", "")],
            "ngram_round_s": {k: t for (name, k), t in med.items() if name == "round"},
            "ngram_lookup_s": {k: t for (name, k), t in med.items() if name == "lookup"}}
