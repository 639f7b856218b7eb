"""The documentation stays true to the code: README.md's length, its
configuration table against zpath.config.settings(), relative links in
README.md and docs/*.md, and no commit hashes in the README.

``python -m zpath.config`` prints the configuration table the README must
carry (paste it under "## Configuration" after changing zpath/config.py).
"""
from __future__ import annotations

import re
import unicodedata
from pathlib import Path

from zpath.config import markdown_table

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
MAX_README_LINES = 600

TABLE_HEADER = "| variable | read by | default | meaning |"
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
HASH = re.compile(r"\b[0-9a-f]{7,40}\b")


def config_rows() -> dict[str, str]:
    """The table row for each environment variable: zpath.config.markdown_table()."""
    return {row.split("`")[1]: row for row in markdown_table().splitlines()[2:]}


def _section(text: str, title: str) -> str:
    """The body of the `## title` section (up to the next `## ` heading)."""
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert match, f"README.md has no '## {title}' section"
    return match.group(1)


def _readme_table_rows() -> list[str]:
    body = _section(README.read_text(), "Configuration")
    assert TABLE_HEADER in body, f"the Configuration section has no table headed {TABLE_HEADER!r}"
    table = body[body.index(TABLE_HEADER):].split("\n\n", 1)[0]
    return [line for line in table.splitlines()[2:] if line.startswith("|")]


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = unicodedata.normalize("NFKC", heading).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _prose(path: Path) -> str:
    """The file without its fenced code blocks."""
    return re.sub(r"^```.*?^```", "", path.read_text(), flags=re.M | re.S)


def _anchors(path: Path) -> set[str]:
    text = _prose(path)
    return {_slug(m.group(1)) for m in re.finditer(r"^#{1,6} (.+)$", text, re.M)}


def test_readme_is_at_most_600_lines() -> None:
    lines = README.read_text().count("\n")
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines, at most {MAX_README_LINES}"


def test_readme_configuration_table_matches_settings() -> None:
    rows = _readme_table_rows()
    names = [re.match(r"\| `(ZPATH_[A-Z0-9_]+)` \|", row) for row in rows]
    assert all(names), f"rows not naming one ZPATH_* variable: {[r for r, n in zip(rows, names, strict=True) if not n]}"
    found = [n.group(1) for n in names if n]
    assert len(found) == len(set(found)), f"variables listed twice: {sorted({n for n in found if found.count(n) > 1})}"
    expected = config_rows()
    assert set(found) - set(expected) == set(), f"not settings in zpath/config.py: {sorted(set(found) - set(expected))}"
    assert set(expected) - set(found) == set(), (
        f"settings missing from the README's table: {sorted(set(expected) - set(found))}; "
        f"`python -m zpath.config` prints the table")
    stale = [row for row in rows if row != expected[row.split("`")[1]]]
    assert not stale, ("rows that differ from zpath.config.settings() (`python -m zpath.config` prints "
                       f"the table): {stale}")


def test_relative_links_point_to_existing_files_and_headings() -> None:
    broken = []
    for doc in [README, *DOCS]:
        for match in LINK.finditer(_prose(doc)):
            target = match.group(1) or match.group(2)
            if re.match(r"[a-z][a-z0-9+.-]*:", target):        # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            file = (doc.parent / path).resolve() if path else doc
            if not file.exists():
                broken.append(f"{doc.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
                broken.append(f"{doc.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_readme_names_no_commit_hash() -> None:
    hashes = [h for h in HASH.findall(README.read_text()) if re.search(r"[a-f]", h) and re.search(r"\d", h)]
    assert not hashes, f"commit hashes in README.md: {hashes}"


def test_link_and_hash_checks_catch_what_they_should() -> None:
    assert _slug("`opbyop.py`: op-by-op throughput") == "opbyoppy-op-by-op-throughput"
    assert _slug("Sharing a cluster") == "sharing-a-cluster"
    assert [m.group(1) for m in LINK.finditer("see [a](docs/x.md#y) and ![p](p.png)")] == ["docs/x.md#y", None]
    assert HASH.findall("at 3f618e8 to d8beb18, 2026-11-23") == ["3f618e8", "d8beb18"]
