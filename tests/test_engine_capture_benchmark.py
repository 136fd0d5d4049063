"""benchmarks/engine_capture.py on a CPU: the transformers engine measured on the rows given, and the
sglang engine's refusal recorded by name rather than ending the run."""
import json

import yaml

from benchmarks.engine_capture import main
from tests.support.micro import save_micro_model


def test_each_engine_is_measured_or_its_failure_named(tmp_path, monkeypatch):
    from pathlib import Path

    save_micro_model(tmp_path / "micro", arch="llama", num_layers=4)
    p = yaml.safe_load((Path(__file__).resolve().parents[1] / "params.yaml").read_text())
    p["target"].update(model=str(tmp_path / "micro"), dtype="float32", device="cpu")
    p["capture"]["layers"] = [0, 2]
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(p))
    texts = [" ".join(f"w{i} w{j}" for j in range(40 + 7 * i)) for i in range(5)] + ["too short"]
    (tmp_path / "texts.txt").write_text("\n".join(texts))
    out = tmp_path / "engine-capture.json"
    main(["--params", str(tmp_path / "params.yaml"), "--texts", str(tmp_path / "texts.txt"), "--rows", "4", "--batch", "2",
          "--max-tokens", "64", "--engine-args", "attention_backend=triton", "--out", str(out)])
    got = json.loads(out.read_text())
    assert got["physical"] == [1, 3] and got["engine_args"] == {"attention_backend": "triton"}
    assert got["transformers"]["tokens"] == 4 * 64 and got["transformers"]["tok_s"] > 0  # 4 rows, each cut at 64
    assert "extract.engine sglang" in got["sglang"]["error"] and "relative_error" not in got


def test_an_engine_against_itself_names_each_captured_layer_as_the_closest(tmp_path):
    """transformers against transformers: zero error at each captured layer, a larger one against its
    neighbours (captured by the reference), so the closest is the layer asked for."""
    from pathlib import Path

    save_micro_model(tmp_path / "micro", arch="llama", num_layers=6)
    p = yaml.safe_load((Path(__file__).resolve().parents[1] / "params.yaml").read_text())
    p["target"].update(model=str(tmp_path / "micro"), dtype="float32", device="cpu")
    p["capture"]["layers"] = [0, 2, 4]
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(p))
    (tmp_path / "texts.txt").write_text("\n".join(" ".join(f"w{i} w{j}" for j in range(40)) for i in range(3)))
    out = tmp_path / "engine-capture.json"
    main(["--params", str(tmp_path / "params.yaml"), "--texts", str(tmp_path / "texts.txt"), "--rows", "3", "--batch", "2",
          "--max-tokens", "48", "--engines", "transformers", "transformers", "--out", str(out)])
    got = json.loads(out.read_text())["relative_error"]
    assert sorted(got) == ["final (after the norm)", "physical 1", "physical 3", "physical 5"]
    for i in (1, 3, 5):
        row = got[f"physical {i}"]
        assert row["all"] == 0 and row["closest"] == i
        assert row[f"against physical {i - 1}"] > 0 and (i == 5 or row[f"against physical {i + 1}"] > 0)
    assert "against physical 6" not in got["physical 5"] and got["final (after the norm)"]["all"] == 0
