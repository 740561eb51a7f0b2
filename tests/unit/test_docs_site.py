"""The docs site (mkdocs.yml, docs/) builds with `mkdocs build --strict`: a broken link or
anchor, or a page missing from the nav, fails it. Every shell block in the docs says where it
runs, links into docs/ from the README and the code resolve, and the README stays short."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from markdown.extensions.toc import slugify

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
README = REPO / "README.md"
REAL_CLUSTER = "# for a real cluster"
TESTED_BY = re.compile(r"^# tested by (\S+)$")
THIS_MACHINE = "# on the test bed (this machine)"
# Pages whose commands a reader runs on their cluster: each is tested or marked as not.
GUIDES = ("getting-started", "guides")
SHELL_BLOCK = re.compile(r"^```(?:bash|sh|shell|console)\n(.*?)^```", re.M | re.S)


def test_mkdocs_builds_strict(tmp_path: Path) -> None:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    output = result.stdout + result.stderr
    assert "No module named mkdocs" not in output, "mkdocs is missing: pip install -e '.[dev]'"
    assert result.returncode == 0, output[-5000:]
    assert "WARNING" not in output, output[-5000:]
    assert (tmp_path / "index.html").is_file()


def _pages() -> list[Path]:
    return sorted(DOCS.rglob("*.md"))


@pytest.mark.parametrize("page", _pages(), ids=lambda p: str(p.relative_to(DOCS)))
def test_every_shell_block_says_where_it_runs(page: Path) -> None:
    in_guide = page.relative_to(DOCS).parts[0] in GUIDES
    for block in SHELL_BLOCK.findall(page.read_text()):
        first = block.splitlines()[0].strip() if block.strip() else ""
        tested = TESTED_BY.match(first)
        if tested:
            assert (REPO / tested.group(1)).is_file(), f"{page}: no test {tested.group(1)}"
            continue
        allowed = first == REAL_CLUSTER or (first == THIS_MACHINE and not in_guide)
        assert allowed, (
            f"{page.relative_to(REPO)}: a shell block starts {first!r}; start it with "
            f"'{REAL_CLUSTER}' or '# tested by <test file>'"
            + ("" if in_guide else f" or '{THIS_MACHINE}'")
        )


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.M | re.S)
    headings = re.findall(r"^#{1,6} (.+?)\s*$", text, flags=re.M)
    return {slugify(h.replace("`", ""), "-") for h in headings}


def test_readme_links_resolve() -> None:
    links = re.findall(r"\]\((?!https?:)([^)#\s]+)?(?:#([^)\s]+))?\)", README.read_text())
    assert links
    for target, anchor in links:
        path = REPO / target if target else README
        assert path.exists(), f"README.md links to {target}, which does not exist"
        if anchor:
            missing = f"README.md links to {target}#{anchor}: no such heading"
            assert anchor in _anchors(path), missing


def test_readme_is_short_with_the_quick_start_first() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= 150, f"README.md has {len(lines)} lines; move detail into docs/"
    start = next(i for i, line in enumerate(lines) if line.startswith("## Quick start"))
    assert start < 20, "the quick start should sit in the README's first screenful"
    assert "helm install" in "\n".join(lines[start : start + 30])


def test_docs_paths_named_in_the_repository_exist() -> None:
    """A `docs/<page>.md` named in code, tests, the chart or hack/ is a page of the site."""
    named = re.compile(r"docs/([\w./-]+\.md)(?:#([\w-]+))?")
    roots = ["operator", "worker_image", "frontend_image", "helm", "hack", "tests", "examples"]
    seen = 0
    for root in roots:
        for path in (REPO / root).rglob("*"):
            if path.suffix not in {".py", ".yaml", ".yml", ".json", ".tpl", ".txt", ".sh", ""}:
                continue
            if not path.is_file() or "__pycache__" in path.parts:
                continue
            try:
                text = path.read_text()
            except (UnicodeDecodeError, OSError):
                continue
            for page, anchor in named.findall(text):
                if "<" in page or "*" in page:
                    continue
                seen += 1
                target = DOCS / page
                assert target.is_file(), f"{path.relative_to(REPO)} names docs/{page}: missing"
                if anchor:
                    assert anchor in _anchors(target), (
                        f"{path.relative_to(REPO)} names docs/{page}#{anchor}: no such heading"
                    )
    assert seen > 5
