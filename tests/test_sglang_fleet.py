"""How the synthesize stage spreads a target over SGLang servers (draftlab.sglang.fleet)."""
import pytest

from draftlab.errors import UserError
from draftlab.sglang import fleet


def test_several_servers_per_gpu_split_the_memory_share_and_each_gpu_gets_its_own():
    plan = fleet.plan_servers(3, ["0", "1"], 0.75)
    assert [(p.gpu, p.mem_fraction) for p in plan] == [("0", 0.25)] * 3 + [("1", 0.25)] * 3
    env = fleet.server_env(plan[4], base={"PATH": "/bin", "CUDA_VISIBLE_DEVICES": "0,1"})
    assert env == {"PATH": "/bin", "CUDA_VISIBLE_DEVICES": "1"}  # pinned to its GPU, the rest kept


def test_one_server_keeps_sglangs_own_memory_choice_and_several_share_a_default():
    assert [p.mem_fraction for p in fleet.plan_servers(1, ["0"], None)] == [None]
    assert [p.mem_fraction for p in fleet.plan_servers(4, ["0"], None)] == [fleet.DEFAULT_SHARED_MEM / 4] * 4
    cpu = fleet.plan_servers(2, [], None)  # no GPU: the servers find their device themselves
    assert [p.gpu for p in cpu] == [None, None] and fleet.server_env(cpu[0]) is None


def test_a_share_too_small_per_server_is_refused_naming_both_keys():
    with pytest.raises(UserError, match=r"synth.mem_fraction_static 0.2 shared by 8 servers.*synth.servers_per_gpu"):
        fleet.plan_servers(8, ["0"], 0.2)


def test_auto_gives_a_small_target_several_servers_and_a_large_one_one(tmp_path):
    small, large = tmp_path / "small", tmp_path / "large"
    for folder, size in ((small, 300_000_000), (large, 9_000_000_000)):
        folder.mkdir()
        with open(folder / "model.safetensors", "wb") as f:  # sparse: the size is what counts
            f.truncate(size)
    assert fleet.servers_per_gpu("auto", small) == 4
    assert fleet.servers_per_gpu("auto", large) == 1
    assert fleet.servers_per_gpu("auto", "org/a-hub-id") == 1  # size unknown: one server
    assert fleet.servers_per_gpu(2, large) == 2  # a number is taken as given


