"""The docs a newcomer reads: a short README, docs/recipes.md generated from the schema and current,
and every relative link (and #anchor) in README.md and docs/ resolving."""
import re
from pathlib import Path

from polybasic.config_docs import render_fields

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor of a markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    return {slug(m[1]) for m in re.finditer(r"^#+\s+(.*)$", path.read_text(), re.M)}


def test_docs_recipes_is_generated_from_the_schema_and_current():
    assert (REPO / "docs" / "recipes.md").read_text() == render_fields(), \
        "docs/recipes.md is stale: polybasic recipes --fields > docs/recipes.md"


def test_readme_is_short():
    assert len((REPO / "README.md").read_text().splitlines()) <= 250


def test_every_relative_link_resolves():
    bad = []
    for doc in DOCS:
        for target in LINK.findall(doc.read_text()):
            if re.match(r"[a-z]+://|mailto:", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (doc.parent / path).resolve() if path else doc
            if not dest.exists():
                bad.append(f"{doc.name}: {target} (no file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                bad.append(f"{doc.name}: {target} (no heading)")
    assert len(DOCS) >= 5 and bad == []


def test_the_link_checker_sees_a_broken_link(tmp_path):
    (tmp_path / "a.md").write_text("# Top\n[ok](#top) [gone](b.md)")
    doc = tmp_path / "a.md"
    targets = LINK.findall(doc.read_text())
    assert targets == ["#top", "b.md"] and "top" in anchors(doc) and not (tmp_path / "b.md").exists()
