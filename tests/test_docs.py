"""The README and docs/*.md as a reader meets them: every relative link (and #anchor) leads
somewhere, and the README opens with the two commands that CI runs."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

FENCE = re.compile(r"^```.*?^```", re.M | re.S)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[[^\]\n]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6} (.+?)\s*$", re.M)


def _prose(text: str) -> str:
    """The text outside code, where a link is a link."""
    return INLINE_CODE.sub("", FENCE.sub("", text))


def _slugs(text: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation other than - and _ dropped, spaces
    to hyphens, a repeated heading suffixed -1, -2, ..."""
    seen: dict[str, int] = {}
    slugs = set()
    for heading in HEADING.findall(FENCE.sub("", text)):
        slug = re.sub(r"[^\w\- ]", "", heading.replace("`", "").lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        slugs.add(slug if n == 0 else f"{slug}-{n}")
    return slugs


def broken_links(page: Path) -> list[str]:
    """Each relative link of the page whose file, or whose anchor in a Markdown file, does not
    exist (external links are not followed)."""
    broken = []
    for target in LINK.findall(_prose(page.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in _slugs(dest.read_text()):
            broken.append(f"{target}: no heading with that anchor in {dest.name}")
    return broken


def test_there_are_docs_pages():
    names = {p.name for p in PAGES}
    for name in ("attention.md", "gemm.md", "simulator.md", "integration.md", "mac.md",
                 "performance.md", "reliability.md"):  # fmt: skip
        assert name in names


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    assert broken_links(page) == []


def test_every_docs_page_is_linked_from_the_readme():
    readme = (ROOT / "README.md").read_text()
    for page in PAGES[1:]:
        assert f"](docs/{page.name})" in readme, page.name


def test_the_link_check_sees_a_missing_file_and_a_missing_anchor(tmp_path):
    (tmp_path / "other.md").write_text("# Other page\n\n## A `code` heading: here\n")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](other.md) [ok](other.md#a-code-heading-here) [ok](#title) [ext](https://x.y/z)\n"
        "`[in code](missing.md)`\n```\n[in a block](missing.md)\n```\n# Title\n"
        "[file](missing.md) [anchor](other.md#nowhere) [image](img/missing.png)\n"
    )
    assert broken_links(page) == [
        "missing.md: no such file",
        "other.md#nowhere: no heading with that anchor in other.md",
        "img/missing.png: no such file",
    ]


def test_the_readme_opens_with_the_two_commands_and_ci_runs_the_second():
    readme = (ROOT / "README.md").read_text()
    first_block = FENCE.search(readme).group(0)
    assert readme.index(first_block) < readme.index("\n## ")
    commands = [line for line in first_block.splitlines()[1:-1] if line and line[0] != "#"]
    assert commands == [
        "apt-get update && apt-get install -y clang-19 libclang-rt-19-dev llvm-19",
        "pip install torch==2.13.0 -e '.[test]' && python -m torch_steel",
        "python -m pytest -n 2",
    ]
    assert "\npython -m pytest -n 2 || status=$?\n" in (ROOT / ".ci" / "run").read_text()
