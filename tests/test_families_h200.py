"""tools/families_h200.py, tools/micro_targets.py and tools/families_report.py on a CPU: the tiny
targets, the per-row plan, the deadline and resume logic, and the report (no SGLang here)."""
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
fam = load_tool("families_h200")
report = load_tool("families_report")


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    out = tmp_path_factory.mktemp("targets")
    return {name: mt.build(name, out / name) for name in fam.FAMILY_ORDER}


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


def test_the_plan_follows_the_projects_rules_per_family_on_0_5_14():
    rows = by_id(fam.plan(fam.FAMILY_ORDER, "0.5.14"))
    # Llama: the embedding is refused (SGLang 0.5.14 crashes on it); decoder layer 0's output takes its place.
    llama = rows["llama [embedding, 3, 5]"]
    assert llama["status"] == "refused" and "TypeError" in llama["refusal"] and "0.5.22" in llama["refusal"]
    assert rows["llama [0, 3, 6]"]["ids_expected"] == [0, 3, 6] and rows["llama [0, 3, 6]"]["trained_physical"] == [1, 4, 7]
    assert rows["llama [1, 3, 5]"]["ids_expected"] == [1, 3, 5]
    # Qwen3 MoE: id -1 for the embedding. Qwen3 dense: refused (0.5.14 feeds an overwritten tensor), with a fallback.
    assert rows["qwen3-moe [embedding, 3, 5]"]["ids_expected"] == [-1, 3, 5] and "qwen3-moe [0, 3, 6]" not in rows
    assert rows["qwen3 [embedding, 3, 5]"]["status"] == "refused" and "in place" in rows["qwen3 [embedding, 3, 5]"]["refusal"]
    assert rows["qwen3 [0, 3, 6]"]["ids_expected"] == [0, 3, 6]
    # DeepSeek-V3 and Kimi-K2.5: the embedding as-is (first id 0), [1, 3, 5] through the +1 mode.
    for name in ("deepseek-v3", "kimi-k2.5"):
        emb = rows[f"{name} [embedding, 3, 5]"]
        assert (emb["status"], emb["trained_physical"], emb["ids_expected"]) == ("planned", [0, 4, 6], [0, 4, 6])
        assert rows[f"{name} [1, 3, 5]"]["ids_expected"] == [1, 3, 5]
    # gpt-oss on 0.5.14 and 0.5.17: the embedding is refused (a crash, then an overwritten tensor); from 0.5.21 it is id -1.
    assert rows["gpt-oss [embedding, 3, 5]"]["status"] == "refused" and rows["gpt-oss [0, 3, 6]"]["status"] == "planned"
    assert "in place" in by_id(fam.plan(["gpt-oss"], "0.5.17"))["gpt-oss [embedding, 3, 5]"]["refusal"]
    assert by_id(fam.plan(["gpt-oss"], "0.5.21"))["gpt-oss [embedding, 3, 5]"]["ids_expected"] == [-1, 3, 5]
    # Every family gets at least two layouts that run.
    for name in fam.FAMILY_ORDER:
        assert sum(r["family"] == name and r["status"] == "planned" for r in rows.values()) >= 2, name


def test_deepseek_before_0_5_14_falls_back_to_a_layout_its_rule_can_take():
    rows = by_id(fam.plan(["deepseek-v3"], "0.5.13"))
    assert rows["deepseek-v3 [embedding, 3, 5]"]["status"] == "refused"
    assert rows["deepseek-v3 [2, 4, 6]"]["ids_expected"] == [3, 5, 7]  # as-is from 0.5.13: physical [3, 5, 7]


