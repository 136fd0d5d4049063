"""The draft's figures on the eval split: loss, per-step acceptance and predicted tau (teacher
forced), greedy decoding replayed over the eval answers, and step-1 acceptance split by loop
tokens, position in the answer and the answer's turn.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from draftlab.data.loops import POSITION_BANDS, answer_loop_flags, band_names, spans
from draftlab.features.dataset import FeatureDataset
from draftlab.metrics import chain_tau, conditional_acceptance
from draftlab.train.objective import TTT, labels_dtype, shift, step_token_counts, target_labels


TURN_GROUPS = ("1", "2", "3+")  # an answer's turn in its conversation: the first, the second, any later one


def token_groups(batch: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per token [B, T]: a loop token of its answer (draftlab.data.loops), the band of its position
    in its answer (index into POSITION_BANDS), and its answer's turn in the row's conversation
    (0 for the first learned answer, 1 for the second, 2 for any later); -1 off the loss mask."""
    ids, mask = batch["input_ids"].tolist(), batch["loss_mask"].tolist()
    loop = torch.zeros(len(ids), len(ids[0]) if ids else 0, dtype=torch.bool)
    band = torch.full(loop.shape, -1, dtype=torch.long)
    turn = torch.full(loop.shape, -1, dtype=torch.long)
    starts = torch.tensor(POSITION_BANDS)
    for b, (row, m) in enumerate(zip(ids, mask)):
        loop[b] = torch.tensor(answer_loop_flags(row, m), dtype=torch.bool)
        for n, (a, e) in enumerate(spans(m)):
            band[b, a:e] = torch.bucketize(torch.arange(e - a), starts, right=True) - 1
            turn[b, a:e] = min(n, len(TURN_GROUPS) - 1)
    return loop, band, turn


