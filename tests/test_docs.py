"""The README and docs/ stay true to the repo: links resolve, every CLI flag is documented, the
README stays a short front door, and the pages describe what is rather than what changed.

Fast: reads text files and builds the CLIs' argument parsers; nothing trains.
"""
from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from tests.helpers import ROOT

README = ROOT / "README.md"
DOCS = ROOT / "docs"
README_MAX_LINES = 250
# Words and phrases that narrate a change, or speak to files older than the code, instead of saying what is.
# Matched in prose only (code spans and blocks removed), across line breaks, case-insensitive; each is
# narrow enough that legitimate prose does not trip it.
CHANGELOG_PHRASES = {
    "previously": r"\bpreviously\b",
    "no longer": r"\bno\s+longer\b",
    "the earlier": r"\bthe\s+earlier\b",
    "not yet": r"\bnot\s+yet\b",
    "yet": r"\byet\b",
    "until more": r"\buntil\s+more\b",
    "used to": r"\b(?:we|it|this|that|they|there|which|yolotrain|train\.py)\s+used\s+to\b",  # not "is used to"
    "we changed": r"\bwe\s+changed\b",
    "a checkpoint that records no": r"\bcheckpoints?\s+that\s+records?\s+no\b",
    "exported without the": r"\bexported\s+without\s+the\b",
    "in this code": r"\bin\s+this\s+code\b",
    "an earlier version": r"\ban\s+earlier\s+(?:version|loader|code)\b",
    "in the shipped code": r"\bin\s+the\s+shipped\s+code\b",
}
# A git commit hash: 7-40 hex characters with a digit and a letter, or all digits right after "at",
# "commit" or "@". benchmarks.md's table rows may name the commit a figure was measured at; prose may not.
HEX_TOKEN = re.compile(r"(?<![\w./#-])[0-9a-f]{7,40}(?![\w-])")
HASH_ALLOWED = {"docs/benchmarks.md"}  # in table rows only

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


def prose_lines(text: str) -> str:
    """The text with fenced code blocks blanked (their newlines kept, so line numbers hold) and each inline
    code span replaced by the word CODE."""
    blanked = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    return INLINE_CODE.sub("CODE", blanked)


def changelog_hits(text: str) -> list[str]:
    """'line N: phrase' for every changelog phrase in the text's prose."""
    body = prose_lines(text)
    hits = []
    for name, pattern in CHANGELOG_PHRASES.items():
        for m in re.finditer(pattern, body, re.IGNORECASE):
            hits.append((body.count("\n", 0, m.start()) + 1, name))
    return [f"line {n}: '{name}'" for n, name in sorted(hits)]


def commit_hashes(text: str, allow_table_rows: bool) -> list[str]:
    """'line N: HASH' for every commit-hash-like token in the text's prose (table rows skipped if allowed)."""
    hits = []
    for lineno, line in enumerate(prose_lines(text).splitlines(), 1):
        if allow_table_rows and line.lstrip().startswith("|"):
            continue
        for m in HEX_TOKEN.finditer(line):
            token = m.group(0)
            mixed = re.search(r"[0-9]", token) and re.search(r"[a-f]", token)
            before = line[:m.start()]
            after_commit_word = token.isdigit() and re.search(r"(?:\bat|\bcommit|@)\s*$", before, re.IGNORECASE)
            if mixed or after_commit_word:
                hits.append(f"line {lineno}: {token}")
    return hits


def table_rows(text: str) -> list[list[str]]:
    """Every markdown table row outside code blocks, as its stripped cells."""
    rows = []
    for line in FENCE.sub("", text).splitlines():
        s = line.strip()
        if s.startswith("|") and s.endswith("|"):
            rows.append([c.strip() for c in s.strip("|").split("|")])
    return rows


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
    from yolotrain.app import detect
    from yolotrain.app import export
    from yolotrain.app import train
    from yolotrain.app import tune
    from yolotrain.app import val

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


