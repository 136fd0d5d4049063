"""The extract stage as users run it: resume per shard, clear errors for bad input."""
import contextlib
import hashlib
import io
import json
import os
import runpy
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors import safe_open

from tests.support.micro import save_micro_model

ROOT = Path(__file__).resolve().parents[1]


def write_rows(path: Path, n: int, answer_len: int, prefix: str):
    rows = [{"id": f"{prefix}{i:014d}", "messages": [{"role": "user", "content": f"question {i}?"},
                                                    {"role": "assistant", "content": "<think>\nok\n</think>\n" + "x" * (answer_len + i)}]}
            for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.fixture(scope="module")
def extracted(tmp_path_factory):
    """The project every test starts from, and its hidden states as one `python -m stages.extract`
    process writes them (hidden/), with their digests."""
    root = tmp_path_factory.mktemp("extract")
    save_micro_model(root / "micro", arch="llama", num_layers=6)
    synth = root / "synth"
    synth.mkdir()
    write_rows(synth / "train.jsonl", 12, 20, "a")
    write_rows(synth / "eval.jsonl", 3, 20, "b")
    (synth / "manifest.json").write_text(json.dumps({"config_hash": "0" * 64}))
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["target"]["model"] = "micro"
    params["capture"]["layers"] = [0, 2, 4]
    params["extract"].update(shard_tokens=100, batch_size=4)
    (root / "params.yaml").write_text(yaml.safe_dump(params))
    r = extract(root)
    assert r.returncode == 0, r.stderr
    return root, digests(root)


@pytest.fixture
def project(extracted, tmp_path):
    """A fresh copy of the project, without the extracted states."""
    root = tmp_path / "project"
    shutil.copytree(extracted[0], root, ignore=lambda d, names: ["hidden"] if Path(d) == extracted[0] else [])
    return root


@pytest.fixture
def extracted_project(extracted, tmp_path):
    """A fresh copy of the project with hidden/ as one process extracted it (file times kept)."""
    root = tmp_path / "project"
    shutil.copytree(extracted[0], root)
    return root


def set_params(root, section, **kw):
    p = yaml.safe_load((root / "params.yaml").read_text())
    p[section].update(kw)
    (root / "params.yaml").write_text(yaml.safe_dump(p))


def extract(root, out="hidden", nproc=1):
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"] if nproc > 1 else [sys.executable]
    return subprocess.run(launcher + ["-m", "stages.extract", "--synth", "synth", "--out", out], cwd=root,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}, capture_output=True, text=True)


def extract_here(root, monkeypatch, out="hidden") -> subprocess.CompletedProcess:
    """`python -m stages.extract` run in this process (the same __main__, argv and working
    directory; no new interpreter to start): its exit status and what it wrote to stderr."""
    argv = ["stages.extract", "--synth", "synth", "--out", out]
    monkeypatch.chdir(root)
    monkeypatch.setattr(sys, "argv", list(argv))
    err, rc = io.StringIO(), 0
    with contextlib.redirect_stderr(err):
        try:
            runpy.run_module("stages.extract", run_name="__main__", alter_sys=True)
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return subprocess.CompletedProcess(argv, rc, "", err.getvalue())


