"""The documentation holds together: README.md and docs/*.md link only to files and headings that exist, the README
stays a front page (at most 300 lines), every figure in docs/ is shown on some page, and the generated configuration
reference (docs/configuration.md) matches ASPOConfig."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
README_MAX_LINES = 300

FENCE = re.compile(r"^\s*(`{3,}|~{3,})")
INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1")
# [text](target) and ![alt](target); the target ends at whitespace (an optional "title" follows) or ")".
LINK = re.compile(r"(!?)\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
EXTERNAL = ("http://", "https://", "mailto:", "ftp://")


def prose_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, text) of the lines outside fenced code blocks."""
    lines, fence = [], None
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        match = FENCE.match(line)
        if match:
            marker = match[1]
            if fence is None:
                fence = marker
            elif marker[0] == fence[0] and len(marker) >= len(fence):
                fence = None
            continue
        if fence is None:
            lines.append((number, line))
    return lines


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lowercased, links reduced to their text, punctuation other than '-' and '_'
    dropped, spaces turned into '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a markdown file, with GitHub's -1, -2, ... suffixes for repeated headings."""
    seen: dict[str, int] = {}
    result = set()
    for _, line in prose_lines(path):
        match = HEADING.match(line)
        if not match:
            continue
        slug = github_slug(match[2])
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        result.add(slug if count == 0 else f"{slug}-{count}")
    return result


def links(path: Path) -> list[tuple[int, bool, str]]:
    """(line number, is an image, target) of every link and image outside code."""
    found = []
    for number, line in prose_lines(path):
        for match in LINK.finditer(INLINE_CODE.sub("", line)):
            found.append((number, match[1] == "!", match[2]))
    return found


def relative_links() -> list[tuple[Path, int, bool, str]]:
    return [
        (page, number, image, target)
        for page in PAGES
        for number, image, target in links(page)
        if not target.startswith(EXTERNAL)
    ]


def test_the_pages_exist():
    names = {page.name for page in PAGES}
    for name in ("index.md", "configuration.md", "design.md", "api.md", "experiments.md", "development.md"):
        assert name in names, f"docs/{name} is missing"


def test_every_relative_link_and_image_resolves():
    problems = []
    anchor_cache: dict[Path, set[str]] = {}
    for page, number, _, target in relative_links():
        where = f"{page.relative_to(ROOT)}:{number}: {target}"
        file_part, _, anchor = target.partition("#")
        linked = (page.parent / unquote(file_part)).resolve() if file_part else page
        if not linked.exists():
            problems.append(f"{where}: no such file")
            continue
        if anchor and linked.suffix == ".md":
            if linked not in anchor_cache:
                anchor_cache[linked] = anchors(linked)
            if unquote(anchor).lower() not in anchor_cache[linked]:
                problems.append(f"{where}: no heading with anchor #{anchor} in {linked.relative_to(ROOT)}")
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_the_pages_link_somewhere():
    # A guard for the link pattern itself: the README links to the docs and shows a figure.
    readme = links(ROOT / "README.md")
    assert any(target.startswith("docs/") and not image for _, image, target in readme)
    assert any(image for _, image, _ in readme)


def test_readme_is_at_most_300_lines():
    count = len((ROOT / "README.md").read_text().splitlines())
    assert count <= README_MAX_LINES, f"README.md has {count} lines (at most {README_MAX_LINES}): move text to docs/"


def test_every_figure_in_docs_is_shown_on_a_page():
    shown = {(page.parent / unquote(target.partition("#")[0])).resolve() for page, _, _, target in relative_links()}
    unused = sorted(png.name for png in DOCS.glob("*.png") if png.resolve() not in shown)
    assert not unused, f"figures in docs/ that no page shows: {unused}"


@pytest.mark.parametrize(
    ("heading", "slug"),
    [
        ("Quick start (a fresh clone, CPU, no network)", "quick-start-a-fresh-clone-cpu-no-network"),
        (
            "Asynchronous training from the command line (`trainer: async`)",
            "asynchronous-training-from-the-command-line-trainer-async",
        ),
        ("KL-adaptive rho (`value_rho_mode: kl`)", "kl-adaptive-rho-value_rho_mode-kl"),
        ("The reference recipe (Archer2.0)", "the-reference-recipe-archer20"),
        ("4. Asynchronous training", "4-asynchronous-training"),
    ],
)
def test_github_slug(heading, slug):
    assert github_slug(heading) == slug


def test_configuration_reference_is_current():
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "config_reference.py"), "--check"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
