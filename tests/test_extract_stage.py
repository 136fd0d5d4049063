"""The extract stage as users run it: resume per shard, clear errors for bad input."""
import hashlib
import json
import os
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


@pytest.fixture
def project(tmp_path):
    save_micro_model(tmp_path / "micro", arch="llama", num_layers=6)
    synth = tmp_path / "synth"
    synth.mkdir()
    write_rows(synth / "train.jsonl", 12, 20, "a")
    write_rows(synth / "eval.jsonl", 3, 20, "b")
    (synth / "manifest.json").write_text(json.dumps({"config_hash": "0" * 64}))
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["target"]["model"] = "micro"
    params["capture"]["layers"] = [0, 2, 4]
    params["extract"].update(shard_tokens=100, batch_size=4)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    return tmp_path


def set_params(root, section, **kw):
    p = yaml.safe_load((root / "params.yaml").read_text())
    p[section].update(kw)
    (root / "params.yaml").write_text(yaml.safe_dump(p))


def extract(root, out="hidden", nproc=1):
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"] if nproc > 1 else [sys.executable]
    return subprocess.run(launcher + ["-m", "stages.extract", "--synth", "synth", "--out", out], cwd=root,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}, capture_output=True, text=True)


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


def test_interrupted_extraction_resumes_to_the_same_shards(project):
    r = extract(project)
    assert r.returncode == 0, r.stderr
    full = digests(project)
    train = sorted((project / "hidden" / "train").glob("shard-*.safetensors"))
    assert len(train) >= 3  # several shards, so a resume has something to keep
    kept = {p: p.stat().st_mtime_ns for p in train[1:]}
    # An interruption: the first shard never finished (only its temp file exists).
    train[0].unlink()
    (train[0].parent / (train[0].name + ".tmp")).write_bytes(b"torn")
    r = extract(project)
    assert r.returncode == 0, r.stderr
    assert digests(project) == full  # nothing lost, nothing duplicated
    assert {p: p.stat().st_mtime_ns for p in train[1:]} == kept  # finished shards were not recomputed
    manifest = json.loads((project / "hidden" / "manifest.json").read_text())
    assert manifest["info"]["counts"]["train"]["rows"] == 12


def test_changed_capture_layers_recompute_every_shard(project):
    assert extract(project).returncode == 0
    before = digests(project)
    set_params(project, "capture", layers=[1, 2, 4])
    r = extract(project)
    assert r.returncode == 0, r.stderr
    after = digests(project)
    assert after.keys() == before.keys() and all(after[k] != before[k] for k in after)


def test_row_longer_than_max_length_is_named(project):
    set_params(project, "extract", max_length=40)
    r = extract(project)
    assert r.returncode == 2
    assert "row a00000000000000 has" in r.stderr and "extract.max_length" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("layers,says", [([0, 2, 9], "layer 9 is out of range"), ([1, 5], "layer 5 is out of range"),
                                         ("middle", "must be a list of layer numbers or 'default'")])
def test_layers_sglang_cannot_capture_are_refused(project, layers, says):
    set_params(project, "capture", layers=layers)
    r = extract(project)
    assert r.returncode == 2 and says in r.stderr
    assert not (project / "hidden").exists()  # refused before any compute


def test_bad_json_in_answers_names_file_and_line(project):
    with open(project / "synth" / "train.jsonl", "a") as f:
        f.write("{torn line\n")
    r = extract(project)
    assert r.returncode == 2 and "train.jsonl:13: not valid JSON" in r.stderr


def test_two_processes_write_the_shards_one_process_writes(project):
    """torchrun: each process writes every other shard; together they are the single process's
    shards, byte for byte, and one manifest with the same config hash and the summed counts."""
    one, two = extract(project, "one"), extract(project, "two", nproc=2)
    assert one.returncode == 0 and two.returncode == 0, two.stderr[-3000:]
    assert "extract train (rank 0 of 2)" in two.stderr and "extract train (rank 1 of 2)" in two.stderr
    assert len(digests(project, "one")) >= 4 and digests(project, "two") == digests(project, "one")
    for a, b in zip(sorted((project / "one").rglob("*.safetensors")), sorted((project / "two").rglob("*.safetensors"))):
        assert a.read_bytes() == b.read_bytes()
    m1, m2 = (json.loads((project / d / "manifest.json").read_text()) for d in ("one", "two"))
    assert m1["config_hash"] == m2["config_hash"] and m1["info"]["counts"] == m2["info"]["counts"]
    assert m2["info"]["bytes_per_token"] == m1["info"]["bytes_per_token"] and m2["info"]["device"] == "cpu x 2 processes"
