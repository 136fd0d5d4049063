"""train.features online: the train stage computes the target's states per batch, nothing stored.

One micro project runs extract -> standardize -> train twice in-process (offline, then online);
the tests compare the two runs and exercise resume and the params key.
"""
import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors import safe_open

from draftlab.features.dataset import FeatureDataset, load_draft_vocab
from draftlab.features.online import OnlineFeatures, OnlineTarget
from draftlab.params import ParamsError, load_params
from tests.support.micro import save_micro_model

ROOT = Path(__file__).resolve().parents[1]
N_TRAIN, N_EVAL, SAMPLE = 24, 8, 4


def write_rows(path: Path, n: int, prefix: str):
    """Answers with some structure (a counting pattern) so the draft has something to learn."""
    rows = [{"id": f"{prefix}{i:014d}", "messages": [
        {"role": "user", "content": f"count from {i}"},
        {"role": "assistant", "content": "<think>\nok\n</think>\n" + " ".join(str(i + j) for j in range(6 + i % 7))}]}
        for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def write_params(root: Path, features: str):
    p = yaml.safe_load((ROOT / "params.yaml").read_text())
    p["target"].update(model=str(root / "micro"), device="cpu")  # absolute: some tests run from elsewhere
    p["capture"]["layers"] = [0, 2, 3]
    p["extract"].update(shard_tokens=300, batch_size=8, online_sample_sequences=SAMPLE)
    p["standardize"]["draft_vocab_size"] = 96
    p["train"].update(epochs=3, batch_size=4, checkpoint_every=4, ttt_steps=3, device="cpu", lr=0.01, features=features)
    (root / "params.yaml").write_text(yaml.safe_dump(p))


def run_pipeline(root: Path, features: str, monkeypatch) -> Path:
    from stages import extract, standardize, train

    write_params(root, features)
    monkeypatch.chdir(root)
    extract.main(Path("synth"), Path(f"hidden-{features}"))
    standardize.main(Path(f"hidden-{features}"), Path(f"features-{features}"), Path(f"reports/{features}/standardize.json"))
    train.main(Path(f"features-{features}"), Path(f"ckpt-{features}"), Path(f"reports/{features}"), Path(f"resume-{features}"))
    return root


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("online")
    model = save_micro_model(root / "micro", arch="llama", num_layers=5)
    with torch.no_grad():  # peaked next-token distributions, like a trained model's: something to learn
        model.lm_head.weight.mul_(30.0)
    model.save_pretrained(root / "micro")
    (root / "synth").mkdir()
    write_rows(root / "synth" / "train.jsonl", N_TRAIN, "a")
    write_rows(root / "synth" / "eval.jsonl", N_EVAL, "b")
    (root / "synth" / "manifest.json").write_text(json.dumps({"config_hash": "0" * 64}))
    with pytest.MonkeyPatch.context() as mp:
        run_pipeline(root, "offline", mp)
        run_pipeline(root, "online", mp)
    return root


def metrics(root: Path, features: str) -> dict:
    return json.loads((root / "reports" / features / "metrics.json").read_text())


def test_online_training_matches_offline(runs):
    off, on = metrics(runs, "offline"), metrics(runs, "online")
    assert on["settings"]["features"] == "online" and off["settings"]["features"] == "offline"
    assert on["tokens_per_s"] > 0
    print(f"tau_pred offline {off['tau_pred']:.4f} online {on['tau_pred']:.4f}")
    assert abs(on["tau_pred"] - off["tau_pred"]) <= 0.02 * off["tau_pred"], (off["tau_pred"], on["tau_pred"])
    manifest = json.loads((runs / "ckpt-online" / "manifest.json").read_text())["info"]
    assert manifest["features"] == "online" and manifest["hidden_bytes_written"] == 0 and manifest["tokens_per_s"] > 0
    target = OnlineTarget(None)
    splits = [OnlineFeatures(runs / "features-online" / s, 512, target) for s in ("train", "eval")]
    # params.yaml's train.state_cache auto: the micro splits fit, so their states were kept after the first epoch
    every = sum(ds.state_bytes() for ds in splits)
    assert manifest["state_cache"] == {"kept": True, "bytes": every, "kept_bytes": every, "host_bytes": 0,
                                       "kept_sequences": {"train": N_TRAIN, "eval": N_EVAL}, "host_sequences": {"train": 0, "eval": 0},
                                       "sequences": {"train": N_TRAIN, "eval": N_EVAL}}
    by = manifest["throughput"]["by_states"]  # the first epoch's steps ran the target, the later ones read states back
    assert by["computed"]["steps"] > 0 and by["cached"]["steps"] == 2 * by["computed"]["steps"] and by["cached"]["tokens_per_s"] > 0
    assert manifest["cuda_memory"] is None  # trained on a CPU: no allocator to report


def test_online_vocab_and_sample_match_offline(runs):
    for a, b in zip(load_draft_vocab(runs / "features-offline"), load_draft_vocab(runs / "features-online")):
        assert torch.equal(a, b)  # counted over every row's tokens, not over the sample
    s_off = json.loads((runs / "features-offline" / "stats.json").read_text())
    s_on = json.loads((runs / "features-online" / "stats.json").read_text())
    assert s_on["tokens"] == s_off["tokens"] and s_on["draft_vocab_coverage"] == s_off["draft_vocab_coverage"]
    assert s_on["norms"].keys() == s_off["norms"].keys()
    # The sample's states are the offline states of the same rows (up to the batch-shape rounding).
    stored, sample = rows_of(runs / "features-offline" / "train"), rows_of(runs / "features-online" / "train")
    assert len(sample) == SAMPLE and sample.keys() <= stored.keys()
    for row, (aux, final) in sample.items():
        assert torch.allclose(aux, stored[row][0], rtol=1e-2, atol=1e-2) and torch.allclose(final, stored[row][1], rtol=1e-2, atol=1e-2)


def rows_of(split_dir: Path) -> dict:
    """{row id: (aux_hidden, final_hidden) as float32} of a features split."""
    out = {}
    for path in sorted(split_dir.glob("shard-*.safetensors")):
        with safe_open(str(path), "pt") as f:
            rows, off = json.loads(f.metadata()["row_ids"]), f.get_tensor("seq_offsets").tolist()
            aux, final = f.get_tensor("aux_hidden").float(), f.get_tensor("final_hidden").float()
        out.update({r: (aux[a:b], final[a:b]) for r, a, b in zip(rows, off[:-1], off[1:])})
    return out


def test_online_batches_are_the_offline_batches(runs):
    """Same sequence i in both datasets; states equal up to bf16 rounding of the target's output."""
    stored = FeatureDataset(runs / "features-offline" / "train", 512)
    online = OnlineFeatures(runs / "features-online" / "train", 512, OnlineTarget(load_params(["target"], runs / "params.yaml").target))
    assert len(online) == len(stored) == N_TRAIN and online.physical_layers == stored.physical_layers
    idx = [3, 0, 17, 9]
    a, b = stored.batch(idx, "cpu"), online.batch(idx, "cpu")
    assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["loss_mask"], b["loss_mask"])
    for name in ("aux_hidden", "final_hidden"):
        assert a[name].shape == b[name].shape
        assert torch.allclose(a[name], b[name], rtol=1e-2, atol=1e-2), name
        assert (a[name] == b[name]).float().mean() > 0.95, name  # most values round to the same bf16


