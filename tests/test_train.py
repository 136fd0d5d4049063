import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from draftlab.train.draft import TTTCache
from draftlab.errors import UserError
from draftlab.params import TrainParams
from draftlab.target.weights import load_target_head
from draftlab.train.evaluate import evaluate
from draftlab.train.loop import fit, init_draft, lr_at
from draftlab.train.objective import TTT, shift, step_token_counts
from tiny_features import K, V, VD, make_draft, training_kit

ROOT = Path(__file__).resolve().parents[1]


def params(**kw):
    base = dict(seed=0, epochs=2, batch_size=4, max_length=512, lr=3e-3, min_lr_ratio=0.1, warmup_ratio=0.1,
                weight_decay=0.0, grad_clip=0.5, ttt_steps=3, ttt_decay=0.8, intermediate_size=None,
                checkpoint_every=3, device="cpu", autocast="auto")
    return TrainParams(**{**base, **kw})


@torch.no_grad()
def ttt_states(draft, ids, aux, steps):
    B, T = aux.shape[:2]
    cache, state, out = TTTCache(), draft.project(aux), []
    for i in range(steps):
        state = draft.step(shift(ids, 1 + i), state, torch.arange(T).expand(B, T) + i, cache)
        out.append(state)
    return torch.stack(out)  # [steps, B, T, H]


def test_step_i_row_t_sees_exactly_aux_up_to_t_and_tokens_up_to_t_plus_1_plus_i():
    draft = make_draft()
    T, steps = 10, 3
    torch.manual_seed(0)
    ids, aux = torch.randint(0, V, (1, T)), torch.randn(1, T, K * draft.config.hidden_size)
    base = ttt_states(draft, ids, aux, steps)
    for p in (3, 7):
        aux2 = aux.clone()
        aux2[0, p] += 1.0
        moved = (ttt_states(draft, ids, aux2, steps) - base).abs().amax(-1)[:, 0]  # [steps, T]
        for i in range(steps):
            assert moved[i, :p].max() < 1e-6 and moved[i, p] > 1e-4  # aux[p] first reaches row p
        ids2 = ids.clone()
        ids2[0, p] = (ids[0, p] + 1) % V
        moved = (ttt_states(draft, ids2, aux, steps) - base).abs().amax(-1)[:, 0]
        for i in range(steps):
            t = p - 1 - i  # the row that embeds token p at step i
            assert torch.all(moved[i, :t] < 1e-6) and moved[i, t] > 1e-4


def test_loss_targets_and_masks_on_a_hand_checkable_case():
    """One assistant token (position 5): step i scores only row 3-i, always against the target's
    view at position 4 (its distribution over token 5)."""
    draft = make_draft()
    H, T, steps, decay = draft.config.hidden_size, 8, 3, 0.5
    torch.manual_seed(0)
    batch = {"input_ids": torch.randint(0, V, (1, T)), "loss_mask": torch.zeros(1, T, dtype=torch.bool),
             "aux_hidden": torch.randn(1, T, K * H), "final_hidden": torch.randn(1, T, H)}
    batch["loss_mask"][0, 5] = True
    target_logits, top1 = torch.randn(1, T, VD), torch.randint(0, V, (1, T))
    counts = step_token_counts(batch, steps, 1)
    assert counts.tolist() == [1, 1, 1]
    loss, stats = TTT(draft, steps, decay)(batch, (target_logits, top1), counts)
    states = ttt_states(draft, batch["input_ids"], batch["aux_hidden"], steps)
    p = torch.softmax(target_logits[0, 4], -1)
    want = sum(decay**i * -(p * torch.log_softmax(draft.logits(states[i, 0, 3 - i]), -1)).sum() for i in range(steps))
    assert torch.allclose(loss, want, atol=1e-5)
    assert stats[1].tolist() == [1, 1, 1]  # scored tokens per step
    # Only row 3 has its whole chain inside the answer; rows 2 and 1 start in the prompt.
    assert stats[4].tolist()[1:] == [0, 0]


def test_lr_warms_up_then_decays_to_the_floor():
    lrs = [lr_at(s, 100, 1.0, 0.1, 0.1) for s in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:]))
    assert lr_at(100, 100, 1.0, 0.1, 0.1) == pytest.approx(0.1)


