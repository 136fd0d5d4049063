"""What real SGLang servers fed EAGLE-3 drafts of each target family (one H200, reports/families/). tests/fixtures/sglang/families/<release>/ holds one raw /generate answer
with return_hidden_states per row (a 12-token prompt), the server log of each refused layout served
anyway (the probe), and Kimi-K2.5's start-up failure. The tiny targets are rebuilt here from their
seed (tools/micro_targets.py) and checked to be the very weights the servers ran.
"""
import json
import re
from pathlib import Path

import pytest
import torch

from draftlab.check.parity import prompt_rows
from draftlab.errors import UserError
from draftlab.sglang.layers import captured_physical
from support.tools import load_tool

ROOT = Path(__file__).resolve().parents[1]
FIX = Path(__file__).parent / "fixtures" / "sglang" / "families"
RUNS = ROOT / "reports" / "families" / "run"
mt = load_tool("micro_targets")
ERROR_LINE = re.compile(r"(Error|Exception|error:|Traceback|not supported|RuntimeError|ValueError)")


def slug(rid: str) -> str:
    """The fixture file name of a row id, as the run wrote it."""
    return re.sub(r"[^a-z0-9.]+", "-", rid.lower()).strip("-")


def error_lines(log_text: str, n: int = 6) -> list[str]:
    """A server log's first error lines, and its last exception line (the reason it stopped)."""
    lines = [x.strip() for x in log_text.splitlines() if ERROR_LINE.search(x) and x.strip()]
    first = list(dict.fromkeys(lines))[:n]
    last = [x for x in lines if re.match(r"^\w+(Error|Exception)\b", x)][-1:]
    return first + [x for x in last if x not in first]

# (release, row) -> the physical layer each slot held (None: no layer; the slot was overwritten in place).
FED = {("0.5.14", "llama [1, 3, 5]"): [2, 4, 6],
       ("0.5.14", "qwen3 [embedding, 3, 5]"): [None, 4, 6],
       ("0.5.14", "qwen3-moe [embedding, 3, 5]"): [0, 4, 6],
       ("0.5.14", "deepseek-v3 [embedding, 3, 5]"): [0, 4, 6],
       ("0.5.14", "gpt-oss [1, 3, 5]"): [2, 4, 6],
       ("0.5.17", "gpt-oss [embedding, 3, 5]"): [None, 4, 6]}


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {name: mt.build(name, root / name) for name in {rid.split()[0] for _, rid in FED}}


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("release, rid", sorted(FED))
def test_each_slot_holds_the_layer_the_measurement_says_and_the_rules_agree(targets, release, rid):
    from transformers import AutoModelForCausalLM

    record = json.loads((RUNS / f"families-{release}.json").read_text())["rows"][rid]
    name = rid.split()[0]
    target = targets[name]
    assert target["weights_sha256"] == record["target"]["weights_sha256"]  # the weights the server ran
    answer = json.loads((FIX / release / f"{slug(rid)}.json").read_text())
    ids, meta = answer["input_ids"], answer["response"]["meta_info"]
    rows, start = prompt_rows(meta, len(ids), mt.HIDDEN)
    model = AutoModelForCausalLM.from_pretrained(target["pipeline"], dtype=torch.float32)
    with torch.no_grad():
        hs = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
    fed = []
    for j in range(3):
        slot = rows[:, j * mt.HIDDEN:(j + 1) * mt.HIDDEN]
        errs = {p: rel(slot, hs[p][0][start:]) for p in range(mt.NUM_LAYERS)}
        best = min(errs, key=errs.get)
        fed.append(best if errs[best] < 0.1 else None)  # bf16 served against float32 here
    assert fed == FED[(release, rid)]
    ids_served = record["ids_exported"]
    if None in fed:  # the project's rules now refuse what this server fed wrongly, and say why
        with pytest.raises(UserError, match="overwrite it in place.*with no error"):
            captured_physical(record["architecture"], mt.NUM_LAYERS, ids_served, release)
    else:
        assert captured_physical(record["architecture"], mt.NUM_LAYERS, ids_served, release) == fed


@pytest.mark.parametrize("name", ["llama", "gpt-oss"])
def test_the_embedding_served_anyway_crashes_where_the_rules_say_it_crashes(name):
    lines = error_lines((FIX / "0.5.14" / f"{name}-embedding-probe.log").read_text())
    assert lines[-1] == "TypeError: unsupported operand type(s) for +: 'Tensor' and 'NoneType'"
    arch = {"llama": "LlamaForCausalLM", "gpt-oss": "GptOssForCausalLM"}[name]
    with pytest.raises(UserError, match="crashes with a TypeError.*measured on a real server"):
        captured_physical(arch, mt.NUM_LAYERS, [-1, 3, 5], "0.5.14")
    record = json.loads((RUNS / "families-0.5.14.json").read_text())["rows"][f"{name} [embedding, 3, 5]"]
    assert record["probe"]["ids"] == [-1, 3, 5] and record["probe"]["outcome"].startswith("crashed: TypeError")


def test_kimi_k25_needs_its_media_processor_to_start():
    lines = error_lines((FIX / "0.5.14" / "kimi-k2.5-server.log").read_text())
    assert lines[-1] == "AttributeError: TokenizersBackend has no attribute media_processor"
    assert "multimodal/processors/kimi_k25.py" in (FIX / "0.5.14" / "kimi-k2.5-server.log").read_text()


def test_the_committed_report_is_what_the_runs_make(tmp_path):
    report = load_tool("families_report")
    assert report.main([str(RUNS / "families-0.5.14.json"), str(RUNS / "families-0.5.17.json"), str(tmp_path)]) == 0
    for name in ("README.md", "results.json"):
        assert (tmp_path / name).read_text() == (ROOT / "reports" / "families" / name).read_text(), name
