import pytest
import torch

from draftlab.errors import UserError
from draftlab.features.dataset import (FeatureDataset, build_draft_vocab, count_tokens, draft_to_target, load_draft_vocab, norm_summary,
                               pack_sequences, read_metadata, save_draft_vocab, shard_name, write_shard)

META = {"physical_layers": [2, 4, 6], "hidden_size": 4, "num_layers": 8, "architecture": "LlamaForCausalLM", "vocab_size": 32}


def seq(n, start):
    return {
        "input_ids": torch.arange(start, start + n),
        "loss_mask": torch.arange(n) >= 2,
        "aux_hidden": torch.randn(n, 12).bfloat16(),
        "final_hidden": torch.randn(n, 4).bfloat16(),
    }


def test_shards_round_trip_sequence_by_sequence(tmp_path):
    seqs = [seq(5, 0), seq(3, 10), seq(7, 20)]
    write_shard(tmp_path / shard_name(0), pack_sequences(seqs[:2]), META)
    write_shard(tmp_path / shard_name(1), pack_sequences(seqs[2:]), META)
    ds = FeatureDataset(tmp_path)
    assert len(ds) == 3 and ds.physical_layers == [2, 4, 6]
    for got, want in zip((ds[i] for i in range(3)), seqs):
        for name in want:
            assert torch.equal(got[name], want[name])
    assert read_metadata(tmp_path / shard_name(0))["architecture"] == "LlamaForCausalLM"
    short = FeatureDataset(tmp_path, max_length=4)
    assert short[2]["input_ids"].tolist() == [20, 21, 22, 23] and short[2]["aux_hidden"].shape == (4, 12)


def test_write_shard_refuses_what_training_could_not_read(tmp_path):
    bad = pack_sequences([seq(5, 0)])
    bad["aux_hidden"] = bad["aux_hidden"][:, :8]  # 2 layers' worth, metadata says 3
    with pytest.raises(ValueError, match="aux_hidden shape"):
        write_shard(tmp_path / shard_name(0), bad, META)
    bad = pack_sequences([seq(5, 0)])
    bad["loss_mask"] = bad["loss_mask"].long()
    with pytest.raises(ValueError, match="loss_mask must be torch.bool"):
        write_shard(tmp_path / shard_name(0), bad, META)
    assert not list(tmp_path.iterdir())


def test_draft_vocab_is_the_most_frequent_assistant_tokens_ties_by_id():
    ids = torch.tensor([5, 5, 5, 9, 9, 2, 2, 7, 1, 1, 1, 1])
    mask = torch.tensor([1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0], dtype=torch.bool)  # token 1 is prompt only
    counts = count_tokens(ids, mask, 12)
    assert counts[1] == 0 and counts[5] == 3
    d2t, t2d = build_draft_vocab(counts, 3)
    # 5 (3x), then 2 and 9 (2x each; tie), 7 (1x) left out; draft ids in ascending target order
    assert draft_to_target(d2t).tolist() == [2, 5, 9]
    assert d2t.tolist() == [2 - 0, 5 - 1, 9 - 2] and d2t.dtype == torch.int64
    assert torch.nonzero(t2d).flatten().tolist() == [2, 5, 9] and t2d.dtype == torch.bool
    assert draft_to_target(build_draft_vocab(counts, 2)[0]).tolist() == [2, 5]  # the 2-9 tie goes to the lower id
    d2t_all, t2d_all = build_draft_vocab(counts, 100)
    assert torch.equal(d2t_all, torch.zeros(12, dtype=torch.int64)) and bool(t2d_all.all())


def test_draft_vocab_round_trip_and_consistency_check(tmp_path):
    d2t, t2d = build_draft_vocab(torch.tensor([0, 4, 1, 9, 3, 3]), 4)
    save_draft_vocab(tmp_path / "draft_vocab.safetensors", d2t, t2d)
    d2t2, t2d2 = load_draft_vocab(tmp_path)
    assert torch.equal(d2t, d2t2) and torch.equal(t2d, t2d2)
    wrong = t2d.clone()
    wrong[0] = True
    with pytest.raises(UserError, match="disagree"):
        save_draft_vocab(tmp_path / "x.safetensors", d2t, wrong)
    with pytest.raises(UserError, match="standardize"):
        load_draft_vocab(tmp_path / "missing")


WRITE_ONE_SHARD = """
import sys, torch
from draftlab.features.dataset import pack_sequences, write_shard
seqs = [{"input_ids": torch.arange(5), "loss_mask": torch.ones(5, dtype=torch.bool),
         "aux_hidden": torch.ones(5, 6).bfloat16(), "final_hidden": torch.zeros(5, 2).bfloat16()}]
meta = {"physical_layers": [1, 2, 3], "hidden_size": 2, "num_layers": 4, "architecture": "LlamaForCausalLM",
        "vocab_size": 16, "row_ids": ["a"], "config_hash": "c" * 64, "dtype": "bfloat16"}
write_shard(sys.argv[1], pack_sequences(seqs), meta)
"""