@pytest.fixture(scope="module")
def feats(tmp_path_factory):
    return training_kit(tmp_path_factory.mktemp("feat"))


def new_draft(f, seed=0):
    return init_draft(f["cfg"], f["embed"], f["head"], f["d2t"], f["t2d"], seed)


def weights(draft):
    return {k: v.clone() for k, v in draft.state_dict().items()}


def test_resuming_after_an_interruption_gives_the_uninterrupted_result(feats, tmp_path):
    train_params = params()  # 4 steps per epoch, 8 in all; checkpoints at steps 3 and 6 and at epoch ends
    straight = new_draft(feats)
    history = fit(straight, feats["head"], feats["train"], feats["eval"], train_params, tmp_path / "a.pt", "run", torch.device("cpu"))

    interrupted = new_draft(feats)
    fit(interrupted, feats["head"], feats["train"], feats["eval"], train_params, tmp_path / "b.pt", "run", torch.device("cpu"), stop_after_steps=7)
    resumed = new_draft(feats)  # a new process: fresh weights, then the checkpoint of step 6
    history_b = fit(resumed, feats["head"], feats["train"], feats["eval"], train_params, tmp_path / "b.pt", "run", torch.device("cpu"))
    assert history_b == history
    for name, w in weights(straight).items():
        assert torch.equal(w, resumed.state_dict()[name]), name

    # A checkpoint of another configuration is never resumed from.
    other = new_draft(feats)
    fit(other, feats["head"], feats["train"], feats["eval"], params(lr=1e-2), tmp_path / "c.pt", "other", torch.device("cpu"), stop_after_steps=7)
    fresh = new_draft(feats)
    fit(fresh, feats["head"], feats["train"], feats["eval"], train_params, tmp_path / "c.pt", "run", torch.device("cpu"))
    assert all(torch.equal(w, fresh.state_dict()[k]) for k, w in weights(straight).items())


def test_a_resumed_run_counts_the_steps_before_its_checkpoint_in_its_training_figures(feats, tmp_path):
    """The tokens, steps, step seconds and wall time of a run stopped and resumed cover its whole
    training, as an uninterrupted run's do; from a checkpoint that holds no such counters (an older
    one), the figures say from which step they count."""
    from draftlab.train.flops import Meter

    def meter():
        return Meter({"num_layers": 1, "hidden_size": 4, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 2,
                      "intermediate_size": 8, "vocab_size": V}, feats["cfg"], online=False)

    cpu, run = torch.device("cpu"), (feats["head"], feats["train"], feats["eval"], params())
    whole = meter()
    fit(new_draft(feats), *run, tmp_path / "a.pt", "run", cpu, meter=whole)
    first = meter()
    fit(new_draft(feats), *run, tmp_path / "b.pt", "run", cpu, stop_after_steps=7, meter=first)
    seconds_before = first.wall_s()
    resumed, own = meter(), []
    fit(new_draft(feats), *run, tmp_path / "b.pt", "run", cpu, meter=resumed, on_step=lambda _s, _l, sec: own.append(sec))
    got, want = resumed.summary(None), whole.summary(None)
    assert got["steps"] == want["steps"] == 8 and got["tokens"] == want["tokens"] and got["from_step"] == 0
    assert got["eval_s_by_epoch"].keys() == want["eval_s_by_epoch"].keys() == {"1", "2"}
    assert len(own) == 2 and resumed.seconds > sum(own)  # its own two steps' seconds and the six before the checkpoint
    assert resumed.wall_s() > 0.5 * seconds_before  # the checkpoint's wall time (taken at step 6) and this run's
    fit(new_draft(feats), *run, tmp_path / "c.pt", "run", cpu, stop_after_steps=7, meter=meter())
    old = torch.load(tmp_path / "c.pt", weights_only=True)
    del old["meter"]  # a checkpoint written before it held counters
    torch.save(old, tmp_path / "c.pt")
    later = meter()
    fit(new_draft(feats), *run, tmp_path / "c.pt", "run", cpu, meter=later)
    assert later.summary(None)["from_step"] == 6 and later.summary(None)["steps"] == 2