def test_a_rows_params_are_valid_params_of_the_pipeline(tmp_path):
    sglang_run = load_tool("sglang_run")
    override = fam.row_params("models/pipeline", ["embedding", 3, 5], "0.5.14")
    merged = sglang_run.merge(sglang_run.merge(yaml.safe_load((ROOT / "params.yaml").read_text()), sglang_run.SGLANG_PARAMS), override)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(merged))
    p = load_params(["target", "capture", "export", "bench", "check", "train", "prompts", "synth", "standardize"], tmp_path / "params.yaml")
    assert p.capture.layers == ["embedding", 3, 5] and p.target.model == "models/pipeline" and p.export.sglang_version == "0.5.14"
    assert p.target.dtype == "bfloat16" and p.target.device == "cpu"  # SGLang's dtype, the CPU for the stages
    assert "--disable-cuda-graph" in p.bench.extra_server_args and p.check.fail_on_error is False
    assert p.standardize.draft_vocab_size <= mt.VOCAB


def test_deadline_and_resume_decide_what_runs():
    ok, why = fam.fits(100, "pipeline", "parity")
    assert not ok and "165 s expected" in why and "100 s left" in why
    assert fam.fits(200, "parity")[0]
    rows = fam.plan(["llama"], "0.5.14")
    done = {"llama [1, 3, 5]": {"status": "measured"}, "llama [0, 3, 6]": {"status": "failed"}}
    assert [r["id"] for r in fam.todo(rows, done)] == ["llama [0, 3, 6]"]  # measured and refused rows are not re-run
    done["llama [0, 3, 6]"]["status"] = "not served"
    assert fam.todo(rows, done) == []


def _args(results, **kw):
    return fam.parse_args(["--results", str(results), "--families", "llama,qwen3", "--backend", "reference", *kw.get("extra", [])])


def test_the_run_writes_each_row_and_a_rerun_skips_finished_rows(tmp_path, monkeypatch):
    calls = []

    def pipeline(self, row, target):
        calls.append(("pipeline", row["id"]))
        return {"status": "trained", "pipeline_s": 1.0}

    def parity(self, row, target):
        calls.append(("parity", row["id"]))
        assert (self.path).exists()  # rows before this one are already on disk
        if row["family"] == "qwen3" and row["layout"] == [1, 3, 5]:
            return {"status": "not served", "error_lines": ["ValueError: no kernel"], "parity_s": 2.0}
        physical = row["trained_physical"]
        return {"status": "measured", "fed_physical": physical, "max_rel_err": 0.004, "ids_exported": row["ids_expected"], "parity_s": 2.0}

    monkeypatch.setattr(fam.Families, "pipeline", pipeline)
    monkeypatch.setattr(fam.Families, "parity", parity)
    assert fam.Families(_args(tmp_path)).run() == 0
    rec = json.loads((tmp_path / "families.json").read_text())["rows"]
    assert rec["llama [embedding, 3, 5]"]["status"] == "refused"
    assert rec["llama [1, 3, 5]"]["verdict"] == "parity clean" and rec["llama [1, 3, 5]"]["seconds"] == 3.0
    assert rec["qwen3 [1, 3, 5]"]["verdict"] == "not served: ValueError: no kernel"
    first = len(calls)
    assert fam.Families(_args(tmp_path)).run() == 0
    assert len(calls) == first  # everything finished: nothing re-runs


