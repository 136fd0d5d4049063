"""tools/make_twin.py and tools/check_twin.py: a twin of models/tiny-target at a reduced shape computes
the tiny target's function (float32, CPU), its capture-layer map is right, and bad shapes are refused."""
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from draftlab.data import tasks
from tests.support.tools import load_tool

ROOT = Path(__file__).resolve().parents[1]
SMALL = ROOT / "models" / "tiny-target"
# twice the tiny target in every dimension: hidden ratio 2, head dim ratio 2, 2 layers per small layer
REDUCED = ["--hidden-size", "512", "--num-layers", "16", "--num-heads", "16", "--num-kv-heads", "4",
           "--head-dim", "64", "--intermediate-size", "1536"]
RTOL = 1e-5  # of the largest |value|: float32 sums in another order over padded dims (measured ~5e-7)


make_twin, check_twin = load_tool("make_twin"), load_tool("check_twin")


@pytest.fixture(scope="module")
def twin_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("twin") / "tiny-twin"
    make_twin.main(["--small", str(SMALL), "--out", str(out), "--dtype", "float32", "--shard-gb", "0.1", *REDUCED])
    return out


@pytest.fixture(scope="module")
def models(twin_dir):
    small = AutoModelForCausalLM.from_pretrained(SMALL, local_files_only=True).eval()
    twin = AutoModelForCausalLM.from_pretrained(twin_dir, local_files_only=True).eval()
    return small, twin


def real_batches(n=3):
    """Held-out problems rendered with their answers, each one sequence (no padding)."""
    tok = AutoTokenizer.from_pretrained(SMALL, local_files_only=True)
    return [tok(tok.apply_chat_template(p.messages(), tokenize=False), return_tensors="pt", add_special_tokens=False)
            for p in tasks.generate(n, seed=0, split="heldout")]


def assert_close(big, small, what):
    diff, scale = (big - small).abs().max().item(), small.abs().max().item()
    assert diff <= RTOL * scale, f"{what}: max |diff| {diff:.3g} > {RTOL:g} x max |value| {scale:.3g}"