def test_the_next_batch_is_made_before_a_steps_loss_is_read_and_every_step_is_read_before_a_checkpoint(feats, tmp_path, monkeypatch):
    """A step's loss is read back (a wait for the GPU) only once the next step is queued, so the host
    makes batches while the GPU still trains; the first step after the start, a checkpoint or an
    evaluation is read at once, and every step is read, in order, before a checkpoint is written
    and before the epoch's evaluation."""
    from draftlab.train import loop

    events = []
    train_ds = feats["train"]
    monkeypatch.setattr(train_ds, "batch", lambda rows, device, make=train_ds.batch: (events.append("batch"), make(rows, device))[1])
    monkeypatch.setattr(loop, "atomic_write_bytes", lambda path, data, write=loop.atomic_write_bytes: (events.append("checkpoint"), write(path, data))[1])
    monkeypatch.setattr(loop, "evaluate", lambda *a, run=loop.evaluate, **k: (events.append("eval"), run(*a, **k))[1])
    fit(new_draft(feats), feats["head"], train_ds, feats["eval"], params(checkpoint_every=3), tmp_path / "a.pt", "run",
        torch.device("cpu"), on_step=lambda step, _loss, _s: events.append(f"read {step}"))
    # 4 steps an epoch, 2 epochs; checkpoints after steps 3 and 6 and at each epoch's end
    assert " ".join(events) == ("batch read 1 batch batch read 2 read 3 checkpoint batch read 4 eval checkpoint "
                                "batch read 5 batch read 6 checkpoint batch read 7 batch read 8 eval checkpoint")


def identity(lr=3e-3, code="c1", torch_version="2.13.0"):
    return {"params": {"train": {"lr": lr, "epochs": 2}}, "inputs": {"features": "f1"}, "code": code,
            "packages": {"torch": torch_version}}


def test_another_configurations_checkpoint_is_named_kept_aside_and_resumed_when_it_runs_again(feats, tmp_path, capsys):
    """A run of other params finds the checkpoint of an interrupted one: it says what differs, keeps
    it under its own key instead of writing over it, and trains from the start; the interrupted
    configuration, run again, resumes from it to the uninterrupted weights."""
    cpu, path = torch.device("cpu"), tmp_path / "last.pt"
    straight = new_draft(feats)
    fit(straight, feats["head"], feats["train"], feats["eval"], params(), tmp_path / "a.pt", "run-a", cpu)
    fit(new_draft(feats), feats["head"], feats["train"], feats["eval"], params(), path, "run-a", cpu, stop_after_steps=7,
        identity=identity())
    fit(new_draft(feats), feats["head"], feats["train"], feats["eval"], params(lr=1e-2), path, "run-b", cpu,
        identity=identity(lr=1e-2))
    out = capsys.readouterr().out
    assert f"{path} holds step 6 of another configuration (what differs: train.lr 0.003 -> 0.01)" in out
    assert f"kept as {tmp_path / 'last.run-a.pt'}" in out and "across-code" not in out
    assert (tmp_path / "last.run-a.pt").exists() and path.exists()  # b's own checkpoint where a's was
    resumed = new_draft(feats)
    fit(resumed, feats["head"], feats["train"], feats["eval"], params(), path, "run-a", cpu, identity=identity())
    out = capsys.readouterr().out
    assert "resuming from" in out and "at step 6" in out and (tmp_path / "last.run-b.pt").exists()
    assert not (tmp_path / "last.run-a.pt").exists()  # back under the usual name
    for name, w in weights(straight).items():
        assert torch.equal(w, resumed.state_dict()[name]), name


