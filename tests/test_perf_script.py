"""benchmarks/paths_vs_ceilings.py runs end to end on the CPU (--quick) and writes every section's figures."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

NUMERIC = {
    "ceilings": ["matmul_tflops", "copy_gbs"],
    "extraction": ["T16_tokens_per_s", "T16_fraction_of_floor", "T16_bytes_per_token_stored", "T16_store_write_gbs",
                   "T32_tokens_per_s", "T32_peak_mem_gb", "T16_stage_tokens_per_s", "T32_stage_vs_capture"],
    "spec": ["baseline_tokens_per_s", "bandwidth_floor_tokens_per_s", "baseline_fraction_of_floor",
             "oracle_s1_speedup", "oracle_s3_tau", "null_s3_tokens_per_s", "oracle_s3_overhead_ms_per_step"],
    "decode_profile": ["decode_host_ms", "decode_gpu_ms", "labels_bf16_ms", "engine_decode_cudnn_cold_ratio"],
    "decode_graph": ["eager_ms_per_token", "eager_fraction_of_floor", "engine_ms_per_token"],
    "training": ["B1_tokens_per_s", "B1_mfu", "B1_model_flops", "B1_peak_mem_gb", "B1_gemm_share"],
}


def test_quick_run_writes_every_section_with_numbers(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks/paths_vs_ceilings.py"), "--quick", "--out", str(tmp_path)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads((tmp_path / "results.json").read_text())
    assert (tmp_path / "notes.md").read_text().startswith("# draftlab GPU measurements")
    for section, keys in NUMERIC.items():
        got = res[section]
        assert "error" not in got, (section, got.get("error"))
        for k in keys:
            assert isinstance(got[k], (int, float)) and math.isfinite(got[k]), (section, k, got.get(k))
        assert all(got[k] > 0 for k in keys if k.endswith("tokens_per_s"))
    # The oracle draft is accepted every time: tau = num_steps + 1 (the bonus token included).
    assert res["spec"]["oracle_s3_tau"] == 4.0 and res["spec"]["null_s3_tau"] < 1.5
    assert res["extraction"]["T16_bytes_per_token_stored"] == (3 + 1) * 64 * 2
    # The static-cache decode measures the same computation as the engine.
    assert res["decode_graph"]["eager_logits_rel_err"] < 1e-4 and res["decode_graph"]["eager_matches_engine"] == 1
    assert 0 < res["training"]["B1_gemm_share"] < 1 and res["training"]["B1_top_ops_ms"]
    emb = res["embedded"]
    assert "error" not in emb, emb.get("error")
    if emb["skipped"]:  # models/draft is a DVC output: absent on a fresh checkout
        assert not (ROOT / "models/draft/config.json").exists()
    else:
        assert emb["tau"] >= 1.0 and emb["speedup"] > 0 and emb["outputs_equal_baseline"] == emb["prompts"]


def test_the_training_section_times_the_stage_setup_beside_eager_and_refuses_an_unknown_mode(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}

    def run(modes, out):
        r = subprocess.run([sys.executable, str(ROOT / "benchmarks/paths_vs_ceilings.py"), "--quick", "--out", str(out),
                            "--sections", "training", "--train-modes", modes], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        return json.loads((out / "results.json").read_text())["training"]

    got = run("eager,stage", tmp_path / "both")
    assert "error" not in got, got.get("error")
    for prefix in ("", "stage_"):  # both modes timed, each under its own keys
        assert got[f"{prefix}B1_tokens_per_s"] > 0 and got[f"{prefix}B1_warmup_s"] > 0 and math.isfinite(got[f"{prefix}B1_mfu"])
    assert "unknown" in run("eager,unknown", tmp_path / "bad")["error"]
