"""Every stage checks its upstream's outputs against the upstream manifest before computing, and
names the file that is missing, cut, truncated or changed (draftlab.manifest.verify_outputs)."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
import torch
from safetensors.torch import save_file

from draftlab.errors import UserError
from draftlab.features.extract import layer_key
from draftlab.manifest import build_manifest, dir_hash, output_files, read_verified, write_manifest

ROOT = Path(__file__).resolve().parents[1]
H, V, L = 4, 32, 8


def make_hidden(root: Path, legacy: bool = False) -> Path:
    """An extract output: 2 train shards, 1 eval shard, and the manifest extract writes."""
    hidden = root / "hidden"
    target = {"model": "m", "revision": None, "architecture": "LlamaForCausalLM", "num_layers": L, "hidden_size": H,
              "vocab_size": V, "physical_layers": [2, 5]}
    manifest = build_manifest("extract", {}, {}, info={"target": target, "chat_template_sha256": "c", "tokenizer_sha256": "t"})
    g = torch.Generator().manual_seed(0)
    for split, n in (("train", 2), ("eval", 1)):
        (hidden / split).mkdir(parents=True)
        for s in range(n):
            T = 6
            tensors = {"input_ids": torch.randint(0, V, (T,), generator=g), "loss_mask": torch.tensor([0, 1, 1, 0, 1, 1], dtype=torch.bool),
                       "seq_offsets": torch.tensor([0, 3, 6]), "final_hidden": torch.randn(T, H, generator=g).bfloat16(),
                       **{layer_key(p): torch.randn(T, H, generator=g).bfloat16() for p in (2, 5)}}
            save_file(tensors, str(hidden / split / f"shard-{s:05d}.safetensors"),
                      metadata={"config_hash": manifest["config_hash"], "row_ids": json.dumps([f"{split}{s}a", f"{split}{s}b"])})
    if legacy:  # an extract manifest of before info.files: per-split counts only
        manifest["info"]["counts"] = {"train": {"rows": 4, "shards": 2, "tokens": 12}, "eval": {"rows": 2, "shards": 1, "tokens": 6}}
    else:
        manifest["info"]["files"] = output_files(hidden)
    write_manifest(hidden, manifest)
    return hidden


@pytest.fixture
def project(tmp_path, monkeypatch):
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["standardize"]["draft_vocab_size"] = 16  # the shards' vocabulary has 32 tokens
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def standardize(root: Path, hidden: Path):
    from stages.standardize import main

    main(hidden, root / "features", root / "standardize.json")


@pytest.mark.parametrize("legacy", [False, True])
def test_standardize_names_a_missing_shard_and_writes_nothing(project, legacy):
    hidden = make_hidden(project, legacy)
    (hidden / "train/shard-00001.safetensors").unlink()
    with pytest.raises(UserError, match=r"(shard-00001.safetensors: missing|1 shards).*dvc repro extract"):
        standardize(project, hidden)
    assert not (project / "features").exists() and not (project / "standardize.json").exists()


def test_standardize_names_a_truncated_shard_and_writes_nothing(project):
    hidden = make_hidden(project)
    shard = hidden / "eval/shard-00000.safetensors"
    shard.write_bytes(shard.read_bytes()[:-40])
    with pytest.raises(UserError, match=r"eval/shard-00000.safetensors: truncated.*dvc repro extract"):
        standardize(project, hidden)
    shard.write_bytes(b"\x05")  # not even a header
    with pytest.raises(UserError, match="not a readable safetensors file"):
        standardize(project, hidden)
    assert not (project / "features").exists()


def test_standardize_run_directly_exits_non_zero_with_the_reason(project):
    hidden = make_hidden(project)
    (hidden / "train/shard-00000.safetensors").unlink()
    r = subprocess.run([sys.executable, "-m", "stages.standardize", "--hidden", "hidden", "--out", "features", "--metrics", "s.json"],
                       cwd=project, env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}, capture_output=True, text=True)
    assert r.returncode != 0 and "shard-00000.safetensors: missing" in r.stderr and "Traceback" not in r.stderr
    assert not (project / "features").exists()


def test_train_and_export_name_a_features_shard_gone_or_changed(project):
    from stages.export import main as export
    from stages.train import main as train

    standardize(project, make_hidden(project))
    feat = project / "features"
    assert sorted(json.loads((feat / "manifest.json").read_text())["info"]["files"]) == [
        "draft_vocab.safetensors", "eval/shard-00000.safetensors", "train/shard-00000.safetensors", "train/shard-00001.safetensors"]
    read_verified(feat)  # clean
    (feat / "train/shard-00001.safetensors").unlink()
    for run in (lambda: train(feat, project / "ckpt", project / "reports", project / "resume"),
                lambda: export(project / "ckpt", feat, project / "draft", project / "export.json")):
        with pytest.raises(UserError, match=r"train/shard-00001.safetensors: missing.*dvc repro standardize"):
            run()
    shutil.copy(feat / "train/shard-00000.safetensors", feat / "train/shard-00001.safetensors")  # a foreign stand-in
    with pytest.raises(UserError, match=r"shard-00001.safetensors: .*(bytes|tokens|differs)"):
        train(feat, project / "ckpt", project / "reports", project / "resume")
    assert not any((project / d).exists() for d in ("ckpt", "reports", "draft", "export.json"))


def edit_manifest(out: Path, edit) -> None:
    path = out / "manifest.json"
    m = json.loads(path.read_text())
    edit(m)
    path.write_text(json.dumps(m))


@pytest.mark.parametrize("edit, both_sides", [
    (lambda t: t.update(physical_layers=[2, 3]), r"says physical layers \[2, 3\].*shard-00000.safetensors holds the states of layers \[2, 5\]"),
    (lambda t: t.update(physical_layers=[2]), r"says physical layers \[2\].*holds the states of layers \[2, 5\]"),
    (lambda t: t.update(hidden_size=8), r"says hidden_size 8 \(info.target\), but .*shard-00000.safetensors holds states 4 wide"),
    (lambda t: t.update(vocab_size=20), r"says vocab_size 20 \(info.target\), but .*shard-00000.safetensors holds token id \d+"),
    (lambda t: t.pop("physical_layers"), r"info.target lacks physical_layers"),
])
def test_standardize_names_both_sides_of_a_manifest_that_disagrees_with_its_shards(project, edit, both_sides):
    """A hand-edited extract manifest gave KeyError: 'hidden.3'; now the manifest's claim and what the shard holds."""
    hidden = make_hidden(project)
    edit_manifest(hidden, lambda m: edit(m["info"]["target"]))
    with pytest.raises(UserError, match=both_sides + r".*dvc repro -f extract"):
        standardize(project, hidden)
    assert not (project / "standardize.json").exists()