def test_a_code_or_package_change_resumes_only_when_asked_and_is_recorded(feats, tmp_path, capsys):
    cpu, path = torch.device("cpu"), tmp_path / "last.pt"
    fit(new_draft(feats), feats["head"], feats["train"], feats["eval"], params(), path, "run-old", cpu, stop_after_steps=7,
        identity=identity())
    fit(new_draft(feats), feats["head"], feats["train"], feats["eval"], params(), path, "run-new", cpu, stop_after_steps=1,
        identity=identity(code="c2", torch_version="2.14.0"))
    out = capsys.readouterr().out
    assert "what differs: the training code; torch 2.13.0 -> 2.14.0" in out and "DRAFTLAB_TRAIN_RESUME=across-code" in out
    (tmp_path / "last.run-old.pt").replace(path)
    notes = {}
    fit(new_draft(feats), feats["head"], feats["train"], feats["eval"], params(), path, "run-new", cpu,
        identity=identity(code="c2", torch_version="2.14.0"), across_code=True, notes=notes)
    assert "at step 6" in capsys.readouterr().out
    assert notes["resumed_across_code"] == {"from_step": 6, "differences": ["the training code", "torch 2.13.0 -> 2.14.0"]}
    # other params are never resumed across, asked or not
    fit(new_draft(feats), feats["head"], feats["train"], feats["eval"], params(), tmp_path / "p.pt", "run-p", cpu,
        stop_after_steps=7, identity=identity())
    fit(new_draft(feats), feats["head"], feats["train"], feats["eval"], params(lr=1e-2), tmp_path / "p.pt", "run-q", cpu,
        stop_after_steps=1, identity=identity(lr=1e-2, code="c2"), across_code=True)
    assert "train.lr 0.003 -> 0.01; the training code" in capsys.readouterr().out


TWO_PROCESS_SET_ASIDE = '''
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from draftlab import parallel
from draftlab.features.dataset import FeatureDataset, load_draft_vocab
from draftlab.target.weights import load_target_head
from draftlab.train.draft import DraftConfig
from draftlab.train.loop import fit, init_draft
from tests.test_train import identity, params

feat, out = Path(sys.argv[1]), Path(sys.argv[2])
rank, world = parallel.setup_distributed("cpu")
info = __import__("json").loads((feat / "manifest.json").read_text())["info"]["target"]
d2t, t2d = load_draft_vocab(feat)
embed, head = load_target_head(str(feat.parent / "target"))
cfg = DraftConfig.from_target(info, 3, len(d2t))
train, evals, cpu = FeatureDataset(feat / "train"), FeatureDataset(feat / "eval"), torch.device("cpu")


def run(path, key, lr=3e-3, stop=None):
    draft = init_draft(cfg, embed, head, d2t, t2d, 0)
    fit(draft, head, train, evals, params(lr=lr), out / path, key, cpu, rank, world, stop_after_steps=stop, identity=identity(lr=lr))
    return draft


straight = run("a.pt", "run-a")
run("last.pt", "run-a", stop=7)  # interrupted after its checkpoint of step 6
run("last.pt", "run-b", lr=1e-2)  # another configuration finds it: kept aside, not written over
resumed = run("last.pt", "run-a")  # the first configuration again: resumes from the one kept aside
if rank == 0:
    save_file({k: v.contiguous() for k, v in straight.state_dict().items()}, str(out / "straight.safetensors"))
    save_file({k: v.contiguous() for k, v in resumed.state_dict().items()}, str(out / "resumed.safetensors"))
'''


def test_two_processes_keep_another_configurations_checkpoint_aside_and_resume_from_it(feats, tmp_path):
    """Under data parallelism the checkpoint is read by every process before rank 0 moves it aside,
    and the configuration run again resumes from it to the uninterrupted two-process weights."""
    script = tmp_path / "set_aside.py"
    script.write_text(TWO_PROCESS_SET_ASIDE)
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script), str(feats["feat"]), str(tmp_path)]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"holds step 6 of another configuration (what differs: train.lr 0.003 -> 0.01); kept as {tmp_path / 'last.run-a.pt'}" in r.stdout
    assert "resuming from" in r.stdout and "at step 6" in r.stdout
    assert (tmp_path / "last.run-b.pt").exists() and not (tmp_path / "last.run-a.pt").exists()
    straight, resumed = load_file(str(tmp_path / "straight.safetensors")), load_file(str(tmp_path / "resumed.safetensors"))
    for name, w in straight.items():
        assert torch.equal(w, resumed[name]), name


def cpu_compile_unavailable() -> str | None:
    """Why torch.compile cannot run on this machine's CPU (no C++ compiler, ...), or None."""
    try:
        torch.compile(lambda x: x * 2 + 1)(torch.ones(3))
    except Exception as e:  # noqa: BLE001 - any failure of the toolchain means: nothing to compare here
        return f"torch.compile does not run on this CPU ({type(e).__name__}: {str(e)[:200]})"
    return None