def test_visible_gpus_follow_cuda_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert fleet.visible_gpus() == ["2", "3"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert fleet.visible_gpus() == []


# ---------------------------------------------------------------------------------------------
# Servers sharing a GPU: explicit KV pools, started together

GIB = 1 << 30
SMOLLM2 = {"num_layers": 30, "num_key_value_heads": 3, "head_dim": 64}  # SmolLM2-135M: 9 heads of 64, 3 KV heads


def test_a_token_of_smollm2_takes_23040_bytes_of_kv_cache_in_bf16(tmp_path):
    assert fleet.kv_bytes_per_token(SMOLLM2, 2) == 2 * 30 * 3 * 64 * 2 == 23_040  # K and V, 30 layers, 3 heads of 64, bf16
    assert fleet.kv_bytes_per_token(SMOLLM2, 2, tp_size=2) == 7_680  # 3 // 2 = 1 KV head per GPU, as SGLang splits them
    (tmp_path / "config.json").write_text('{"torch_dtype": "bfloat16"}')
    assert fleet.dtype_bytes("auto", tmp_path) == 2 and fleet.dtype_bytes("float32") == 4  # auto: the checkpoint's
    (tmp_path / "config.json").write_text('{"dtype": "float16", "torch_dtype": "float32"}')  # transformers 5 reads dtype first
    assert fleet.dtype_bytes("auto", tmp_path) == 2


def test_servers_sharing_a_gpu_get_a_pool_from_their_share_and_a_fraction_that_lets_them_load_together():
    smollm2 = fleet.Footprint(weights=270_000_000, per_token=23_040)
    plan = fleet.plan_servers(4, ["0"], 0.8, smollm2, free_memory=lambda gpu: 140 * GIB)
    # each: 0.8 / 4 of 140 GiB = 30,064,771,072 B, less 270 MB of weights, 0.9 of it in tokens of 23,040 B
    assert {p.max_total_tokens for p in plan} == {1_163_858}
    assert plan[0].args() == ["--mem-fraction-static", "0.9", "--max-total-tokens", "1163858"]  # 1 - (1 - 0.8) / 2
    assert [p.gpu for p in plan] == ["0"] * 4 and all(p.explicit for p in plan)


def test_without_the_gpus_memory_or_the_targets_size_the_servers_size_their_pools_themselves():
    smollm2 = fleet.Footprint(weights=270_000_000, per_token=23_040)
    unknown = fleet.plan_servers(2, ["0"], 0.8, smollm2, free_memory=lambda gpu: None)
    assert [p.args() for p in unknown] == [["--mem-fraction-static", "0.4"]] * 2 and not unknown[0].explicit
    assert not fleet.plan_servers(2, ["0"], 0.8, None, free_memory=lambda gpu: 140 * GIB)[0].explicit  # a hub id
    one = fleet.plan_servers(1, ["0"], 0.5, smollm2, free_memory=lambda gpu: 140 * GIB)
    assert one[0].args() == ["--mem-fraction-static", "0.5"]  # one server per GPU starts alone: SGLang sizes its pool


def test_a_share_that_holds_no_more_than_the_weights_is_refused_before_anything_starts():
    big = fleet.Footprint(weights=16 * GIB, per_token=131_072)
    with pytest.raises(UserError, match=r"synth.mem_fraction_static 0.5 shared by 4 servers on GPU 0 .*no room for a KV cache"):
        fleet.plan_servers(4, ["0"], 0.5, big, free_memory=lambda gpu: 80 * GIB)


def test_a_pool_the_user_gives_is_kept_within_the_share_and_refused_beyond_it():
    planned = fleet.PlannedServer("0", 0.9, 100_000)
    kept, args = fleet.with_given_pool(planned, ["--max-total-tokens", "64k", "--grammar-backend", "none"], "synth.server_args")
    assert kept.max_total_tokens == 64_000 and args == ["--grammar-backend", "none"]  # passed once, by the plan
    assert fleet.with_given_pool(planned, ["--max-total-tokens=64Ki"], "k")[0].max_total_tokens == 65_536
    with pytest.raises(UserError, match=r"synth.server_args: --max-total-tokens 200000 is more than .*100000 tokens"):
        fleet.with_given_pool(planned, ["--max-total-tokens", "200000"], "synth.server_args")
    alone = fleet.PlannedServer("0", None)  # no explicit pool: the user's flag goes through as given
    assert fleet.with_given_pool(alone, ["--max-total-tokens", "5000"], "k") == (alone, ["--max-total-tokens", "5000"])


SLOW_SGLANG = '''
import http.server, json, os, sys, time
port = sys.argv[sys.argv.index("--port") + 1]
record = {"argv": sys.argv[1:], "gpu": os.environ.get("CUDA_VISIBLE_DEVICES"), "started": time.time()}
open(os.path.join(os.environ["STANDIN_RECORDS"], port + ".json"), "w").write(json.dumps(record))
time.sleep(float(os.environ["STANDIN_STARTUP_S"]))  # loading, capturing graphs
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", int(port)), H).serve_forever()
'''
STARTUP_S = 2.0


@pytest.fixture
def slow_sglang(tmp_path, monkeypatch):
    """`python -m sglang.launch_server` as a stand-in that takes STARTUP_S to become healthy and
    records its argv, GPU and start time; a micro target; GPU 0 visible. Returns a function that
    runs the synthesize stage's own_servers and gives (records, seconds until all were healthy, the
    start-ups own_servers recorded)."""
    import json
    import time
    import types

    from stages.synthesize import own_servers
    from tests.support.micro import save_micro_model

    (tmp_path / "standin/sglang").mkdir(parents=True)
    (tmp_path / "standin/sglang/__init__.py").write_text("")
    (tmp_path / "standin/sglang/launch_server.py").write_text(SLOW_SGLANG)
    (tmp_path / "records").mkdir()
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "standin"))
    monkeypatch.setenv("STANDIN_RECORDS", str(tmp_path / "records"))
    monkeypatch.setenv("STANDIN_STARTUP_S", str(STARTUP_S))
    monkeypatch.setattr(fleet, "visible_gpus", lambda: ["0"])
    save_micro_model(tmp_path / "target", arch="llama", num_layers=2)
    target = types.SimpleNamespace(model=str(tmp_path / "target"), revision=None, dtype="bfloat16")

    def run(free_gib, server_args=()):
        monkeypatch.setattr(fleet, "gpu_free_memory", lambda gpu: None if free_gib is None else free_gib * GIB)
        synth = types.SimpleNamespace(servers_per_gpu=3, mem_fraction_static=0.6, server_args=list(server_args), startup_timeout_s=60.0)
        t0, startups = time.monotonic(), []
        with own_servers(target, synth, tmp_path / "out", startups) as urls:
            took = time.monotonic() - t0
            assert len(urls) == 3
        records = [json.loads(p.read_text()) for p in (tmp_path / "records").iterdir()]
        for p in (tmp_path / "records").iterdir():
            p.unlink()
        return sorted(records, key=lambda r: r["started"]), took, startups

    return run