def test_written_twin_has_the_bigger_shape_sharded_with_the_small_tokenizer(twin_dir):
    cfg, small_cfg = (json.loads((d / "config.json").read_text()) for d in (twin_dir, SMALL))
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_key_value_heads"], cfg["head_dim"]) == (512, 16, 4, 64)
    assert cfg["rms_norm_eps"] == pytest.approx(small_cfg["rms_norm_eps"] / 2)
    for key in ("vocab_size", "max_position_embeddings", "eos_token_id", "pad_token_id", "rope_parameters"):
        assert cfg.get(key) == small_cfg.get(key), key
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (twin_dir / name).read_bytes() == (SMALL / name).read_bytes(), name
    index = json.loads((twin_dir / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 2 and all((twin_dir / s).exists() for s in shards)
    info = json.loads((twin_dir / "twin.json").read_text())
    assert info["parameters"] == index["metadata"]["total_parameters"] == 60_834_304 > info["nonzero"]
    assert info["capture_layer_map"]["1"] == 3 and "[3, 7, 11]" in (twin_dir / "README.md").read_text()
    assert not [p for p in twin_dir.parent.iterdir() if p.name.startswith(".")]  # no temp dir left behind


def test_logits_and_mapped_hidden_states_equal_the_small_models(models):
    small, twin = models
    m = twin.config.num_hidden_layers // small.config.num_hidden_layers
    H = small.config.hidden_size
    with torch.no_grad():
        for enc in real_batches():
            a, b = small(**enc, output_hidden_states=True), twin(**enc, output_hidden_states=True)
            assert_close(b.logits, a.logits, "logits")
            assert torch.equal(a.logits.argmax(-1), b.logits.argmax(-1))
            L = small.config.num_hidden_layers
            for k in range(L):  # hidden_states[k + 1] = output of layer k (the last one after the final norm)
                for j in range(k * m, k * m + m) if k < L - 1 else [L * m - 1]:  # every twin layer of the block
                    assert_close(b.hidden_states[j + 1][..., :H], a.hidden_states[k + 1], f"layer {k} / twin {j}")
                    assert not b.hidden_states[j + 1][..., H:].any(), f"twin layer {j}: padded dims not zero"
            for k, j in zip([1, 3, 5], make_twin.capture_layers_for_twin([1, 3, 5], m)):
                assert_close(b.hidden_states[j + 1][..., :H], a.hidden_states[k + 1], f"capture {k} -> {j}")


def test_rotary_pairs_must_keep_their_frequency(monkeypatch):
    """Negative control: copying head dims contiguously (d -> d) instead of by rotary pair breaks the function."""
    small_cfg = json.loads((SMALL / "config.json").read_text())
    sd = load_file(SMALL / "model.safetensors")
    shape = dict(hidden_size=256, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
                 head_dim=64, intermediate_size=768)
    monkeypatch.setattr(make_twin, "head_rows", lambda n, hs, hb: (torch.arange(n)[:, None] * hb + torch.arange(hs)).flatten())
    cfg, tensors = make_twin.inflate_state_dict(sd, small_cfg, shape)
    wrong = LlamaForCausalLM(LlamaConfig(**cfg)).eval()
    wrong.load_state_dict(dict(tensors))
    small = LlamaForCausalLM.from_pretrained(SMALL, local_files_only=True).eval()
    enc = real_batches(1)[0]
    with torch.no_grad():
        diff = (wrong(**enc).logits - small(**enc).logits).abs().max().item()
    assert diff > 0.1, diff


def test_capture_layer_map():
    assert make_twin.capture_layers_for_twin([1, 3, 5], 4) == [7, 15, 23]
    assert make_twin.capture_layers_for_twin([0, 6], 2) == [1, 13]
    assert make_twin.capture_layers_for_twin([1, 3, 5], 1) == [1, 3, 5]
    with pytest.raises(ValueError, match="default.*list them"):
        make_twin.capture_layers_for_twin("default", 4)
    with pytest.raises(ValueError, match="out of range"):
        make_twin.capture_layers_for_twin([7], 4, num_small_layers=8)  # the last layer's output: not capturable


@pytest.mark.parametrize("change, dtype, word", [
    ({"num_key_value_heads": 16}, torch.float32, "num_key_value_heads"),  # 2 q heads per kv head, not 4
    ({"num_hidden_layers": 12}, torch.float32, "num_hidden_layers"),  # 1.5 layers per small layer
    ({"head_dim": 48}, torch.float32, "head_dim"),  # rotary pairs cannot keep their frequencies
    ({"hidden_size": 128}, torch.float32, "hidden_size"),  # smaller than the small model
    ({"hidden_size": 512}, torch.bfloat16, "hidden_size"),  # w / sqrt(2) rounds in bf16
])
def test_refused_shapes_name_the_dimension(change, dtype, word):
    small_cfg = json.loads((SMALL / "config.json").read_text())
    shape = {**make_twin.SHAPES["llama-3.1-8b"], **change}
    with pytest.raises(ValueError, match=word):
        make_twin.inflate_state_dict({}, small_cfg, shape, dtype)


def test_cli_refuses_before_writing(tmp_path):
    out = tmp_path / "twin"
    with pytest.raises(SystemExit, match="num_hidden_layers.*multiple"):
        make_twin.main(["--small", str(SMALL), "--out", str(out), "--num-layers", "12"])
    assert list(tmp_path.iterdir()) == []


def test_bf16_weights_are_exact_at_power_of_four_ratios():
    """The 8B ratios (hidden 16x, head dim 4x) scale by 1/4 and 2: bf16 holds the scaled weights exactly."""
    small_cfg = json.loads((SMALL / "config.json").read_text())
    sd = load_file(SMALL / "model.safetensors")
    shape = dict(hidden_size=1024, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
                 head_dim=128, intermediate_size=768)
    _, tensors = make_twin.inflate_state_dict(sd, small_cfg, shape, torch.bfloat16)
    big = dict(tensors)
    q, norm = sd["model.layers.0.self_attn.q_proj.weight"], sd["model.layers.0.input_layernorm.weight"]
    assert torch.equal(big["model.layers.0.input_layernorm.weight"][:256].float(), norm.bfloat16().float() / 2)
    rows = make_twin.head_rows(8, 32, 128)
    assert torch.equal(big["model.layers.0.self_attn.q_proj.weight"][rows, :256].float(), q.bfloat16().float() * 2)


def test_check_twin_reports_full_agreement_in_float32(twin_dir, tmp_path):
    out = tmp_path / "check.json"
    report = check_twin.main(["--small", str(SMALL), "--twin", str(twin_dir), "--device", "cpu", "--dtype", "float32",
                              "--num-prompts", "3", "--max-new-tokens", "16", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    assert report["prompts_identical"] == 1.0 and report["passed"] and report["first_divergence"] == [None] * 3
    assert report["generated_tokens"]["small"] == report["generated_tokens"]["twin"] > 3
    assert report["prefill"]["relative"] < RTOL and report["prefill"]["argmax_agree"] == 1.0


# ---------------------------------------------------------------------------------------------
# the draft, inflated to the twin's width

def small_draft_dir(tmp_path) -> Path:
    """A random EAGLE-3 draft of the tiny target in SGLang's layout (reduced draft vocab, norms not all ones)."""
    from safetensors.torch import save_file

    from draftlab.train.draft import DraftConfig, Eagle3Draft
    from draftlab.sglang.checkpoint import WEIGHTS, sglang_config

    target = json.loads((SMALL / "config.json").read_text())
    target = {**target, "head_dim": target.get("head_dim")}
    cfg = DraftConfig.from_target(target, num_aux_layers=3, draft_vocab_size=512)
    torch.manual_seed(0)
    draft = Eagle3Draft(cfg)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    ids = torch.randperm(cfg.vocab_size)[:cfg.draft_vocab_size].sort().values
    t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    t2d[ids] = True
    draft.set_vocab(ids - torch.arange(cfg.draft_vocab_size), t2d)
    out = tmp_path / "small-draft"
    out.mkdir()
    save_file({k: v.contiguous() for k, v in draft.state_dict().items()}, out / WEIGHTS)
    config = sglang_config(cfg, [1, 3, 5], "float32", target, {"physical_layers": [2, 4, 6]})
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_inflated_draft_on_the_twin_gives_the_small_drafts_logits(tmp_path, twin_dir, models):
    """The reduced twin's aux states + the inflated draft = the tiny target's aux states + the small
    draft: the same draft logits (float32 rounding), two draft steps, loaded by draftlab's own loader."""
    from draftlab.train.draft import KVCache
    from draftlab.sglang.checkpoint import load_exported

    small_dir, big_dir = small_draft_dir(tmp_path), tmp_path / "big-draft"
    make_twin.main(["--small", str(SMALL), "--draft", str(small_dir), "--draft-out", str(big_dir), "--dtype", "float32", *REDUCED])
    cfg = json.loads((big_dir / "config.json").read_text())
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [3, 7, 11]  # small [1, 3, 5], 2 twin layers each
    assert cfg["draftlab"]["physical_layers"] == [4, 8, 12] and "target_hidden_size" not in cfg
    assert (cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"],
            cfg["intermediate_size"]) == (512, 16, 4, 64, 1536)
    assert cfg["rms_norm_eps"] == pytest.approx(json.loads((small_dir / "config.json").read_text())["rms_norm_eps"] / 2)
    small_target, twin = models
    small, _ = load_exported(small_dir, embed=small_target.model.embed_tokens.weight)
    big, _ = load_exported(big_dir, embed=twin.model.embed_tokens.weight)
    assert torch.equal(big.d2t, small.d2t) and torch.equal(big.t2d, small.t2d)
    H = small.config.hidden_size
    with torch.no_grad():
        for enc in real_batches(2):
            hs_s = small_target(**enc, output_hidden_states=True).hidden_states
            hs_b = twin(**enc, output_hidden_states=True).hidden_states
            aux_s = torch.cat([hs_s[k + 1] for k in (1, 3, 5)], -1)
            aux_b = torch.cat([hs_b[k + 1] for k in cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]], -1)
            ids = enc["input_ids"]
            T = ids.shape[1] - 1
            pos = torch.arange(T)[None]
            caches = KVCache(), KVCache()
            states = small.project(aux_s[:, :-1]), big.project(aux_b[:, :-1])
            for step in range(2):  # the second step feeds back each draft's own state, as serving does
                (ls, ss), (lb, sb) = (d(ids[:, 1:], h, pos + step, c) for d, h, c in zip((small, big), states, caches))
                assert_close(lb, ls, f"draft logits, step {step}")
                assert torch.equal(lb.argmax(-1), ls.argmax(-1))
                assert_close(sb[..., :H], ss, f"draft state, step {step}")
                assert not sb[..., H:].any(), "padded state dims not zero"
                states = ss, sb


def test_inflate_draft_refuses_a_draft_without_capture_ids(tmp_path):
    small_dir = small_draft_dir(tmp_path)
    cfg = json.loads((small_dir / "config.json").read_text())
    del cfg["eagle_config"]
    (small_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SystemExit, match="eagle_aux_hidden_state_layer_ids"):
        make_twin.main(["--small", str(SMALL), "--draft", str(small_dir), "--draft-out", str(tmp_path / "big"),
                        "--dtype", "float32", *REDUCED])
    assert not (tmp_path / "big").exists()


def test_inflated_8b_draft_tensors_have_sglangs_shapes_in_bf16():
    """At the real 8B shape (a draft vocab of 32 to keep it small): SGLang's names and shapes, exact bf16 scales."""
    from draftlab.sglang.checkpoint import check_tensors, config_from_exported

    small_cfg = json.loads((SMALL / "config.json").read_text())
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": 256, "intermediate_size": 768, "num_attention_heads": 8,
           "num_key_value_heads": 2, "head_dim": 32, "rms_norm_eps": 1e-6, "vocab_size": small_cfg["vocab_size"],
           "draft_vocab_size": 32, "max_position_embeddings": 512, "rope_theta": 10000.0, "rope_scaling": None,
           "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 5]}}
    g = torch.Generator().manual_seed(0)
    shapes = {"fc.weight": (256, 768), "midlayer.self_attn.q_proj.weight": (256, 512), "midlayer.self_attn.k_proj.weight": (64, 512),
              "midlayer.self_attn.v_proj.weight": (64, 512), "midlayer.self_attn.o_proj.weight": (256, 256),
              "midlayer.mlp.gate_proj.weight": (768, 256), "midlayer.mlp.up_proj.weight": (768, 256),
              "midlayer.mlp.down_proj.weight": (256, 768), "lm_head.weight": (32, 256),
              **{name: (256,) for name in make_twin.DRAFT_NORMS}}
    sd = {k: torch.randn(s, generator=g).bfloat16() for k, s in shapes.items()}
    sd["d2t"], sd["t2d"] = torch.zeros(32, dtype=torch.int64), torch.arange(cfg["vocab_size"]) < 32
    big_cfg, big = make_twin.inflate_draft_tensors(sd, cfg, make_twin.SHAPES["llama-3.1-8b"], torch.bfloat16)
    big_cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [7, 15, 23]}
    check_tensors(big, config_from_exported(big_cfg), torch.bfloat16)
    assert big["fc.weight"].shape == (4096, 3 * 4096) and big_cfg["rms_norm_eps"] == pytest.approx(1e-6 / 16)
    assert torch.equal(big["fc.weight"][:256, 2 * 4096:2 * 4096 + 256], sd["fc.weight"][:, 512:])
    assert not big["fc.weight"][:, 256:4096].any() and not big["fc.weight"][256:].any()
    rows = make_twin.head_rows(8, 32, 128)
    q = sd["midlayer.self_attn.q_proj.weight"]
    assert torch.equal(big["midlayer.self_attn.q_proj.weight"][rows][:, 4096:4096 + 256].float(), q[:, 256:].float() * 2)
    assert torch.equal(big["midlayer.hidden_norm.weight"][:256].float(), sd["midlayer.hidden_norm.weight"].float() / 4)


# --- SmolLM2's shape: 9 heads over 3 KV heads (a GQA group of 3), tied embeddings ----------------

SMOLLM2 = dict(architectures=["LlamaForCausalLM"], hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
               num_key_value_heads=3, head_dim=64, intermediate_size=1536, tie_word_embeddings=True, vocab_size=49152,
               rms_norm_eps=1e-5, rope_parameters={"rope_theta": 100000.0, "rope_type": "default"})


def test_the_smollm2_preset_holds_smollm2_exactly_in_bf16_at_8b_bytes_per_token():
    """The preset is a valid, bf16-exact body for SmolLM2's config, reading what Llama-3.1-8B reads per token."""
    p = make_twin.plan(SMOLLM2, make_twin.SHAPES["smollm2-at-8b-cost"], torch.bfloat16)
    assert (p["r"], p["f"], p["m"], p["norm_scale"]) == (4.0, 1, 1, 0.5)
    twin = make_twin.decode_params(make_twin.SHAPES["smollm2-at-8b-cost"], 49152, tied=True)
    llama = make_twin.decode_params(make_twin.SHAPES["llama-3.1-8b"], 128256, tied=False)
    assert abs(twin / llama - 1) < 0.025, (twin, llama)
    with pytest.raises(ValueError, match="GQA group of 3"):  # Llama-3.1-8B's own heads (group 4) cannot hold it
        make_twin.plan(SMOLLM2, {**make_twin.SHAPES["llama-3.1-8b"], "num_hidden_layers": 30}, torch.float32)


def test_a_twin_of_a_smollm2_shaped_model_computes_its_function(tmp_path):
    """A micro model of SmolLM2's layout (GQA 3, tied, rope theta 1e5) and its twin at the preset's ratios."""
    torch.manual_seed(0)
    cfg = LlamaConfig(**{**SMOLLM2, "hidden_size": 72, "num_hidden_layers": 3, "head_dim": 8, "intermediate_size": 96,
                         "vocab_size": 256})
    small = LlamaForCausalLM(cfg).eval()
    small.save_pretrained(tmp_path / "small")
    shape = ["--hidden-size", "288", "--num-layers", "6", "--num-heads", "36", "--num-kv-heads", "12",
             "--head-dim", "8", "--intermediate-size", "1000"]
    make_twin.main(["--small", str(tmp_path / "small"), "--out", str(tmp_path / "twin"), "--dtype", "float32",
                    "--shape", "smollm2-at-8b-cost", *shape])
    twin = AutoModelForCausalLM.from_pretrained(tmp_path / "twin", local_files_only=True).eval()
    assert twin.config.tie_word_embeddings and "lm_head.weight" not in load_file(next((tmp_path / "twin").glob("*.safetensors")))
    ids = torch.randint(0, 256, (2, 40))
    with torch.no_grad():
        a, b = small(ids, output_hidden_states=True), twin(ids, output_hidden_states=True)
    assert_close(b.logits, a.logits, "logits")
    assert torch.equal(a.logits.argmax(-1), b.logits.argmax(-1))
    assert_close(b.hidden_states[2][..., :72], a.hidden_states[1], "layer 0 / twin 1")  # capture id 0 -> 1
