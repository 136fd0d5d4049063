"""Make an "8B-cost twin" of a small Llama: the body of a big Llama that computes the small one's function.

The twin has the small model's vocabulary, tokenizer and chat template, and the hidden size,
depth, heads and MLP of a big Llama (default Llama-3.1-8B). Its logits equal the small model's up
to float rounding, so answers and speculative acceptance are the small model's, while a dense
kernel pays the big model's cost per token. Construction (each step keeps the function exact):

- hidden: the small model's dims go in the first slots, the rest are zero (embeddings, norms,
  every projection's input columns, lm_head columns), so the residual stream is [x_small, 0].
- RMSNorm: the mean of squares over H_big of [x, 0] is the small one / r (r = H_big / H_small);
  eps_big = eps / r makes the rms sqrt(r) smaller, and weights w / sqrt(r) undo it.
- heads: small q head i -> big q head i, kv head g -> big kv head g (same GQA group size); the
  head dim d -> f*d and d + hd/2 -> f*d + hd_big/2 (f = hd_big / hd_small) keeps every rotary
  pair at its frequency; q is scaled by sqrt(f) to undo the 1/sqrt(head_dim) score scale.
- depth: small layer k is big layer k*m (m = L_big / L_small); the other layers are all-zero
  weights, i.e. identity layers (zero o_proj and down_proj add nothing to the residual stream).

    python tools/make_twin.py --small models/tiny-target --out ../twin-8b            # bf16, ~14 GB
    python tools/make_twin.py --small models/tiny-target --out twin-test --dtype float32 \\
        --hidden-size 512 --num-layers 16 --num-heads 16 --num-kv-heads 4 --head-dim 64 --intermediate-size 1536
    python tools/make_twin.py --small models/tiny-target --out ../twin-8b --draft models/draft --draft-out ../twin-8b-draft
    python tools/make_twin.py --small models/target-dequantized --shape smollm2-at-8b-cost --out ../smollm2-twin \
        --draft models/draft --draft-out ../smollm2-twin-draft     # the real workload's target at 8B cost

--draft inflates an EAGLE-3 draft of the small model (SGLang's LlamaForCausalLMEagle3 layout) the same
way, to the twin's width, with the capture ids mapped to the twin's layers: the small draft's
acceptance at the cost of a draft layer of the big width (not a draft trained at that width).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import shutil
import string
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, not installed
from draftlab.fsutil import atomic_replace_dir, canonicalize_safetensors_file, make_readable  # noqa: E402

SHAPES = {"llama-3.1-8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                               num_key_value_heads=8, head_dim=128, intermediate_size=14336),
          # SmolLM2-135M (30 layers, hidden 576, 9 heads of 64 over 3 KV heads, tied embeddings) at the
          # bytes per decode token of Llama-3.1-8B (within 2%), not its head layout: hidden 4x (norm
          # scale 1/2, exact in bf16), the same head dim and GQA group of 3, the same 30 layers (the
          # launch count of a 32-layer model), and an MLP wide enough to carry the rest of the bytes.
          "smollm2-at-8b-cost": dict(hidden_size=2304, num_hidden_layers=30, num_attention_heads=36,
                                     num_key_value_heads=12, head_dim=64, intermediate_size=34304)}
REFERENCE_VOCAB = {"llama-3.1-8b": 128256}  # the real model's vocabulary, for the card's comparison
SHAPE_KEYS = tuple(SHAPES["llama-3.1-8b"])
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# rope types whose inverse frequencies depend on the frequencies alone, not on head_dim: the dim map
# keeps every frequency, so these stay exact. (dynamic / yarn / longrope rescale with head_dim.)
ROPE_TYPES_KEPT = ("default", "linear", "llama3")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "chat_template.jinja", "chat_template.json", "generation_config.json", "vocab.json", "merges.txt")
CARD = Path(__file__).resolve().parent / "templates" / "twin_card.md"


def decode_params(shape: dict, vocab: int, tied: bool) -> int:
    """Weights one decode step reads: every decoder layer and the lm_head (an embedding lookup
    reads one row, so a separate embedding matrix is not counted); norms left out (< 0.01%)."""
    h, hd, inter = shape["hidden_size"], shape["head_dim"], shape["intermediate_size"]
    attn = h * hd * (2 * shape["num_attention_heads"] + 2 * shape["num_key_value_heads"])
    return shape["num_hidden_layers"] * (attn + 3 * h * inter) + vocab * h


def dims(cfg: dict) -> dict:
    """The shape keys of a Llama config.json (head_dim defaults to hidden / heads, as in transformers)."""
    out = {k: cfg.get(k) for k in SHAPE_KEYS}
    out["head_dim"] = out["head_dim"] or cfg["hidden_size"] // cfg["num_attention_heads"]
    return out


def _power_of_two(x: float) -> bool:
    return x > 0 and math.log2(x).is_integer()


def plan(small_cfg: dict, shape: dict, dtype: torch.dtype = torch.float32) -> dict:
    """Check that `shape` can hold the small model exactly; return the factors of the construction."""
    s, b = dims(small_cfg), {**dims(small_cfg), **shape}
    if small_cfg.get("architectures", ["LlamaForCausalLM"])[0] != "LlamaForCausalLM":
        raise ValueError(f"only LlamaForCausalLM can be inflated, the small model is {small_cfg['architectures']}")
    if small_cfg.get("attention_bias") or small_cfg.get("mlp_bias") or small_cfg.get("partial_rotary_factor", 1) != 1:
        raise ValueError("the small model has biases or partial rotary dims: not supported (no Llama-3 model has them)")
    rope = small_cfg.get("rope_parameters") or small_cfg.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) not in ROPE_TYPES_KEPT:
        raise ValueError(f"rope type {rope.get('rope_type', rope.get('type'))!r} depends on head_dim; "
                         f"the twin keeps only {ROPE_TYPES_KEPT} exact")
    for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size"):
        if b[k] < s[k]:
            raise ValueError(f"{k}: the twin's {b[k]} is smaller than the small model's {s[k]}; it must hold it")
    if b["num_hidden_layers"] % s["num_hidden_layers"]:
        raise ValueError(f"num_hidden_layers: {b['num_hidden_layers']} is not a multiple of the small model's "
                         f"{s['num_hidden_layers']}; each small layer becomes a block of equal length")
    if b["head_dim"] % s["head_dim"] or b["head_dim"] % 2:
        raise ValueError(f"head_dim: {b['head_dim']} is not an even multiple of the small model's {s['head_dim']}; "
                         "only then does each rotary pair keep its frequency")
    group_s = s["num_attention_heads"] // s["num_key_value_heads"]
    if b["num_attention_heads"] % b["num_key_value_heads"] or b["num_attention_heads"] // b["num_key_value_heads"] != group_s:
        raise ValueError(f"num_key_value_heads: {b['num_attention_heads']} heads over {b['num_key_value_heads']} kv heads "
                         f"is not the small model's GQA group of {group_s} q heads per kv head; "
                         f"set num_key_value_heads = num_attention_heads / {group_s}")
    r, f = b["hidden_size"] / s["hidden_size"], b["head_dim"] / s["head_dim"]
    if dtype != torch.float32:  # 16-bit weights hold w / sqrt(r) and sqrt(f) * q exactly only for powers of two
        for k, x in (("hidden_size", r), ("head_dim", f)):
            if not _power_of_two(math.sqrt(x)):
                raise ValueError(f"{k}: ratio {x:g} has square root {math.sqrt(x):.4f}, not a power of two, so the "
                                 f"scaled weights round in {str(dtype).removeprefix('torch.')} and the twin would drift from the small model; "
                                 "use a ratio of 4**n (e.g. 256 -> 4096) or --dtype float32")
    return dict(small=s, big=b, r=r, f=int(f), m=b["num_hidden_layers"] // s["num_hidden_layers"],
                norm_scale=1 / math.sqrt(r), q_scale=math.sqrt(f), eps=small_cfg["rms_norm_eps"] / r)


def head_rows(n_heads: int, hd_s: int, hd_b: int) -> torch.Tensor:
    """Big projection row of each small row (head h, dim d): rotary pair (d, d+hd/2) -> (f*d, f*d+hd_big/2)."""
    f, half = hd_b // hd_s, hd_s // 2
    d = torch.arange(hd_s)
    big_d = torch.where(d < half, f * d, f * (d - half) + hd_b // 2)
    return (torch.arange(n_heads)[:, None] * hd_b + big_d[None]).flatten()


def capture_layers_for_twin(layers, m: int, num_small_layers: int | None = None) -> list[int]:
    """capture.layers of the small model (output of decoder layer k, 0-based) -> the twin's.

    Small layer k is twin layers k*m .. k*m+m-1 (one real layer, then identities); their outputs are
    all equal, and the last of the block, k*m+m-1, is the residual entering the next real layer.
    """
    if not isinstance(layers, (list, tuple)) or not all(isinstance(k, int) and not isinstance(k, bool) for k in layers):
        raise ValueError(f"capture layers must be a list of layer numbers, got {layers!r} ('default' means "
                         "other layers on the twin than on the small model: list them)")
    top = num_small_layers - 2 if num_small_layers else float("inf")  # the last layer's output is not capturable
    if bad := [k for k in layers if not 0 <= k <= top]:
        raise ValueError(f"capture layers {bad} are out of range (valid 0..{top})")
    return [k * m + m - 1 for k in layers]


def inflate_state_dict(small_sd: dict, small_cfg: dict, shape: dict, dtype=torch.float32):
    """(big config.json dict, iterator of (name, tensor)); the shape is checked before anything is built."""
    p = plan(small_cfg, shape, dtype)
    b = p["big"]
    big_cfg = {**small_cfg, **b, "rms_norm_eps": p["eps"]}
    big_cfg["dtype"] = str(dtype).removeprefix("torch.")
    if "torch_dtype" in small_cfg:  # transformers 4 spelling
        big_cfg["torch_dtype"] = big_cfg["dtype"]
    return big_cfg, _tensors(small_sd, p, dtype)


def _tensors(sd: dict, p: dict, dtype):
    s, b, m = p["small"], p["big"], p["m"]
    hs, hb = s["hidden_size"], b["hidden_size"]
    q_rows = head_rows(s["num_attention_heads"], s["head_dim"], b["head_dim"])
    kv_rows = head_rows(s["num_key_value_heads"], s["head_dim"], b["head_dim"])
    q_out, kv_out = b["num_attention_heads"] * b["head_dim"], b["num_key_value_heads"] * b["head_dim"]
    shapes = {"input_layernorm": (hb,), "post_attention_layernorm": (hb,),
              "self_attn.q_proj": (q_out, hb), "self_attn.k_proj": (kv_out, hb), "self_attn.v_proj": (kv_out, hb),
              "self_attn.o_proj": (hb, q_out), "mlp.gate_proj": (b["intermediate_size"], hb),
              "mlp.up_proj": (b["intermediate_size"], hb), "mlp.down_proj": (hb, b["intermediate_size"])}

    def big(name: str, shape: tuple, small: torch.Tensor | None = None) -> torch.Tensor:
        t = torch.zeros(shape, dtype=dtype)
        if small is None:
            return t
        small = small.float()
        if name.endswith("norm"):
            t[:hs] = small * p["norm_scale"]
        elif name.endswith("q_proj"):
            t[q_rows, :hs] = (small * p["q_scale"]).to(dtype)
        elif name.endswith(("k_proj", "v_proj")):
            t[kv_rows, :hs] = small.to(dtype)
        elif name.endswith("o_proj"):
            t[:hs, q_rows] = small.to(dtype)
        elif name.endswith("down_proj"):
            t[:hs, :small.shape[1]] = small
        else:  # gate / up / embeddings / lm_head: rows as they are, hidden columns padded
            t[:small.shape[0], :hs] = small
        return t

    vocab = sd["model.embed_tokens.weight"].shape[0]
    yield "model.embed_tokens.weight", big("embed", (vocab, hb), sd["model.embed_tokens.weight"])
    for j in range(b["num_hidden_layers"]):
        k, offset = divmod(j, m)  # offset 0: small layer k; 1..m-1: identity layers
        for part, shape in shapes.items():
            small = sd[f"model.layers.{k}.{part}.weight"] if offset == 0 else None
            yield f"model.layers.{j}.{part}.weight", big(part, shape, small)
    yield "model.norm.weight", big("norm", (hb,), sd["model.norm.weight"])
    if "lm_head.weight" in sd:  # absent when tied: the padded embedding serves both
        yield "lm_head.weight", big("lm_head", (vocab, hb), sd["lm_head.weight"])


def load_small(path: Path) -> tuple[dict, dict]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise SystemExit(f"{path}: no *.safetensors weights; pass --small the directory of a saved model")
    sd = {k: v for f in files for k, v in load_file(f).items()}
    return json.loads((path / "config.json").read_text()), sd


def write_shards(tensors, out: Path, shard_bytes: int) -> dict:
    """Stream (name, tensor) into shards of about shard_bytes; return the index and counts."""
    names, shard, size, n_params, n_nonzero, total = [], {}, 0, 0, 0, 0

    def flush():
        names.append((f"part-{len(names)}", list(shard)))
        save_file(shard, out / names[-1][0], metadata={"format": "pt"})
        canonicalize_safetensors_file(out / names[-1][0])  # same content -> same bytes
        print(f"  shard {len(names)}: {size / 1e9:.2f} GB", flush=True)

    for name, t in tensors:
        if shard and size + t.nbytes > shard_bytes:
            flush()
            shard, size = {}, 0
        shard[name], size = t.contiguous(), size + t.nbytes
        n_params, n_nonzero, total = n_params + t.numel(), n_nonzero + int(t.count_nonzero()), total + t.nbytes
    flush()
    weight_map = {}
    for i, (tmp_name, keys) in enumerate(names):
        final = f"model-{i + 1:05d}-of-{len(names):05d}.safetensors"
        (out / tmp_name).rename(out / final)
        weight_map.update(dict.fromkeys(keys, final))
    index = {"metadata": {"total_size": total, "total_parameters": n_params}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return dict(parameters=n_params, nonzero=n_nonzero, bytes=total, shards=len(names))


def sglang_default(num_layers: int) -> list[int]:
    """SGLang's capture ids for a Llama when the draft names none: outputs of layers 1, L/2-1, L-4."""
    return [1, num_layers // 2 - 1, num_layers - 4]


def fmt_bytes(n: float) -> str:
    return f"{n / 1e9:.2f} GB ({n / 2**30:.2f} GiB)"


def card_text(info: dict) -> str:
    b, s, m = info["shape"], info["small_shape"], info["m"]
    rows = "\n".join(f"| {k} | {s[k]} | {b[k]} |" for k in SHAPE_KEYS)
    body = info["parameters"] - info["vocab"] * b["hidden_size"] * (1 if info["tied"] else 2)
    ref = REFERENCE_VOCAB.get(info["shape_name"])
    reference = "" if ref is None else (
        f"The real {info['shape_name']} has the same body and a {ref:,}-token vocabulary: "
        f"{body + ref * b['hidden_size'] * 2:,} parameters. The twin differs only in its embedding and lm_head "
        f"({info['vocab']:,} rows), so its lm_head GEMM is {info['vocab'] / ref:.1%} of the real one's; "
        f"every decoder layer costs the same.")
    small_layers = list(range(s["num_hidden_layers"] - 1))  # capturable: 0 .. L-2
    example = [k for k in (1, 3, 5) if k in small_layers]
    return string.Template(CARD.read_text()).substitute(
        small_name=info["small_name"], shape_name=info["shape_name"], shape_rows=rows, dtype=info["dtype"],
        parameters=f"{info['parameters']:,}", nonzero=f"{info['nonzero']:,}",
        nonzero_share=f"{info['nonzero'] / info['parameters']:.3%}", bytes_dtype=fmt_bytes(info["bytes"]),
        bf16_row="" if info["dtype"] == "bfloat16" else f"| weights, if bfloat16 | {fmt_bytes(info['parameters'] * 2)} |\n",
        body=f"{body:,}", flops=f"{2 * (body + info['vocab'] * b['hidden_size']) / 1e9:.1f}",
        kv_bytes=f"{b['num_hidden_layers'] * 2 * b['num_key_value_heads'] * b['head_dim'] * 2 / 1024:.0f}",
        reference=reference, m=m, m_minus_1=m - 1, r=f"{info['r']:g}", f=info["f"], norm_scale=f"{1 / math.sqrt(info['r']):.4g}",
        q_scale=f"{math.sqrt(info['f']):.4g}", eps_small=f"{info['eps_small']:g}", eps_big=f"{info['eps_big']:g}",
        layer_rows="\n".join(f"| {k} | {k * m} | {k * m + 1}..{k * m + m - 1} | {k * m + m - 1} |"
                             for k in range(s["num_hidden_layers"])),
        capture_small=json.dumps(example), capture_big=json.dumps(capture_layers_for_twin(example, m)),
        capture_map=", ".join(f"{k} -> {k * m + m - 1}" for k in small_layers),
        shards=info["shards"], small_default=sglang_default(s["num_hidden_layers"]),
        twin_default=sglang_default(b["num_hidden_layers"]),
        twin_default_small=[j // m for j in sglang_default(b["num_hidden_layers"])])


def make_twin(small: Path, out: Path, shape: dict, shape_name: str, dtype_name: str, shard_gb: float = 4.0) -> dict:
    dtype = DTYPES[dtype_name]
    small_cfg, small_sd = load_small(small)
    big_cfg, tensors = inflate_state_dict(small_sd, small_cfg, shape, dtype)  # raises on a bad shape
    p = plan(small_cfg, shape, dtype)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-"))  # same file system: rename is atomic
    try:
        print(f"writing {shape_name} twin of {small.name} to {out} ({dtype_name})", flush=True)
        counts = write_shards(tensors, tmp, int(shard_gb * 1e9))
        (tmp / "config.json").write_text(json.dumps(big_cfg, indent=2, sort_keys=True) + "\n")
        for name in TOKENIZER_FILES:
            if (small / name).exists():
                shutil.copy2(small / name, tmp / name)
        sha = hashlib.sha256()
        for f in sorted(small.glob("*.safetensors")):
            sha.update(f.read_bytes())
        info = dict(small_name=small.name, small_weights_sha256=sha.hexdigest(), shape_name=shape_name, dtype=dtype_name,
                    small_shape=p["small"], shape=p["big"], m=p["m"], r=p["r"], f=p["f"],
                    eps_small=small_cfg["rms_norm_eps"], eps_big=p["eps"], vocab=small_sd["model.embed_tokens.weight"].shape[0],
                    tied="lm_head.weight" not in small_sd, **counts,
                    layer_map={str(k): list(range(k * p["m"], (k + 1) * p["m"])) for k in range(p["small"]["num_hidden_layers"])},
                    capture_layer_map={str(k): capture_layers_for_twin([k], p["m"])[0]
                                       for k in range(p["small"]["num_hidden_layers"] - 1)})
        (tmp / "twin.json").write_text(json.dumps(info, indent=2) + "\n")
        (tmp / "README.md").write_text(card_text(info))
        make_readable(tmp)  # mkdtemp makes 0700: the twin reads like any model directory
        atomic_replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    print(f"done: {counts['parameters']:,} parameters, {fmt_bytes(counts['bytes'])} in {counts['shards']} shards")
    return info


DRAFT_NORMS = ("midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight",
               "midlayer.post_attention_layernorm.weight", "norm.weight")


def inflate_draft_tensors(sd: dict, draft_cfg: dict, shape: dict, dtype=torch.float32) -> tuple[dict, dict]:
    """(big draft config.json dict without the capture ids, big state dict) of an SGLang EAGLE-3 draft.

    The same construction as the target's: the draft's hidden dims in the first slots of every
    H-wide vector. fc reads k aux states of the twin (each [x_small, 0], twin-wide), so aux block j
    of the small input goes to columns j*H_big .. j*H_big + H_small; q/k/v read
    cat(input_layernorm(embed), hidden_norm(h)), 2H wide, so the embedding half goes to columns
    0..H_small and the state half to H_big..H_big + H_small; heads by rotary pair with the q scale,
    GQA kept; RMSNorm eps / r with weights / sqrt(r); MLP zero-padded; lm_head columns padded;
    d2t / t2d as they are.
    """
    as_llama = {**draft_cfg, "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1}
    p = plan(as_llama, {**shape, "num_hidden_layers": 1}, dtype)
    s, b = p["small"], p["big"]
    hs, hb = s["hidden_size"], b["hidden_size"]
    hts = draft_cfg.get("target_hidden_size") or hs
    if hts != hs:
        raise ValueError(f"the draft reads aux states {hts} wide but is {hs} wide: only a draft of the small target's width inflates")
    k = sd["fc.weight"].shape[1] // hts
    q_rows = head_rows(s["num_attention_heads"], s["head_dim"], b["head_dim"])
    kv_rows = head_rows(s["num_key_value_heads"], s["head_dim"], b["head_dim"])
    q_out, kv_out, inter = b["num_attention_heads"] * b["head_dim"], b["num_key_value_heads"] * b["head_dim"], b["intermediate_size"]
    m = "midlayer."
    out = {}

    def zeros(*size):
        return torch.zeros(size, dtype=dtype)

    fc = zeros(hb, k * hb)
    for j in range(k):
        fc[:hs, j * hb:j * hb + hts] = sd["fc.weight"][:, j * hts:(j + 1) * hts].float()
    out["fc.weight"] = fc
    for name, rows, n_out, scale in (("q_proj", q_rows, q_out, p["q_scale"]), ("k_proj", kv_rows, kv_out, 1.0),
                                     ("v_proj", kv_rows, kv_out, 1.0)):
        small, t = sd[f"{m}self_attn.{name}.weight"].float() * scale, zeros(n_out, 2 * hb)
        t[rows, :hs] = small[:, :hs].to(dtype)  # input_layernorm(embed) half
        t[rows, hb:hb + hs] = small[:, hs:].to(dtype)  # hidden_norm(state) half
        out[f"{m}self_attn.{name}.weight"] = t
    o = zeros(hb, q_out)
    o[:hs, q_rows] = sd[f"{m}self_attn.o_proj.weight"].float().to(dtype)
    out[f"{m}self_attn.o_proj.weight"] = o
    i_s = sd[f"{m}mlp.gate_proj.weight"].shape[0]
    for name in ("gate_proj", "up_proj"):
        t = zeros(inter, hb)
        t[:i_s, :hs] = sd[f"{m}mlp.{name}.weight"].float()
        out[f"{m}mlp.{name}.weight"] = t
    down = zeros(hb, inter)
    down[:hs, :i_s] = sd[f"{m}mlp.down_proj.weight"].float()
    out[f"{m}mlp.down_proj.weight"] = down
    for name in DRAFT_NORMS:
        t = zeros(hb)
        t[:hs] = sd[name].float() * p["norm_scale"]
        out[name] = t
    lm = zeros(sd["lm_head.weight"].shape[0], hb)
    lm[:, :hs] = sd["lm_head.weight"].float()
    out["lm_head.weight"] = lm
    out["d2t"], out["t2d"] = sd["d2t"].clone(), sd["t2d"].clone()
    if unknown := set(sd) - set(out):
        raise ValueError(f"the draft has tensors this inflation does not know: {sorted(unknown)}")
    big_cfg = {key: v for key, v in draft_cfg.items() if key != "target_hidden_size"}
    big_cfg.update({key: b[key] for key in ("hidden_size", "intermediate_size", "num_attention_heads",
                                            "num_key_value_heads", "head_dim")})
    big_cfg["rms_norm_eps"] = p["eps"]
    big_cfg["torch_dtype"] = str(dtype).removeprefix("torch.")
    return big_cfg, out


def inflate_draft(small_draft: Path, out: Path, shape: dict, m: int, dtype_name: str | None = None) -> dict:
    """Write the draft of the small target, inflated to the twin's width, to `out` (SGLang layout).

    m: twin layers per small layer (the capture ids are mapped with capture_layers_for_twin).
    dtype_name: default the small draft's torch_dtype. Returns the written config.json.
    """
    from safetensors import safe_open

    from draftlab.sglang.checkpoint import WEIGHTS, check_tensors, config_from_exported

    small_draft, out = Path(small_draft), Path(out)
    cfg = json.loads((small_draft / "config.json").read_text())
    ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        raise ValueError(f"{small_draft}/config.json names no eagle_config.eagle_aux_hidden_state_layer_ids: "
                         "SGLang's default layers differ between the small target and the twin; export the ids")
    with safe_open(str(small_draft / WEIGHTS), framework="pt") as f:
        sd = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118  (safe_open is no dict)
    dtype_name = dtype_name or cfg.get("torch_dtype") or "bfloat16"
    dtype = DTYPES[dtype_name]
    big_cfg, tensors = inflate_draft_tensors(sd, cfg, shape, dtype)
    twin_ids = capture_layers_for_twin(list(ids), m)
    big_cfg["eagle_config"] = {**cfg["eagle_config"], "eagle_aux_hidden_state_layer_ids": twin_ids}
    extra = dict(big_cfg.get("draftlab") or {})
    if "physical_layers" in extra:  # Llama rule: id k captures physical k + 1
        extra["physical_layers"] = [k + 1 for k in sorted(twin_ids)]
    extra["inflated_from"] = {"hidden_size": cfg["hidden_size"], "eagle_aux_hidden_state_layer_ids": list(ids),
                              "layers_per_small_layer": m, "tool": "tools/make_twin.py inflate_draft"}
    big_cfg["draftlab"] = extra
    check_tensors(tensors, config_from_exported(big_cfg), dtype, where=f"inflated draft {out}")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-"))
    try:
        save_file({k: v.contiguous() for k, v in tensors.items()}, tmp / WEIGHTS, metadata={"format": "pt"})
        canonicalize_safetensors_file(tmp / WEIGHTS)
        (tmp / "config.json").write_text(json.dumps(big_cfg, indent=2, sort_keys=True) + "\n")
        make_readable(tmp)
        atomic_replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    n = sum(t.numel() for name, t in tensors.items() if name not in ("d2t", "t2d"))
    print(f"draft: {small_draft} (hidden {cfg['hidden_size']}) -> {out} (hidden {big_cfg['hidden_size']}, "
          f"{n:,} parameters, capture ids {list(ids)} -> {twin_ids})", flush=True)
    return big_cfg


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", default="models/tiny-target", help="directory of the small Llama")
    ap.add_argument("--out", default=None, help="directory to write the twin to (replaced atomically)")
    ap.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES), help="preset body; flags below override it")
    for key, flag in zip(SHAPE_KEYS, ("--hidden-size", "--num-layers", "--num-heads", "--num-kv-heads",
                                      "--head-dim", "--intermediate-size")):
        ap.add_argument(flag, dest=key, type=int, default=None)
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    ap.add_argument("--shard-gb", type=float, default=4.0, help="bytes per safetensors shard, in GB (1e9)")
    ap.add_argument("--draft", default=None, help="an EAGLE-3 draft of --small (SGLang layout) to inflate to the twin's width")
    ap.add_argument("--draft-out", default=None, help="directory to write the inflated draft to (with --draft)")
    args = ap.parse_args(argv)
    if args.out is None and args.draft is None:
        ap.error("nothing to do: pass --out (the twin) and/or --draft with --draft-out (the inflated draft)")
    if (args.draft is None) != (args.draft_out is None):
        ap.error("--draft and --draft-out go together")
    shape = {k: getattr(args, k) if getattr(args, k) is not None else v for k, v in SHAPES[args.shape].items()}
    custom = any(getattr(args, k) is not None for k in SHAPE_KEYS)
    info = {}
    try:
        if args.out is not None:
            info = make_twin(Path(args.small), Path(args.out), shape, "custom" if custom else args.shape, args.dtype, args.shard_gb)
        if args.draft is not None:
            small_layers = json.loads((Path(args.small) / "config.json").read_text())["num_hidden_layers"]
            if shape["num_hidden_layers"] % small_layers:
                raise ValueError(f"num_hidden_layers: {shape['num_hidden_layers']} is not a multiple of {small_layers}")
            info["draft_config"] = inflate_draft(Path(args.draft), Path(args.draft_out), shape,
                                                 shape["num_hidden_layers"] // small_layers, args.dtype)
    except ValueError as e:
        raise SystemExit(f"make_twin: {e}") from None
    return info


if __name__ == "__main__":
    main()
