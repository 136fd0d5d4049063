"""Time of the target stage's weight check (draftlab.target.check.check_weight_layout) on an 8B checkpoint.

    python benchmarks/weight_layout.py              # Llama-3-8B's shapes, bf16, 4 shards
    python benchmarks/weight_layout.py --repeats 5

Method. A Llama-3-8B folder is written to a temporary directory: its config.json (32 layers,
hidden 4096, MLP 14336, 8 KV heads, vocab 128256), an index and 4 safetensors shards whose
headers name every tensor with its real shape and dtype (bf16, 16.1 GB in all). The shards are
sparse files: the header, then the data region as a hole of the right length, so the folder
takes a few KB of disk and a check that read a tensor would read zeros, not fail; what is timed
is the header read, the meta-device skeleton and transformers' loading steps. Each repeat is one
check_weight_layout call; printed: seconds per repeat, their median and the tensor count.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
          "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
          "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False,
          "dtype": "bfloat16", "bos_token_id": 128000, "eos_token_id": 128009}
SHARDS = 4


def shapes(c: dict) -> dict[str, list[int]]:
    """The tensors of LlamaForCausalLM for config `c`, as its checkpoints name them."""
    h, m, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    kv = h // c["num_attention_heads"] * c["num_key_value_heads"]
    out = {"model.embed_tokens.weight": [v, h], "model.norm.weight": [h], "lm_head.weight": [v, h]}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out.update({p + "self_attn.q_proj.weight": [h, h], p + "self_attn.k_proj.weight": [kv, h],
                    p + "self_attn.v_proj.weight": [kv, h], p + "self_attn.o_proj.weight": [h, h],
                    p + "mlp.gate_proj.weight": [m, h], p + "mlp.up_proj.weight": [m, h], p + "mlp.down_proj.weight": [h, m],
                    p + "input_layernorm.weight": [h], p + "post_attention_layernorm.weight": [h]})
    return out


def write_sparse_checkpoint(folder: Path, c: dict) -> int:
    """config.json, the index and SHARDS sparse bf16 shards; returns the bytes the shards declare."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(c))
    names = list(shapes(c).items())
    weight_map, total = {}, 0
    for s in range(SHARDS):
        file = f"model-{s + 1:05d}-of-{SHARDS:05d}.safetensors"
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for name, shape in names[s::SHARDS]:
            n = 2 * math.prod(shape)  # bf16: 2 bytes per element
            header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + n]}
            weight_map[name], offset = file, offset + n
        raw = json.dumps(header).encode()
        with open(folder / file, "wb") as f:
            f.write(len(raw).to_bytes(8, "little") + raw)
            f.truncate(8 + len(raw) + offset)  # a hole: no data written, the size a real shard has
        total += offset
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                      "weight_map": weight_map}))
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    from transformers import AutoConfig

    from draftlab.target.check import check_weight_layout

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "llama-3-8b"
        total = write_sparse_checkpoint(folder, CONFIG)
        cfg = AutoConfig.from_pretrained(str(folder))
        times = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            check_weight_layout(folder, str(folder), cfg)
            times.append(time.perf_counter() - t)
    print(f"check_weight_layout, Llama-3-8B shapes ({len(shapes(CONFIG))} tensors, {total / 1e9:.1f} GB bf16 in {SHARDS} "
          f"sparse shards): " + ", ".join(f"{t:.2f}" for t in times) + f" s; median {statistics.median(times):.2f} s")


if __name__ == "__main__":
    main()