def test_online_resume_gives_the_uninterrupted_weights(runs, tmp_path):
    from draftlab.train import loop as train
    from draftlab.train.draft import DraftConfig
    from draftlab.target.weights import load_target_head

    p = load_params(["target", "train"], runs / "params.yaml")
    tp = p.train
    feat = runs / "features-online"
    target = OnlineTarget(p.target)
    train_ds, eval_ds = (OnlineFeatures(feat / s, tp.max_length, target) for s in ("train", "eval"))
    info = json.loads((feat / "manifest.json").read_text())["info"]["target"]
    d2t, t2d = load_draft_vocab(feat)
    embed, head = load_target_head(str(runs / "micro"))
    cfg = DraftConfig.from_target(info, 3, len(d2t))

    def run(path, stop=None):
        draft = train.init_draft(cfg, embed, head, d2t, t2d, tp.seed)
        train.fit(draft, head.float(), train_ds, eval_ds, tp, path, "k", torch.device("cpu"), stop_after_steps=stop)
        return draft.state_dict()

    straight = run(tmp_path / "a.pt")
    run(tmp_path / "b.pt", stop=9)  # interrupted after the checkpoint of step 8
    resumed = run(tmp_path / "b.pt")
    for name, w in straight.items():
        assert torch.equal(w, resumed[name]), name


def test_online_stores_only_the_sample(runs):
    def size(d):
        return sum(p.stat().st_size for p in (runs / d).rglob("shard-*.safetensors"))

    manifest = json.loads((runs / "hidden-online" / "manifest.json").read_text())["info"]
    assert manifest["mode"] == "online"
    for split, n in (("train", N_TRAIN), ("eval", N_EVAL)):
        assert manifest["counts"][split]["rows"] == n and manifest["counts"][split]["sample_rows"] == SAMPLE
        assert (runs / "hidden-online" / split / "tokens.safetensors").exists()
    # 8 of 32 rows, and the shortest rows are not favoured: well under half the offline bytes.
    assert size("hidden-online") < 0.5 * size("hidden-offline")
    tokens = sum(p.stat().st_size for p in (runs / "hidden-online").rglob("tokens.safetensors"))
    assert tokens < 0.05 * size("hidden-offline")  # ~10 bytes per token against (k+1)*H*2


def test_params_reject_an_unknown_features_mode(tmp_path):
    p = yaml.safe_load((ROOT / "params.yaml").read_text())
    p["train"]["features"] = "foo"
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(p))
    with pytest.raises(ParamsError, match=r"train\.features must be one of offline, online, got 'foo'"):
        load_params(["train"], tmp_path / "params.yaml")


def test_train_refuses_features_of_the_other_mode(runs):
    from draftlab.errors import UserError
    from stages.train import datasets

    p = load_params(["target", "train"], runs / "params.yaml")  # online
    offline = json.loads((runs / "features-offline" / "manifest.json").read_text())
    with pytest.raises(UserError, match=r"train\.features is 'online' but .* standardized for 'offline'.*dvc repro"):
        datasets(runs / "features-offline", offline, p)


def test_online_training_refuses_a_tensor_parallel_capture_engine(runs, tmp_path, monkeypatch):
    """One whole target per training process: extract.tp_size > 1 (engine sglang) is for offline
    extraction, and online training says so before loading anything."""
    from draftlab.errors import UserError
    from stages.train import datasets

    p = yaml.safe_load((runs / "params.yaml").read_text())
    p["extract"].update(engine="sglang", tp_size=2)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(p))
    monkeypatch.chdir(tmp_path)
    online = json.loads((runs / "features-online" / "manifest.json").read_text())
    with pytest.raises(UserError, match=r"extract\.tp_size 2 with train\.features online.*set train\.features offline"):
        datasets(runs / "features-online", online, load_params(["target", "train"]))