def test_train_compile_gives_the_eager_losses_and_the_eager_checkpoint_names(feats, tmp_path):
    """train.compile changes kernels, not math: the same losses step by step (float rounding
    apart), and checkpoints under SGLang's parameter names."""
    if reason := cpu_compile_unavailable():
        pytest.skip(reason)
    runs = {}
    for name, compiled in (("eager", False), ("compiled", True)):
        draft, losses = new_draft(feats), []
        fit(draft, feats["head"], feats["train"], feats["eval"], params(compile=compiled, ttt_steps=2), tmp_path / f"{name}.pt", "run",
            torch.device("cpu"), stop_after_steps=3, on_step=lambda _s, loss, _t: losses.append(loss))
        runs[name] = draft, losses
    (eager, eager_losses), (compiled, compiled_losses) = runs["eager"], runs["compiled"]
    # Steps 2 and 3 score the weights each run's updates made. (The weights themselves are not
    # compared: AdamW moves a weight whose gradient is ~0 by up to lr either way on rounding.)
    assert compiled_losses == pytest.approx(eager_losses, rel=1e-5)
    saved = torch.load(tmp_path / "compiled.pt", weights_only=True)["model"]  # checkpoint_every 3: written at step 3
    assert list(saved) == list(eager.state_dict())


def test_a_checkpoint_that_is_not_this_runs_is_discarded_with_a_warning(feats, tmp_path, capsys):
    """Resume state damaged or edited by hand never gives a traceback: fit() warns and trains from
    the start, to exactly the weights of a run that never saw the file (a checkpoint that failed
    halfway through loading leaves no tensor behind)."""
    train_params = params(epochs=1, checkpoint_every=0)
    straight = new_draft(feats)
    fit(straight, feats["head"], feats["train"], feats["eval"], train_params, tmp_path / "none.pt", "run", torch.device("cpu"))
    good = tmp_path / "good.pt"
    fit(new_draft(feats), feats["head"], feats["train"], feats["eval"], params(epochs=1, checkpoint_every=1), good, "run",
        torch.device("cpu"), stop_after_steps=2)
    ckpt = torch.load(good, weights_only=True)
    wrong_shape = {**ckpt["model"], "fc.weight": torch.zeros(3, 3)}  # loads after other tensors did: a half-loaded draft
    bad = {"garbage": b"not a checkpoint", "number": 5, "no run_key": {"step": 1},
           "a step that is not a number": {**ckpt, "step": "2"}, "a position past the run": {**ckpt, "epoch": 99},
           "history of another shape": {**ckpt, "history": "x"}, "weights of another shape": {**ckpt, "model": wrong_shape}}
    for name, content in bad.items():
        path = tmp_path / f"{len(name)}.pt"
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            torch.save(content, path)
        draft = new_draft(feats)
        fit(draft, feats["head"], feats["train"], feats["eval"], train_params, path, "run", torch.device("cpu"))
        assert "warning: ignoring the checkpoint" in capsys.readouterr().out, name
        assert all(torch.equal(w, draft.state_dict()[k]) for k, w in weights(straight).items()), name
    (tmp_path / "dir.pt").mkdir()  # not a file: not discarded (it may hold anything), named
    with pytest.raises(UserError, match=r"dir.pt is not a file.*move or delete it"):
        fit(new_draft(feats), feats["head"], feats["train"], feats["eval"], train_params, tmp_path / "dir.pt", "run", torch.device("cpu"))


def test_a_batch_larger_than_the_data_is_refused_with_the_size_that_fits(feats, tmp_path):
    with pytest.raises(UserError, match=r"train.batch_size 17 is more than the 16 sequences .* set train.batch_size to 16 or less"):
        fit(new_draft(feats), feats["head"], feats["train"], feats["eval"], params(batch_size=17), tmp_path / "x.pt", "run",
            torch.device("cpu"))


def test_training_raises_acceptance_on_what_it_learns_from(feats, tmp_path):
    draft = new_draft(feats)
    ttt = TTT(draft, 3, 0.8)
    before = evaluate(ttt, feats["train"], feats["head"], 8, torch.device("cpu"), False)
    fit(draft, feats["head"], feats["train"], feats["train"], params(epochs=12, checkpoint_every=0, lr=1e-2), tmp_path / "r.pt", "k", torch.device("cpu"))
    after = evaluate(ttt, feats["train"], feats["head"], 8, torch.device("cpu"), False)
    assert after["loss"] < before["loss"]
    assert after["tau_pred"] > before["tau_pred"] + 0.3, (before["accept"], after["accept"])