FLAG_TABLES = {"train.py": ("training.md", "## Every train.py flag"), "val.py": ("deploy.md", "## val.py:"),
               "detect.py": ("deploy.md", "## detect.py:"), "export.py": ("deploy.md", "## export.py:"),
               "tune.py": ("tuning.md", "## Every tune.py flag")}


def flag_table(text: str, heading: str) -> set[str]:
    """The flags a page's table lists under ``heading`` (rows up to the next ## heading): every --flag in the
    first cell of a row, aliases and --no-X forms included."""
    text = "\n" + text
    start = text.index("\n" + heading) + 1
    end = text.find("\n## ", start + len(heading))
    rows = [line for line in text[start:end if end > 0 else None].splitlines() if line.startswith("| `-")]
    return {f for row in rows for f in re.findall(r"--[\w-]+", row.split(" | ")[0])}


@pytest.mark.parametrize("cli", list(FLAG_TABLES))
def test_each_tool_table_lists_exactly_its_parser_flags(cli: str):
    """The flag table of each tool is its parser: a flag missing from the table, or a row for a flag the tool no
    longer has, fails (mentioning the flag elsewhere in docs/ does not count)."""
    page, heading = FLAG_TABLES[cli]
    table, flags = flag_table((DOCS / page).read_text(encoding="utf-8"), heading), set(long_options(cli_parsers()[cli]))
    assert table, f"docs/{page}: no flag table under {heading!r}"
    assert sorted(flags - table) == [], f"docs/{page} {heading!r}: {cli} flags missing from the table"
    assert sorted(table - flags) == [], f"docs/{page} {heading!r}: rows for flags {cli} does not have"


def test_flag_table_reading():
    text = "## A\n| flag | x |\n| `--a N` (`--b`) | 1 |\n| `--c` / `--no-c` | `--not-a-flag` |\n## B\n| `--d` | |\n"
    assert flag_table(text, "## A") == {"--a", "--b", "--c", "--no-c"} and flag_table(text, "## B") == {"--d"}