def _fit_online(runs, tmp_path, cache, stop=None, path=None, meter=None):
    """(draft weights, history, tokens the target ran on, tokens of both splits) of train.fit over the
    online features of `runs`; cache: True keeps every sequence's states, False none, a number of
    bytes what cache_states keeps within that budget, a pair of numbers (device bytes, host bytes)
    what it keeps within those two budgets (two tiers, both on the CPU), a function of the two
    splits what it makes them keep."""
    from draftlab.features import online
    from draftlab.train import loop as train
    from draftlab.train.draft import DraftConfig
    from draftlab.target.weights import load_target_head

    p = load_params(["target", "train"], runs / "params.yaml")
    tp, feat = p.train, runs / "features-online"
    target = OnlineTarget(p.target)
    ran = []
    capture = target.capture
    target.capture = lambda ids, mask, physical, device: ran.append(int(mask.sum())) or capture(ids, mask, physical, device)
    train_ds, eval_ds = (OnlineFeatures(feat / s, tp.max_length, target) for s in ("train", "eval"))
    if cache is True:
        for ds in (train_ds, eval_ds):
            ds.keep_states("cpu")
    elif callable(cache):
        cache(train_ds, eval_ds)
    elif isinstance(cache, tuple):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(online, "free_memory", lambda device: cache[0] / online.STATE_CACHE_SHARE)
            mp.setattr(online, "host_memory", lambda: cache[1] / online.HOST_SHARE)
            online.cache_states([train_ds, eval_ds], "auto", "cpu", host="cpu")
    elif cache is not False:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(online, "free_memory", lambda device: cache / online.STATE_CACHE_SHARE)
            online.cache_states([train_ds, eval_ds], "auto", "cpu")
    info = json.loads((feat / "manifest.json").read_text())["info"]["target"]
    d2t, t2d = load_draft_vocab(feat)
    embed, head = load_target_head(str(runs / "micro"))
    draft = train.init_draft(DraftConfig.from_target(info, 3, len(d2t)), embed, head, d2t, t2d, tp.seed)
    path = path or tmp_path / f"cache-{cache}.pt"  # a function of the splits: the caller names the path
    history = train.fit(draft, head.float(), train_ds, eval_ds, tp, path, "k",
                        torch.device("cpu"), stop_after_steps=stop, meter=meter)
    tokens = sum(train_ds.length(i) for i in range(len(train_ds))) + sum(eval_ds.length(i) for i in range(len(eval_ds)))
    return draft.state_dict(), history, sum(ran), tokens, (train_ds, eval_ds)


def test_the_state_cache_runs_the_target_once_per_sequence_and_trains_as_without_it(runs, tmp_path):
    """train.state_cache: three epochs cost one pass of the target over both splits, not three; the
    states read back are those it computed, so the run learns as the uncached one does (the target's
    rounding under other batch shapes aside)."""
    cached, h_cached, ran_cached, tokens, _ = _fit_online(runs, tmp_path, cache=True)
    plain, h_plain, ran_plain, *_ = _fit_online(runs, tmp_path, cache=False)
    assert ran_cached == tokens  # every sequence of both splits once
    assert ran_plain == 3 * tokens  # three epochs, each split every epoch
    for a, b in zip(h_cached, h_plain):
        assert a["eval_loss"] == pytest.approx(b["eval_loss"], rel=2e-2)
    assert h_cached[-1]["eval_loss"] < h_cached[0]["eval_loss"]  # it learns
    for name, w in cached.items():
        assert torch.allclose(w, plain[name], rtol=5e-2, atol=5e-3), name


def test_a_resumed_run_with_the_state_cache_gives_the_uninterrupted_weights(runs, tmp_path):
    """The cache starts empty after a restart: the steps before the checkpoint fill it again, as
    they first did, so the later epochs read the same states to the bit."""
    straight, *_ = _fit_online(runs, tmp_path, cache=True, path=tmp_path / "a.pt")
    _fit_online(runs, tmp_path, cache=True, stop=9, path=tmp_path / "b.pt")  # stopped in epoch 2, after step 8's checkpoint
    resumed, *_ = _fit_online(runs, tmp_path, cache=True, path=tmp_path / "b.pt")
    for name, w in straight.items():
        assert torch.equal(w, resumed[name]), name


def test_the_state_cache_is_kept_whole_where_both_splits_fit_and_off_where_not_one_sequence_does(runs, monkeypatch):
    from draftlab.features import online

    target = OnlineTarget(None)
    splits = [OnlineFeatures(runs / "features-online" / s, 512, target) for s in ("train", "eval")]
    need = sum(ds.state_bytes() for ds in splits)
    assert need == sum(sum(ds.length(i) for i in range(len(ds))) for ds in splits) * 4 * 64 * 2  # (k+1) x H x bf16
    first = min(ds.length(0) for ds in splits) * 4 * 64 * 2  # the smaller split is tried first, from its sequence 0
    monkeypatch.setattr(online, "free_memory", lambda device: int(first / online.STATE_CACHE_SHARE) - 1)
    line = online.cache_states(splits, "auto", "cpu")
    assert "state cache off" in line and "more than 60% of the" in line and all(ds.cache is None for ds in splits)
    from stages.train import state_cache_info

    assert state_cache_info(*splits, "online")["kept"] is False
    assert "off" in online.cache_states(splits, "auto", "cpu", world=2) and splits[0].cache is None
    assert "off (train.state_cache)" in online.cache_states(splits, "off", "cpu")
    monkeypatch.setattr(online, "free_memory", lambda device: int(need / online.STATE_CACHE_SHARE) + 1)
    assert "state cache on cpu:" in online.cache_states(splits, "auto", "cpu")
    assert [ds.kept_sequences() for ds in splits] == [N_TRAIN, N_EVAL] and sum(ds.cache.nbytes() for ds in splits) == need
    monkeypatch.setattr(online, "free_memory", lambda device: None)
    assert "cannot be read" in online.cache_states([OnlineFeatures(runs / "features-online" / "eval", 512, target)], "auto", "cpu")