def test_step1_acceptance_is_split_by_the_predicted_tokens_kind_and_position(feats):
    """The groups partition the scored first-step rows: loop + other = every band together = all,
    and their hit rates pool back to a_1. Counted by hand on one row: a 12-token answer of one
    repeated token has loop tokens from its 9th on; row t predicts token t+2."""
    from draftlab.train.evaluate import step1_groups

    ttt = TTT(new_draft(feats), 3, 0.8)
    got = evaluate(ttt, feats["eval"], feats["head"], 4, torch.device("cpu"), False)
    kinds, bands = got["step1_by_kind"], got["step1_by_position"]
    assert kinds["loop"]["tokens"] + kinds["other"]["tokens"] == got["scored_tokens"] == sum(c["tokens"] for c in bands.values())
    hits = sum(c["tokens"] * (c["a_1"] or 0) for c in kinds.values())
    assert hits / got["scored_tokens"] == pytest.approx(got["accept"][0], abs=1e-3)

    draft = make_draft()
    H, T = draft.config.hidden_size, 17
    ids = torch.tensor([[1, 2] + [5] * 12 + [3, 0, 0]])
    batch = {"input_ids": ids, "loss_mask": torch.tensor([[0, 0] + [1] * 12 + [0, 0, 0]]).bool(),
             "aux_hidden": torch.randn(1, T, K * H), "final_hidden": torch.randn(1, T, H)}
    one = TTT(draft, 1, 0.8)
    one(batch, (torch.randn(1, T, VD), torch.full((1, T), 5)), step_token_counts(batch, 1, 1))
    groups = step1_groups(one, batch).tolist()
    assert [g[0] for g in groups] == [4, 8, 12, 0, 0, 0, 0, 12, 0, 0]  # scored: loop, other, bands 0-63 .. 512+, turns 1, 2, 3+
    assert groups[0][1] == float(one.scored[1][0][8:12].sum())  # hits of rows 8..11, which predict tokens 10..13


def test_step1_acceptance_and_decoding_are_split_by_the_answers_turn():
    """A conversation of three answers: each answer's tokens count in its turn's group, and the
    first-turns decoded tau walks the first answer alone (what a bench of first turns serves)."""
    from draftlab.train.evaluate import decoded_rounds, predicted_groups, step1_breakdown, step1_groups

    draft = make_draft()
    H = draft.config.hidden_size
    # user [1, 2], answer 1 (5 tokens), user [3], answer 2 (4 tokens), user [4], answer 3 (3 tokens), pad
    mask = [0, 0] + [1] * 5 + [0] + [1] * 4 + [0] + [1] * 3 + [0]
    ids = [1, 2, 10, 11, 12, 13, 14, 3, 20, 21, 22, 23, 4, 30, 31, 32, 0]
    T = len(ids)
    batch = {"input_ids": torch.tensor([ids]), "loss_mask": torch.tensor([mask]).bool(),
             "aux_hidden": torch.randn(1, T, K * H), "final_hidden": torch.randn(1, T, H)}
    one = TTT(draft, 1, 0.8)
    one(batch, (torch.randn(1, T, VD), torch.full((1, T), 5)), step_token_counts(batch, 1, 1))
    loop, band, turn = predicted_groups(batch)
    assert turn.tolist() == [0] * 5 + [-1] + [1] * 4 + [-1] + [2] * 3 + [-1] * 3  # row t: the turn of token t+2
    got = step1_breakdown(step1_groups(one, batch))["step1_by_turn"]
    assert {k: c["tokens"] for k, c in got.items()} == {"1": 5, "2": 4, "3+": 3}
    valid, correct = (x.cpu() for x in one.scored)
    correct = torch.ones_like(correct)  # every step hits: a round at depth 1 emits 2 tokens
    first = decoded_rounds(valid, correct, keep=turn == 0)
    # the first answer's rows 0..4: its first token is the prefill's, then rounds of 2 over the other 4
    assert first.tolist() == [[2, 4]]
    assert decoded_rounds(valid, correct).tolist() == [[2 + 2 + 1, 4 + 3 + 2]]