def test_every_convert_flag_documented():
    """python -m yolotrain convert: each subcommand's flags (argparse keeps them in its subparsers)."""
    from yolotrain.app import convert

    docs_text = "\n".join(p.read_text(encoding="utf-8") for p in sorted(DOCS.glob("*.md")))
    subs = [a for a in convert.build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    flags = sorted({f for sub in subs for parser in sub.choices.values() for f in long_options(parser)})
    assert {"--images", "--keep-difficult", "--names", "--exist-ok"} <= set(flags)
    missing = [f for f in flags if not re.search(re.escape(f) + r"(?![\w-])", docs_text)]
    assert not missing, f"yolotrain/app/convert.py: flags not documented in any docs/*.md: {', '.join(missing)}"


def test_readme_is_short():
    n = len(README.read_text(encoding="utf-8").splitlines())
    assert n <= README_MAX_LINES, f"README.md: {n} lines, more than {README_MAX_LINES}; move depth to docs/"


@pytest.mark.parametrize("doc", doc_files(), ids=rel)
def test_no_changelog_wording(doc: Path):
    hits = changelog_hits(doc.read_text(encoding="utf-8"))
    assert not hits, f"{rel(doc)}: changelog wording (describe what is): {'; '.join(hits)}"


def test_changelog_rules():
    """The phrases the docs review found trip the check; the same words in code or legitimate prose do not."""
    for bad in ("No GPU figure has been measured yet.", "the Ultralytics row is the earlier full run's",
                "one dataset, so the rule stays until more data says otherwise", "This is not yet\nmeasured.",
                "a checkpoint that records no\nprecision resumes in fp32",
                "Files exported without the end-to-end key read as not end-to-end.", "yolotrain used to pad",
                "We changed the default.", "It no longer waits.", "(in this code `--optimizer auto` took 4 steps)",
                "An earlier version of micro-steps ramped", "an earlier\nloader (four JPEG decodes)",
                "In the shipped code an outgrown slot grows"):
        assert changelog_hits(bad), bad
    for good in ("the tensor is used to index", "the images used to train it", "`yet` and `the earlier` in code", "```\nno longer\n```\n",
                 "the previous trials' fitness", "three earlier runs", "a file exported without `--dynamic`",
                 "the shipped code's default", "code that copies each batch", "an earlier epoch"):
        assert not changelog_hits(good), good


@pytest.mark.parametrize("doc", doc_files(), ids=rel)
def test_no_commit_hashes(doc: Path):
    """Commit hashes belong to measurements: allowed only in benchmarks.md's table rows."""
    hits = commit_hashes(doc.read_text(encoding="utf-8"), allow_table_rows=rel(doc) in HASH_ALLOWED)
    assert not hits, f"{rel(doc)}: commit hash outside a benchmarks.md measurement row: {'; '.join(hits)}"


def test_commit_hash_rules():
    assert commit_hashes("2026-11-25, AMD EPYC, at 7101366 (fuse)", True)
    assert commit_hashes("The loader of commit 02423a6, profiled", True)
    assert commit_hashes("| 2026-11-26 | H200 | 02423a6 |", False)
    assert not commit_hashes("| 2026-11-26 | H200 | 02423a6 |", True)
    assert not commit_hashes("2,572,280 parameters, 20,000 images, 2026-11-25, 1.2e-5, `02423a6`, "
                             "https://github.com/pytorch/pytorch/issues/50036, defaced, 1234567 images", True)


def channels_last_expected(monkeypatch) -> dict[str, bool]:
    """What utils/core/precision.channels_last_default picks when no flag is given (on Linux): True is NHWC."""
    import torch

    from yolotrain.utils.core import precision

    monkeypatch.setattr(precision.sys, "platform", "linux")
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    return {"cpu": precision.channels_last_default(None, cpu),
            "cuda_fp16": precision.channels_last_default(None, cuda, half=True),
            "cuda_fp32": precision.channels_last_default(None, cuda, half=False)}


def memory_format_problems(default_cell: str, expected: dict[str, bool]) -> list[str]:
    """How a --channels-last row's default cell disagrees with the code. The cell, parentheses dropped, is
    split into clauses at ',' and ';'; a clause without a layout takes the one before it ("NHWC on CPU, and on
    CUDA under fp16"). Each case needs a clause that names it with the layout the code picks."""
    text = re.sub(r"\([^)]*\)", "", default_cell)
    layout, clauses = None, []
    for clause in re.split(r"[,;]", text):
        found = re.findall(r"NHWC|NCHW", clause)
        layout = found[-1] if found else layout
        clauses.append((clause, layout))
    cases = {"cpu": (lambda c: "CPU" in c, "on CPU"),
             "cuda_fp16": (lambda c: "CUDA" in c and re.search(r"fp16|--half|--amp", c), "on CUDA under fp16"),
             "cuda_fp32": (lambda c: "CUDA" in c and "fp32" in c, "for fp32 on CUDA")}
    problems = []
    for case, (names_it, words) in cases.items():
        want = "NHWC" if expected[case] else "NCHW"
        if not any(names_it(c) and got == want for c, got in clauses):
            problems.append(f"{want} {words}")
    return problems


def test_memory_format_defaults_match_code(monkeypatch):
    expected = channels_last_expected(monkeypatch)
    rows = 0
    for doc in doc_files():
        for cells in table_rows(doc.read_text(encoding="utf-8")):
            if len(cells) >= 2 and cells[0].startswith("`--channels-last`"):
                rows += 1
                problems = memory_format_problems(cells[1], expected)
                assert not problems, (f"{rel(doc)}: the --channels-last row's default '{cells[1]}' does not say what "
                                      f"utils/core/precision.channels_last_default picks: {', '.join(problems)}")
    assert rows >= 2, "the --channels-last rows of training.md and deploy.md were not found"


def harmless_resume_flags(text: str) -> set[str]:
    """The flags of distributed.md's "Harmless ones (...) apply" sentence, as config names."""
    m = re.search(r"Harmless ones\s*\((.*?)\)\s*apply", text, re.S)
    assert m, "distributed.md's sentence of the arguments a resume may change was not found"
    return {f.replace("-", "_") for f in re.findall(r"`--([a-z-]+)`", m.group(1))}


def test_the_resume_harmless_list_is_the_code_s():
    from yolotrain.utils.engine.config import RESUME_HARMLESS
    assert harmless_resume_flags((DOCS / "distributed.md").read_text(encoding="utf-8")) == RESUME_HARMLESS


def test_harmless_resume_reading():
    assert harmless_resume_flags("Harmless ones (`--device`, more `--epochs`,\n`--cache-dir`) apply.") == {
        "device", "epochs", "cache_dir"}


def test_memory_format_rule(monkeypatch):
    expected = channels_last_expected(monkeypatch)
    assert memory_format_problems("NHWC on CPU, NCHW on CUDA", expected)
    assert not memory_format_problems("NHWC on CPU, and on CUDA under fp16 (`--amp`, the CUDA default); NCHW for "
                                      "fp32 on CUDA", expected)
    assert not memory_format_problems("NHWC on CPU, and on CUDA with `--half`; NCHW for fp32 on CUDA", expected)


def ci_commands(script: str) -> list[str]:
    """The commands .ci/run runs, in order: the venv, the install (``if ! CMD >log``), each pytest line."""
    commands = []
    for line in script.splitlines():
        line = line.strip()
        install = re.match(r"^if ! (.+?pip install .+?) >\S+ 2>&1; then$", line)
        if install:
            commands.append(install[1])
        elif line.startswith(("python3 -m venv", ".venv/bin/python -m pytest")):
            commands.append(line)
    return commands


def test_the_readme_test_command_is_the_one_ci_runs():
    """README's second command is .ci/run's commands joined by &&: the venv, the install with every extra, the
    suite and the bench step, whole, so the README's time, counts and coverage are CI's."""
    readme = re.findall(r"^python3 -m venv \.venv && .+pytest.+$", README.read_text(encoding="utf-8"), re.M)
    assert len(readme) == 1, "README.md: not exactly one set-up-and-test command"
    ci = ci_commands((ROOT / ".ci" / "run").read_text())
    assert [c for c in ci if "pip install" in c] and [c for c in ci if "bench/tests" in c], ".ci/run: no install or bench step"
    assert readme[0] == " && ".join(ci), f"README.md's test command is not .ci/run's:\n{readme[0]}\n{' && '.join(ci)}"


def test_ci_command_reading():
    script = ("set -e\npython3 -m venv .venv\nif ! .venv/bin/pip install -q -r a.txt -r b.txt >/tmp/l 2>&1; then\n"
              "  exit 1\nfi\n.venv/bin/python -c 'print(1)'\n.venv/bin/python -m pytest tests -q\n")
    assert ci_commands(script) == ["python3 -m venv .venv", ".venv/bin/pip install -q -r a.txt -r b.txt",
                                   ".venv/bin/python -m pytest tests -q"]


# A figure the README states: a ratio (2.38x, 1.2-1.4x), an mAP (0.733), a time (2 min 2 s, 40 s), a rate
# (957.6 img/s), a size (1.5 GB), a share (94.4 %) or a test count (973 and 63 tests passed). Counts of images,
# epochs and pixels are settings, not figures, and are not matched.
README_FIGURE = re.compile(
    r"(?<![\w.])(?:\d+\.\d+(?:-\d+\.\d+)?x(?!\w)|\d+ min(?: \d+ s)?(?!\w)|\d+(?:\.\d+)? s(?!\w)|0\.\d{3,}(?![\d])"
    r"|\d[\d,]*(?:\.\d+)? img/s|\d+(?:\.\d+)? (?:GB|MB|GiB|MiB)(?!\w)|\d+(?:\.\d+)? %"
    r"|\d[\d,]*(?: and \d[\d,]*)? tests passed)")
HEADLINE = "## Headline figures"
HEADLINE_COLUMNS = ["value", "what it compares", "ours: machine, precision", "the other side: machine, precision",
                    "date", "code", "command", "noise", "section"]


def readme_figures(text: str) -> list[str]:
    """Every figure in the text's prose (code blocks and inline code left out), in order."""
    return README_FIGURE.findall(prose_lines(text))


def headline_rows(text: str) -> list[list[str]]:
    """The cells of each row of benchmarks.md's headline table (the first table under HEADLINE); a cell may hold
    an escaped pipe (``\\|``)."""
    section = text[text.index("\n" + HEADLINE):]
    lines = [line.strip() for line in section.splitlines()[1:]]
    first = next(i for i, line in enumerate(lines) if line.startswith("|"))
    rows = []
    for line in lines[first:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in re.split(r"(?<!\\)\|", line.strip("|"))])
    assert [c.lower() for c in rows[0]] == HEADLINE_COLUMNS, f"headline table's columns: {rows[0]}"
    return [r for r in rows[2:]]


