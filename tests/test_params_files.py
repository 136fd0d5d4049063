"""params.yaml and profiles are read as DVC reads them: a key given twice is refused ("found duplicate
key"), and a file that is a folder, unreadable, not UTF-8, nested or aliased into something huge is
an error naming the file (and the line), with every quoted value bounded. Through the stages'
loader, `exp run --dry-run`, `exp show-profile` and `run-stages` alike."""
import re
import shutil
import time
from pathlib import Path

import pytest

from draftlab.errors import QUOTE_CHARS, UserError
from draftlab.main import main
from draftlab.params import ParamsError, load_params, read_yaml
from draftlab.experiments.profiles import apply_profiles
from draftlab.experiments.run_stages import run_stages
from draftlab.yamlfile import read_mapping

ROOT = Path(__file__).resolve().parents[1]
PARAMS = (ROOT / "params.yaml").read_text()


def with_line(text: str, after: str, line: str) -> str:
    """`text` with `line` inserted after the first line that starts with `after` (indented alike)."""
    lines = text.splitlines()
    i = next(n for n, l in enumerate(lines) if l.strip().startswith(after))
    lines.insert(i + 1, line)
    return "\n".join(lines) + "\n"


def line_of(text: str, start: str, nth: int = 0) -> int:
    return [n for n, l in enumerate(text.splitlines(), 1) if l.strip().startswith(start)][nth]


@pytest.fixture
def project(tmp_path, monkeypatch):
    shutil.copy(ROOT / "params.yaml", tmp_path / "params.yaml")
    (tmp_path / "configs").mkdir()
    monkeypatch.chdir(tmp_path)
    return tmp_path


def run_main(capsys, *argv) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exit_:
        main(list(argv))
    return exit_.value.code, capsys.readouterr().err


def test_a_key_given_twice_in_params_yaml_is_refused_naming_key_and_lines(project):
    text = with_line(PARAMS, "num_steps:", "  num_steps: 5")
    (project / "params.yaml").write_text(text)
    first, second = line_of(text, "num_steps:"), line_of(text, "num_steps:", 1)
    with pytest.raises(ParamsError, match=rf"params.yaml:{second}: found duplicate key spec.num_steps \(first given at line {first}\)"):
        load_params(["spec"])


def test_a_section_given_twice_is_refused(project):
    (project / "params.yaml").write_text(PARAMS + "spec:\n  num_steps: 5\n")
    with pytest.raises(ParamsError, match=r"found duplicate key spec \(first given at line \d+\)"):
        load_params(["target"])  # even when the stage reads another section: DVC refuses the whole file


def test_a_profile_with_a_key_twice_is_refused_by_exp_run_and_show_profile(project, capsys):
    (project / "configs" / "dup.yaml").write_text("spec:\n  num_steps: 3\n  topk: 1\n  num_steps: 5\n")
    with pytest.raises(ParamsError, match=r"configs/dup.yaml:4: found duplicate key spec.num_steps \(first given at line 2\)"):
        apply_profiles(["dup"])
    for argv in (["exp", "run", "--dry-run", "dup"], ["exp", "show-profile", "dup"]):
        code, err = run_main(capsys, *argv)
        assert code == 2 and "found duplicate key spec.num_steps" in err and "Traceback" not in err


def test_run_stages_refuses_a_duplicate_before_running_anything(project):
    (project / "params.yaml").write_text(with_line(PARAMS, "seed:", "  seed: 7"))
    shutil.copy(ROOT / "dvc.yaml", project / "dvc.yaml")
    with pytest.raises(ParamsError, match="found duplicate key prompts.seed"):
        run_stages([], params_file="params.yaml", dvc_file="dvc.yaml")
    assert not (project / "data").exists()


