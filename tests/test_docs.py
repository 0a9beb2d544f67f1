"""The repository carries its own documentation: nothing cites notes kept outside it, and every citation of
`docs/<file>.md#<anchor>` (and every relative link inside docs/) lands on a file and a heading that exist."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"

# Developer notes that live outside the repository. Spelled as patterns so that this file does not cite them.
OUTSIDE = re.compile(r"\b(?:FACTS|DESIGN|TESTING|STYLE)\.md\b|\.\./shared\b")
# A repository path into docs/, as code and READMEs cite it: docs/facts.md or docs/facts.md#eagle-3-drafter.
CITATION = re.compile(r"(?<![\w./-])docs/([\w.-]+\.md)(?:#([\w-]+))?")
# A Markdown link target inside docs/: (facts.md#anchor), (../training/README.md#statusjson), (#same-file).
LINK = re.compile(r"\]\((?!https?://|mailto:)([^)#\s]*)(?:#([^)\s]+))?\)")
SKIP_DIRS = {".git", "__pycache__", "node_modules"}


def repo_files() -> list[Path]:
    """Tracked files (git ls-files); outside a git checkout, every file not under a dot-directory."""
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=60).stdout
        names = [n for n in out.decode().split("\0") if n]
    except (OSError, subprocess.SubprocessError):
        names = [
            str(p.relative_to(ROOT))
            for p in ROOT.rglob("*")
            if p.is_file() and not any(part.startswith(".") or part in SKIP_DIRS for part in p.relative_to(ROOT).parts)
        ]
    # docs/ must be checked even before its files are committed.
    names += [str(p.relative_to(ROOT)) for p in DOCS.glob("*.md")]
    return [ROOT / n for n in sorted(set(names)) if (ROOT / n).is_file()]


def read_text(path: Path) -> str | None:
    """The file's text, or None for a binary file (a NUL byte, or not UTF-8)."""
    data = path.read_bytes()
    if b"\0" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lowercase, punctuation dropped (except '-' and '_'), spaces -> '-'.

    >>> github_anchor("Processes, torchrun and systemd")
    'processes-torchrun-and-systemd'
    >>> github_anchor("`status.json`"), github_anchor("EAGLE-3 drafter")
    ('statusjson', 'eagle-3-drafter')
    """
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a Markdown file (outside fenced code), with GitHub's -1, -2 for repeats."""
    seen: dict[str, int] = {}
    found = set()
    fenced = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
            continue
        heading = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if fenced or not heading:
            continue
        base = github_anchor(heading.group(1))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def broken(target: Path, anchor: str | None) -> str | None:
    """Why a link to target#anchor is broken, or None when it resolves."""
    if not target.is_file():
        return f"{shown(target)} does not exist"
    if anchor and target.suffix == ".md" and anchor not in anchors(target):
        return f"{shown(target)} has no heading with anchor #{anchor}"
    return None


def line_of(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


FILES = repo_files()


def test_the_docs_exist_with_the_sections_code_cites():
    for name in ("architecture.md", "contracts.md", "facts.md"):
        assert (DOCS / name).is_file(), f"docs/{name} is missing"
    assert {
        "eagle-3-drafter",
        "training-time-test",
        "memory-and-flex-attention",
        "proxmox-gpu-passthrough",
        "nvidia-in-containers",
        "processes-torchrun-and-systemd",
    } <= anchors(DOCS / "facts.md")


def test_nothing_cites_notes_kept_outside_the_repository():
    hits = []
    for path in FILES:
        text = read_text(path)
        if text is None:
            continue
        for match in OUTSIDE.finditer(text):
            hits.append(f"{path.relative_to(ROOT)}:{line_of(text, match.start())}: {match.group(0)}")
    assert not hits, (
        "these files cite notes that are not part of the repository; write what the reader needs into docs/ "
        "(with public sources) and cite docs/<file>.md#<anchor> instead:\n" + "\n".join(hits)
    )


def test_every_docs_citation_lands_on_a_file_and_a_heading():
    problems, cited = [], 0
    for path in FILES:
        text = read_text(path)
        if text is None:
            continue
        for match in CITATION.finditer(text):
            cited += 1
            why = broken(DOCS / match.group(1), match.group(2))
            if why:
                problems.append(f"{path.relative_to(ROOT)}:{line_of(text, match.start())}: {match.group(0)}: {why}")
    assert cited, "no file cites docs/<file>.md: the citations this test guards are gone"
    assert not problems, "broken citations of docs/:\n" + "\n".join(problems)


@pytest.mark.parametrize("doc", sorted(DOCS.glob("*.md")), ids=lambda p: p.name)
def test_links_inside_docs_resolve(doc):
    text = doc.read_text(encoding="utf-8")
    problems = []
    for match in LINK.finditer(text):
        target, anchor = match.group(1), match.group(2)
        why = broken(doc if not target else (doc.parent / target).resolve(), anchor)
        if why:
            problems.append(f"docs/{doc.name}:{line_of(text, match.start())}: {match.group(0)}: {why}")
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_the_anchor_rule_catches_a_renamed_heading(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Page\n\n## Memory and flex attention\n\n```\n## not a heading\n```\n## Page\n")
    assert anchors(page) == {"page", "memory-and-flex-attention", "page-1"}
    assert broken(page, "memory-and-flex-attention") is None
    assert broken(page, "not-a-heading") is not None and broken(tmp_path / "gone.md", None) is not None


# A repository path of a source file, as docs/ cite them: `training/eagle3/plan/model.py`, `library/gpu_cleanup.py`.
SOURCE_PATH = re.compile(r"`((?:training|library|module_utils|roles|plugins|bin|bench|scripts|tests)/[\w./-]+\.\w+)`")


def test_every_source_file_the_docs_cite_exists():
    """A file moved or split (plan.py became plan/) must not leave docs/ pointing at nothing."""
    missing = [
        f"{doc.name}: {path}"
        for doc in sorted(DOCS.glob("*.md"))
        for path in SOURCE_PATH.findall(doc.read_text())
        if "*" not in path and not (ROOT / path).exists()
    ]
    assert not missing, "docs cite files that do not exist: " + "; ".join(missing)
