"""The README and docs/ stay true to the repo: links resolve, every CLI flag is documented, the
README stays a short front door, and the pages describe what is rather than what changed.

Fast: reads text files and builds the CLIs' argument parsers; nothing trains.
"""
from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from tests.conftest import ROOT

README = ROOT / "README.md"
DOCS = ROOT / "docs"
README_MAX_LINES = 250
# Words that only ever narrate a change; kept small so legitimate prose never trips it.
CHANGELOG_WORDS = ("previously", "no longer")

# [text](target) and ![alt](target); the target ends at whitespace or ')' (an optional "title" follows).
MD_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
IMG_SRC = re.compile(r"<img\b[^>]*\bsrc\s*=\s*[\"']([^\"']+)[\"']", re.IGNORECASE)
FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
INLINE_CODE = re.compile(r"`[^`\n]*`")


def doc_files() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def prose(text: str) -> str:
    """The text without fenced code blocks and inline code, where link-like strings are not links."""
    return INLINE_CODE.sub("", FENCE.sub("", text))


def relative_links(text: str) -> list[str]:
    """Every relative link target (markdown links and images, <img src>), '#anchor' stripped."""
    body = prose(text)
    targets = MD_LINK.findall(body) + IMG_SRC.findall(body)
    out = []
    for target in targets:
        if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith(("#", "//")):
            continue  # http:, https:, mailto: ... or an anchor on the same page
        path = target.split("#", 1)[0].split("?", 1)[0]
        if path:
            out.append(path)
    return out


def cli_parsers() -> dict[str, argparse.ArgumentParser]:
    import detect
    import export
    import train
    import tune
    import val

    return {"train.py": train.build_parser(), "val.py": val.build_parser(),
            "detect.py": detect.build_parser(), "export.py": export.build_parser(), "tune.py": tune.build_parser()}


def long_options(parser: argparse.ArgumentParser) -> list[str]:
    """Every --long option string a user can type, aliases and --no-X forms included; hidden ones skipped."""
    flags = []
    for action in parser._actions:
        if action.help == argparse.SUPPRESS or isinstance(action, argparse._HelpAction):
            continue
        flags += [s for s in action.option_strings if s.startswith("--")]
    return flags


def test_doc_files_exist():
    for name in ("datasets", "training", "distributed", "deploy", "benchmarks", "architecture"):
        assert (DOCS / f"{name}.md").is_file(), f"docs/{name}.md is missing"


@pytest.mark.parametrize("doc", doc_files(), ids=rel)
def test_relative_links_resolve(doc: Path):
    broken = [t for t in relative_links(doc.read_text(encoding="utf-8")) if not (doc.parent / t).exists()]
    assert not broken, f"{rel(doc)}: links to missing files: {', '.join(broken)}"


def test_link_extraction():
    text = ("[a](docs/x.md#part) ![b](img/p.png) <img src='c.jpg' width=3> [d](https://e.org/f) [g](#h)\n"
            "`[not](inline.md)`\n```\n[not](fenced.md)\n```\n")
    assert relative_links(text) == ["docs/x.md", "img/p.png", "c.jpg"]


@pytest.mark.parametrize("cli", ["train.py", "val.py", "detect.py", "export.py", "tune.py"])
def test_every_flag_documented(cli: str):
    parser = cli_parsers()[cli]
    docs_text = "\n".join(p.read_text(encoding="utf-8") for p in sorted(DOCS.glob("*.md")))
    flags = long_options(parser)
    assert ("--weights" in flags or cli == "tune.py") and "--local-rank" not in flags and "--help" not in flags
    missing = [f for f in flags if not re.search(re.escape(f) + r"(?![\w-])", docs_text)]
    assert not missing, f"{cli}: flags not documented in any docs/*.md: {', '.join(missing)}"


def test_every_convert_flag_documented():
    """python -m yolotrain.convert: each subcommand's flags (argparse keeps them in its subparsers)."""
    from yolotrain import convert

    docs_text = "\n".join(p.read_text(encoding="utf-8") for p in sorted(DOCS.glob("*.md")))
    subs = [a for a in convert.build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    flags = sorted({f for sub in subs for parser in sub.choices.values() for f in long_options(parser)})
    assert {"--images", "--keep-difficult", "--names", "--exist-ok"} <= set(flags)
    missing = [f for f in flags if not re.search(re.escape(f) + r"(?![\w-])", docs_text)]
    assert not missing, f"yolotrain/convert.py: flags not documented in any docs/*.md: {', '.join(missing)}"


def test_readme_is_short():
    n = len(README.read_text(encoding="utf-8").splitlines())
    assert n <= README_MAX_LINES, f"README.md: {n} lines, more than {README_MAX_LINES}; move depth to docs/"


@pytest.mark.parametrize("doc", doc_files(), ids=rel)
def test_no_changelog_wording(doc: Path):
    hits = []
    for lineno, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), 1):
        for word in CHANGELOG_WORDS:
            if re.search(rf"\b{re.escape(word)}\b", line, re.IGNORECASE):
                hits.append(f"line {lineno}: '{word}'")
    assert not hits, f"{rel(doc)}: changelog wording (describe what is): {'; '.join(hits)}"
