"""tools/micro_targets.py and tools/families_report.py on a CPU: the tiny
targets (one per family) and the report of the committed families.json (no SGLang here)."""
import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from draftlab.params import load_params
from tests.support.tools import load_tool

ROOT = Path(__file__).resolve().parents[1]


mt = load_tool("micro_targets")
FAMILIES = ["llama", "qwen3", "qwen3-moe", "deepseek-v3", "kimi-k2.5", "gpt-oss"]  # the report's order
report = load_tool("families_report")


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    out = tmp_path_factory.mktemp("targets")
    return {name: mt.build(name, out / name) for name in FAMILIES}


def test_every_family_has_a_target_transformers_loads_with_the_keys_sglang_reads(targets):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert set(targets) == set(mt.FAMILIES)
    for name, t in targets.items():
        config = json.loads((t["pipeline"] / "config.json").read_text())
        for key, value in mt.family(name).sglang_keys.items():
            assert config[key] == value, (name, key)
        model = AutoModelForCausalLM.from_pretrained(t["pipeline"], dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(t["pipeline"])
        ids = tok.apply_chat_template([{"role": "user", "content": "2+2?"}], add_generation_prompt=True, return_dict=False)
        with torch.no_grad():
            hs = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
        assert len(hs) == mt.NUM_LAYERS + 1 and hs[0].shape[-1] == mt.HIDDEN, name
        assert t["num_layers"] == mt.NUM_LAYERS and torch.isfinite(hs[-1]).all(), name
    deepseek = json.loads((targets["deepseek-v3"]["pipeline"] / "config.json").read_text())
    assert {"moe_layer_freq", "topk_method", "scoring_func"} <= set(deepseek)  # what SGLang's deepseek_v2 needs
    assert json.loads((targets["gpt-oss"]["pipeline"] / "config.json").read_text())["swiglu_limit"] == 7.0


def test_the_same_seed_rebuilds_the_same_weights(targets, tmp_path):
    again = mt.build("qwen3-moe", tmp_path / "again")
    assert again["weights_sha256"] == targets["qwen3-moe"]["weights_sha256"]
    assert mt.build("qwen3-moe", tmp_path / "other", seed=1)["weights_sha256"] != again["weights_sha256"]


def test_kimi_is_served_from_a_kimi_checkpoint_of_the_same_language_model(targets):
    t = targets["kimi-k2.5"]
    assert t["serve"] != t["pipeline"] and t["architecture"] == "KimiK25ForConditionalGeneration"
    config = json.loads((t["serve"] / "config.json").read_text())
    assert config["architectures"] == ["KimiK25ForConditionalGeneration"] and config["model_type"] == "kimi_k25"
    assert config["text_config"]["architectures"] == ["DeepseekV3ForCausalLM"]
    assert config["text_config"]["topk_method"] == "noaux_tc" and config["vision_config"]["text_hidden_size"] == mt.HIDDEN
    lm, served = load_file(t["pipeline"] / "model.safetensors"), load_file(t["serve"] / "model.safetensors")
    assert set(served) == {f"language_model.{k}" for k in lm}
    assert all(torch.equal(served[f"language_model.{k}"], v) for k, v in lm.items())
    assert (t["serve"] / "tokenizer.json").exists()


def by_id(rows):
    return {r["id"]: r for r in rows}


def test_the_report_has_one_row_per_family_and_layout_and_says_where_each_comes_from(tmp_path):
    record = {"versions": {"sglang": "0.5.14", "torch": "2.11.0", "transformers": "5.8.1", "gpu": "NVIDIA H200"},
              "settings": {"server_args": ["--disable-cuda-graph"], "cuda_graphs": "off", "rtol": 0.05, "num_layers": 8},
              "rows": {"deepseek-v3 [embedding, 3, 5]": {"family": "deepseek-v3", "label": "DeepSeek-V3", "architecture": "DeepseekV3ForCausalLM",
                                                        "sglang_version": "0.5.14", "layout": ["embedding", 3, 5], "ids_exported": [0, 4, 6],
                                                        "fed_physical": [0, 4, 6], "trained_physical": [0, 4, 6], "max_rel_err": 0.0061,
                                                        "verdict": "parity clean", "source": "measured on real SGLang 0.5.14",
                                                        "server_log_tail": "rows/x/server-tail.log", "status": "measured"},
                       "llama [embedding, 3, 5]": {"family": "llama", "label": "Llama", "architecture": "LlamaForCausalLM",
                                                   "sglang_version": "0.5.14", "layout": ["embedding", 3, 5], "status": "refused",
                                                   "refusal": "SGLang 0.5.14 cannot capture the embedding output",
                                                   "verdict": "refused by the project's rules", "source": "read from source (the project's rules)"}}}
    src = tmp_path / "families.json"
    src.write_text(json.dumps(record))
    assert report.main([str(src), str(tmp_path / "out")]) == 0
    md = (tmp_path / "out" / "README.md").read_text()
    table = [x for x in md.splitlines() if x.startswith("| ") and "---" not in x][1:]
    assert len(table) == 2 and table[0].startswith("| Llama |")  # the family order, not the file's
    assert "| [embedding, 3, 5] | [0, 4, 6] | [0, 4, 6] | 0.0061 | parity clean | measured on real SGLang 0.5.14 |" in table[1]
    assert "read from source" in table[0] and "cannot capture the embedding output" in md and "SGLang 0.5.14" in md
    out = json.loads((tmp_path / "out" / "results.json").read_text())
    assert [r["family"] for r in out["rows"]] == ["llama", "deepseek-v3"] and "server_log_tail" not in out["rows"][1]
    assert report.main([str(tmp_path / "missing.json"), str(tmp_path / "out")]) == 2


