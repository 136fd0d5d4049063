"""tools/specforge_offline.py: our stored features in SpecForge's offline format, row for row."""
import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
import yaml

from draftlab.errors import UserError
from draftlab.features.dataset import FeatureDataset, load_draft_vocab
from tests.tiny_features import make_features

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("specforge_offline", ROOT / "tools" / "specforge_offline.py")
tool = importlib.util.module_from_spec(spec)
sys.modules["specforge_offline"] = tool
spec.loader.exec_module(tool)


def draft_dir(root: Path, draft_vocab: int, ids=(0, 1, 2)) -> Path:
    d = root / "draft"
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": draft_vocab,
                                               "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(ids)}}))
    return d


def test_every_sequence_becomes_one_specforge_file_with_our_rows(tmp_path):
    feat, target, _ = make_features(tmp_path, n_train=5, n_eval=3, draft_vocab_size=64)
    out = tmp_path / "sf"
    got = tool.main(["--features", str(feat), "--draft", str(draft_dir(tmp_path, 64)), "--target", str(target),
                     "--out", str(out), "--epochs", "3", "--batch-size", "4", "--ttt-length", "5"])
    for split, n in (("train", 5), ("eval", 3)):
        files = sorted((out / "hidden_states" / split).glob("*.ckpt"))
        assert len(files) == n
        ours = FeatureDataset(feat / split)
        for i, path in enumerate(files):
            s = torch.load(path, weights_only=True)
            assert set(s) == {"input_ids", "loss_mask", "hidden_state", "aux_hidden_state"}
            assert torch.equal(s["input_ids"], ours[i]["input_ids"]) and s["loss_mask"].dtype == torch.int64
            assert torch.equal(s["loss_mask"].bool(), ours[i]["loss_mask"])
            assert s["hidden_state"].shape == (1, *ours[i]["final_hidden"].shape) and s["hidden_state"].dtype == torch.bfloat16
            assert torch.equal(s["aux_hidden_state"][0].float(), ours[i]["aux_hidden"].to(torch.bfloat16).float())
    assert got["tokens"]["train"] == sum(len(FeatureDataset(feat / "train")[i]["input_ids"]) for i in range(5))
    mapping = torch.load(out / "vocab_mapping.pt", weights_only=True)
    d2t, t2d = load_draft_vocab(feat)
    assert torch.equal(mapping["d2t"], d2t) and torch.equal(mapping["t2d"], t2d)  # both drafts predict the same tokens
    run = yaml.safe_load((out / "run.yaml").read_text())
    assert run["model"]["aux_hidden_state_layer_ids"] == [0, 1, 2]
    assert run["training"] == {"num_epochs": 3, "batch_size": 4, "learning_rate": 1e-4, "ttt_length": 5,
                               "eval_interval": 2}  # 5 sequences, 4 a step: the eval split once per epoch
    assert Path(run["data"]["hidden_states_path"]) == out / "hidden_states" / "train"


def test_what_cannot_be_compared_is_refused_with_the_fix(tmp_path):
    feat, target, _ = make_features(tmp_path, n_train=2, n_eval=1, draft_vocab_size=64)
    args = ["--features", str(feat), "--target", str(target), "--out", str(tmp_path / "sf")]
    with pytest.raises(UserError, match="different runs"):
        tool.main(args + ["--draft", str(draft_dir(tmp_path / "a", 32))])
    with pytest.raises(UserError, match="eagle_aux_hidden_state_layer_ids"):
        tool.main(args + ["--draft", str(draft_dir(tmp_path / "b", 64, ids=()))])
    online = tmp_path / "online"
    (online / "train").mkdir(parents=True)
    (online / "train" / "tokens.safetensors").write_bytes(b"")
    with pytest.raises(UserError, match="train.features=offline"):
        tool.main(["--features", str(online), "--target", str(target), "--out", str(tmp_path / "sf"),
                   "--draft", str(draft_dir(tmp_path / "c", 64))])