def test_a_recomputed_shard_has_the_same_bytes(tmp_path):
    """safetensors orders its metadata by a per-process hash; ours are sorted, so DVC sees no change."""
    import subprocess
    import sys

    for name in ("a", "b", "c"):
        subprocess.run([sys.executable, "-c", WRITE_ONE_SHARD, str(tmp_path / name)], check=True)
    blobs = {(tmp_path / n).read_bytes() for n in "abc"}
    assert len(blobs) == 1


def test_canonical_header_keeps_tensors_and_metadata_and_works_in_place(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save, save_file

    from draftlab.fsutil import canonical_safetensors, canonicalize_safetensors_file

    tensors = {"z": torch.arange(7), "a": torch.randn(3, 5).bfloat16(), "m": torch.ones(2, dtype=torch.bool)}
    meta = {f"k{i}": str(i) * i for i in range(9)} | {"unicode": "é"}
    save_file(tensors, str(tmp_path / "f"), metadata=meta)
    canonicalize_safetensors_file(tmp_path / "f")
    assert (tmp_path / "f").read_bytes() == canonical_safetensors(save(tensors, metadata=meta))
    with safe_open(str(tmp_path / "f"), "pt") as f:
        assert f.metadata() == meta and all(torch.equal(f.get_tensor(k), t) for k, t in tensors.items())


def test_standardize_writes_the_physical_layers_into_the_shard_headers_only(tmp_path, monkeypatch):
    """The extract manifest names the layers once; the features hold them in their shard headers
    (ascending), and neither the features manifest nor stats.json repeats them."""
    import json

    from safetensors import safe_open
    from safetensors.torch import save_file

    from draftlab.features.extract import layer_key
    from draftlab.features.dataset import physical_layers_of
    from draftlab.manifest import build_manifest, write_manifest
    from stages.standardize import main

    H, V, L = 4, 32, 8
    target = {"model": "m", "revision": None, "architecture": "LlamaForCausalLM", "num_layers": L, "hidden_size": H,
              "vocab_size": V, "physical_layers": [5, 2]}
    hidden = tmp_path / "hidden"
    manifest = build_manifest("extract", {}, {}, info={"target": target, "chat_template_sha256": "c", "tokenizer_sha256": "t"})
    write_manifest(hidden, manifest)
    g = torch.Generator().manual_seed(0)
    for split in ("train", "eval"):
        T = 6
        tensors = {"input_ids": torch.randint(0, V, (T,), generator=g), "loss_mask": torch.tensor([0, 1, 1, 0, 1, 1], dtype=torch.bool),
                   "seq_offsets": torch.tensor([0, 3, 6]), "final_hidden": torch.randn(T, H, generator=g).bfloat16(),
                   **{layer_key(p): torch.randn(T, H, generator=g).bfloat16() for p in (2, 5)}}
        (hidden / split).mkdir()
        save_file(tensors, str(hidden / split / "shard-00000.safetensors"),
                  metadata={"config_hash": manifest["config_hash"], "row_ids": json.dumps(["a", "b"])})
    (tmp_path / "params.yaml").write_text("standardize: {draft_vocab_size: 16}\n")
    monkeypatch.chdir(tmp_path)
    main(hidden, tmp_path / "features", tmp_path / "standardize.json")

    features = tmp_path / "features"
    assert physical_layers_of(features) == [2, 5] and physical_layers_of(features, "eval") == [2, 5]
    assert read_metadata(features / "train/shard-00000.safetensors")["num_layers"] == L
    info = json.loads((features / "manifest.json").read_text())["info"]
    stats = json.loads((features / "stats.json").read_text())
    assert "physical_layers" not in info and "physical_layers" not in info["target"] and "physical_layers" not in stats
    assert info["target"]["architecture"] == "LlamaForCausalLM" and sorted(stats["norms"]) == ["2", "5", "final"]
    with safe_open(str(hidden / "train/shard-00000.safetensors"), "pt") as f:
        assert stats["norms"]["5"] == norm_summary(f.get_tensor(layer_key(5)).float().norm(dim=-1))
    metrics = json.loads((tmp_path / "standardize.json").read_text())
    assert metrics["settings"]["capture_physical_layers"] == [2, 5]

    # A draft vocab larger than the target's is refused, not clamped without a word.
    (tmp_path / "params.yaml").write_text(f"standardize: {{draft_vocab_size: {V + 1}}}\n")
    with pytest.raises(UserError, match=f"draft_vocab_size {V + 1} exceeds the target's vocabulary of {V}"):
        main(hidden, tmp_path / "features-too-wide", tmp_path / "standardize-too-wide.json")
    assert not (tmp_path / "features-too-wide").exists()


def test_norm_summary_of_one_value_and_of_many():
    one = norm_summary(torch.tensor([3.0]))
    assert one == {"mean": 3.0, "std": 0.0, "p5": 3.0, "p50": 3.0, "p95": 3.0}
    many = norm_summary(torch.arange(300_001, dtype=torch.float32))  # quantiles over a subsample
    assert many["mean"] == pytest.approx(150_000) and many["p50"] == pytest.approx(150_000, rel=1e-3)
    assert set(many) == {"mean", "std", "p5", "p50", "p95"}