def unbacked_figures(readme: str, rows: list[list[str]]) -> list[str]:
    """The README figures that no headline row's value cell states (the same string, not inside a longer number)."""
    def stated(figure: str, cell: str) -> bool:
        return re.search(r"(?<![\w.])" + re.escape(figure) + r"(?![\w])", cell) is not None

    return [f for f in dict.fromkeys(readme_figures(readme)) if not any(stated(f, r[0]) for r in rows)]


def test_every_readme_figure_has_a_headline_row():
    """Each figure README.md states is a row of benchmarks.md's headline table with the same value, and each row
    says its machine on both sides, a date, its code, its command with placeholders, its noise and its section;
    no row rests on a machine not recorded or a modified copy of the code."""
    rows = headline_rows((DOCS / "benchmarks.md").read_text(encoding="utf-8"))
    figures = readme_figures(README.read_text(encoding="utf-8"))
    assert len(figures) >= 10, f"README.md: only {figures} read as figures"
    missing = unbacked_figures(README.read_text(encoding="utf-8"), rows)
    assert not missing, f"README.md figures with no row of that value in docs/benchmarks.md {HEADLINE!r}: {missing}"
    for row in rows:
        assert len(row) == len(HEADLINE_COLUMNS) and all(row), f"headline row with an empty or missing cell: {row}"
        assert re.fullmatch(r"2\d{3}-\d\d-\d\d.*", row[4]), f"headline row without a date: {row[:2]}"
        assert re.search(r"\b[0-9a-f]{7,40}\b", row[5]), f"headline row without a commit: {row[:2]}"
        assert "`" in row[6] and "](" in row[8], f"headline row's command or link: {row[:2]}"
        for cell in row[2:4]:
            assert "not recorded" not in cell and "modified" not in cell, f"not a headline: {row[:2]}: {cell}"