def test_a_partial_state_cache_keeps_the_eval_split_whole_and_a_prefix_of_train_and_allocates_only_that(runs, monkeypatch):
    """Where not every state fits, the cache keeps what does: the eval split whole (small, read after
    every epoch), then train's sequences in index order up to the first that would pass the budget;
    its tensors hold the kept sequences' tokens only."""
    from draftlab.features import online

    target = OnlineTarget(None)
    train_ds, eval_ds = splits = [OnlineFeatures(runs / "features-online" / s, 512, target) for s in ("train", "eval")]
    per_token = 4 * 64 * 2  # (k+1) x H x bf16
    lengths = [train_ds.length(i) for i in range(N_TRAIN)]
    need = (sum(lengths) + sum(eval_ds.length(i) for i in range(N_EVAL))) * per_token
    free = int((eval_ds.state_bytes() + train_ds.state_bytes() // 2) / online.STATE_CACHE_SHARE)
    monkeypatch.setattr(online, "free_memory", lambda device: free)
    line = online.cache_states(splits, "auto", "cpu")
    room = online.STATE_CACHE_SHARE * free
    k = train_ds.kept_sequences()
    assert eval_ds.kept_sequences() == N_EVAL and all(eval_ds.cache.keeps(i) for i in range(N_EVAL))
    assert 0 < k < N_TRAIN and [train_ds.cache.keeps(i) for i in range(N_TRAIN)] == [True] * k + [False] * (N_TRAIN - k)
    assert train_ds.cache.nbytes() == sum(lengths[:k]) * per_token < train_ds.state_bytes()  # the kept tokens only
    assert eval_ds.cache.nbytes() == eval_ds.state_bytes()
    kept = train_ds.cache.nbytes() + eval_ds.cache.nbytes()
    assert kept <= room < kept + lengths[k] * per_token  # as many as fit: the next one would pass the budget
    assert line == (f"train: state cache on cpu for {k} of {N_TRAIN} train sequences ({kept / 2**30:.1f} of {need / 2**30:.1f} GiB; "
                    f"the eval split whole): all that fits 60% of the {free / 2**30:.1f} GiB free, computed by the target in the "
                    "first epoch and read back after it; the target computes the rest every epoch")
    from stages.train import state_cache_info

    assert state_cache_info(train_ds, eval_ds, "online") == {  # the train manifest's: bytes stays every state's
        "kept": True, "bytes": need, "kept_bytes": kept, "host_bytes": 0, "kept_sequences": {"train": k, "eval": N_EVAL},
        "host_sequences": {"train": 0, "eval": 0}, "sequences": {"train": N_TRAIN, "eval": N_EVAL}}
    aux, final = torch.ones(lengths[k], 3 * 64), torch.ones(lengths[k], 64)
    train_ds.cache.put(k, aux, final)  # a sequence past the prefix: never kept
    assert not train_ds.cache.has(k) and not train_ds.cache.has(N_TRAIN - 1)
    # Less than the eval split: a prefix of it, and none of train.
    monkeypatch.setattr(online, "free_memory", lambda device: int(eval_ds.state_bytes() / 2 / online.STATE_CACHE_SHARE))
    line = online.cache_states(splits, "auto", "cpu")
    assert 0 < eval_ds.kept_sequences() < N_EVAL and train_ds.cache is None
    assert f"for {eval_ds.kept_sequences()} of {N_EVAL} eval sequences" in line and "none of the train split" in line


def test_a_batch_of_kept_and_unkept_sequences_takes_each_row_from_where_it_is(runs):
    """With a partial cache the target runs on the rows not kept and the kept rows are read back: each
    row's values are those a batch without a cache gives for the same rows and shape, to the bit."""
    p = load_params(["target"], runs / "params.yaml")
    target = OnlineTarget(p.target)
    plain = OnlineFeatures(runs / "features-online" / "train", 512, target)
    part = OnlineFeatures(runs / "features-online" / "train", 512, target)
    part.keep_states("cpu", 10)
    idx = [3, 15, 0, 20]  # kept, not kept, kept, not kept
    first = part.batch(idx, "cpu")
    assert part.target_ran and part.target_lengths == [part.length(i) for i in idx]
    for name, t in plain.batch(idx, "cpu").items():
        assert torch.equal(first[name], t), name
    assert [part.cache.has(i) for i in idx] == [True, False, True, False]
    again = part.batch(idx, "cpu")  # 3 and 0 read back, 15 and 20 from the target in their own batch
    assert part.target_ran and part.target_lengths == [part.length(15), part.length(20)]
    fresh = plain.batch([15, 20], "cpu")
    for name in ("aux_hidden", "final_hidden"):
        assert torch.equal(again[name][[0, 2]], first[name][[0, 2]]), name
        for row, j in ((1, 0), (3, 1)):
            n = part.length(idx[row])
            assert torch.equal(again[name][row, :n], fresh[name][j, :n]) and not again[name][row, n:].any(), name
        assert again[name][[1, 3]].abs().sum() > 0, name
    part.batch([0, 3], "cpu")
    assert not part.target_ran and part.target_lengths == []


def test_a_partial_state_cache_trains_as_without_it_and_runs_the_target_on_the_unkept_sequences_only(runs, tmp_path):
    """The target computes the kept sequences' states once and the others' every epoch: fewer target
    tokens than with the cache off, more than with every state kept; the run learns as without a cache."""
    target = OnlineTarget(None)
    train_ds, eval_ds = (OnlineFeatures(runs / "features-online" / s, 512, target) for s in ("train", "eval"))
    budget = eval_ds.state_bytes() + train_ds.state_bytes() // 2
    partial, h_partial, ran_partial, tokens, (train_kept, eval_kept) = _fit_online(runs, tmp_path, cache=budget)
    plain, h_plain, ran_plain, *_ = _fit_online(runs, tmp_path, cache=False)
    _, _, ran_all, *_ = _fit_online(runs, tmp_path, cache=True)
    assert ran_all < ran_partial < ran_plain
    kept = sum(ds.length(i) for ds in (train_kept, eval_kept) for i in range(len(ds)) if ds.cache.keeps(i))
    assert 0 < kept < tokens and ran_partial == tokens + 2 * (tokens - kept)  # the unkept ones in epochs 2 and 3 again
    for a, b in zip(h_partial, h_plain):
        assert a["eval_loss"] == pytest.approx(b["eval_loss"], rel=2e-2)
    for name, w in partial.items():
        assert torch.allclose(w, plain[name], rtol=5e-2, atol=5e-3), name


def test_a_resumed_run_with_a_partial_state_cache_gives_the_uninterrupted_weights(runs, tmp_path, monkeypatch):
    """The restart refills the kept sequences only: a step whose sequences are kept, or never kept, is
    not made again."""
    from draftlab.train import loop as train

    target = OnlineTarget(load_params(["target"], runs / "params.yaml").target)
    train_ds, eval_ds = (OnlineFeatures(runs / "features-online" / s, 512, target) for s in ("train", "eval"))
    budget = eval_ds.state_bytes() + train_ds.state_bytes() // 2
    straight, *_ = _fit_online(runs, tmp_path, cache=budget, path=tmp_path / "a.pt")
    _fit_online(runs, tmp_path, cache=budget, stop=9, path=tmp_path / "b.pt")  # stopped in epoch 2, after step 8's checkpoint
    resumed, *_ = _fit_online(runs, tmp_path, cache=budget, path=tmp_path / "b.pt")
    for name, w in straight.items():
        assert torch.equal(w, resumed[name]), name
    # Every kept sequence has its states: refilling runs the target for none of the steps.
    made = []
    train_ds.keep_states("cpu", 10)
    train_ds.batch(list(range(10)), "cpu")
    monkeypatch.setattr(train_ds, "batch", lambda rows, device: made.append(rows))
    tp = load_params(["train"], runs / "params.yaml").train
    train.refill_state_cache(train_ds, train.epoch_plans(train_ds, tp, 1)[0], False, "cpu", 1, 0)
    assert made == []
    train_ds.keep_states("cpu", 11)  # sequence 10 kept but not computed: only the step holding it is made again
    train.refill_state_cache(train_ds, train.epoch_plans(train_ds, tp, 1)[0], False, "cpu", 1, 0)
    assert len(made) == len(train.epoch_plans(train_ds, tp, 1)[0]) and [10 in rows for rows in made].count(True) == 1


def _two_tier_budgets(runs):
    """(device bytes, host bytes) that keep the eval split and about a quarter of train's tokens on the
    device and about a third more in host memory: the rest of train is never kept."""
    train_ds, eval_ds = (OnlineFeatures(runs / "features-online" / s, 512, OnlineTarget(None)) for s in ("train", "eval"))
    return eval_ds.state_bytes() + train_ds.state_bytes() // 4, train_ds.state_bytes() // 3


def test_a_state_cache_past_the_device_budget_keeps_the_next_sequences_in_host_memory(runs, monkeypatch):
    """Where the device's budget ends, a host tier takes the sequences after its prefix, in the same
    order, up to HOST_SHARE of the host's available memory: the eval split whole and a prefix of train
    on the device, the next run of train in host memory, the rest never kept. Each tier's tensors hold
    its own sequences' tokens only, and the line names both with their figures."""
    from draftlab.features import online
    from stages.train import state_cache_info

    target = OnlineTarget(None)
    train_ds, eval_ds = splits = [OnlineFeatures(runs / "features-online" / s, 512, target) for s in ("train", "eval")]
    per_token = 4 * 64 * 2  # (k+1) x H x bf16
    lengths = [train_ds.length(i) for i in range(N_TRAIN)]
    need = train_ds.state_bytes() + eval_ds.state_bytes()
    on_device, in_host = _two_tier_budgets(runs)
    free, available = int(on_device / online.STATE_CACHE_SHARE), int(in_host / online.HOST_SHARE)
    monkeypatch.setattr(online, "free_memory", lambda device: free)
    monkeypatch.setattr(online, "host_memory", lambda: available)
    line = online.cache_states(splits, "auto", "cpu")  # a CPU training device: one tier, no second CPU tier on top of it
    assert train_ds.cache.on_host is None and eval_ds.cache.on_host is None and "host memory" not in line
    alone = train_ds.kept_sequences()
    line = online.cache_states(splits, "auto", "cpu", host="cpu")
    k, m = train_ds.kept_sequences() - train_ds.host_sequences(), train_ds.host_sequences()
    assert k == alone and m > 0 and k + m < N_TRAIN  # the device tier as before; the host tier after it
    assert eval_ds.kept_sequences() == N_EVAL and eval_ds.cache.on_host is None and eval_ds.host_sequences() == 0
    assert [train_ds.cache.keeps(i) for i in range(N_TRAIN)] == [True] * (k + m) + [False] * (N_TRAIN - k - m)
    assert [i in train_ds.cache.on_host for i in range(N_TRAIN)] == [False] * k + [True] * m + [False] * (N_TRAIN - k - m)
    dev, host = eval_ds.state_bytes() + sum(lengths[:k]) * per_token, sum(lengths[k : k + m]) * per_token
    assert train_ds.cache.device_nbytes() + eval_ds.cache.device_nbytes() == dev  # each tier sized to its sequences' tokens
    assert train_ds.cache.host_nbytes() == train_ds.cache.on_host.aux.nbytes + train_ds.cache.on_host.final.nbytes == host
    assert dev <= online.STATE_CACHE_SHARE * free < dev + lengths[k] * per_token  # each tier up to the first that would pass it
    assert host <= online.HOST_SHARE * available < host + lengths[k + m] * per_token
    kept = dev + host
    assert line == (f"train: state cache for {k + m} of {N_TRAIN} train sequences ({kept / 2**30:.1f} of {need / 2**30:.1f} GiB; "
                    f"the eval split whole): {dev / 2**30:.1f} GiB on cpu (60% of its {free / 2**30:.1f} GiB free), "
                    f"{host / 2**30:.1f} GiB in host memory (50% of its {available / 2**30:.1f} GiB available); computed by the "
                    "target in the first epoch and read back after it; the target computes the rest every epoch")
    assert state_cache_info(train_ds, eval_ds, "online") == {
        "kept": True, "bytes": need, "kept_bytes": kept, "host_bytes": host, "kept_sequences": {"train": k + m, "eval": N_EVAL},
        "host_sequences": {"train": m, "eval": 0}, "sequences": {"train": N_TRAIN, "eval": N_EVAL}}
    # Room for every state in the two tiers: all kept, no rest to compute.
    monkeypatch.setattr(online, "host_memory", lambda: int(need / online.HOST_SHARE))
    line = online.cache_states(splits, "auto", "cpu", host="cpu")
    assert train_ds.kept_sequences() == N_TRAIN and train_ds.host_sequences() == N_TRAIN - k
    assert line.startswith(f"train: state cache for {N_TRAIN} of {N_TRAIN} train sequences ({need / 2**30:.1f} GiB; the eval "
                           "split whole): ") and "the rest" not in line
    # No room on the device for one sequence: the host tier starts at the eval split's first.
    monkeypatch.setattr(online, "free_memory", lambda device: 1)
    line = online.cache_states(splits, "auto", "cpu", host="cpu")
    assert eval_ds.host_sequences() == N_EVAL and train_ds.host_sequences() == N_TRAIN and train_ds.cache.device_nbytes() == 0
    assert "0.0 GiB on cpu" in line


def test_two_state_cache_tiers_train_as_without_a_cache_and_run_the_target_on_fewer_tokens_than_the_device_tier_alone(runs, tmp_path):
    """Three epochs with a host tier behind the device tier: the target computes the kept sequences once
    and the others every epoch, on fewer tokens than with the device tier alone; the states read back
    from host memory are those a device tier holds, so the weights are those of one tier keeping the
    same sequences, to the bit, and the run learns as without a cache."""
    budgets = _two_tier_budgets(runs)
    two, h_two, ran_two, tokens, (train_kept, eval_kept) = _fit_online(runs, tmp_path, cache=budgets)
    assert train_kept.host_sequences() > 0 and all(train_kept.cache.has(i) for i in range(train_kept.kept_sequences()))
    _, _, ran_device, *_ = _fit_online(runs, tmp_path, cache=budgets[0])  # the device tier alone
    plain, h_plain, ran_plain, *_ = _fit_online(runs, tmp_path, cache=False)
    kept = sum(ds.length(i) for ds in (train_kept, eval_kept) for i in range(len(ds)) if ds.cache.keeps(i))
    assert ran_two == tokens + 2 * (tokens - kept) and ran_two < ran_device < ran_plain
    n = train_kept.kept_sequences(), eval_kept.kept_sequences()
    one_tier, *_ = _fit_online(runs, tmp_path, cache=lambda tr, ev: (tr.keep_states("cpu", n[0]), ev.keep_states("cpu", n[1])),
                               path=tmp_path / "one-tier.pt")
    for name, w in two.items():
        assert torch.equal(w, one_tier[name]), name
        assert torch.allclose(w, plain[name], rtol=5e-2, atol=5e-3), name
    for a, b in zip(h_two, h_plain):
        assert a["eval_loss"] == pytest.approx(b["eval_loss"], rel=2e-2)


def test_a_resumed_run_with_two_state_cache_tiers_gives_the_uninterrupted_weights(runs, tmp_path, monkeypatch):
    """The restart refills both tiers from the steps before the checkpoint, as they first filled them."""
    from draftlab.train import loop as train

    budgets = _two_tier_budgets(runs)
    straight, *_ = _fit_online(runs, tmp_path, cache=budgets, path=tmp_path / "a.pt")
    _fit_online(runs, tmp_path, cache=budgets, stop=9, path=tmp_path / "b.pt")  # stopped in epoch 2, after step 8's checkpoint
    resumed, *_ = _fit_online(runs, tmp_path, cache=budgets, path=tmp_path / "b.pt")
    for name, w in straight.items():
        assert torch.equal(w, resumed[name]), name
    # A sequence of the host tier kept but not computed yet: the step holding it is made again, and only it.
    target = OnlineTarget(load_params(["target"], runs / "params.yaml").target)
    train_ds = OnlineFeatures(runs / "features-online" / "train", 512, target)
    train_ds.keep_states("cpu", 5, host_n=6, host="cpu")
    train_ds.batch(list(range(11)), "cpu")
    made = []
    monkeypatch.setattr(train_ds, "batch", lambda rows, device: made.append(rows))
    tp = load_params(["train"], runs / "params.yaml").train
    plan = train.epoch_plans(train_ds, tp, 1)[0]
    train.refill_state_cache(train_ds, plan, False, "cpu", 1, 0)
    assert made == []
    train_ds.keep_states("cpu", 5, host_n=7, host="cpu")
    train_ds.cache.on_device.kept = [True] * 5
    train_ds.cache.on_host.kept = [True] * 6 + [False]  # sequence 11, in host memory
    train.refill_state_cache(train_ds, plan, False, "cpu", 1, 0)
    assert made == [rows for rows in plan if 11 in rows]


def test_a_batch_from_both_tiers_and_the_target_is_the_batch_without_a_cache(runs):
    """Rows read back from the device tier, rows copied from host memory and rows the target computes
    now, in one batch: each is what a batch without a cache gives for the same rows, to the bit."""
    p = load_params(["target"], runs / "params.yaml")
    target = OnlineTarget(p.target)
    plain = OnlineFeatures(runs / "features-online" / "train", 512, target)
    part = OnlineFeatures(runs / "features-online" / "train", 512, target)
    part.keep_states("cpu", 6, host_n=8, host="cpu")  # 0-5 on the device, 6-13 in host memory, 14 on never kept
    idx = [3, 9, 20, 0, 12]  # device, host, computed, device, host
    first = part.batch(idx, "cpu")
    without = plain.batch(idx, "cpu")
    for name, t in without.items():
        assert torch.equal(first[name], t), name
    assert [part.cache.has(i) for i in idx] == [True, True, False, True, True]
    assert [i in part.cache.on_host for i in idx] == [False, True, False, False, True]
    kept_aux, kept_final = part.cache.on_host.rows(9)  # what the host tier holds: the batch's row, in the storage dtype
    assert torch.equal(kept_aux.float(), first["aux_hidden"][1, : part.length(9)])
    assert torch.equal(kept_final.float(), first["final_hidden"][1, : part.length(9)])
    again = part.batch(idx, "cpu")  # 3, 9, 0, 12 read back; 20 from the target in its own batch
    assert part.target_ran and part.target_lengths == [part.length(20)]
    alone = plain.batch([20], "cpu")
    n = part.length(20)
    for name in ("aux_hidden", "final_hidden"):
        assert torch.equal(again[name][[0, 1, 3, 4]], without[name][[0, 1, 3, 4]]), name
        assert torch.equal(again[name][2, :n], alone[name][0, :n]) and not again[name][2, n:].any(), name
    assert torch.equal(again["input_ids"], without["input_ids"]) and torch.equal(again["loss_mask"], without["loss_mask"])
    part.batch([12, 0, 7], "cpu")  # 7 computed and kept in host memory; then every row read back
    assert part.cache.has(7)
    part.batch([7, 3, 12], "cpu")
    assert not part.target_ran


def test_host_tier_rows_are_copied_in_off_the_training_thread_and_kept_once_there(runs):
    """A batch's host-tier rows are handed to a background copy: the batch returns before they are
    in host memory, a row counts as kept (and is read back) only once copied, and a copy that fails
    raises in the training thread, not silently in the background."""
    import threading

    target = OnlineTarget(load_params(["target"], runs / "params.yaml").target)
    plain = OnlineFeatures(runs / "features-online" / "train", 512, target)
    part = OnlineFeatures(runs / "features-online" / "train", 512, target)
    part.keep_states("cpu", 2, host_n=8, host="cpu")  # 0-1 on the device, 2-9 in host memory
    puts, gate, put = part.cache.host_puts, threading.Event(), part.cache.host_puts.put
    puts.put = lambda i, a, f: (gate.wait(), put(i, a, f))
    first = part.batch([3, 0, 7], "cpu")  # returns while the copy waits at the gate
    assert part.cache.on_host.kept[3 - 2] is False and part.cache.on_host.kept[7 - 2] is False
    gate.set()
    assert part.cache.has(3) and part.cache.has(7) and part.cache.has(0)  # has waits for the row's copy
    again = part.batch([3, 0, 7], "cpu")
    assert not part.target_ran  # all three read back
    want = plain.batch([3, 0, 7], "cpu")
    for name in want:
        assert torch.equal(first[name], want[name]) and torch.equal(again[name], want[name]), name

    def broken(i, a, f):
        raise RuntimeError("host memory gone")
    puts.put = broken
    part.batch([4], "cpu")
    with pytest.raises(RuntimeError, match="host memory gone"):
        part.cache.has(4)
    part.batch([5], "cpu")
    with pytest.raises(RuntimeError, match="host memory gone"):
        puts.wait()


def test_out_of_memory_gives_back_the_device_tier_and_keeps_the_host_tier(runs, capsys):
    """A step short of the device's memory beside the cache: what the device tier holds is counted and
    given back; the host tier takes none of the device's memory and stays."""
    from draftlab.train import loop as train

    target = OnlineTarget(None)
    train_ds, eval_ds = splits = [OnlineFeatures(runs / "features-online" / s, 512, target) for s in ("train", "eval")]
    train_ds.keep_states("cpu", 6, host_n=8, host="cpu")
    eval_ds.keep_states("cpu", 0, host_n=N_EVAL, host="cpu")  # all in host memory
    held = train.held_states(splits)
    assert held == sum(train_ds.length(i) for i in range(6)) * 4 * 64 * 2 < train_ds.cache.nbytes()
    train.give_back_states(splits, held, torch.device("cpu"), 0)
    assert "ran out of memory beside the state cache" in capsys.readouterr().out
    assert train_ds.cache.on_device is None and train_ds.kept_sequences() == 8 and eval_ds.kept_sequences() == N_EVAL
    assert [train_ds.cache.keeps(i) for i in (0, 5, 6, 13, 14)] == [False, False, True, True, False]
    assert train.held_states(splits) == 0  # nothing left on the device: a second shortfall is the run's error
    train_ds.keep_states("cpu", 6)
    train.give_back_states(splits, train.held_states(splits), torch.device("cpu"), 0)
    assert train_ds.cache is None  # a device tier alone: nothing kept after it


def test_host_memory_is_meminfos_available_memory_within_the_cgroups_limits(tmp_path, monkeypatch):
    """The host tier's budget: MemAvailable (not the free pages alone), bounded by what this process's
    cgroup and those above it leave under their limits (a container's), v2 or v1."""
    from draftlab.features import online

    gib = 2**30
    (tmp_path / "meminfo").write_text(f"MemTotal: {128 * 2**20} kB\nMemFree: {4 * 2**20} kB\nMemAvailable: {100 * 2**20} kB\n")
    (tmp_path / "cgroup").write_text("0::/job/step\n")
    fs = tmp_path / "fs"
    (fs / "job" / "step").mkdir(parents=True)
    (fs / "job" / "step" / "memory.max").write_text("max\n")
    (fs / "job" / "step" / "memory.current").write_text(f"{2 * gib}\n")
    (fs / "job" / "memory.max").write_text(f"{64 * gib}\n")
    (fs / "job" / "memory.current").write_text(f"{28 * gib}\n")
    (fs / "job" / "memory.stat").write_text(f"anon {20 * gib}\nfile {8 * gib}\ninactive_file {4 * gib}\n")
    monkeypatch.setattr(online, "MEMINFO", tmp_path / "meminfo")
    monkeypatch.setattr(online, "PROC_CGROUP", tmp_path / "cgroup")
    monkeypatch.setattr(online, "CGROUP", fs)
    # the parent group's limit less its usage (the inactive page cache, reclaimed first, not counted), under the 100 GiB available
    assert online.host_memory() == 40 * gib
    assert online.free_memory("cpu") == 40 * gib
    (fs / "job" / "memory.max").write_text("max\n")
    assert online.host_memory() == 100 * gib  # no limit: MemAvailable, not the 4 GiB free
    (tmp_path / "cgroup").write_text("4:memory:/docker/abc\n0::/\n")  # v1; the container's own group at the mount's root
    (fs / "memory").mkdir()
    (fs / "memory" / "memory.limit_in_bytes").write_text(f"{8 * gib}\n")
    (fs / "memory" / "memory.usage_in_bytes").write_text(f"{gib}\n")
    (fs / "memory" / "memory.stat").write_text("cache 0\ntotal_inactive_file 0\n")
    assert online.host_memory() == 7 * gib


def test_a_step_that_read_its_states_from_the_cache_counts_no_target_forward():
    from draftlab.train.draft import DraftConfig
    from draftlab.train.flops import Meter

    info = {"hidden_size": 64, "intermediate_size": 128, "num_layers": 5, "num_attention_heads": 4, "num_key_value_heads": 2,
            "vocab_size": 320, "max_position_embeddings": 512, "architecture": "LlamaForCausalLM"}
    meters = [Meter(info, DraftConfig.from_target(info, 3, 96), online) for online in (True, True, False)]
    ran, cached, stored = meters
    for m, target_ran in zip(meters, (True, False, True)):
        m.step([30, 20], [40, 38, 36], 1.0, slots=50, target_ran=target_ran)
    assert cached.target == stored.target < ran.target  # the soft labels' head only, as with stored states
    assert cached.draft == ran.draft


def test_a_step_whose_target_ran_on_some_sequences_counts_their_forward_only():
    """A partial state cache: the target runs on the step's rows not kept; their forward is counted,
    the soft labels' head on every token."""
    from draftlab.train.draft import DraftConfig
    from draftlab.train.flops import Meter, target_flops

    info = {"hidden_size": 64, "intermediate_size": 128, "num_layers": 5, "num_attention_heads": 4, "num_key_value_heads": 2,
            "vocab_size": 320, "max_position_embeddings": 512, "architecture": "LlamaForCausalLM"}
    ran, part, cached = (Meter(info, DraftConfig.from_target(info, 3, 96), True) for _ in range(3))
    ran.step([30, 20], [40, 38, 36], 1.0, slots=60)
    part.step([30, 20], [40, 38, 36], 1.0, slots=60, target_lengths=[20])
    cached.step([30, 20], [40, 38, 36], 1.0, slots=60, target_ran=False)
    assert cached.target < part.target < ran.target and part.draft == ran.draft
    forward = target_flops(info, [20], True) - target_flops(info, [20], False)  # the 20-token sequence through the target
    assert part.target - cached.target == pytest.approx(forward)
    assert part.summary(None)["by_states"] is None  # a step the target ran in, for part of it: no cached step


def test_the_rates_of_computed_and_cached_steps_are_reported_apart():
    """With the state cache, the first epoch (the target runs) and the later ones (states read back)
    run at different rates: the summary gives each its own, so a slow first epoch shows."""
    from draftlab.train.draft import DraftConfig
    from draftlab.train.flops import Meter

    info = {"hidden_size": 64, "intermediate_size": 128, "num_layers": 5, "num_attention_heads": 4, "num_key_value_heads": 2,
            "vocab_size": 320, "max_position_embeddings": 512, "architecture": "LlamaForCausalLM"}
    m = Meter(info, DraftConfig.from_target(info, 3, 96), True)
    for target_ran, seconds in ((True, 2.0), (True, 3.0), (False, 1.0), (False, 1.0), (False, 0.5)):
        m.step([30, 20], [40, 38, 36], seconds, slots=50, target_ran=target_ran)
    s = m.summary(None)
    assert s["by_states"] == {"computed": {"steps": 2, "tokens_per_s": 20.0}, "cached": {"steps": 3, "tokens_per_s": 60.0}}
    assert s["tokens_per_s"] == round(250 / 7.5, 1)  # over every step, as before
    plain = Meter(info, DraftConfig.from_target(info, 3, 96), True)
    plain.step([30, 20], [40, 38, 36], 1.0, slots=50)
    assert plain.summary(None)["by_states"] is None  # no step was cached: nothing to tell apart


def test_a_step_out_of_memory_beside_the_state_cache_drops_the_cache_and_the_run_goes_on(runs, tmp_path, monkeypatch, capsys):
    """The cache's 60% share is a rule of thumb: where a training step still runs out of memory beside
    it, the cache is given back and the step runs again, the target computing the states from then on."""
    from draftlab.train import loop as train

    calls, forward = [], train.TTT.forward

    def short_of_memory_once(self, *args, **kw):
        calls.append(1)
        if len(calls) == 4:  # the fourth training step of the first epoch
            raise torch.OutOfMemoryError("CUDA out of memory (stand-in)")
        return forward(self, *args, **kw)

    monkeypatch.setattr(train.TTT, "forward", short_of_memory_once)
    weights, history, ran, tokens, _ = _fit_online(runs, tmp_path, cache=True)
    assert "ran out of memory beside the state cache" in capsys.readouterr().out
    assert len(history) == 3 and all(torch.isfinite(w).all() for w in weights.values())
    assert ran > tokens  # after the drop the target computed states again, as with train.state_cache off
    calls.clear()
    with pytest.raises(torch.OutOfMemoryError):  # with no cache to give back, the error is the run's
        _fit_online(runs, tmp_path, cache=False)


def test_the_allocators_shortfalls_come_from_cudas_memory_stats(monkeypatch):
    """The train manifest's cuda_memory: peaks in GiB and the allocator's retries (each frees its cache and
    synchronizes the GPU: what a state cache filling the memory would cost); None off a GPU."""
    from stages import train as stage

    stats = {"allocated_bytes.all.peak": 3 * 2**30, "reserved_bytes.all.peak": 5.5 * 2**30, "num_alloc_retries": 7, "num_ooms": 0}
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device: stats)
    assert stage.cuda_memory(torch.device("cuda", 0)) == {"peak_allocated_gib": 3.0, "peak_reserved_gib": 5.5, "alloc_retries": 7, "ooms": 0}
    assert stage.cuda_memory(torch.device("cpu")) is None

