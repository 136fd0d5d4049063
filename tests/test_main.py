"""The `draftlab` command's wiring: its verbs, their arguments and exit codes (0 ok, 1 findings with
errors, 2 bad input printed as one line without a traceback). What the verbs find is tested where
the functions live (tests/test_check_external.py, tests/test_check.py, tests/test_server.py); the
exp verbs in tests/test_profiles.py."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from draftlab.main import main
from draftlab.sglang.checkpoint import export_sglang
from tests.support.micro import save_micro_model

ROOT = Path(__file__).resolve().parents[1]
VERBS = ["check-draft", "parity", "serve", "exp"]


def draftlab(*argv, cwd=ROOT) -> subprocess.CompletedProcess:
    """The command as a user runs it (python -m draftlab is the console script's entry point)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "draftlab", *map(str, argv)], cwd=cwd, env=env, capture_output=True, text=True)


def run_main(capsys, *argv) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_:
        main([str(a) for a in argv])
    out = capsys.readouterr()
    return exit_.value.code, out.out, out.err


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """(dir, facts) of an 8-layer micro Llama (the one tests/test_check_external.py builds drafts for)."""
    from tests.test_check_external import H, L, V, target_facts

    path = tmp_path_factory.mktemp("target") / "micro"
    model = save_micro_model(path, arch="llama", num_layers=L, hidden_size=H, vocab_size=V)
    return path, target_facts(model, path)


def test_help_lists_every_verb_with_one_line(capsys):
    r = draftlab("--help")
    assert r.returncode == 0
    lines = r.stdout.splitlines()
    for verb in VERBS:
        (line,) = [x for x in lines if x.split()[:1] == [verb]]
        assert len(line.split()) > 2, line  # the verb and its help on the same line
    for verb in VERBS:  # each verb has its own --help
        code, out, _ = run_main(capsys, verb, "--help")
        assert code == 0 and out.startswith("usage:"), verb
    assert "--model-path" in run_main(capsys, "serve", "--help")[1]  # the server's own options
    for sub in ("run", "show-profile"):
        code, out, _ = run_main(capsys, "exp", sub, "--help")
        assert code == 0 and "PROFILE" in out


def test_no_verb_or_an_unknown_one_is_a_usage_error(capsys):
    for argv in ([], ["bogus"], ["exp"], ["check-draft", "some/path"]):  # check-draft: --target is required
        code, _, err = run_main(capsys, *argv)
        assert code == 2 and "usage: draftlab" in err, argv


def test_check_draft_exits_0_clean_1_on_errors(target, tmp_path, capsys):
    from tests.test_check_external import make_draft

    path, facts = target
    export_sglang(make_draft(facts), tmp_path / "draft", facts, [2, 4, 6], "0.5.14")
    code, out, _ = run_main(capsys, "check-draft", tmp_path / "draft", "--target", path, "--json", tmp_path / "v.json")
    assert code == 0 and "verdict: ok" in out and json.loads((tmp_path / "v.json").read_text())["ok"]
    config = json.loads((tmp_path / "draft/config.json").read_text())
    config.pop("eagle_config")  # SGLang would silently capture its default layers
    (tmp_path / "draft/config.json").write_text(json.dumps(config))
    code, out, _ = run_main(capsys, "check-draft", tmp_path / "draft", "--target", path)
    assert code == 1 and "eagle_config_missing" in out and "NOT ready" in out


@pytest.mark.parametrize("argv, words", [
    (["check-draft", "no/such/draft", "--target", "no/such/target"], "no/such/draft: no such checkpoint directory"),
    (["parity", "--features", "no/such/features"], "no/such/features/manifest.json: manifest not found"),
    (["exp", "show-profile", "no/such/profile.yaml"], "no/such/profile.yaml: no such profile"),
])
def test_bad_input_is_one_line_on_stderr_exit_2_no_traceback(argv, words):
    r = draftlab(*argv)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.startswith("error: ") and words in r.stderr and r.stderr.count("\n") == 1, r.stderr
    assert "Traceback" not in r.stderr


def test_serve_refuses_what_the_reference_server_cannot_run(target, capsys):
    code, _, err = run_main(capsys, "serve", "--model-path", target[0], "--device", "cpu", "--speculative-algorithm", "EAGLE")
    last = err.strip().splitlines()[-1]  # after transformers' weight-loading progress
    assert code == 2 and last == "error: --speculative-algorithm EAGLE: the reference server runs EAGLE3 and NGRAM only"
    assert "Traceback" not in err


def test_the_python_m_forms_still_work():
    r = subprocess.run([sys.executable, "-m", "draftlab.check", "draft", "no/such/draft", "--target", "x"], cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.startswith("error: no/such/draft: no such checkpoint directory")
    r = subprocess.run([sys.executable, "-m", "draftlab.server", "--help"], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                       capture_output=True, text=True)
    assert r.returncode == 0 and "--speculative-draft-model-path" in r.stdout