def test_servers_of_one_gpu_start_together_when_their_pools_are_explicit(slow_sglang, capsys):
    records, took, startups = slow_sglang(80)
    assert took < 2 * STARTUP_S  # about one start-up, not three
    assert len(startups) == 3 and all(STARTUP_S <= s["total_s"] <= took + 0.1 for s in startups)  # kept for the manifest
    assert "synthesize: 3 servers up in" in capsys.readouterr().out
    assert records[-1]["started"] - records[0]["started"] < 1.0  # none waited for another to be healthy
    for r in records:
        argv = r["argv"]
        assert r["gpu"] == "0"
        assert argv[argv.index("--mem-fraction-static") + 1] == "0.8"  # 1 - (1 - 0.6) / 2
        assert int(argv[argv.index("--max-total-tokens") + 1]) > 0
        assert argv.count("--max-total-tokens") == 1 and argv.count("--mem-fraction-static") == 1
    records, _, _ = slow_sglang(80, server_args=["--max-total-tokens", "1000"])  # the user's own pool, within the share
    assert [r["argv"][r["argv"].index("--max-total-tokens") + 1] for r in records] == ["1000"] * 3
    assert all(r["argv"].count("--max-total-tokens") == 1 for r in records)


def test_servers_of_one_gpu_whose_memory_is_unknown_start_one_after_another(slow_sglang):
    records, took, _ = slow_sglang(None)
    assert took >= 3 * STARTUP_S
    assert all(b["started"] - a["started"] >= STARTUP_S for a, b in zip(records, records[1:]))  # each once the one before was up
    assert all("--max-total-tokens" not in r["argv"] and "0.2" in r["argv"] for r in records)  # 0.6 / 3 each, SGLang's own pool


def test_fa3_on_a_gpu_sglangs_fa3_refuses_is_refused_before_any_server_starts(slow_sglang, monkeypatch):
    """SGLang 0.5.14 asserts SM 8.x/9.x for --attention-backend fa3 only after loading the weights, in the
    server's log; the synthesize stage says it first, naming the key, the GPU and what to set."""
    monkeypatch.setattr(fleet, "compute_capability", lambda gpu: ("NVIDIA B200", 10, 0))
    with pytest.raises(UserError, match=r"synth.server_args: --attention-backend fa3 runs on GPUs of compute capability 8.x "
                                        r"or 9.0 .* GPU 0 is a NVIDIA B200 \(10.0\): choose triton or flashinfer in "
                                        r"synth.server_args"):
        slow_sglang(80, server_args=["--attention-backend", "fa3"])
    records, _, _ = slow_sglang(80, server_args=["--attention-backend", "triton"])  # another backend: no question asked
    assert len(records) == 3  # these three alone: the fa3 run started none


def test_fa3_is_checked_on_every_visible_gpu_and_left_to_sglang_where_unknown(monkeypatch):
    caps = {"0": ("NVIDIA H100 80GB HBM3", 9, 0), "1": ("NVIDIA A100-SXM4-80GB", 8, 0), "2": None, "3": ("Tesla V100", 7, 0)}
    fleet.check_fa3(["--attention-backend", "fa3"], "k", gpus=["0", "1", "2"], capability=caps.get)  # 9.0, 8.0, unknown: fine
    with pytest.raises(UserError, match=r"k: .* GPU 3 is a Tesla V100 \(7.0\)"):
        fleet.check_fa3(["--attention-backend=fa3"], "k", gpus=["0", "3"], capability=caps.get)
    asked = []
    fleet.check_fa3(["--attention-backend", "triton"], "k", gpus=["3"], capability=lambda g: asked.append(g))
    assert asked == []  # no probe at all for another backend


def test_the_compute_capability_is_read_from_nvidia_smi(monkeypatch):
    import subprocess

    def smi(argv, **_):
        assert argv[:3] == ["nvidia-smi", "--id=1", "--query-gpu=name,compute_cap"]
        return subprocess.CompletedProcess(argv, 0, stdout="NVIDIA H200, 9.0\n")
    monkeypatch.setattr(fleet.subprocess, "run", smi)
    assert fleet.compute_capability("1") == ("NVIDIA H200", 9, 0)
    monkeypatch.setattr(fleet.subprocess, "run", lambda *a, **k: (_ for _ in ()).throw(FileNotFoundError("nvidia-smi")))
    assert fleet.compute_capability("1") is None  # no driver tool: unknown, left to SGLang
