"""Stage standardize: extraction shards -> training features, draft vocabulary, feature statistics.

    python -m stages.standardize --hidden data/hidden --out data/features --metrics reports/standardize.json
Reads params section: standardize.

- aux states are concatenated in ascending physical order (what SGLang feeds the draft,
  whatever order a config lists them in);
- the draft vocabulary is the draft_vocab_size most frequent target tokens under the loss mask
  of the train split (d2t/t2d, DESIGN.md section 6);
- per-layer L2-norm statistics are recorded: the wiring check compares them with what a server
  captures live (a shifted or unnormalised layer shows up as a norm ratio far from 1).

The physical layers come from the extract manifest (info.target.physical_layers, their one place
among the manifests) and go into every feature shard's header; the features manifest does not
repeat them (readers take them from the shards: draftlab.features.dataset.physical_layers_of).

train.features online (the extract manifest's info.mode): the shards are a sample, used for the
norm statistics and the check; the draft vocabulary and token counts come from every row's
tokens record (<split>/tokens.safetensors), which is copied into the features for the train stage.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from draftlab.features import dataset
from draftlab.cli import run_stage_cli
from draftlab.errors import UserError
from draftlab.features.extract import TOKENS_FILE, layer_key, read_tokens_record
from draftlab.fsutil import atomic_write_json
from draftlab.manifest import build_manifest, output_files, read_verified, with_lineage, write_manifest
from draftlab.params import as_dict, load_params


def load_shard(path: Path) -> tuple[dict, dict]:
    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata() or {}


def check_shard(path: Path, t: dict, meta: dict, physical: list[int], target: dict, manifest: Path) -> None:
    """The shard holds what the extract manifest says (its physical layers, hidden size and
    vocabulary); else a UserError naming both sides: a hand-edited manifest, or a shard of another run."""
    fix = f"re-run extract (dvc repro -f extract), or restore {manifest}"
    lacking = [k for k in ("input_ids", "loss_mask", "final_hidden", "seq_offsets") if k not in t]
    if lacking:
        raise UserError(f"{path}: no {', '.join(lacking)} tensor(s): not a shard extract writes; {fix}")
    held = sorted(int(k.split(".", 1)[1]) for k in t if k.startswith("hidden.") and k.split(".", 1)[1].isdigit())
    try:
        header = json.loads(meta.get("physical_layers", "null"))
    except json.JSONDecodeError:
        header = None
    if (header is not None and sorted(header) != physical) or held != physical:
        raise UserError(f"{manifest} says physical layers {physical} (info.target.physical_layers), but {path} holds "
                        f"the states of layers {held}" + (f" (its header: physical_layers {header})" if header is not None else "")
                        + f"; {fix}")
    H, V = target.get("hidden_size"), target.get("vocab_size")
    width = t["final_hidden"].shape[-1] if t["final_hidden"].ndim == 2 else None
    if width != H:
        raise UserError(f"{manifest} says hidden_size {H} (info.target), but {path} holds states {width} wide; {fix}")
    top = int(t["input_ids"].max()) if len(t["input_ids"]) else -1
    if not isinstance(V, int) or top >= V:
        raise UserError(f"{manifest} says vocab_size {V} (info.target), but {path} holds token id {top}; {fix}")


def copy_tokens(hidden: Path, out: Path, split: str, config_hash: str, shard_meta: dict, upstream_hash: str) -> dict:
    """train.features online: the split's tokens record, checked and copied into the features
    (the train stage reads only data/features); returns its arrays."""
    path = hidden / split / TOKENS_FILE
    arrays, meta = read_tokens_record(path)
    if meta.get("config_hash") != upstream_hash:
        raise UserError(f"{path}: written by another extract run than {hidden}/manifest.json; re-run extract")
    dataset.write_tokens(out / split / TOKENS_FILE, arrays, {**shard_meta, "row_ids": json.loads(meta["row_ids"]),
                                                              "dtype": meta["dtype"], "config_hash": config_hash})
    return arrays


def main(hidden: Path, out: Path, metrics: Path) -> None:
    params = load_params(["standardize"])
    n_vocab = params.standardize.draft_vocab_size
    upstream = read_verified(hidden)  # every shard extract recorded, complete, before any compute
    recorded = (upstream.get("info") or {}).get("target")
    layers = recorded.get("physical_layers") if isinstance(recorded, dict) else None
    if not (isinstance(layers, list) and layers and all(isinstance(i, int) and not isinstance(i, bool) for i in layers)
            and isinstance(recorded.get("vocab_size"), int) and isinstance(recorded.get("hidden_size"), int)):
        raise UserError(f"{hidden / 'manifest.json'}: info.target lacks physical_layers (a list of layer indices), hidden_size "
                        f"or vocab_size; re-run extract (dvc repro -f extract)")
    target = {k: v for k, v in recorded.items() if k != "physical_layers"}
    physical = sorted(layers)
    # online (train.features): the shards are a sample for the stats; vocab and counts come from
    # the tokens record of every row.
    online = upstream["info"].get("mode", "offline") == "online"
    if n_vocab > target["vocab_size"]:  # a refusal, not a silent clamp: the user asked for something else
        raise UserError(f"params.yaml: standardize.draft_vocab_size {n_vocab} exceeds the target's vocabulary of "
                        f"{target['vocab_size']} tokens; set it to {target['vocab_size']} (the identity map) or less")
    manifest = build_manifest("standardize", as_dict(params), {"extract": upstream["config_hash"]}, __file__)
    out.mkdir(parents=True, exist_ok=True)
    counts = torch.zeros(target["vocab_size"], dtype=torch.long)
    norms: dict[str, list[torch.Tensor]] = {str(i): [] for i in physical} | {"final": []}
    split_tokens = {}
    masked_ids = {"train": [], "eval": []}
    shard_meta = {"physical_layers": physical, "hidden_size": target["hidden_size"], "num_layers": target["num_layers"],
                  "architecture": target["architecture"], "vocab_size": target["vocab_size"]}
    for split in ("train", "eval"):
        listed = (upstream.get("info") or {}).get("files")
        shards = ([hidden / n for n in sorted(listed) if n.startswith(f"{split}/shard-")] if listed
                  else sorted((hidden / split).glob("shard-*.safetensors")))
        if not shards:
            raise UserError(f"{hidden / split}: no shards; re-run the extract stage (dvc repro extract)")
        (out / split).mkdir(exist_ok=True)
        for old in (out / split).glob("shard-*.safetensors"):
            if not (hidden / split / old.name).exists():
                old.unlink()
        n_tok = 0
        for path in tqdm(shards, desc=f"standardize {split}" + (" (sample)" if online else ""), unit="shard"):
            t, meta = load_shard(path)
            if meta.get("config_hash") != upstream["config_hash"]:
                raise UserError(f"{path}: written by another extract run than {hidden}/manifest.json; re-run extract")
            check_shard(path, t, meta, physical, target, hidden / "manifest.json")
            aux = torch.cat([t[layer_key(i)] for i in physical], dim=-1)  # ascending physical order
            arrays = {"input_ids": t["input_ids"], "loss_mask": t["loss_mask"], "aux_hidden": aux,
                      "final_hidden": t["final_hidden"], "seq_offsets": t["seq_offsets"]}
            dataset.write_shard(out / split / path.name, arrays,
                                 {**shard_meta, "row_ids": json.loads(meta["row_ids"]), "config_hash": manifest["config_hash"]})
            if not online:
                masked_ids[split].append(t["input_ids"][t["loss_mask"]])
                if split == "train":
                    counts += dataset.count_tokens(t["input_ids"], t["loss_mask"], len(counts))
            if split == "train":
                for i in physical:
                    norms[str(i)].append(t[layer_key(i)].float().norm(dim=-1))
                norms["final"].append(t["final_hidden"].float().norm(dim=-1))
            n_tok += len(t["input_ids"])
        if online:
            t = copy_tokens(hidden, out, split, manifest["config_hash"], shard_meta, upstream["config_hash"])
            masked_ids[split].append(t["input_ids"][t["loss_mask"]])
            if split == "train":  # the same count as offline, over every row
                counts += dataset.count_tokens(t["input_ids"], t["loss_mask"], len(counts))
            n_tok = len(t["input_ids"])
        else:
            (out / split / TOKENS_FILE).unlink(missing_ok=True)  # of an earlier online run
        split_tokens[split] = n_tok
    d2t, t2d = dataset.build_draft_vocab(counts, n_vocab)
    dataset.save_draft_vocab(out / "draft_vocab.safetensors", d2t, t2d)
    # Share of answer tokens the draft can propose at all: an upper bound on acceptance.
    coverage = {s: (t2d[torch.cat(ids)].float().mean().item() if ids else None) for s, ids in masked_ids.items()}
    stats = {
        "norms": {k: dataset.norm_summary(torch.cat(v)) for k, v in norms.items()},
        "draft_vocab_size": int(len(d2t)),
        "draft_vocab_coverage": coverage,
        "tokens": split_tokens,
    }
    atomic_write_json(out / "stats.json", stats)
    manifest["info"] = {"target": target, "chat_template_sha256": upstream["info"]["chat_template_sha256"],
                        "tokenizer_sha256": upstream["info"]["tokenizer_sha256"], **stats,
                        "files": output_files(out)}  # per shard bytes + tokens: train, export and check verify them
    if online:  # the train stage reads this: the shards are a sample, tokens.safetensors the data
        manifest["info"]["mode"] = "online"
    write_manifest(out, manifest)
    figures = {"draft_vocab_size": int(len(d2t)), "draft_vocab_coverage_eval": coverage["eval"],
               "train_tokens": split_tokens["train"], "eval_tokens": split_tokens["eval"]}
    atomic_write_json(metrics, with_lineage(figures, manifest, {"capture_physical_layers": physical, "target": target["model"]}))
    print(f"standardize: {split_tokens} tokens" + (" (online: states of a sample only)" if online else "") +
          f", draft vocab {len(d2t)} covering {100 * (coverage['eval'] or 0):.1f}% of eval answer tokens -> {out}")


if __name__ == "__main__":
    run_stage_cli(main, __doc__, hidden="data/hidden", out="data/features", metrics="reports/standardize.json")