def test_a_merge_may_be_overridden_as_yaml_and_dvc_allow(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("base: &b {k: 1, j: 2}\nother:\n  <<: *b\n  k: 3\n")
    assert read_mapping(path)["other"] == {"k": 3, "j": 2}
    path.write_text("a:\n  - {k: 1, k: 2}\n")
    with pytest.raises(UserError, match=r"p.yaml:2: found duplicate key a.0.k"):
        read_mapping(path)


@pytest.mark.parametrize("make, words", [
    (lambda p: p.mkdir(), "a folder, not a params file"),
    (lambda p: p.write_bytes(b"spec:\n  num_steps: 3\n  topk: \xff1\n"), "params.yaml:3:9: not UTF-8 text (byte 0xff at line 3, column 9)"),
    (lambda p: p.write_text("spec: [" * 20000), "nested too deeply"),
    (lambda p: p.write_text("train:\n  seed: " + "1" * 5000 + "\n"), "a value YAML cannot build"),
    (lambda p: p.write_text("- a\n- b\n"), "the top level must be a mapping of sections, got list"),
    (lambda p: p.write_text("a: [1, 2\n"), "not valid YAML"),
])
def test_unreadable_params_files_are_named(project, make, words):
    (project / "params.yaml").unlink()
    make(project / "params.yaml")
    with pytest.raises(ParamsError, match=re.escape(words)):
        load_params(["spec"])


def test_an_unreadable_file_is_named(project, monkeypatch):
    def denied(self):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(Path, "read_bytes", denied)
    with pytest.raises(ParamsError, match=r"params.yaml: cannot read the params file \(Permission denied\)"):
        read_yaml("params.yaml")


def laughs(levels: int = 9) -> str:
    """A flow list whose anchors expand to 10**levels strings: its repr would be gigabytes."""
    parts = ['&l0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    parts += [f"&l{i} [" + ", ".join([f"*l{i - 1}"] * 10) + "]" for i in range(1, levels + 1)]
    return "[" + ", ".join(parts) + "]"


@pytest.mark.parametrize("key", ["train.lr", "synth.server_args", "capture.layers", "export.sglang_version"])
def test_an_alias_bomb_gets_a_bounded_error_in_under_a_second(project, capsys, key):
    section, name = key.split(".")
    text = PARAMS.replace(f"\n  {name}:", f"\n  {name}: {laughs()}  #", 1) if f"\n  {name}:" in PARAMS else None
    assert text and text != PARAMS
    (project / "params.yaml").write_text(text)
    t0 = time.perf_counter()
    with pytest.raises(ParamsError, match=rf"key {key} ") as e:
        load_params([section])
    assert time.perf_counter() - t0 < 5  # generous: about 0.1 s here
    assert len(str(e.value)) < 4 * QUOTE_CHARS
    (project / "params.yaml").write_text(PARAMS)
    (project / "configs" / "bomb.yaml").write_text(f"{section}:\n  {name}: {laughs()}\n")
    code, err = run_main(capsys, "exp", "show-profile", "bomb")
    assert code == 2 and len(err) < 4 * QUOTE_CHARS and "bomb.yaml" in err


def test_a_huge_unknown_key_is_quoted_bounded(project):
    # an explicit key (`? KEY`): YAML allows 1024 characters to an implicit one
    (project / "params.yaml").write_text(PARAMS.replace("\nspec:\n", "\nspec:\n  ? " + "k" * 100_000 + "\n  : 1\n", 1))
    with pytest.raises(ParamsError, match="unknown key spec.k") as e:
        load_params(["spec"])
    assert len(str(e.value)) < 4 * QUOTE_CHARS


def test_profile_names_that_are_no_files_are_named(project, capsys):
    code, err = run_main(capsys, "exp", "show-profile", "p" * 5000)
    assert code == 2 and "no such profile (a name of 5,000 characters is no file name)" in err and len(err) < 400
    (project / "configs" / "dir.yaml").mkdir()
    code, err = run_main(capsys, "exp", "show-profile", "configs/dir.yaml")
    assert code == 2 and "configs/dir.yaml: a folder, not a profile" in err
