"""Every doc page the code, tests and scripts point a reader at exists, and a quoted section after it
(`docs/NAME.md "Section"`) is a heading of that page: pages get split and renamed, and a comment
that sends a reader to a page or section that is gone is worse than none."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REF = re.compile(r"docs/([a-z_0-9]+\.md)(?:,? \"([^\"]{3,80})\")?")
SOURCES = ("src", "tests", "scripts")
SUFFIXES = {".py", ".toml", ".sh"}


def references() -> list[tuple[str, str, str | None]]:
    out = []
    for top in SOURCES:
        for path in sorted((ROOT / top).rglob("*")):
            if path.suffix in SUFFIXES and path.is_file() and path.name != "test_doc_refs.py":
                for m in REF.finditer(path.read_text(errors="replace")):
                    out.append((str(path.relative_to(ROOT)), m.group(1), m.group(2)))
    return out


def test_referenced_pages_and_sections_exist() -> None:
    refs = references()
    assert len(refs) > 50  # the scan sees the comments (a broken pattern would pass vacuously)
    bad = []
    for where, page, section in refs:
        doc = ROOT / "docs" / page
        if not doc.is_file():
            bad.append(f"{where}: docs/{page} does not exist")
            continue
        if section:
            headings = [line.lstrip("#").strip().lower() for line in doc.read_text().splitlines()
                        if line.startswith("#")]
            if not any(section.lower().lstrip("# ") in h for h in headings):
                bad.append(f"{where}: docs/{page} has no heading {section!r}")
    assert not bad, "\n".join(bad)


def test_no_page_is_over_about_300_lines_or_tells_its_own_making() -> None:
    pages = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
    long = [f"{p.name}: {n} lines" for p in pages if (n := len(p.read_text().splitlines())) > 320]
    assert not long, long
    history = re.compile(r"session \d+|\(session|issue \d+|this session|in the second round", re.I)
    told = [f"{p.name}: {m.group(0)!r}" for p in pages for m in history.finditer(p.read_text())]
    assert not told, told
