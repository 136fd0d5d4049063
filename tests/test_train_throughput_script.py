"""benchmarks/train_throughput.py runs end to end on a CPU (its tiny shape) and reports what it says."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_benchmark_times_both_batchings_and_packed_batches_pad_less(tmp_path):
    out = tmp_path / "r.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("DRAFTLAB_PEAK_FLOPS", None)
    r = subprocess.run([sys.executable, "benchmarks/train_throughput.py", "--warmup", "1", "--steps", "3", "--out", str(out)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    padded, tokens = json.loads(out.read_text())["results"]
    assert padded["mode"].startswith("padded") and tokens["mode"].startswith("packed")
    assert padded["steps"] == tokens["steps"] == 3 and padded["tokens_per_s"] > 0 and tokens["tokens_per_s"] > 0
    assert tokens["padding_share"] < padded["padding_share"] / 2
    assert padded["mfu"] is None and 0 < padded["target_flop_share"] < 1  # no peak on a CPU; both parts counted
    assert "tok/s" in r.stdout and "FLOPs per real token" in r.stdout


def write_split(root: Path, n: int, vocab: int = 512, physical=(0, 1, 2)) -> Path:
    """A tokens record as the extract stage writes it (online features), for the tiny shape's target."""
    import torch

    from draftlab.features.dataset import write_tokens
    from draftlab.features.extract import TOKENS_FILE

    g = torch.Generator().manual_seed(n)
    lengths = torch.randint(8, 150, (n,), generator=g).tolist()
    root.mkdir(parents=True)
    write_tokens(root / TOKENS_FILE, {"input_ids": torch.randint(0, vocab, (sum(lengths),), generator=g),
                                      "loss_mask": torch.cat([torch.arange(k) >= k // 3 for k in lengths]),
                                      "seq_offsets": torch.tensor([0] + lengths).cumsum(0)},
                 {"physical_layers": list(physical), "hidden_size": 64, "num_layers": 4, "architecture": "LlamaForCausalLM",
                  "vocab_size": vocab, "dtype": "float32"})
    return root


def run(args, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "benchmarks/train_throughput.py", *map(str, args)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def test_a_pipeline_split_is_trained_and_its_eval_split_timed_twice(tmp_path):
    train, ev = write_split(tmp_path / "train", 80), write_split(tmp_path / "eval", 12)
    out = tmp_path / "r.json"
    r = run(["--split", train, "--eval", ev, "--skip-padded", "--warmup", "1", "--steps", "2", "--profile", "--out", out], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"80 sequences of" in r.stdout and str(train) in r.stdout  # the split's own sequences, not the shape's 96
    packed, profiled = json.loads(out.read_text())["results"]
    assert len(packed["eval_s"]) == 2 and all(s > 0 for s in packed["eval_s"])
    assert profiled["mode"] == "profile" and profiled["gpu_busy_share"] is None  # no GPU kernels on a CPU


def test_compare_cache_times_the_packed_mode_again_with_no_target_forward(tmp_path):
    train = write_split(tmp_path / "train", 80)
    out = tmp_path / "r.json"
    r = run(["--split", train, "--skip-padded", "--warmup", "1", "--steps", "2", "--compare-cache", "--profile-filling", "--out", out],
            tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    live, filling, cached, profiled = json.loads(out.read_text())["results"]
    assert profiled["mode"] == "profile, states filling the cache"  # the first epoch's path traced
    assert filling["mode"].endswith("states filling the cache") and cached["mode"].endswith("states cached")
    assert live["tokens"] == filling["tokens"] == cached["tokens"]  # the same steps
    assert filling["target_flops_per_token"] == live["target_flops_per_token"]  # filling: the target runs, as epoch 1
    assert cached["target_flops_per_token"] < live["target_flops_per_token"]  # the soft labels' head only


def test_a_split_of_another_target_is_refused_naming_what_does_not_fit(tmp_path):
    layers = run(["--split", write_split(tmp_path / "a", 20, physical=(1, 2, 9))], tmp_path)
    assert layers.returncode != 0 and "physical layers [1, 2, 9]" in layers.stderr and "4 layers" in layers.stderr
    vocab = run(["--split", write_split(tmp_path / "b", 20, vocab=4000)], tmp_path)
    assert vocab.returncode != 0 and "outside the shape's vocabulary of 512" in vocab.stderr


def test_compare_target_compiles_every_layer_with_one_graph_and_gives_the_eager_states_back():
    """--compare-target's target: the captured states equal the eager ones up to rounding, the layers
    share one graph per masking (padded batches and unpadded ones), and the next mode gets the eager
    layers back."""
    import torch
    import torch._dynamo
    import torch._dynamo.utils as dynamo_utils

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import train_throughput

    from draftlab.features import extract
    from tests.support.micro import make_micro_model

    torch._dynamo.reset()
    model = make_micro_model("llama", num_layers=4)
    padded = (torch.randint(5, 200, (2, 11)), torch.ones(2, 11, dtype=torch.long))
    padded[1][1, 8:] = 0
    whole = (torch.randint(5, 200, (3, 17)), torch.ones(3, 17, dtype=torch.long))
    eager = [extract.capture(model, ids, att, [1, 2, 4]) for ids, att in (padded, whole)]
    before = dynamo_utils.counters["stats"]["unique_graphs"]
    with train_throughput.target_layers_compiled(model, True):
        train_throughput.compile_layers(model)  # a second call compiles nothing again
        for (ids, att), (aux_ref, final_ref) in zip((padded, whole), eager):
            aux, final = extract.capture(model, ids, att, [1, 2, 4])
            for i in aux:
                torch.testing.assert_close(aux[i], aux_ref[i], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(final, final_ref, rtol=1e-5, atol=1e-5)
    assert dynamo_utils.counters["stats"]["unique_graphs"] - before <= 2  # not one per layer (4 layers, 2 batches)
    assert not any("forward" in layer.__dict__ for layer in model.model.layers)
