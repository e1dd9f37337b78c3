"""What an editor sees in a plain checkout, with no code run and nothing installed: jedi (behind many editors'
go-to-definition) resolves every project import of three files on the core path to the file that defines it.

    python tests/test_static_imports.py     # prints each import and the file it resolves to
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FILES = ("utils/engine/setup.py", "yolotrain/app/train.py", "models/yolo.py")  # as a reader opens them


def resolved_imports(rel: str) -> list[tuple[str, str, Path | None]]:
    """(module, name, the file jedi's goto reaches) for every ``from yolotrain... import name`` of a file, with
    only the checkout on jedi's path (no site-packages, so an installed yolotrain cannot answer for it)."""
    import jedi

    project = jedi.Project(ROOT, sys_path=[str(ROOT)], smart_sys_path=False)
    path = ROOT / rel
    text = path.read_text()
    script = jedi.Script(text, path=path, project=project)
    out = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "yolotrain":
            for alias in node.names:
                found = script.goto(alias.lineno, alias.col_offset, follow_imports=True)
                out.append((node.module, alias.name, found[0].module_path if found else None))
    return out


def _defines(path: Path, name: str) -> bool:
    """Whether a file is ``name`` (a submodule) or binds it at its top (def, class, assignment)."""
    if path.stem == name or (path.name == "__init__.py" and path.parent.name == name):
        return True
    bound = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            bound |= {t.id for t in targets if isinstance(t, ast.Name)}
    return name in bound


@pytest.mark.parametrize("rel", FILES)
def test_jedi_resolves_each_project_import_to_its_file(rel):
    pytest.importorskip("jedi", reason="jedi (requirements-test.txt)")
    found = resolved_imports(rel)
    assert len(found) >= 4
    package = (ROOT / "yolotrain").resolve()
    wrong = [f"{m}.{n} -> {p}" for m, n, p in found
             if p is None or not Path(p).resolve().is_relative_to(package) or not _defines(Path(p), n)]
    assert wrong == []


if __name__ == "__main__":
    bad = 0
    for rel in FILES:
        for module, name, path in resolved_imports(rel):
            bad += path is None
            print(f"{rel}: {module}.{name} -> {Path(path).relative_to(ROOT) if path else 'UNRESOLVED'}")
    sys.exit(1 if bad else 0)