def test_readme_figure_reading():
    text = ("at 2.38x and 1.2-1.4x; mAP50 **0.945**, in 2 min 2 s (1.5 GB, 94.4 %), 957.6 img/s, 973 and 63 tests "
            "passed, 40 s.\n`3.14x` in code, 1,000 images at 256 px for 8 epochs, Python 3.11, 4x the lr\n")
    assert readme_figures(text) == ["2.38x", "1.2-1.4x", "0.945", "2 min 2 s", "1.5 GB", "94.4 %", "957.6 img/s",
                                    "973 and 63 tests passed", "40 s"]
    rows = [["2.38x; 1.2-1.4x", ""], ["mAP50 0.945; 2 min 2 s; 1.5 GB; 94.4 %; 957.6 img/s; 973 and 63 tests passed", ""]]
    assert unbacked_figures(text, rows) == ["40 s"]
    assert unbacked_figures("2.3x", [["12.3x"]]) == ["2.3x"] and unbacked_figures("0.94x", [["0.945"]]) == ["0.94x"]


def coming_from_rows(page: str, heading: str) -> list[list[str]]:
    """The rows of the table under ``heading`` (up to the next ## heading), header and rule left out."""
    text = "\n" + (DOCS / page).read_text(encoding="utf-8")
    start = text.index("\n" + heading + "\n")
    end = text.find("\n## ", start + 1)
    return table_rows(text[start:end if end > 0 else None])[2:]


