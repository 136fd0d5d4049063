"""The README and docs/ as a user reads them: every relative link lands on a file (and a heading),
the Quick start is still the two commands, and every page opens with the commands it runs."""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

FENCE = re.compile(r"^\s*(```|~~~)")
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
CODE_SPAN = re.compile(r"(`+)(.+?)\1")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks, with inline code spans blanked (links there are not links)."""
    out, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append(CODE_SPAN.sub(lambda m: "x" * len(m.group(2)), line))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: link text kept, lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "")
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    fenced = False
    for line in page.read_text().splitlines():  # headings in raw text: code spans are part of the slug
        if FENCE.match(line):
            fenced = not fenced
            continue
        m = None if fenced else HEADING.match(line)
        if m:
            base = slug(m.group(2))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")  # GitHub numbers repeated headings
    return out


def links(page: Path) -> list[tuple[int, str]]:
    found = []
    for number, line in enumerate(prose_lines(page.read_text()), 1):
        found += [(number, m.group(1)) for m in LINK.finditer(line)]
    return found


def test_the_pages_exist_and_link_somewhere():
    assert len(PAGES) > 5, "README.md and the docs/ pages"
    assert any(target.startswith("docs/") for _, target in links(ROOT / "README.md")), "the README links the docs"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    broken = []
    for _, target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:: not checked offline
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no file {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}")
        elif anchor and (dest.suffix != ".md" or anchor not in anchors(dest)):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: broken links:\n" + "\n".join(broken)


def test_slugs_follow_github():
    assert slug("DVC's cache and the size of data/hidden") == "dvcs-cache-and-the-size-of-datahidden"
    assert slug("A plan for 10^8 training tokens") == "a-plan-for-108-training-tokens"
    assert slug("The `draftlab` command") == "the-draftlab-command"


def test_a_broken_link_is_found(tmp_path):
    page = tmp_path / "page.md"
    (tmp_path / "other.md").write_text("# Other\n\n## A section\n")
    page.write_text("[ok](other.md#a-section) [no file](gone.md) [no heading](other.md#nope)\n"
                    "```\n[in code](ignored.md)\n```\n")
    found = [target for _, target in links(page)]
    assert found == ["other.md#a-section", "gone.md", "other.md#nope"]
    assert "a-section" in anchors(tmp_path / "other.md") and "nope" not in anchors(tmp_path / "other.md")


def quick_start_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = re.search(r"^## Quick start\n(.*?)(?=^## )", text, re.S | re.M)
    assert section, "README.md has a '## Quick start' section"
    block = re.search(r"^```bash\n(.*?)^```", section.group(1), re.S | re.M)
    assert block, "the Quick start has a ```bash block"
    lines = [re.sub(r"\s+#.*$", "", line).strip() for line in block.group(1).splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


def steps(command: str) -> list[str]:
    return [part.strip() for part in command.split("&&")]


def test_quick_start_is_two_commands_run_and_test():
    commands = quick_start_commands()
    assert len(commands) == 2, commands
    run, test = commands
    assert any(re.fullmatch(r"dvc repro(\s.*)?", step) for step in steps(run)), run
    assert any(re.fullmatch(r"python -m pytest(\s.*)?", step) for step in steps(test)), test


def test_ci_runs_the_quick_start_test_command():
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert quick_start_commands()[1] in ci, ".ci/run runs exactly the README's test command"


@pytest.mark.parametrize("page", PAGES[1:], ids=lambda p: str(p.relative_to(ROOT)))
def test_every_docs_page_opens_with_its_commands(page):
    lines = [line for line in page.read_text().splitlines() if line.strip()]
    assert lines[0].startswith("# "), f"{page.name}: a title first"
    assert lines[1] == "```bash", f"{page.name}: the commands a user runs, right under the title"