def digest(path: Path) -> str:
    """Hash of a shard's tensors and metadata (safetensors writes header keys in no fixed order)."""
    h = hashlib.sha256()
    with safe_open(str(path), "pt") as f:
        h.update(json.dumps(f.metadata(), sort_keys=True).encode())
        for k in sorted(f.keys()):
            t = f.get_tensor(k)
            h.update(k.encode() + str(t.dtype).encode() + t.view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def digests(root, out="hidden") -> dict:
    return {p.relative_to(root / out).as_posix(): digest(p) for p in sorted((root / out).rglob("shard-*.safetensors"))}


def test_interrupted_extraction_resumes_to_the_same_shards(extracted, extracted_project, monkeypatch):
    project, full = extracted_project, extracted[1]
    assert digests(project) == full
    train = sorted((project / "hidden" / "train").glob("shard-*.safetensors"))
    assert len(train) >= 3  # several shards, so a resume has something to keep
    kept = {p: p.stat().st_mtime_ns for p in train[1:]}
    # An interruption: the first shard never finished (only its temp file exists).
    train[0].unlink()
    (train[0].parent / (train[0].name + ".tmp")).write_bytes(b"torn")
    r = extract_here(project, monkeypatch)
    assert r.returncode == 0, r.stderr
    assert digests(project) == full  # nothing lost, nothing duplicated
    assert {p: p.stat().st_mtime_ns for p in train[1:]} == kept  # finished shards were not recomputed
    manifest = json.loads((project / "hidden" / "manifest.json").read_text())
    assert manifest["info"]["counts"]["train"]["rows"] == 12


def test_changed_capture_layers_recompute_every_shard(extracted, extracted_project, monkeypatch):
    project, before = extracted_project, extracted[1]
    set_params(project, "capture", layers=[1, 2, 4])
    r = extract_here(project, monkeypatch)
    assert r.returncode == 0, r.stderr
    after = digests(project)
    assert after.keys() == before.keys() and all(after[k] != before[k] for k in after)


def test_row_longer_than_max_length_is_named(project, monkeypatch):
    set_params(project, "extract", max_length=40)
    r = extract_here(project, monkeypatch)
    assert r.returncode == 2
    assert "row a00000000000000 has" in r.stderr and "extract.max_length" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("layers,says", [([0, 2, 9], "layer 9 is out of range"), ([1, 5], "layer 5 is out of range"),
                                         ("middle", "must be a list of decoder layer numbers")])
def test_layers_sglang_cannot_capture_are_refused(project, monkeypatch, layers, says):
    set_params(project, "capture", layers=layers)
    r = extract_here(project, monkeypatch)
    assert r.returncode == 2 and says in r.stderr
    assert not (project / "hidden").exists()  # refused before any compute


def test_bad_json_in_answers_names_file_and_line(project, monkeypatch):
    with open(project / "synth" / "train.jsonl", "a") as f:
        f.write("{torn line\n")
    r = extract_here(project, monkeypatch)
    assert r.returncode == 2 and "train.jsonl:13: not valid JSON" in r.stderr


def test_two_processes_write_the_shards_one_process_writes(extracted, extracted_project):
    """torchrun: each process writes every other shard; together they are the single process's
    shards (hidden/, written by `python -m stages.extract`), byte for byte, and one manifest with
    the same config hash and the summed counts."""
    project = extracted_project
    two = extract(project, "two", nproc=2)
    assert two.returncode == 0, two.stderr[-3000:]
    assert "extract train (rank 0 of 2)" in two.stderr and "extract train (rank 1 of 2)" in two.stderr
    assert len(extracted[1]) >= 4 and digests(project, "two") == digests(project, "hidden") == extracted[1]
    for a, b in zip(sorted((project / "hidden").rglob("*.safetensors")), sorted((project / "two").rglob("*.safetensors"))):
        assert a.read_bytes() == b.read_bytes()
    m1, m2 = (json.loads((project / d / "manifest.json").read_text()) for d in ("hidden", "two"))
    assert m1["config_hash"] == m2["config_hash"] and m1["info"]["counts"] == m2["info"]["counts"]
    assert m2["info"]["bytes_per_token"] == m1["info"]["bytes_per_token"] and m2["info"]["device"] == "cpu x 2 processes"


def shard_masks(out: Path, split: str) -> list[list[bool]]:
    """Every sequence's loss mask in the split's shards, in shard order."""
    masks = []
    for shard in sorted((out / split).glob("shard-*.safetensors")):
        with safe_open(str(shard), "pt") as f:
            offsets, mask = f.get_tensor("seq_offsets").tolist(), f.get_tensor("loss_mask").tolist()
        masks += [mask[a:b] for a, b in zip(offsets, offsets[1:])]
    return masks


def test_loop_tokens_skip_takes_the_train_splits_loops_off_the_loss_and_keeps_the_evals(extracted, project):
    """Each fixture answer ends in 20+i x's: its 9th x on closes an 8-gram already seen, so with
    extract.loop_tokens skip the train split learns 12+i fewer tokens per row, the eval split the same."""
    learned = {s: shard_masks(extracted[0] / "hidden", s) for s in ("train", "eval")}
    set_params(project, "extract", loop_tokens="skip")
    r = extract(project)
    assert r.returncode == 0, r.stderr
    skipped = {s: shard_masks(project / "hidden", s) for s in ("train", "eval")}
    assert skipped["eval"] == learned["eval"]
    lost = sorted(sum(a) - sum(b) for a, b in zip(learned["train"], skipped["train"]))
    assert lost == [12 + i for i in range(12)]
    assert all(not b or a for a, b in zip(sum(learned["train"], []), sum(skipped["train"], [])))  # only ever taken off
    counts = json.loads((project / "hidden" / "manifest.json").read_text())["info"]["counts"]
    assert counts["train"]["loop_tokens"] == sum(12 + i for i in range(12)) and counts["eval"]["loop_tokens"] == 12 + 13 + 14
    assert counts["train"]["loop_tokens_learned"] == 0 and "loop_tokens_learned" not in counts["eval"]
    assert "the train split's are off the loss" in r.stdout
