"""train.batch_tokens packs: each step lays the epoch's shuffled sequences end to end into rows.

What a user relies on: a packed batch trains exactly as its sequences would one at a time (the
same loss sums, scores and gradients: no attention, rope position or label crosses a sequence's
end), offline and online; every sequence once per epoch, rows within train.max_length and the
budget, the same plan on resume and on every process."""
import pytest
import torch

from draftlab.errors import UserError
from draftlab.features.dataset import FeatureDataset, pack, write_tokens
from draftlab.features.extract import TOKENS_FILE, tokens_record
from draftlab.features.online import OnlineFeatures, OnlineTarget
from draftlab.params import TrainParams
from draftlab.train.batches import epoch_batches, packed_batches, packed_padding_share
from draftlab.train.evaluate import eval_batches
from draftlab.train.loop import epoch_plans, fit, init_draft
from draftlab.train.objective import TTT, step_token_counts, target_labels
from tiny_features import training_kit

STEPS = 3


@pytest.fixture(scope="module")
def feats(tmp_path_factory):
    kit = training_kit(tmp_path_factory.mktemp("pack"))
    return {**kit, "online": online_features(kit["root"], kit["train"], kit["model"])}


def online_features(root, stored: FeatureDataset, model) -> OnlineFeatures:
    """The train split as a tokens record, its states from the micro target, kept in float32
    (the storage rounding would hide the comparison's 1e-5)."""
    rows = [(stored[i]["input_ids"].tolist(), stored[i]["loss_mask"].tolist()) for i in range(len(stored))]
    split = root / "online" / "train"
    split.mkdir(parents=True)
    write_tokens(split / TOKENS_FILE, tokens_record(rows), {**stored.metadata, "dtype": "float32"})
    target = OnlineTarget(None)
    target._model, target.device = model.float().eval(), torch.device("cpu")  # the loaded target, as model() keeps it
    return OnlineFeatures(split, None, target)


def new_draft(f):
    return init_draft(f["cfg"], f["embed"], f["head"], f["d2t"], f["t2d"], 0)


def sums_and_grads(draft, batch, head):
    """Loss as a plain sum over scored tokens (normalizer 1 per step), stats [5, K], gradients."""
    draft.zero_grad(set_to_none=True)
    labels = target_labels(batch["final_hidden"], head, draft.d2t)
    loss, stats = TTT(draft, STEPS, 0.8)(batch, labels, torch.ones(STEPS))
    loss.backward()
    return loss.detach(), stats, {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None}


def one_at_a_time(draft, ds, seqs, head):
    loss, stats, grads = 0.0, 0.0, {}
    for i in seqs:
        lo, st, gr = sums_and_grads(draft, ds.batch([i], "cpu"), head)
        loss, stats = loss + lo, stats + st
        grads = {n: grads.get(n, 0.0) + g for n, g in gr.items()}
    return loss, stats, grads


@pytest.mark.parametrize("source", ["train", "online"])
def test_a_packed_batch_trains_as_its_sequences_one_at_a_time(feats, source):
    ds, draft = feats[source], new_draft(feats)
    rows = [[0, 5, 9], [3, 12], [7]]  # several sequences per row, a row of one, rows of unequal fill
    packed = ds.packed_batch(rows, "cpu")
    assert packed["input_ids"].shape[0] == 3 and packed["seq_ids"][1, -1] == -1  # row 1 is padded at its end
    loss, stats, grads = sums_and_grads(draft, packed, feats["head"])
    loss1, stats1, grads1 = one_at_a_time(draft, ds, [i for row in rows for i in row], feats["head"])
    assert stats[1].sum() > 0 and torch.equal(stats[1:], stats1[1:])  # scored tokens, top-1 hits, accepted, reached
    assert torch.allclose(stats[0], stats1[0], rtol=1e-5)  # ce sums
    assert torch.allclose(loss, loss1, rtol=1e-5)
    for name, g in grads1.items():
        assert torch.allclose(grads[name], g, rtol=1e-4, atol=1e-6 * g.abs().max()), name


def test_online_states_of_a_packed_row_are_those_of_each_sequence_alone(feats):
    online, rows = feats["online"], [[2, 8, 11], [4]]
    packed = online.packed_batch(rows, "cpu")
    at = 0
    for i in rows[0]:
        alone, n = online.batch([i], "cpu"), online.length(i)
        assert torch.equal(packed["position_ids"][0, at : at + n], torch.arange(n))
        for name in ("aux_hidden", "final_hidden"):
            assert (packed[name][0, at : at + n] - alone[name][0]).abs().max() < 1e-5, name
        at += n


