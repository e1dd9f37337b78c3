"""The layers of docs/architecture.md hold: imports point down, at the top of each file."""
from __future__ import annotations

import ast
from pathlib import Path

from tests.helpers import ROOT

_CHAIN = ("utils.core", "models", "utils.weights", "utils.data", "utils.eval", "utils.engine", "utils.infer")
ORDER = (*(f"yolotrain.{n}" for n in _CHAIN), "yolotrain.app", "yolotrain")  # each may import those before it
ALLOWED = {name: set(ORDER[:i + 1]) for i, name in enumerate(ORDER[:len(_CHAIN)])}
ALLOWED["yolotrain.utils.infer"].discard("yolotrain.utils.engine")  # inference skips the training engine
ALLOWED["yolotrain.app"] = set(ORDER[:-1])  # the tools: the whole library, never the API above them
ALLOWED["yolotrain"] = set(ORDER)  # the Python API and python -m yolotrain
CLIS = ("train", "val", "detect", "export", "tune")  # the root scripts: each only calls its tool's cli()
APPS = sorted((ROOT / "yolotrain").rglob("*.py"))


def _layer(module: str) -> str | None:
    for name in sorted(ORDER, key=len, reverse=True):  # yolotrain.app before yolotrain
        if module == name or module.startswith(name + "."):
            return name
    return "cli" if module in CLIS else None


def _imports(path: Path) -> list[tuple[str, bool]]:
    """(module, at top level) for every import of the project's own modules in a file."""
    tree = ast.parse(path.read_text())
    typing_only = [n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test).endswith("TYPE_CHECKING")]
    top = {id(n) for n in tree.body} | {id(n) for block in typing_only for n in block.body}  # annotations only
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        out += [(n, id(node) in top) for n in names if _layer(n)]
    return out


def _library_files() -> list[Path]:
    return sorted(p for d in ("utils", "models", "yolotrain") for p in (ROOT / d).rglob("*.py"))


def _module(path: Path) -> str:
    """The name a file is imported by: utils/ and models/ are yolotrain.utils and yolotrain.models."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    parts = parts if parts[0] == "yolotrain" else ("yolotrain", *parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_imports_point_down_the_layers():
    wrong = []
    for path in _library_files():
        me = _layer(_module(path))
        wrong += [f"{path.relative_to(ROOT)} imports {m}" for m, _ in _imports(path) if _layer(m) not in ALLOWED[me]]
    assert wrong == []


def test_the_leaf_layer_imports_nothing_of_the_project_but_itself():
    core = sorted((ROOT / "utils" / "core").glob("*.py"))
    assert core and all(_layer(m) == "yolotrain.utils.core" for p in core for m, _ in _imports(p))


def test_project_imports_sit_at_the_top_of_each_file():
    lazy = [f"{p.relative_to(ROOT)}: {m}" for p in _library_files() + [ROOT / f"{c}.py" for c in CLIS]
            for m, top in _imports(p) if not top]
    assert lazy == []


def test_inference_loads_weights_without_the_training_engine():
    infer = sorted((ROOT / "utils" / "infer").glob("*.py"))
    engine = [f"{p.name} imports {m}" for p in infer for m, _ in _imports(p) if _layer(m) == "yolotrain.utils.engine"]
    assert infer and engine == []


def test_checkpoint_keys_are_read_in_the_checkpoint_module_only():
    """Inference reads a checkpoint's card, not its dict: one place knows the keys."""
    readers = [p.relative_to(ROOT).as_posix() for p in [*(ROOT / "utils" / "infer").glob("*.py"),
                                                       *(ROOT / "yolotrain" / "app" / f"{c}.py" for c in ("val", "detect", "export"))]
               if "ckpt[" in p.read_text() or "ckpt.get(" in p.read_text()]
    assert readers == []


def test_no_library_module_reads_rank_from_the_environment():
    readers = [p.relative_to(ROOT).as_posix() for p in _library_files() if "WORLD_SIZE" in p.read_text()]
    assert readers == ["utils/core/dist.py"]


def test_functions_and_modules_stay_small():
    """No function over 60 lines and no module over 400 in the CLIs, models/ and utils/: each is read in one view."""
    files = [ROOT / f"{c}.py" for c in CLIS] + APPS + sorted((ROOT / "models").rglob("*.py")) + sorted(
        (ROOT / "utils").rglob("*.py"))
    big = []
    for path in files:
        text = path.read_text()
        if len(text.splitlines()) > 400:
            big.append(f"{path.relative_to(ROOT)}: {len(text.splitlines())} lines")
        big += [f"{path.relative_to(ROOT)}:{n.lineno} {n.name}: {n.end_lineno - n.lineno + 1} lines"
                for n in ast.walk(ast.parse(text)) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                and n.end_lineno - n.lineno + 1 > 60]
    assert big == []


def test_the_root_scripts_only_run_their_tool():
    """train.py and the others are a few lines that call yolotrain/app/<tool>.cli; the tool lives in the library."""
    for c in CLIS:
        text = (ROOT / f"{c}.py").read_text()
        assert len(text.splitlines()) <= 15 and [m for m, _ in _imports(ROOT / f"{c}.py")] == [f"yolotrain.app.{c}"]


def test_nothing_imports_a_root_script():
    """The API, tune, the tests and the benches import the tools from yolotrain.app, never a script."""
    files = [p for d in ("utils", "models", "yolotrain", "tests", "bench") for p in (ROOT / d).rglob("*.py")]
    wrong = [f"{p.relative_to(ROOT)} imports {m}" for p in files for m, _ in _imports(p) if m in CLIS]
    assert files and wrong == []
