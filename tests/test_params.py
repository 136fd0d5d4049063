"""The params contract: unknown, missing, mistyped and out-of-range keys stop a stage with a clear message."""
import json
import re
from pathlib import Path

import pytest
import yaml

from draftlab.params import RANGES, SECTIONS, ParamsError, load_params

REPO_PARAMS = "params.yaml"


def write(tmp_path, data):
    p = tmp_path / "params.yaml"
    p.write_text(yaml.safe_dump(data))
    return p


@pytest.fixture
def base():
    return yaml.safe_load(open(REPO_PARAMS))


def test_repo_params_load_every_section():
    p = load_params(list(SECTIONS), REPO_PARAMS)
    assert p.capture.layers == [1, 3, 5]
    assert p.export.sglang_version == "0.5.14"


def test_typo_names_key_and_suggests(tmp_path, base):
    base["spec"]["num_step"] = 5
    path = write(tmp_path, base)
    with pytest.raises(ParamsError, match=r"unknown key spec\.num_step, did you mean spec\.num_steps\?") as e:
        load_params(["spec"], path)
    assert str(path) in str(e.value)


def test_unknown_key_only_checked_for_loaded_sections(tmp_path, base):
    base["spec"]["num_step"] = 5
    path = write(tmp_path, base)
    assert load_params(["prompts"], path).prompts.seed == base["prompts"]["seed"]


def test_unknown_section_is_an_error(tmp_path, base):
    base["captur"] = {"layers": [1]}
    with pytest.raises(ParamsError, match="unknown section 'captur', did you mean capture"):
        load_params(["prompts"], write(tmp_path, base))


def test_missing_key_names_type(tmp_path, base):
    del base["train"]["lr"]
    with pytest.raises(ParamsError, match=r"missing key train\.lr \(expected float\)"):
        load_params(["train"], write(tmp_path, base))


def test_wrong_type_names_expected(tmp_path, base):
    base["train"]["epochs"] = "many"
    with pytest.raises(ParamsError, match=r"train\.epochs must be int, got 'many'"):
        load_params(["train"], write(tmp_path, base))


@pytest.mark.parametrize(
    "section,key,given,expected",
    [
        ("train", "epochs", "3", 3),  # quoted number from a YAML edit
        ("train", "epochs", 3.0, 3),  # integral float
        ("train", "lr", 1, 1.0),  # Hydra types `lr=1` as int
        ("bench", "ignore_eos", "true", True),
        ("spec", "num_draft_tokens", None, None),  # unset is allowed where SGLang allows it
        ("capture", "layers", "default", "default"),
        ("capture", "layers", [2, 4], [2, 4]),
    ],
)
def test_lossless_coercions(tmp_path, base, section, key, given, expected):
    base[section][key] = given
    got = getattr(getattr(load_params([section], write(tmp_path, base)), section), key)
    assert got == expected and type(got) is type(expected)


@pytest.mark.parametrize(
    "section,key,given,msg",
    [
        ("train", "epochs", 2.5, "must be int"),
        ("train", "epochs", True, "must be int"),
        ("export", "sglang_version", 0.5, "quote it"),  # Hydra turned "0.5" into a float
        ("capture", "layers", [1, "x"], "must be list of int or str"),
        ("spec", "on_adjust", "ignore", "must be one of error, allow"),
    ],
)
def test_lossy_values_rejected(tmp_path, base, section, key, given, msg):
    base[section][key] = given
    with pytest.raises(ParamsError, match=msg):
        load_params([section], write(tmp_path, base))


def test_missing_file_says_where(tmp_path):
    with pytest.raises(ParamsError, match="params file not found"):
        load_params(["prompts"], tmp_path / "nope.yaml")


def _write(tmp_path, section, key, value):
    data = yaml.safe_load(Path("params.yaml").read_text())
    data[section][key] = value
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize("key,value", [
    ("train.batch_size", 0), ("train.batch_size", -1), ("train.lr", -1), ("train.epochs", 0),
    ("extract.batch_size", 0), ("bench.concurrency", []), ("bench.concurrency", [1, 0]),
    ("prompts.eval_fraction", 1.0), ("train.ttt_decay", 0), ("synth.top_p", 0), ("bench.port", 70000),
])
def test_a_value_out_of_range_names_the_key_and_the_range(tmp_path, key, value):
    section, name = key.split(".")
    path = _write(tmp_path, section, name, value)
    with pytest.raises(ParamsError, match=rf"{path}: key {key} must (be|list)"):
        load_params([section], path)