def test_the_target_of_a_packed_batch_runs_on_groups_no_wider_than_the_packed_rows(feats, monkeypatch):
    """Online, each step's sequences go through the target padded apart: in groups of similar length,
    each at most the packed batch's slots, not all of them padded to the longest (a step of 40
    chat turns of 100-4,000 tokens would cost the target 5x its packed tokens)."""
    online, calls = feats["online"], []
    real_batch = type(online).batch
    monkeypatch.setattr(type(online), "batch", lambda self, idx, dev: calls.append(list(idx)) or real_batch(self, idx, dev))
    lengths = [online.length(i) for i in range(len(online))]
    rows = packed_batches(lengths, 3 * max(lengths), 2, seed=0, epoch=0)[0]  # one step: two rows of 3x the longest
    assert len(sum(rows, [])) > 4
    packed = online.packed_batch(rows, "cpu")
    slots = packed["input_ids"].numel()
    assert sorted(i for c in calls for i in c) == sorted(i for row in rows for i in row)  # each sequence once
    assert all(len(c) * max(lengths[i] for i in c) <= slots for c in calls)
    assert sum(len(c) * max(lengths[i] for i in c) for c in calls) < len(sum(rows, [])) * max(lengths[i] for i in sum(rows, []))


def test_pack_lays_sequences_end_to_end_and_pads_rows_only_at_their_end():
    batch = {"input_ids": torch.tensor([[1, 2, 0], [4, 5, 0], [6, 0, 0]]), "loss_mask": torch.ones(3, 3, dtype=torch.bool)}
    out = pack(batch, [[2, 2], [1]])  # the batch's sequences in order: lengths 2 and 2 in row 0, 1 in row 1
    assert out["input_ids"].tolist() == [[1, 2, 4, 5], [6, 0, 0, 0]]
    assert out["position_ids"].tolist() == [[0, 1, 0, 1], [0, 0, 0, 0]]
    assert out["seq_ids"].tolist() == [[0, 0, 1, 1], [2, -1, -1, -1]]
    assert out["loss_mask"].tolist() == [[True] * 4, [True, False, False, False]]


# --------------------------------------------------------------------------------------------
# The plan


def chat_lengths(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.exp(torch.empty(n).uniform_(3.0, 6.2, generator=g)).clamp(20, 512)).long().tolist()


@pytest.mark.parametrize("world", [1, 2, 3])
def test_every_sequence_once_per_epoch_in_rows_within_the_width_and_the_budget(world):
    lengths, width, rows = chat_lengths(3000), 512, 6
    for epoch in range(3):
        steps = packed_batches(lengths, width, rows, seed=5, epoch=epoch, min_rows=world)
        assert sorted(i for s in steps for row in s for i in row) == list(range(len(lengths)))
        assert all(sum(lengths[i] for i in row) <= width for s in steps for row in s)
        assert all(len(s) == rows for s in steps[:-2]) and rows - 2 * world < len(steps[-2]) <= rows
        assert world <= len(steps[-1]) < rows + world
        assert steps == packed_batches(lengths, width, rows, seed=5, epoch=epoch, min_rows=world)  # resumable
    assert packed_batches(lengths, width, rows, 5, 0) != packed_batches(lengths, width, rows, 5, 1)


@pytest.mark.parametrize("world, sequences", [(1, 4 * 5 + 1), (2, 8 * 5 + 2), (2, 8 * 5 + 3)])
def test_the_last_step_gives_each_process_two_rows_so_that_compiled_steps_are_not_compiled_again(world, sequences):
    """torch.compile(dynamic=True) specializes a size of 1: a last step of one row per process
    would compile the draft's layer once more (19 s on one H100). Rows move to it from the step
    before; every sequence still comes once, and every other step keeps its rows."""
    rows = 4 * world
    steps = packed_batches([10] * sequences, 10, rows, seed=3, epoch=0, min_rows=world)  # one sequence fills a row
    assert sorted(i for s in steps for row in s for i in row) == list(range(sequences))
    assert all(len(s) == rows for s in steps[:-2])
    assert len(steps[-1]) >= 2 * world and len(steps[-2]) >= 2 * world
    assert len(steps[-2]) + len(steps[-1]) == rows + sequences % rows
    for s in steps:  # each process's share of every step: at least two rows
        assert all(len(s[r::world]) >= 2 for r in range(world))


