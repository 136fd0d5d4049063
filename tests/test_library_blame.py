"""A load error on the folder the target stage wrote (a GGUF target's models/target-dequantized) names
the library and its version first, not "fix the folder"; a user's own folder keeps "fix it"; a
folder of ours whose files are damaged is made again. The failing release is played by a
transformers whose AutoConfig cannot read the dequantized folder (the way transformers 5.25.0's
hub kernels could not load what 5.24.0 had written)."""
import json
from importlib import metadata
from pathlib import Path

import pytest
import transformers
import yaml

from draftlab.errors import UserError
from draftlab.target.gguf import DEQUANTIZED_DIR
from draftlab.target.packaged import REAL_INSTALL
from draftlab.params import TargetParams
from draftlab.target.load import load_config
from draftlab.target.tokenizer import save_tokenizer
from draftlab.target.check import check_loadable
from stages import target as target_stage
from tests.support.gguf_file import write_gguf
from tests.support.micro import make_micro_model, make_micro_tokenizer

VERSION = transformers.__version__


@pytest.fixture(scope="module")
def micro():
    model = make_micro_model("llama", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, tie_word_embeddings=True)
    return model, make_micro_tokenizer(model.config.vocab_size)


def a_release_that_cannot_read(monkeypatch, folder_name: str) -> None:
    """AutoConfig.from_pretrained fails on `folder_name` with an error raised inside an installed
    package (PyYAML), as a release that breaks on the folder would; everything else loads as before."""
    real = transformers.AutoConfig.from_pretrained.__func__

    def from_pretrained(cls, *args, **kwargs):
        path = args[0] if args else kwargs.get("pretrained_model_name_or_path")
        if Path(str(path)).name == folder_name and "gguf_file" not in kwargs:
            yaml.safe_load("device: [meta")  # raises yaml's own ParserError from inside the package
        return real(cls, *args, **kwargs)

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", classmethod(from_pretrained))


def dequantize(tmp_path: Path, monkeypatch, micro) -> Path:
    model, tok = micro
    gguf = write_gguf(model, tok, tmp_path / "micro.Q8_0.gguf", "Q8_0")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump({"target": {"model": str(gguf), "revision": None,
                                                                     "dtype": "float32", "device": "cpu"}}))
    return gguf


def test_the_target_stage_names_the_library_first_when_its_own_folder_does_not_load(tmp_path, monkeypatch, micro):
    gguf = dequantize(tmp_path, monkeypatch, micro)
    a_release_that_cannot_read(monkeypatch, DEQUANTIZED_DIR.name)
    with pytest.raises(UserError) as e:
        target_stage.main(tmp_path / "models" / "target-pin.json")
    msg = str(e.value)
    assert msg.startswith(f"transformers {VERSION} (through PyYAML {metadata.version('PyYAML')}, where the error was raised) "
                          f"could not load {DEQUANTIZED_DIR}, the folder the target stage wrote from {str(gguf)!r} "
                          f"with transformers {VERSION}: cannot load its config: "), msg
    assert "this release of transformers or PyYAML, not the folder" in msg and REAL_INSTALL in msg
    assert "dvc repro --force target" in msg and "fix models" not in msg


def test_a_later_stage_loading_a_gguf_target_names_the_library_and_the_folder(tmp_path, monkeypatch, micro):
    gguf = dequantize(tmp_path, monkeypatch, micro)
    target_stage.main(tmp_path / "models" / "target-pin.json")  # made and checked under the working release
    a_release_that_cannot_read(monkeypatch, DEQUANTIZED_DIR.name)
    with pytest.raises(UserError) as e:
        load_config(TargetParams(model=str(gguf), revision=None, dtype="float32", device="cpu"))
    msg = str(e.value)
    assert msg.startswith(f"transformers {VERSION} (through PyYAML") and f"could not load {DEQUANTIZED_DIR}," in msg
    assert "hub id" not in msg  # a GGUF target is not a hub id: the old message advised checking one


def test_a_folder_of_ours_with_a_damaged_file_is_made_again(tmp_path, monkeypatch, micro):
    dequantize(tmp_path, monkeypatch, micro)
    target_stage.main(tmp_path / "models" / "target-pin.json")
    config = tmp_path / DEQUANTIZED_DIR / "config.json"
    config.write_text(config.read_text()[:40])  # cut short
    with pytest.raises(UserError) as e:
        check_loadable(str(DEQUANTIZED_DIR))
    msg = str(e.value)
    assert "config.json is not valid JSON" in msg and msg.endswith("make it again with dvc repro --force target")


def test_a_users_own_folder_keeps_the_fix_the_folder_advice(tmp_path, monkeypatch, micro):
    model, tok = micro
    folder = tmp_path / "my-model"
    model.save_pretrained(folder)
    save_tokenizer(tok, folder)
    monkeypatch.chdir(tmp_path)
    a_release_that_cannot_read(monkeypatch, "my-model")
    with pytest.raises(UserError) as e:
        check_loadable("my-model")
    msg = str(e.value)
    assert msg.startswith("target.model 'my-model': cannot load its config: ") and "fix my-model" in msg
    assert not json.loads((folder / "config.json").read_text()).get("quantization_config")
