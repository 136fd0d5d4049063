#!/usr/bin/env python3
"""Our stored features as SpecForge's offline training input, with its run config: the peer
trainer on exactly the states, loss mask and draft vocabulary that our train stage reads.

    python tools/specforge_offline.py --features data/features --draft models/draft \\
        --target models/tiny-target --out runs/specforge --epochs 5 --batch-size 16 --ttt-length 5
    specforge train --config runs/specforge/run.yaml
    specforge export --to sglang --checkpoint runs/specforge/output \\
        --draft-config runs/specforge/draft_config.json --vocab-mapping runs/specforge/vocab_mapping.pt \\
        --output-dir runs/specforge/draft

SpecForge 0.2.0 (it pins torch 2.11, transformers 5.8.1 and sglang 0.5.14) trains offline from a
directory of files, one per sequence, each a torch.save of
  input_ids         int64 [L]
  loss_mask         int64 [L]           1 = an assistant token (ours, as stored)
  hidden_state      bf16  [1, L, H]     the target's final state after its norm (our final_hidden)
  aux_hidden_state  bf16  [1, L, k*H]   the captured layers, ascending (our aux_hidden)
which is what its reader (`runtime/data_plane/offline_reader.py`) and `normalize_offline_sample`
take. Its own data path is not used, because it needs more than a GPU box has: it renders
conversations through its chat-template registry, and captures online through SGLang patched
with its capture patch, plus Mooncake (tools/specforge_data.py writes our conversations for that
path where it runs). Written here:
  OUT/hidden_states/{train,eval}/NNNNNN.ckpt   one per sequence, in our shard order
  OUT/draft_config.json   the exported draft's config.json: the same draft size, capture ids and
                          draft vocab size (SpecForge's export writes its config from it)
  OUT/vocab_mapping.pt    {"d2t", "t2d"}: our draft vocabulary, so that both drafts predict the same tokens
  OUT/run.yaml            model / data / training / output_dir for `specforge train --config`
Needs train.features offline: online features store no states (re-run extract with
`-S train.features=offline`).
"""
from __future__ import annotations

import argparse
import io
import json
import sys
from pathlib import Path

import torch
import yaml
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from draftlab.errors import UserError  # noqa: E402
from draftlab.features.dataset import FeatureDataset, load_draft_vocab  # noqa: E402
from draftlab.fsutil import atomic_write_bytes, atomic_write_json, atomic_write_text  # noqa: E402


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--features", required=True, help="data/features of an offline run (shards with the states)")
    ap.add_argument("--draft", required=True, help="our exported draft (its config.json: size, capture ids, draft vocab)")
    ap.add_argument("--target", required=True, help="the target model directory (SpecForge reads its embedding and lm_head)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--batch-size", type=int, default=1, help="SpecForge's training.batch_size (sequences per step and GPU)")
    ap.add_argument("--lr", type=float, default=1e-4, help="SpecForge's default learning rate")
    ap.add_argument("--max-length", type=int, default=2048)
    ap.add_argument("--ttt-length", type=int, default=7, help="SpecForge's default; ours is train.ttt_steps")
    return ap.parse_args(argv)


def write_split(dataset: FeatureDataset, out: Path) -> int:
    """Every sequence of one split as a SpecForge offline file; returns the tokens written."""
    out.mkdir(parents=True, exist_ok=True)
    tokens = 0
    for i in tqdm(range(len(dataset)), desc=out.name, unit="seq"):
        row = dataset[i]
        sample = {"input_ids": row["input_ids"].to(torch.int64), "loss_mask": row["loss_mask"].to(torch.int64),
                  "hidden_state": row["final_hidden"].to(torch.bfloat16).unsqueeze(0).contiguous(),
                  "aux_hidden_state": row["aux_hidden"].to(torch.bfloat16).unsqueeze(0).contiguous()}
        buf = io.BytesIO()
        torch.save(sample, buf)
        atomic_write_bytes(out / f"{i:06d}.ckpt", buf.getvalue())
        tokens += len(sample["input_ids"])
    return tokens


def run_config(args, out: Path, draft_config: dict, train_sequences: int) -> dict:
    """SpecForge's run config (its pydantic schema, config/schema.py, rejects unknown keys and an eval
    set without training.eval_interval: evaluated here once per epoch, as our train stage does)."""
    ids = (draft_config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    steps_per_epoch = max(1, -(-train_sequences // args.batch_size))
    return {
        "model": {"target_model_path": str(Path(args.target).resolve()), "draft_model_config": str(out / "draft_config.json"),
                  "aux_hidden_state_layer_ids": ids, "vocab_mapping_path": str(out / "vocab_mapping.pt"),
                  "torch_dtype": "bfloat16"},
        "data": {"hidden_states_path": str(out / "hidden_states" / "train"),
                 "eval_hidden_states_path": str(out / "hidden_states" / "eval"), "max_length": args.max_length},
        "training": {"num_epochs": args.epochs, "batch_size": args.batch_size, "learning_rate": args.lr,
                     "ttt_length": args.ttt_length, "eval_interval": steps_per_epoch},
        "output_dir": str(out / "output"),
        "run_id": "draftlab-peer",
    }


def main(argv=None) -> dict:
    args = parse_args(argv)
    features, out = Path(args.features), Path(args.out).resolve()
    if not any((features / "train").glob("shard-*.safetensors")) and (features / "train" / "tokens.safetensors").exists():
        raise UserError(f"{features}: online features (token records only) hold no hidden states; "
                        "re-run with -S train.features=offline to store them")
    config_path = Path(args.draft) / "config.json"
    if not config_path.exists():
        raise UserError(f"{config_path}: not found; export the draft first (dvc repro export)")
    draft_config = json.loads(config_path.read_text())
    if not (draft_config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids"):
        raise UserError(f"{config_path}: eagle_config.eagle_aux_hidden_state_layer_ids is missing; SpecForge would capture its own default layers")
    d2t, t2d = load_draft_vocab(features)
    if draft_config.get("draft_vocab_size") != len(d2t):
        raise UserError(f"{config_path}: draft_vocab_size {draft_config.get('draft_vocab_size')} != {len(d2t)} in "
                        f"{features}/draft_vocab.safetensors; the draft and the features come from different runs")
    out.mkdir(parents=True, exist_ok=True)
    splits = {split: FeatureDataset(features / split, args.max_length) for split in ("train", "eval")}
    tokens = {split: write_split(ds, out / "hidden_states" / split) for split, ds in splits.items()}
    atomic_write_json(out / "draft_config.json", draft_config)
    buf = io.BytesIO()
    torch.save({"d2t": d2t, "t2d": t2d}, buf)
    atomic_write_bytes(out / "vocab_mapping.pt", buf.getvalue())
    config = run_config(args, out, draft_config, len(splits["train"]))
    atomic_write_text(out / "run.yaml", yaml.safe_dump(config, sort_keys=False))
    print(f"specforge_offline: {tokens['train']} train and {tokens['eval']} eval tokens -> {out}\n"
          f"  specforge train --config {out / 'run.yaml'}")
    return {"tokens": tokens, "config": config}


if __name__ == "__main__":
    main()