def predicted_groups(batch: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`token_groups` of the token each row's first draft step predicts (row t predicts token t+2),
    flattened as TTT.scored's rows are."""
    return tuple(shift(g, 2, fill).flatten() for g, fill in zip(token_groups(batch), (False, -1, -1)))


def step1_groups(ttt: TTT, batch: dict, groups: tuple | None = None) -> torch.Tensor:
    """[2 + bands + turns, 2]: (scored, top-1 hits) at the first draft step of the batch `ttt` just
    ran, on loop tokens, other tokens, each position band, then each answer turn (TURN_GROUPS).
    The group is the predicted token's. groups: `predicted_groups(batch)`, when already made."""
    valid, correct = (x[0].cpu() for x in ttt.scored)
    loop, band, turn = groups if groups is not None else predicted_groups(batch)
    sels = ([loop, ~loop] + [band == k for k in range(len(POSITION_BANDS))]
            + [turn == k for k in range(len(TURN_GROUPS))])
    return torch.tensor([[float((valid & s).sum()), float((valid & correct & s).sum())] for s in sels], dtype=torch.float64)


def decoded_rounds(valid: torch.Tensor, correct: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
    """[K, 2] (rounds, tokens) of greedy chain decoding at depth 1..K, replayed over the eval answers.

    Row t's TTT steps are exactly a decoding round that starts after token t+1: step i embeds the
    token before it (in a round, the draft's own, equal to it while the chain holds) and predicts
    token t+2+i, a hit being the target's greedy choice. So a round at depth d starting at row t
    accepts its first run of hits, at most d, emits one token more (the target's), and the next
    round starts where it stopped. Decoding scores the rows rounds start at, which crowd where the
    draft misses; the teacher-forced a_i average every row, easy runs counted whole (tau_pred). The
    first row of an answer predicts its first token, which the prefill makes: rounds start after it.
    valid, correct: [K, N] bool (TTT.scored; rows of one answer contiguous). keep: [N] bool, the
    answers walked (those whose first row it marks); None = every one."""
    K = valid.shape[0]
    lead = (valid & correct).int().cumprod(0).sum(0).tolist()  # hits in a row from step 1, per row
    out = torch.zeros(K, 2, dtype=torch.float64)
    for a, e in spans(valid[0].tolist()):  # one answer each
        if keep is not None and not keep[a]:
            continue
        for d in range(1, K + 1):
            t, rounds, tokens = a + 1, 0, 0
            while t < e:
                step = min(lead[t], d) + 1
                rounds, tokens, t = rounds + 1, tokens + min(step, e - t), t + step
            out[d - 1] += torch.tensor([rounds, tokens], dtype=torch.float64)
    return out


def step1_breakdown(groups: torch.Tensor) -> dict:
    """Step-1 acceptance (the first draft token's top-1 hit rate) by kind of token and by position band."""
    def cell(scored, hits):
        return {"tokens": int(scored), "a_1": round(hits / scored, 4) if scored else None}
    rows = [cell(*g) for g in groups.tolist()]
    bands = 2 + len(POSITION_BANDS)
    return {"step1_by_kind": {"loop": rows[0], "other": rows[1]},
            "step1_by_position": dict(zip(band_names(), rows[2:bands])),
            "step1_by_turn": dict(zip(TURN_GROUPS, rows[bands:]))}


def summarize(stats: torch.Tensor, decay: float) -> dict:
    """Pooled stats [5, K] -> loss, per-position acceptance a_i, top-1 accuracy, predicted tau."""
    ce, scored, hits, accepted, reached = stats.tolist()
    K = len(ce)
    accept = conditional_acceptance(accepted, reached)
    per_step_loss = [c / s if s else 0.0 for c, s in zip(ce, scored)]
    return {
        "loss": sum(decay**i * per_step_loss[i] for i in range(K)),
        "loss_per_step": per_step_loss,
        "accept": accept,  # a_i, i = 1..K (index 0 = first draft token)
        "top1_acc": [h / s if s else 0.0 for h, s in zip(hits, scored)],
        "tau_pred": chain_tau(accept),
        "tau_by_steps": [chain_tau(accept[:n]) for n in range(1, K + 1)],
        "scored_tokens": int(scored[0]),
    }


@torch.no_grad()
def evaluate(ttt: TTT, dataset: FeatureDataset, head: torch.Tensor, batch_size: int, device, autocast: bool, rank: int = 0, world: int = 1,
             batch_tokens: int | None = None) -> dict:
    """Pooled stats of `dataset` (this process's share, rank::world), in batches of `batch_size`
    sequences, or of at most `batch_tokens` padded tokens when given; sums over tokens, so the
    batching changes nothing but float rounding."""
    draft = ttt.draft
    was_training = draft.training
    draft.eval()
    stats = torch.zeros(5, ttt.steps, device=device)
    groups = torch.zeros(2 + len(POSITION_BANDS) + len(TURN_GROUPS), 2, dtype=torch.float64)  # exact counts past 2**24 tokens
    rounds = torch.zeros(2, ttt.steps, 2, dtype=torch.float64)  # decoded_rounds, pooled: every answer, first answers
    mine = sorted(range(rank, len(dataset), world), key=dataset.length)  # similar lengths pad little
    for rows in eval_batches(mine, [dataset.length(i) for i in mine], batch_size, batch_tokens):
        batch = dataset.batch(rows, device)
        labels = target_labels(batch["final_hidden"], head, draft.d2t, dtype=labels_dtype(autocast))
        counts = step_token_counts(batch, ttt.steps, 1)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            _, s = ttt(batch, labels, counts)
        stats += s
        predicted = predicted_groups(batch)
        groups += step1_groups(ttt, batch, predicted)
        scored, first_turn = [x.cpu() for x in ttt.scored], predicted[2] == 0
        first = decoded_rounds(*scored, keep=first_turn)  # each answer walked once: first turns, then the rest
        rounds += torch.stack([first + decoded_rounds(*scored, keep=~first_turn), first])
    if world > 1:
        dist.all_reduce(stats)
        groups, rounds = groups.to(device), rounds.to(device)
        dist.all_reduce(groups)
        dist.all_reduce(rounds)
    draft.train(was_training)
    decoded, first = ([tok / n if n else 1.0 for n, tok in r] for r in rounds.cpu().tolist())
    # first: the first answer of each conversation alone, what a bench of first turns serves
    return {**summarize(stats.cpu(), ttt.decay), **step1_breakdown(groups.cpu()), "tau_decoded_by_steps": decoded,
            "tau_decoded_first_turns_by_steps": first}


def eval_batches(rows: list[int], lengths: list[int], batch_size: int, batch_tokens: int | None) -> list[list[int]]:
    """`rows` (sorted by length) cut into runs of `batch_size`, or of at most `batch_tokens` padded tokens.
    With batch_tokens, a last run of one row beside runs of several takes the longest row of the run
    before it where the two fit the budget: a batch of one row would make torch.compile (train.compile)
    build the no-grad graphs once more (it specializes a size of 1; draftlab.train.batches.at_least_two_rows)."""
    if batch_tokens is None:
        return [rows[a : a + batch_size] for a in range(0, len(rows), batch_size)]
    out, cur = [], []
    for i, n in zip(rows, lengths):  # ascending: the newest row is the batch's longest
        if cur and (len(cur) + 1) * n > batch_tokens:
            out.append(cur)
            cur = []
        cur.append(i)
    out += [cur] if cur else []
    if len(out) > 1 and len(out[-1]) == 1 and len(out[-2]) >= 3 and 2 * lengths[-1] <= batch_tokens:
        out[-1].insert(0, out[-2].pop())
    return out