def write_params(root: Path, target_dir: Path):
    (root / "params.yaml").write_text(f"""
target: {{model: {target_dir}, revision: null, dtype: float32, device: cpu}}
train: {{seed: 0, epochs: 1, batch_size: 4, max_length: 512, lr: 0.003, min_lr_ratio: 0.1, warmup_ratio: 0.1,
        weight_decay: 0.0, grad_clip: 0.5, ttt_steps: 3, ttt_decay: 0.8, intermediate_size: null,
        checkpoint_every: 2, device: auto, autocast: auto, features: offline, batch_tokens: null, compile: false, attention: auto,
        state_cache: auto}}
""")


def run_train(root: Path, out: str, nproc: int):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"] if nproc > 1 else [sys.executable]
    cmd = launcher + ["-m", "stages.train", "--features", "features", "--out", out, "--reports", f"reports/{out}", "--resume-dir", f"resume-{out}"]
    r = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    return load_file(str(root / out / "draft.safetensors"))


def test_two_process_data_parallel_run_matches_one_process(feats):
    root = feats["root"]
    write_params(root, root / "target")
    one, two = run_train(root, "one", 1), run_train(root, "two", 2)
    for name, w in one.items():
        assert torch.allclose(w, two[name], atol=2e-5), name
    metrics = json.loads((root / "reports/two/metrics.json").read_text())
    manifest = json.loads((root / "two/manifest.json").read_text())
    assert metrics["config_hash"] == manifest["config_hash"] and manifest["info"]["processes"] == 2
    assert metrics["settings"]["physical_layers"] == [1, 2, 3] and metrics["settings"]["ttt_steps"] == 3
    assert (root / "reports/two/plots/accept.tsv").read_text().startswith("epoch\taccept_1\taccept_2\taccept_3\ttau_pred")
    decoded = (root / "reports/two/plots/decoded.tsv").read_text().splitlines()
    assert decoded[0] == "epoch\tfirst_turns_1\tfirst_turns_2\tfirst_turns_3\tevery_turn_1\tevery_turn_2\tevery_turn_3"
    last = dict(zip(decoded[0].split("\t"), map(float, decoded[-1].split("\t"))))  # the last epoch's row is the metrics'
    assert last["first_turns_3"] == pytest.approx(metrics["tau_decoded_first_turns_by_steps"]["steps_3"], abs=1e-6)
    assert last["every_turn_2"] == pytest.approx(metrics["tau_decoded_by_steps"]["steps_2"], abs=1e-6)
    assert not (root / "resume-two/last.pt").exists()  # removed once the stage completed


def test_target_embedding_and_head_come_from_sharded_tied_or_cached_checkpoints(tmp_path, monkeypatch):
    from safetensors.torch import save_file

    from draftlab.errors import UserError

    embed, head = torch.randn(10, 4), torch.randn(10, 4)
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    save_file({"model.embed_tokens.weight": embed, "model.norm.weight": torch.ones(4)}, str(sharded / "a.safetensors"))
    save_file({"lm_head.weight": head}, str(sharded / "b.safetensors"))
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "model.embed_tokens.weight": "a.safetensors", "model.norm.weight": "a.safetensors", "lm_head.weight": "b.safetensors"}}))
    e, h = load_target_head(str(sharded))
    assert torch.equal(e, embed) and torch.equal(h, head)

    tied = tmp_path / "tied"
    tied.mkdir()
    save_file({"model.embed_tokens.weight": embed}, str(tied / "model.safetensors"))
    (tied / "config.json").write_text(json.dumps({"tie_word_embeddings": True}))
    e, h = load_target_head(str(tied))
    assert torch.equal(h, embed)

    # A hub id resolves through the local HF cache only, never the network.
    cache = tmp_path / "hub"
    snap = cache / "models--org--tiny" / "snapshots" / ("0" * 40)
    snap.mkdir(parents=True)
    (cache / "models--org--tiny" / "refs").mkdir()
    (cache / "models--org--tiny" / "refs" / "main").write_text("0" * 40)
    save_file({"model.embed_tokens.weight": embed, "lm_head.weight": head}, str(snap / "model.safetensors"))
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    e, h = load_target_head("org/tiny")
    assert torch.equal(h, head)
    with pytest.raises(UserError, match="not in the local HF cache"):
        load_target_head("org/absent")