def test_coming_from_yolov5_table_is_the_parser():
    """training.md's YOLOv5 table: a row says 'refused' exactly for the flags train.py refuses with an alternative,
    and every yolotrain flag it names is one train.py has."""
    from yolotrain.app import train

    rows = coming_from_rows("training.md", "## Coming from YOLOv5")
    refused = {re.findall(r"--[\w-]+", r[0])[0] for r in rows if r[1].startswith("refused")}
    assert refused == set(train.YOLOV5_REFUSED), "training.md 'Coming from YOLOv5': refused rows != YOLOV5_REFUSED"
    ours = {f for r in rows if "val.py" not in r[0] for f in re.findall(r"--[\w-]+", r[1].split("train.py")[-1])}
    flags = set(long_options(cli_parsers()["train.py"]))
    assert ours and ours <= flags, f"training.md 'Coming from YOLOv5' names flags train.py lacks: {ours - flags}"


def test_coming_from_ultralytics_table_is_the_api():
    """python.md's Ultralytics table: every keyword it gives for yolotrain is an option of train, val or predict
    (aliases included), and the hyperparameters it sends to a hyp file are hyp keys the API refuses as options."""
    from yolotrain import options

    rows = coming_from_rows("python.md", "## Coming from Ultralytics")
    names = set(options.ALIASES)
    for cli in ("train.py", "val.py", "detect.py"):
        names |= set(options.option_flags(cli_parsers()[cli]))
    given = {k for r in rows for k in re.findall(r"\b(\w+)=", r[1])}
    assert given and given <= names, f"python.md 'Coming from Ultralytics': not options: {given - names}"
    hyp_row = next(r for r in rows if "hyp file" in r[1])
    keys = set(re.findall(r"\b(\w+)=", hyp_row[0]))
    assert keys and keys <= options.hyp_keys() and not keys & set(options.option_flags(cli_parsers()["train.py"]))


# What each code block of README.md and docs/python.md is, on its fence line after the language (GitHub shows
# only the language): `installed` blocks run as they are in tests/test_package.py; the rest say why they do not.
CODE_BLOCK_KINDS = {"installed": "runs in tests/test_package.py, installed, in an empty folder",
                    "install": "the install itself (tests/test_package.py builds and installs the wheel)",
                    "checkout": "the checkout form (python train.py ...): checkout-only",
                    "example": "needs the reader's own data, files or GPUs",
                    "output": "what a command prints"}
USER_PAGES = ("README.md", "docs/python.md")
FENCED = re.compile(r"^```([^\n]*)\n(.*?)^```", re.M | re.S)


def code_blocks(text: str) -> list[tuple[str, str, str]]:
    """(language, kind, body) of every fenced block; kind is the fence's second word, '' when none."""
    out = []
    for m in FENCED.finditer(text):
        words = m[1].split()
        out.append((words[0] if words else "", words[1] if len(words) > 1 else "", m[2]))
    return out


@pytest.mark.parametrize("page", USER_PAGES)
def test_every_user_code_block_says_what_it_is(page):
    blocks = code_blocks((ROOT / page).read_text(encoding="utf-8"))
    unmarked = [body.splitlines()[0] for _, kind, body in blocks if kind not in CODE_BLOCK_KINDS]
    assert blocks and not unmarked, (f"{page}: code blocks without a kind ({', '.join(CODE_BLOCK_KINDS)}) after the "
                                     f"language: {unmarked}")
    checkout = [body for _, kind, body in blocks if kind != "checkout" and re.search(r"^(?:python|\.venv/bin/python) "
                                                                                     r"(?:train|val|detect|export|tune)"
                                                                                     r"\.py", body, re.M)]
    assert not checkout, f"{page}: a block runs python <tool>.py (the checkout form) but is not marked checkout"


def test_code_block_reading():
    text = "```bash checkout\npython train.py\n```\n\n```python installed\nimport x\n```\n```\nplain\n```\n"
    assert code_blocks(text) == [("bash", "checkout", "python train.py\n"), ("python", "installed", "import x\n"),
                                 ("", "", "plain\n")]
