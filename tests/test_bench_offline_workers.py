"""The offline run decoded by several processes at once (bench.offline_workers): the same figures
as one process, and a worker count that fits the host and the device."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from draftlab.bench import offline_workers
from draftlab.bench import run as bench_run
from draftlab.errors import UserError
from draftlab.params import ParamsError, load_params
from tests.test_bench_sweep import make_project, prepare

ROOT = Path(__file__).resolve().parent.parent

GIB = 1 << 30


def test_auto_decodes_in_process_on_a_cpu_and_with_one_process_per_four_cores_on_a_gpu(monkeypatch):
    monkeypatch.setattr(offline_workers.os, "cpu_count", lambda: 16)
    assert offline_workers.worker_count("auto", "cpu", prompts=32, copy_bytes=GIB, room_bytes=None) == 1
    assert offline_workers.worker_count("auto", "cuda:0", prompts=32, copy_bytes=GIB, room_bytes=None) == 4
    monkeypatch.setattr(offline_workers.os, "cpu_count", lambda: 6)
    assert offline_workers.worker_count("auto", "cuda:0", prompts=32, copy_bytes=GIB, room_bytes=None) == 1


def test_workers_are_bounded_by_the_copies_that_fit_and_by_the_prompts():
    assert offline_workers.worker_count(8, "cuda:0", prompts=32, copy_bytes=3 * GIB, room_bytes=10 * GIB) == 3
    assert offline_workers.worker_count(8, "cuda:0", prompts=32, copy_bytes=3 * GIB, room_bytes=GIB) == 1  # one always runs
    assert offline_workers.worker_count(8, "cpu", prompts=2, copy_bytes=GIB, room_bytes=None) == 2  # asked for: kept on a CPU


@pytest.mark.parametrize("value,message", [(0, "bench.offline_workers must be >= 1, got 0"),
                                           ("many", "bench.offline_workers must be int or 'auto', got 'many'")])
def test_a_worker_count_that_is_not_a_positive_int_or_auto_is_refused_by_name(tmp_path, value, message):
    base = yaml.safe_load((ROOT / "params.yaml").read_text())
    base["bench"]["offline_workers"] = value
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(base))
    with pytest.raises(ParamsError, match=re.escape(message)):
        load_params(["bench"], tmp_path / "params.yaml")


def test_two_processes_decode_the_offline_run_to_the_figures_of_one(tmp_path, capsys):
    root = make_project(tmp_path)
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    one = bench_run.measure_offline(prepare(root, tmp_path / "one", offline_workers=1))
    assert "offline run (in-process" in capsys.readouterr().out
    two = bench_run.measure_offline(prepare(root, tmp_path / "two", offline_workers=2))
    assert "offline run (2 processes" in capsys.readouterr().out
    (a, a_costs, a_physical, _), (b, b_costs, b_physical, _) = one, two
    # greedy, batch 1: every prompt's output and counts are one process's, whichever process decoded it
    for key in ("tau", "acceptance", "tokens_per_request", "verify_ct", "requests", "step1_by_kind", "step1_by_position"):
        assert b[key] == a[key], key
    assert b_physical == a_physical
    # the seconds come from the first prompt decoded again alone: a round as one process runs it
    assert b["tokens_per_s"] > 0 and b_costs["offline_round_s"] > 0
    assert b_costs["baseline_run_step_s"] > 0  # the reference backend's baseline step, from that same lone decode


def _die(*_args):
    import os

    os._exit(9)  # as a process killed for memory ends: no exception, no result


def test_a_worker_that_dies_names_the_setting_that_runs_without_it(tmp_path, monkeypatch):
    root = make_project(tmp_path)
    plan = prepare(root, tmp_path, offline_workers=2)
    pool = offline_workers.DecodePool(plan.target_params, plan.draft.path, plan.device, 2)
    monkeypatch.setattr(offline_workers, "_decode", _die)  # what the workers run, pickled by name: this module's _die
    with pool, pytest.raises(UserError, match=r"set bench.offline_workers to fewer than 2 \(1 decodes in the bench's own process\)"):
        pool.decode([[1, 2, 3]], plan.flags, [1, 3, 5], 4, None, False, False)