@pytest.mark.parametrize("key", sorted(RANGES))
def test_every_range_refuses_its_first_value_outside_and_accepts_the_default(tmp_path, key):
    section, name = key.split(".")
    low, high, low_open, _ = RANGES[key]
    default = yaml.safe_load(Path("params.yaml").read_text())[section][name]
    load_params([section])  # the shipped default is inside every range
    outside = low if low_open else (low - 1 if isinstance(low, int) else low - 1e-3)
    if isinstance(default, list):
        outside = [outside]
    with pytest.raises(ParamsError, match=re.escape(key)):
        load_params([section], _write(tmp_path, section, name, outside))


def _typed(value):
    """`value` with every leaf paired with its type name: 1 == 1.0 == True in Python, not in a hash."""
    if isinstance(value, dict):
        return {k: _typed(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_typed(v) for v in value]
    return type(value).__name__, value


def test_the_default_run_hashes_the_same_configuration():
    """Manifests hash as_dict: the repo's params.yaml must give the same keys, values and types as
    the fixture, written by the dataclass loader this one replaced. Adding or renaming a key on
    purpose changes the configuration hash of every stage that reads it: update the fixture with it."""
    from draftlab.fsutil import canonical_json
    from draftlab.params import as_dict

    want = json.loads(Path("tests/fixtures/params_as_dict.json").read_text())
    got = as_dict(load_params(list(SECTIONS), REPO_PARAMS))
    assert _typed(got) == _typed(want)
    assert canonical_json(got) == canonical_json(want)


@pytest.mark.parametrize("section,key,default", [("train", "features", "offline"), ("train", "batch_tokens", None),
                                                      ("train", "compile", False), ("train", "attention", "auto"), ("train", "state_cache", "off"),
                                                      ("extract", "online_sample_sequences", 64), ("bench", "offline_workers", "auto"),
                                                      ("extract", "train_conversations", None), ("extract", "train_turns", None),
                                                      ("prompts", "leading_assistant", "skip")])
def test_a_key_with_a_default_for_code_is_still_required_in_the_file(tmp_path, base, section, key, default):
    built = SECTIONS[section](**{k: v for k, v in base[section].items() if k != key})  # code may leave it out
    assert getattr(built, key) == default
    del base[section][key]
    with pytest.raises(ParamsError, match=rf"missing key {section}\.{key} \(expected (int|int or null|bool|int or 'auto'|'\w+'( or '\w+')+)\)"):
        load_params([section], write(tmp_path, base))


def test_prompt_length_bounds_that_contradict_each_other_are_named(tmp_path, base):
    base["prompts"].update(min_prompt_tokens=500, max_prompt_tokens=10)
    with pytest.raises(ParamsError, match=r"prompts\.min_prompt_tokens 500 is above prompts\.max_prompt_tokens 10"):
        load_params(["prompts"], write(tmp_path, base))
    base["prompts"].update(min_prompt_tokens=10, max_prompt_tokens=10)  # equal: prompts of exactly 10 tokens
    assert load_params(["prompts"], write(tmp_path, base)).prompts.max_prompt_tokens == 10


def test_state_cache_off_written_unquoted_in_yaml_is_off(tmp_path):
    """YAML 1.1 reads an unquoted `off` as false: `state_cache: off` in params.yaml or a profile means off,
    and true still names the choices."""
    text = Path(REPO_PARAMS).read_text()
    assert re.search(r"^  state_cache: auto\b", text, re.M)
    (tmp_path / "params.yaml").write_text(re.sub(r"^  state_cache: auto\b", "  state_cache: off", text, flags=re.M))
    assert load_params(["train"], tmp_path / "params.yaml").train.state_cache == "off"
    (tmp_path / "params.yaml").write_text(re.sub(r"^  state_cache: auto\b", "  state_cache: on", text, flags=re.M))
    with pytest.raises(ParamsError, match="state_cache"):
        load_params(["train"], tmp_path / "params.yaml")
