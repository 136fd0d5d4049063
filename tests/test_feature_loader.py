"""FeatureDataset.batch (preadv into a preallocated batch, prefetch) gives exactly the batches a
straightforward reader gives: safetensors' own load_file, sliced, padded and stacked by hand."""
import pickle

import pytest
import torch
from safetensors.torch import load_file

from draftlab.features.dataset import FeatureDataset, collate, pack_sequences, shard_name, write_shard
from draftlab.train.batches import epoch_batches

H, K = 8, 3
META = {"physical_layers": [1, 2, 3], "hidden_size": H, "num_layers": 4, "architecture": "LlamaForCausalLM", "vocab_size": 50}


def row(n, g, dtype=torch.bfloat16):
    return {"input_ids": torch.randint(1, 50, (n,), generator=g), "loss_mask": torch.rand(n, generator=g) > 0.4,
            "aux_hidden": torch.randn(n, K * H, generator=g).to(dtype), "final_hidden": torch.randn(n, H, generator=g).to(dtype)}


@pytest.fixture
def split(tmp_path):
    """Shards of 4, 1 (a single-row shard), 5 and 3 rows of lengths 1..12."""
    g = torch.Generator().manual_seed(0)
    for s, n_rows in enumerate((4, 1, 5, 3)):
        rows = [row(int(torch.randint(1, 13, (1,), generator=g)), g) for _ in range(n_rows)]
        write_shard(tmp_path / shard_name(s), pack_sequences(rows), META)
    return tmp_path


def reference_rows(split_dir, max_length=None):
    """Every row of the split in shard order, read with safetensors.load_file."""
    out = []
    for path in sorted(split_dir.glob("shard-*.safetensors")):
        t = load_file(str(path))
        off = t["seq_offsets"].tolist()
        for a, b in zip(off[:-1], off[1:]):
            if b > a:
                b = min(b, a + max_length) if max_length else b
                out.append({k: t[k][a:b] for k in ("input_ids", "loss_mask", "aux_hidden", "final_hidden")})
    return out


def reference_batch(rows, indices):
    T = max(len(rows[i]["input_ids"]) for i in indices)
    out = {}
    for name, dtype in (("input_ids", torch.int64), ("loss_mask", torch.bool), ("aux_hidden", torch.float32), ("final_hidden", torch.float32)):
        shape = rows[indices[0]][name].shape[1:]
        x = torch.zeros((len(indices), T, *shape), dtype=dtype)
        for j, i in enumerate(indices):
            r = rows[i][name]
            x[j, : len(r)] = r.to(dtype)
        out[name] = x
    return out


def assert_same(got, want):
    assert set(got) == set(want)
    for name in want:
        assert got[name].dtype == want[name].dtype and got[name].shape == want[name].shape, name
        assert torch.equal(got[name], want[name]), name


@pytest.mark.parametrize("max_length", [None, 5])
def test_batches_of_an_epoch_equal_the_reference_reader(split, max_length):
    ds = FeatureDataset(split, max_length)
    rows = reference_rows(split, max_length)
    assert len(ds) == len(rows) == 13
    for epoch in range(2):  # fit's order: shuffled per (seed, epoch); batches cross shard boundaries
        batches = epoch_batches(len(ds), 4, seed=3, epoch=epoch)
        for b, idx in enumerate(batches):
            got = ds.batch(idx, "cpu")
            if b + 1 < len(batches):
                ds.prefetch(batches[b + 1], "cpu")  # as fit does
            assert_same(got, reference_batch(rows, idx))
            assert_same(got, collate([ds[i] for i in idx], "cpu"))  # the item path and collate agree too


def test_edges_first_last_row_of_a_shard_and_a_single_row_shard(split):
    ds = FeatureDataset(split)
    rows = reference_rows(split)
    # shard 0: rows 0-3, shard 1: row 4 (single), shard 2: rows 5-9, shard 3: rows 10-12
    for idx in ([0], [3], [4], [5], [9], [12], [3, 4, 5], [12, 0], [4, 4], list(range(13))):
        assert_same(ds.batch(idx, "cpu"), reference_batch(rows, idx))


def test_prefetch_of_other_rows_is_dropped(split):
    ds = FeatureDataset(split)
    rows = reference_rows(split)
    ds.prefetch([1, 2], "cpu")
    assert_same(ds.batch([7, 8], "cpu"), reference_batch(rows, [7, 8]))  # not the prefetched rows
    ds.prefetch([1, 2], "cpu")
    ds.prefetch([10, 11], "cpu")  # a second prefetch replaces the first
    assert_same(ds.batch([10, 11], "cpu"), reference_batch(rows, [10, 11]))
    ds.prefetch([3, 4], "cpu")
    assert_same(ds.batch([3, 4], "cpu"), reference_batch(rows, [3, 4]))  # taken: rows that span two shards
    assert_same(ds.batch([1, 2], "cpu"), reference_batch(rows, [1, 2]))  # nothing read ahead: read now


def test_pickled_dataset_reads_the_same(split):
    ds = FeatureDataset(split)
    ds.batch([0, 6], "cpu")  # open files and threads must not travel
    ds.prefetch([1, 2], "cpu")
    copy = pickle.loads(pickle.dumps(ds))
    assert_same(copy.batch([2, 11, 4], "cpu"), reference_batch(reference_rows(split), [2, 11, 4]))


def test_shards_of_different_state_dtypes_still_batch(tmp_path):
    g = torch.Generator().manual_seed(1)
    write_shard(tmp_path / shard_name(0), pack_sequences([row(3, g), row(6, g)]), META)
    write_shard(tmp_path / shard_name(1), pack_sequences([row(4, g, torch.float32)]), META)
    ds = FeatureDataset(tmp_path)
    rows = reference_rows(tmp_path)
    assert_same(ds.batch([2, 0, 1], "cpu"), reference_batch(rows, [2, 0, 1]))
    assert_same(ds.batch([0, 1], "cpu"), reference_batch(rows, [0, 1]))