def test_a_deadline_skips_rows_and_the_next_run_does_them(tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTLAB_THREADS", "1")
    assert fam.main(["--results", str(tmp_path), "--families", "llama", "--backend", "reference", "--deadline-s", "10"]) == 0
    rows = json.loads((tmp_path / "families.json").read_text())["rows"]
    assert rows["llama [1, 3, 5]"]["status"] == "skipped" and "expected" in rows["llama [1, 3, 5]"]["skipped"]
    assert [r["id"] for r in fam.todo(fam.plan(["llama"], "0.5.14"), rows)] == ["llama [1, 3, 5]", "llama [0, 3, 6]"]


def test_server_error_lines_and_parity_are_read_back():
    log = "INFO start\nWARNING x\nTraceback (most recent call last):\n  File a.py\nAttributeError: 'Cfg' has no attribute 'moe_layer_freq'\n"
    lines = fam.error_lines(log)
    assert lines[0].startswith("Traceback") and lines[-1] == "AttributeError: 'Cfg' has no attribute 'moe_layer_freq'"
    check = {"settings": {"eagle_aux_hidden_state_layer_ids": [0, 4, 6], "sglang_captures": [0, 4, 6]},
             "parity": {"tokens": 40, "slots": [{"best_match": f"physical {p}", "rel_err": e, "candidates": dict.fromkeys(range(10))}
                                                for p, e in ((0, 0.001), (4, 0.006), (6, 0.2))]},
             "findings": [{"name": "live_parity_ok", "severity": "ok-info"}, {"name": "x", "severity": "error"}]}
    got = fam.parity_of(check)
    assert got["fed_physical"] == [0, 4, 6] and got["max_rel_err"] == 0.2 and got["every_layer_compared"] and got["findings"] == ["x"]
    row = {"status": "measured", "trained_physical": [0, 4, 6], **got}
    assert fam.verdict(row, 0.05).startswith("right layers")
    assert fam.verdict({**row, "fed_physical": [1, 4, 6]}, 0.05) == "fed [1, 4, 6], trained [0, 4, 6]"


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


def test_kimi_servers_start_from_the_served_checkpoint_with_the_params_namespace(tmp_path):
    """The pipeline loads Kimi-K2.5's DeepSeek-V3 text model; its servers start from the KimiK25
    checkpoint. The params the driver gets are load_params' namespace of dataclass sections."""
    import types

    from draftlab.params import TargetParams

    class Base:
        def __init__(self, args):
            self.work = tmp_path / "work"
            (self.work / "models").mkdir(parents=True)

        def server(self, p, draft, flags, log, hidden=False):
            return p.target.model, p.bench

    serve = tmp_path / "kimi-serve"
    serve.mkdir()
    driver = fam._row_driver(Base)(None, serve)
    target = TargetParams(model="models/deepseek", revision=None, dtype="bfloat16", device="cpu")
    p = types.SimpleNamespace(target=target, bench="bench-section")
    model, bench = driver.server(p, None, None, tmp_path / "log")
    assert model == "models/serve-kimi-serve" and bench == "bench-section"
    assert (driver.work / "models" / "serve-kimi-serve").resolve() == serve.resolve()
    assert p.target.model == "models/deepseek"  # the pipeline's own params are left as they were


def test_a_refused_layout_is_served_anyway_from_its_fallbacks_draft(tmp_path):
    rows = by_id(fam.plan(["llama", "gpt-oss", "qwen3", "qwen3-moe"], "0.5.14"))
    # The ids a newer release would export for [embedding, 3, 5], served from the fallback row's draft.
    for name in ("llama", "gpt-oss", "qwen3"):
        refused = rows[f"{name} [embedding, 3, 5]"]
        assert refused["probe_ids"] == [-1, 3, 5] and refused["probe_from"] == f"{name} [0, 3, 6]"
    assert "probe_ids" not in rows["qwen3-moe [embedding, 3, 5]"]  # not refused: nothing to probe
    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "model.safetensors").write_bytes(b"weights")
    (draft / "config.json").write_text(json.dumps({"draftlab": {"capture_layers": [0, 3, 6]},
                                                   "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 3, 6], "use_aux_hidden_state": True}}))
    out = fam.with_ids(draft, tmp_path / "probe", [-1, 3, 5])
    config = json.loads((out / "config.json").read_text())
    assert config["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [-1, 3, 5], "use_aux_hidden_state": True}
    assert "draftlab" not in config and (out / "model.safetensors").read_bytes() == b"weights"
    assert json.loads((draft / "config.json").read_text())["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 3, 6]


def test_a_probe_says_whether_the_server_confirms_the_refusal():
    crashed = fam.probe_outcome(None, ["Traceback (most recent call last):", "TypeError: unsupported operand type(s) for +: 'Tensor' and 'NoneType'"])
    assert crashed.startswith("crashed: TypeError")
    served = fam.probe_outcome({"slots": [{"best_match": "physical 0"}, {"best_match": "physical 4"}, {"best_match": "physical 6"}]}, None)
    assert served == "served, fed [0, 4, 6]"
    assert fam.probe_outcome({"slots": [], "error": {"message": "timed out"}}, None) == "no answer: timed out"
    row = {"status": "refused", "probe": {"outcome": crashed}}
    assert fam.verdict(row, 0.05).startswith("refused by the project's rules; served anyway, SGLang crashed: TypeError")
    assert fam.verdict({**row, "probe": {"outcome": served}}, 0.05) == "refused by the project's rules, but SGLang served, fed [0, 4, 6]"
    assert fam.verdict({"status": "refused"}, 0.05) == "refused by the project's rules"


def test_each_refused_layout_is_probed_once_after_its_fallback_trains(tmp_path, monkeypatch):
    probes = []
    monkeypatch.setattr(fam.Families, "pipeline", lambda self, row, target: {"status": "trained", "pipeline_s": 1.0})
    monkeypatch.setattr(fam.Families, "parity", lambda self, row, target: {"status": "measured", "fed_physical": row["trained_physical"],
                                                                           "max_rel_err": 0.01, "parity_s": 1.0})

    def probe(self, refused, fallback, target):
        probes.append((refused["id"], fallback["id"]))
        assert self.record["rows"][fallback["id"]]["status"] == "measured"  # the fallback is on disk first
        return {"outcome": "crashed: TypeError: x", "ids": refused["probe_ids"]}

    monkeypatch.setattr(fam.Families, "probe", probe)
    assert fam.Families(_args(tmp_path)).run() == 0
    assert probes == [("llama [embedding, 3, 5]", "llama [0, 3, 6]"), ("qwen3 [embedding, 3, 5]", "qwen3 [0, 3, 6]")]
    rec = json.loads((tmp_path / "families.json").read_text())["rows"]["llama [embedding, 3, 5]"]
    assert rec["status"] == "refused" and rec["probe"]["ids"] == [-1, 3, 5] and "served anyway" in rec["verdict"]
    assert fam.Families(_args(tmp_path)).run() == 0 and len(probes) == 2  # a re-run does not probe again
    (tmp_path / "b").mkdir()
    assert fam.Families(_args(tmp_path / "b", extra=["--no-probe"])).run() == 0 and len(probes) == 2


def test_a_tiny_deepseek_v3_trains_and_serves_a_draft_on_the_embedding_with_live_parity_clean(tmp_path, monkeypatch):
    """End to end on the CPU: [embedding, 3, 5] on a tiny DeepSeek-V3 through prompts .. export (each
    stage as a process, as dvc runs it), then the reference server with hidden states and the check
    stage's live parity. Real SGLang 0.5.14 fed the same ids [0, 4, 6] the same way (reports/families)."""
    monkeypatch.setenv("DRAFTLAB_THREADS", "2")
    monkeypatch.setattr(fam, "LAYOUTS", [["embedding", 3, 5]])
    monkeypatch.setattr(fam, "ROW_PARAMS", {**fam.ROW_PARAMS, "prompts": {"num_prompts": 16, "eval_fraction": 0.25},
                                            "synth": {"max_new_tokens": 16},
                                            "check": {**fam.ROW_PARAMS["check"], "live_parity_samples": 2}})
    assert fam.main(["--results", str(tmp_path), "--families", "deepseek-v3", "--backend", "reference", "--jobs", "1"]) == 0
    row = json.loads((tmp_path / "families.json").read_text())["rows"]["deepseek-v3 [embedding, 3, 5]"]
    assert row["trained_physical"] == [0, 4, 6] and row["ids_exported"] == [0, 4, 6]  # DeepSeek takes a first id 0 as-is
    assert row["fed_physical"] == [0, 4, 6] and row["best_rel_err"][0] < 1e-3 and row["verdict"] == "parity clean"
