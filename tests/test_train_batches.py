"""train.batch_tokens: packed steps under a token budget (tests/test_train_packing.py has the packing itself).

What a user relies on: far less padding than random padded batches, the same batches after a
resume, and padding changing nothing: a sequence scores the same loss and gradients whatever it
is padded to, and a split of sequences sums to the stats of one padded batch of them (the loss
stays per token)."""
import json

import pytest
import torch
import torch.nn.functional as F

from draftlab.errors import UserError
from draftlab.params import TrainParams
from draftlab.train.batches import epoch_batches, packed_batches, packed_padding_share, padding_share
from draftlab.train.evaluate import evaluate
from draftlab.train.loop import fit, init_draft
from draftlab.train.objective import TTT, step_token_counts, target_labels
from tiny_features import make_features, training_kit


def chat_lengths(n, seed=0):
    """Lengths like a chat set: many short, a long tail, 20-1600 tokens."""
    g = torch.Generator().manual_seed(seed)
    return (torch.exp(torch.empty(n).uniform_(3.0, 7.38, generator=g)).clamp(20, 1600)).long().tolist()


def test_token_budget_pads_far_less_than_random_batches():
    lengths = chat_lengths(20000)
    padded = padding_share(epoch_batches(len(lengths), 32, seed=0, epoch=0), lengths)
    longest = max(lengths)
    packed = packed_padding_share(packed_batches(lengths, longest, 32 * 1024 // longest, seed=0, epoch=0), lengths)
    assert padded > 0.6 and packed < 0.03, (padded, packed)


def test_padding_share_counts_each_process_share_padded_to_its_own_longest():
    lengths = [10, 4, 6, 6]
    assert padding_share([[0, 1, 2, 3]], lengths, world=1) == pytest.approx(1 - 26 / 40)
    assert padding_share([[0, 1, 2, 3]], lengths, world=2) == pytest.approx(1 - 26 / (2 * 10 + 2 * 6))


# --------------------------------------------------------------------------------------------
# Training on token-budget batches


@pytest.fixture(scope="module")
def feats(tmp_path_factory):
    return training_kit(tmp_path_factory.mktemp("feat"))


def params(**kw):
    base = dict(seed=0, epochs=2, batch_size=4, max_length=512, lr=3e-3, min_lr_ratio=0.1, warmup_ratio=0.1,
                weight_decay=0.0, grad_clip=0.5, ttt_steps=3, ttt_decay=0.8, intermediate_size=None,
                checkpoint_every=3, device="cpu", autocast="auto", batch_tokens=120)
    return TrainParams(**{**base, **kw})


def new_draft(f):
    return init_draft(f["cfg"], f["embed"], f["head"], f["d2t"], f["t2d"], 0)


def loss_and_grads(draft, batch, head, steps=3):
    draft.zero_grad(set_to_none=True)
    labels = target_labels(batch["final_hidden"], head, draft.d2t)
    loss, stats = TTT(draft, steps, 0.8)(batch, labels, step_token_counts(batch, steps, 1))
    loss.backward()
    return loss.detach(), stats, {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None}


def pad_to(batch, T):
    return {k: F.pad(v, (0, 0) * (v.ndim - 2) + (0, T - v.shape[1])) for k, v in batch.items()}


def test_padding_changes_neither_the_loss_nor_the_gradients(feats):
    """The same sequences, tight (as a token-budget batch holds them) or padded to a far longer
    sequence (as today's random batches pad them): the same per-token loss and gradients."""
    ds, draft = feats["train"], new_draft(feats)
    rows = sorted(range(len(ds)), key=ds.length)[4:7]  # similar lengths
    tight = ds.batch(rows, "cpu")
    loss, stats, grads = loss_and_grads(draft, tight, feats["head"])
    loss2, stats2, grads2 = loss_and_grads(draft, pad_to(tight, tight["input_ids"].shape[1] + 41), feats["head"])
    assert torch.allclose(loss, loss2, rtol=1e-5, atol=1e-6)
    assert torch.allclose(stats, stats2, rtol=1e-5, atol=1e-4)
    for name, g in grads.items():
        assert torch.allclose(g, grads2[name], rtol=1e-4, atol=1e-6), name


def test_a_split_into_batches_sums_to_the_one_padded_batch(feats):
    """Per-token normalisation: the ce sums and counts of smaller batches are those of one padded
    batch of the same sequences, so the epoch's pooled loss is the same."""
    ds, draft = feats["train"], new_draft(feats)
    rows = list(range(8))
    _, whole, _ = loss_and_grads(draft, ds.batch(rows, "cpu"), feats["head"])
    parts = [[0, 3, 5], [1, 2], [4, 6, 7]]  # indices into rows
    summed = sum(loss_and_grads(draft, ds.batch([rows[j] for j in p], "cpu"), feats["head"])[1] for p in parts)
    assert torch.allclose(summed, whole, rtol=1e-5, atol=1e-4)


def test_resuming_a_token_budget_run_gives_the_uninterrupted_result(feats, tmp_path):
    cpu = torch.device("cpu")
    straight = new_draft(feats)
    history = fit(straight, feats["head"], feats["train"], feats["eval"], params(), tmp_path / "a.pt", "run", cpu)
    assert 0 <= history[0]["train_padding_share"] < 0.3
    interrupted = new_draft(feats)
    fit(interrupted, feats["head"], feats["train"], feats["eval"], params(), tmp_path / "b.pt", "run", cpu, stop_after_steps=4)
    resumed = new_draft(feats)
    assert fit(resumed, feats["head"], feats["train"], feats["eval"], params(), tmp_path / "b.pt", "run", cpu) == history
    for name, w in straight.state_dict().items():
        assert torch.equal(w, resumed.state_dict()[name]), name


def test_a_budget_that_cannot_hold_the_longest_sequence_per_process_names_the_fix(feats, tmp_path):
    longest = max(feats["train"].length(i) for i in range(len(feats["train"])))
    with pytest.raises(UserError, match=rf"train.batch_tokens 10 cannot hold one sequence of {longest} tokens.*at least {longest}"):
        fit(new_draft(feats), feats["head"], feats["train"], feats["eval"], params(batch_tokens=10), tmp_path / "x.pt", "run",
            torch.device("cpu"))


def test_eval_by_token_budget_equals_eval_by_sequence_count(feats):
    ttt, cpu = TTT(new_draft(feats), 3, 0.8), torch.device("cpu")
    by_count = evaluate(ttt, feats["eval"], feats["head"], 3, cpu, False)
    by_tokens = evaluate(ttt, feats["eval"], feats["head"], 3, cpu, False, batch_tokens=90)
    assert by_tokens["scored_tokens"] == by_count["scored_tokens"]
    assert by_tokens["loss"] == pytest.approx(by_count["loss"], rel=1e-5)
    assert by_tokens["accept"] == pytest.approx(by_count["accept"], abs=1e-9)


def test_two_processes_split_each_token_budget_step_to_the_one_process_weights(tmp_path):
    """The stage under torchrun: each step's sequences split across processes, the same weights
    as one process; the metrics carry the padding share and the FLOP rates (no MFU on a CPU)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from safetensors.torch import load_file

    root = Path(__file__).resolve().parents[1]
    make_features(tmp_path, n_train=16, n_eval=8)
    (tmp_path / "params.yaml").write_text(f"""
target: {{model: {tmp_path / 'target'}, revision: null, dtype: float32, device: cpu}}
train: {{seed: 0, epochs: 1, batch_size: 4, max_length: 512, lr: 0.003, min_lr_ratio: 0.1, warmup_ratio: 0.1,
        weight_decay: 0.0, grad_clip: 0.5, ttt_steps: 3, ttt_decay: 0.8, intermediate_size: null,
        checkpoint_every: 2, device: auto, autocast: auto, features: offline, batch_tokens: 160, compile: false, attention: auto,
        state_cache: auto}}
""")
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    env.pop("DRAFTLAB_PEAK_FLOPS", None)
    weights = {}
    for n in (1, 2):
        head = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}"] if n > 1 else [sys.executable]
        r = subprocess.run(head + ["-m", "stages.train", "--features", "features", "--out", f"d{n}", "--reports", f"r{n}",
                                   "--resume-dir", f"resume{n}"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
        assert r.returncode == 0, r.stderr[-3000:]
        weights[n] = load_file(str(tmp_path / f"d{n}" / "draft.safetensors"))
    for name, w in weights[1].items():
        assert torch.allclose(w, weights[2][name], atol=2e-5), name
    metrics = json.loads((tmp_path / "r2" / "metrics.json").read_text())
    assert 0 <= metrics["padding_share"] < 0.3 and metrics["settings"]["batch_tokens"] == 160
    assert metrics["draft_flops_per_s"] > 0 and metrics["target_flops_per_s"] > 0 and metrics["mfu"] is None