def test_bf16_soft_labels_match_fp32_ones_to_bf16_precision():
    """On GPUs the labels' vocab projection runs in bf16 (13x faster for an 8B head); the soft
    labels stay fp32 and the target's top-1 agrees with the fp32 one except at near-ties."""
    from draftlab.train.objective import labels_dtype, target_labels

    g = torch.Generator().manual_seed(0)
    final, head = torch.randn(2, 64, 32, generator=g), torch.randn(300, 32, generator=g)
    d2t = torch.zeros(100, dtype=torch.long)  # draft vocab = the first 100 target ids
    full32, top32 = target_labels(final, head, d2t)
    full16, top16 = target_labels(final, head, d2t, dtype=labels_dtype(True))
    assert full16.dtype == torch.float32 and labels_dtype(False) == torch.float32
    assert ((full16 - full32).norm() / full32.norm()).item() < 0.01
    assert (top16 == top32).float().mean().item() >= 0.95
    logits = final.reshape(-1, 32) @ head.T
    gap = logits.topk(2).values.diff(dim=-1).abs().view(2, 64)
    assert bool((top16 == top32)[gap > 0.1].all())  # where the top-2 are apart, the same token


def test_decoding_replayed_over_the_answers_scores_the_rows_rounds_start_at():
    """Hits that cluster (a looping stretch the draft gets whole, a stretch it misses) give the
    teacher-forced a_i one tau and decoding another: rounds crowd the hard stretch. The replay
    counts what decoding would: 40 hard rows are 40 rounds of 1 token, 40 easy rows at depth 3 are
    10 rounds of 4."""
    from draftlab.metrics import chain_tau
    from draftlab.train.evaluate import decoded_rounds

    K, N = 3, 81  # row 0 predicts the answer's first token (the prefill's): no round starts there
    valid = torch.ones(K, N + 2, dtype=torch.bool)
    valid[:, N:] = False  # two rows past the answer: its end
    correct = torch.zeros(K, N + 2, dtype=torch.bool)
    correct[:, 41:N] = True  # rows 1..40 missed at every step, rows 41..80 hit at every step
    got = decoded_rounds(valid, correct)
    assert got.tolist() == [[40 + 20, 80], [40 + 14, 80], [40 + 10, 80]]  # depth 1, 2, 3: (rounds, tokens)
    assert got[2, 1] / got[2, 0] == pytest.approx(1.6)
    assert chain_tau([0.5, 1.0, 1.0]) == pytest.approx(2.5)  # what the same rows' a_i predict
    # a second answer in the same rows is walked on its own
    two = decoded_rounds(torch.cat([valid, valid], 1), torch.cat([correct, correct], 1))
    assert two.tolist() == (2 * got).tolist()


def test_evaluate_reports_the_decoded_tau_beside_the_teacher_forced_one(tmp_path):
    kit = training_kit(tmp_path)
    draft = init_draft(kit["cfg"], kit["embed"], kit["head"], kit["d2t"], kit["t2d"], 0)
    m = evaluate(TTT(draft, 3, 0.8), kit["train"], kit["head"], 4, torch.device("cpu"), False)
    decoded = m["tau_decoded_by_steps"]
    assert len(decoded) == 3 and all(1.0 <= t <= n + 1 for n, t in enumerate(decoded, start=1))  # at most depth + 1 a round
    first = m["tau_decoded_first_turns_by_steps"]  # single answers here: every answer is a first turn
    assert first == pytest.approx(decoded)
    assert m["step1_by_turn"]["1"]["tokens"] == m["scored_tokens"] and m["step1_by_turn"]["2"]["tokens"] == 0


def test_the_resume_setting_takes_one_value_and_names_it(monkeypatch):
    from stages.train import resume_across_code

    monkeypatch.setenv("DRAFTLAB_TRAIN_RESUME", "across-code")
    assert resume_across_code() is True
    monkeypatch.delenv("DRAFTLAB_TRAIN_RESUME")
    assert resume_across_code() is False
    monkeypatch.setenv("DRAFTLAB_TRAIN_RESUME", "yes")
    with pytest.raises(UserError, match="DRAFTLAB_TRAIN_RESUME='yes': the one value is across-code"):
        resume_across_code()
