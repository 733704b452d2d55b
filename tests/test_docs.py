"""The documentation stays readable and connected: the reference pages (docs/*.md) together fit a
reading budget, dated measurements live under docs/results/, and every relative markdown link in
README.md and docs/ names a file that exists."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
# characters of docs/*.md together (docs/results/ not counted): the reading budget the reference is held to
REFERENCE_BUDGET = 200_000
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")

pytestmark = pytest.mark.pure  # reads files only


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]


def _without_code(text: str) -> str:
    """The text outside fenced and inline code, where a bracket pair is no link."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    return re.sub(r"`[^`\n]*`", "", text)


def _relative_links(page: Path) -> list[str]:
    targets = LINK.findall(_without_code(page.read_text()))
    return [t for t in targets if not re.match(r"[a-z][a-z0-9+.-]*:", t) and not t.startswith("#")]


def _reference_sizes() -> dict[str, int]:
    return {p.name: len(p.read_text()) for p in DOCS.glob("*.md")}


def test_reference_docs_fit_the_budget():
    sizes = _reference_sizes()
    assert sum(sizes.values()) <= REFERENCE_BUDGET, sorted(sizes.items(), key=lambda kv: -kv[1])


def test_results_hold_the_measurement_logs():
    results = [p for p in (DOCS / "results").glob("*.md") if p.name != "README.md"]
    assert results, "docs/results/ holds no measurement log"
    index = (DOCS / "results" / "README.md").read_text()
    assert all(p.name in index for p in results), "docs/results/README.md does not list every log"


@pytest.mark.parametrize("page", _pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path):
    missing = [t for t in _relative_links(page) if not (page.parent / t.split("#")[0]).exists()]
    assert not missing, f"{page.relative_to(ROOT)} links to missing files: {missing}"


def test_the_link_pattern_sees_links():
    """The check above is only as good as its pattern: it must find a plain and a titled link."""
    assert LINK.findall('see [a](docs/a.md) and [b](b.md "title")') == ["docs/a.md", "b.md"]
