"""A tiny features directory built from a micro target, in the exact layout standardize writes."""
from __future__ import annotations

from pathlib import Path

import torch

from draftlab.train.draft import DraftConfig, Eagle3Draft
from draftlab.features.dataset import build_draft_vocab, count_tokens, pack_sequences, save_draft_vocab, shard_name, write_shard
from draftlab.manifest import build_manifest, write_manifest
from tests.support.micro import make_micro_model


def target_facts(model, path) -> dict:
    c = model.config
    return {
        "model": str(path), "revision": None, "architecture": c.architectures[0] if c.architectures else "LlamaForCausalLM",
        "model_type": c.model_type, "num_layers": c.num_hidden_layers, "hidden_size": c.hidden_size,
        "vocab_size": c.vocab_size, "max_position_embeddings": c.max_position_embeddings,
        "torch_dtype": "float32", "rope_theta": c.rope_parameters["rope_theta"], "rope_scaling": None,
        "rms_norm_eps": c.rms_norm_eps, "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim,
        "intermediate_size": c.intermediate_size, "tie_word_embeddings": False,
    }


@torch.no_grad()
def make_sequences(model, n: int, seed: int, prompt_len=8, answer_len=(10, 30)):
    """Random prompts answered greedily by `model`: the answer is what the draft must predict."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(7, model.config.vocab_size, (n, prompt_len), generator=g)
    for _ in range(answer_len[1]):  # greedy, all rows at once
        ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    lengths = torch.randint(answer_len[0], answer_len[1] + 1, (n,), generator=g).tolist()
    return [(row[: prompt_len + a], torch.arange(prompt_len + a) >= prompt_len) for row, a in zip(ids, lengths)]


@torch.no_grad()
def features_of(model, seqs, physical):
    out = []
    for ids, mask in seqs:
        hs = model(ids[None], output_hidden_states=True).hidden_states
        out.append({
            "input_ids": ids,
            "loss_mask": mask,
            "aux_hidden": torch.cat([hs[i][0] for i in physical], dim=-1).bfloat16(),
            "final_hidden": hs[-1][0].bfloat16(),
        })
    return out


def make_features(root, arch="llama", num_layers=4, hidden_size=64, vocab_size=256, physical=(1, 2, 3),
                  n_train=16, n_eval=8, draft_vocab_size=128, seed=0, shard_size=6, sharpen=30.0):
    """Write root/target (micro model) and root/features; returns (features_dir, target_dir, model).

    `sharpen` scales the random lm_head so the target's next-token distributions are peaked
    like a trained model's (a random one is near uniform: nothing to learn).
    """
    root = Path(root)
    target_dir, feat = root / "target", root / "features"
    model = make_micro_model(arch, num_layers=num_layers, hidden_size=hidden_size, vocab_size=vocab_size, seed=seed)
    with torch.no_grad():
        model.lm_head.weight.mul_(sharpen)
    model.save_pretrained(target_dir)
    physical = sorted(physical)
    facts = target_facts(model, target_dir)
    meta = {"physical_layers": physical, "hidden_size": hidden_size, "num_layers": num_layers,
            "architecture": facts["architecture"], "vocab_size": vocab_size}
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for split, n, s in (("train", n_train, seed + 1), ("eval", n_eval, seed + 2)):
        feats = features_of(model, make_sequences(model, n, s), physical)
        for j in range(0, n, shard_size):
            write_shard(feat / split / shard_name(j // shard_size), pack_sequences(feats[j : j + shard_size]), meta)
        if split == "train":
            for f in feats:
                counts += count_tokens(f["input_ids"], f["loss_mask"], vocab_size)
    save_draft_vocab(feat / "draft_vocab.safetensors", *build_draft_vocab(counts, draft_vocab_size))
    info = {"target": facts}  # as standardize writes it: the physical layers are in the shard headers only
    write_manifest(feat, build_manifest("standardize", {"standardize": {"draft_vocab_size": draft_vocab_size}}, {}, info=info))
    return feat, target_dir, model


H, V, VD, K = 32, 64, 48, 3


def make_draft(seed=0, rope_scaling=None, vocab=V, draft_vocab=VD):
    """A small random draft (GQA, non-trivial norms) with a random target embedding."""
    cfg = DraftConfig(hidden_size=H, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                      rms_norm_eps=1e-6, vocab_size=vocab, draft_vocab_size=draft_vocab, target_hidden_size=H, num_aux_layers=K,
                      max_position_embeddings=256, rope_theta=10000.0, rope_scaling=rope_scaling)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        draft = Eagle3Draft(cfg, embed_weight=torch.randn(vocab, H))
        with torch.no_grad():  # non-trivial norms, so a swapped norm would show
            for p in draft.parameters():
                if p.ndim == 1:
                    p.uniform_(0.5, 1.5)
    return draft.eval()


def training_kit(root) -> dict:
    """make_features(root, 16 train, 8 eval) with what training needs beside it: the draft config
    (3 capture layers), the target's embedding and head, the draft vocab and both splits; "model"
    is the micro target (for online features)."""
    import json

    from draftlab.features.dataset import FeatureDataset, load_draft_vocab
    from draftlab.target.weights import load_target_head

    feat, target_dir, model = make_features(root, n_train=16, n_eval=8)
    info = json.loads((feat / "manifest.json").read_text())["info"]["target"]
    d2t, t2d = load_draft_vocab(feat)
    embed, head = load_target_head(str(target_dir))
    return {"root": Path(root), "feat": feat, "model": model, "cfg": DraftConfig.from_target(info, 3, len(d2t)),
            "embed": embed, "head": head, "d2t": d2t, "t2d": t2d,
            "train": FeatureDataset(feat / "train"), "eval": FeatureDataset(feat / "eval")}