def test_standardize_names_a_shard_whose_header_lists_other_layers(project):
    """The manifest may name a subset of the layers a shard holds (its keys are there): the shard's
    own header says which it was written with."""
    hidden = make_hidden(project)
    shard = hidden / "train/shard-00000.safetensors"
    from safetensors import safe_open
    with safe_open(str(shard), "pt") as f:
        tensors, meta = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
    save_file({**tensors, layer_key(7): tensors[layer_key(5)].clone()}, str(shard), metadata={**meta, "physical_layers": "[2, 5, 7]"})
    edit_manifest(hidden, lambda m: m["info"].update(files=output_files(hidden)))
    with pytest.raises(UserError, match=r"says physical layers \[2, 5\].*its header: physical_layers \[2, 5, 7\]"):
        standardize(project, hidden)


@pytest.mark.parametrize("content, why", [("[1, 2]", "a JSON list, not a manifest object"), ("{}", "no config_hash string"),
                                          ('{"config_hash": "x", "info": []}', "info is a JSON list, not an object"),
                                          ("\ufeff{", "corrupt manifest")])
def test_a_manifest_of_another_shape_is_named(project, content, why):
    hidden = make_hidden(project)
    (hidden / "manifest.json").write_text(content)
    with pytest.raises(UserError, match=why + r".*re-run the stage that writes"):
        standardize(project, hidden)


def test_train_and_export_name_both_sides_of_a_features_manifest_edit(project):
    from stages.export import main as export
    from stages.train import main as train

    standardize(project, make_hidden(project))
    feat = project / "features"
    edit_manifest(feat, lambda m: m["info"]["target"].update(hidden_size=8))
    for run in (lambda: train(feat, project / "ckpt", project / "reports", project / "resume"),
                lambda: export(project / "ckpt", feat, project / "draft", project / "export.json")):
        with pytest.raises(UserError, match=r"features/manifest.json says hidden_size 8 \(info.target\), but .*shard-00000"
                                            r".safetensors records 4"):
            run()


def write_synth(root: Path, files: bool) -> Path:
    synth = root / "synth"
    synth.mkdir()
    for split, n in (("train", 5), ("eval", 2)):
        rows = [{"id": f"{split}{i}", "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]} for i in range(n)]
        (synth / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    inputs = {} if files else {"outputs_sha256": dir_hash(synth)}
    write_manifest(synth, build_manifest("synthesize", {}, inputs, info={"files": output_files(synth)} if files else {}))
    return synth


@pytest.mark.parametrize("files", [True, False])
def test_extract_names_a_cut_answer_file_before_loading_the_target(project, files):
    from stages.extract import main

    synth = write_synth(project, files)
    read_verified(synth)  # clean
    lines = (synth / "train.jsonl").read_text().splitlines(keepends=True)
    (synth / "train.jsonl").write_text("".join(lines[:3]))  # cut at a line boundary: still valid JSON lines
    want = r"train.jsonl: 3 rows, but .* records 5" if files else r"synth: its files differ .*outputs_sha256"
    with pytest.raises(UserError, match=want + r".*dvc repro synthesize"):
        main(synth, project / "hidden")  # params.yaml's target is never loaded: the check comes first
    assert not (project / "hidden").exists()
