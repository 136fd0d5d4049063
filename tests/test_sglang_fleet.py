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