def test_a_last_step_is_left_alone_where_steps_hold_too_few_rows_to_share():
    steps = packed_batches([10] * 7, 10, 3, seed=3, epoch=0)  # 3 rows a step: the last keeps its one row
    assert [len(s) for s in steps] == [3, 3, 1]


def test_eval_batches_give_a_lone_longest_row_a_companion_where_two_fit_the_budget():
    rows, lengths = list(range(7)), [10, 10, 10, 10, 10, 10, 30]
    assert eval_batches(rows, lengths, 4, 60) == [[0, 1, 2, 3, 4], [5, 6]]  # the 30-token row alone would be a batch of one
    assert eval_batches(rows, lengths[:6] + [40], 4, 70) == [[0, 1, 2, 3, 4, 5], [6]]  # two rows of 40 exceed 70: left alone
    assert eval_batches(rows, lengths, 4, None) == [[0, 1, 2, 3], [4, 5, 6]]


def test_steps_follow_the_random_order_of_padded_batches_and_pad_little():
    """Packing keeps the epoch's shuffle (steps are random mixes of lengths, not sorted ones)."""
    lengths = chat_lengths(4000)
    steps = packed_batches(lengths, 512, 4, seed=1, epoch=2)
    order = epoch_batches(len(lengths), len(lengths), seed=1, epoch=2)[0]
    rank = {i: r for r, i in enumerate(order)}
    firsts = [min(rank[i] for row in s for i in row) for s in steps]
    assert firsts == sorted(firsts)  # each step is taken further along the same shuffle
    assert packed_padding_share(steps, lengths) < 0.05


def params(**kw):
    base = dict(seed=0, epochs=2, batch_size=4, max_length=512, lr=3e-3, min_lr_ratio=0.1, warmup_ratio=0.1,
                weight_decay=0.0, grad_clip=0.5, ttt_steps=STEPS, ttt_decay=0.8, intermediate_size=None,
                checkpoint_every=3, device="cpu", autocast="auto", batch_tokens=120)
    return TrainParams(**{**base, **kw})


def test_processes_split_each_step_into_equal_row_shares(feats):
    longest = max(feats["train"].length(i) for i in range(len(feats["train"])))
    plans = epoch_plans(feats["train"], params(batch_tokens=5 * longest), world=2)
    for step in plans[0]:
        shares = [step[r::2] for r in range(2)]
        assert all(shares) and abs(len(shares[0]) - len(shares[1])) <= 1


def test_a_budget_below_one_row_per_process_names_the_key(feats, tmp_path):
    longest = max(feats["train"].length(i) for i in range(len(feats["train"])))
    with pytest.raises(UserError, match=rf"train.batch_tokens {2 * longest - 1} cannot hold .* at least {2 * longest}"):
        epoch_plans(feats["train"], params(batch_tokens=2 * longest - 1), world=2)


def test_a_packed_run_records_the_row_padding_and_resumes_to_the_same_weights(feats, tmp_path):
    cpu = torch.device("cpu")
    straight = new_draft(feats)
    history = fit(straight, feats["head"], feats["train"], feats["eval"], params(), tmp_path / "a.pt", "run", cpu)
    plans = epoch_plans(feats["train"], params(), 1)
    assert history[-1]["step"] == sum(len(p) for p in plans)
    lengths = [feats["train"].length(i) for i in range(len(feats["train"]))]
    assert history[-1]["train_padding_share"] == pytest.approx(packed_padding_share(plans[-1], lengths))
    interrupted = new_draft(feats)
    fit(interrupted, feats["head"], feats["train"], feats["eval"], params(), tmp_path / "b.pt", "run", cpu, stop_after_steps=4)
    resumed = new_draft(feats)
    assert fit(resumed, feats["head"], feats["train"], feats["eval"], params(), tmp_path / "b.pt", "run", cpu) == history
    for name, w in straight.state_dict().items():
        assert torch.equal(w, resumed.state_dict()[name]), name


def test_step_token_counts_of_a_packed_batch_leave_out_rows_reading_the_next_sequence():
    batch = {"loss_mask": torch.ones(1, 6, dtype=torch.bool), "seq_ids": torch.tensor([[0, 0, 0, 1, 1, 1]])}
    # step 0 scores row t iff t+2 is of t's sequence: rows 0 and 3; step 1 (t+3): none
    assert step_token_counts(batch, 2, 1).tolist() == [2, 0]
