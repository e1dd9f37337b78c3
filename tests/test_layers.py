"""The layers of docs/architecture.md hold: imports point down, at the top of each file."""
from __future__ import annotations

import ast
import sys
from pathlib import Path

from tests.helpers import LIBRARY_MODULES, ROOT, run

_CHAIN = ("utils.core", "models", "utils.weights", "utils.data", "utils.eval", "utils.engine", "utils.infer")
ORDER = (*(f"yolotrain.{n}" for n in _CHAIN), "yolotrain.app", "yolotrain")  # each may import those before it
ALLOWED = {name: set(ORDER[:i + 1]) for i, name in enumerate(ORDER[:len(_CHAIN)])}
ALLOWED["yolotrain.utils.infer"].discard("yolotrain.utils.engine")  # inference skips the training engine
ALLOWED["yolotrain.app"] = set(ORDER[:-1])  # the tools: the whole library, never the API above them
ALLOWED["yolotrain"] = set(ORDER)  # the Python API and python -m yolotrain
CLIS = ("train", "val", "detect", "export", "tune")  # the root scripts: each only calls its tool's cli()
PACKAGE = ROOT / "yolotrain"  # the library: yolotrain/utils and yolotrain/models (the top-level folders link here)
LIBRARY = sorted(PACKAGE.rglob("*.py"))
TOP_LEVEL = ("utils", "models")  # YOLOv5's names: a module of that name is a second copy, or YOLOv5's own


def _layer(module: str) -> str | None:
    for name in sorted(ORDER, key=len, reverse=True):  # yolotrain.app before yolotrain
        if module == name or module.startswith(name + "."):
            return name
    return "cli" if module in CLIS else None


def _all_imports(tree: ast.Module) -> list[tuple[str, ast.AST]]:
    """(module, node) for every import statement in a file, and every importlib.import_module("...") of a literal."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.append((node.module, node))
        elif isinstance(node, ast.Import):
            out += [(a.name, node) for a in node.names]
        elif (isinstance(node, ast.Call) and ast.unparse(node.func).endswith("import_module") and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            out.append((node.args[0].value, node))
    return out


def _imports(path: Path) -> list[tuple[str, bool]]:
    """(module, at top level) for every import of the project's own modules in a file."""
    tree = ast.parse(path.read_text())
    typing_only = [n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test).endswith("TYPE_CHECKING")]
    top = {id(n) for n in tree.body} | {id(n) for block in typing_only for n in block.body}  # annotations only
    return [(n, id(node) in top) for n, node in _all_imports(tree)
            if isinstance(node, (ast.Import, ast.ImportFrom)) and _layer(n)]


def _module(path: Path) -> str:
    """The name a file is imported by: its path under the checkout's top, yolotrain/ first."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_imports_point_down_the_layers():
    wrong = []
    for path in LIBRARY:
        me = _layer(_module(path))
        wrong += [f"{path.relative_to(ROOT)} imports {m}" for m, _ in _imports(path) if _layer(m) not in ALLOWED[me]]
    assert wrong == []


def test_the_leaf_layer_imports_nothing_of_the_project_but_itself():
    core = sorted((PACKAGE / "utils" / "core").glob("*.py"))
    assert core and all(_layer(m) == "yolotrain.utils.core" for p in core for m, _ in _imports(p))


def test_project_imports_sit_at_the_top_of_each_file():
    lazy = [f"{p.relative_to(ROOT)}: {m}" for p in LIBRARY + [ROOT / f"{c}.py" for c in CLIS]
            for m, top in _imports(p) if not top]
    assert lazy == []


def test_inference_loads_weights_without_the_training_engine():
    infer = sorted((PACKAGE / "utils" / "infer").glob("*.py"))
    engine = [f"{p.name} imports {m}" for p in infer for m, _ in _imports(p) if _layer(m) == "yolotrain.utils.engine"]
    assert infer and engine == []


def test_checkpoint_keys_are_read_in_the_checkpoint_module_only():
    """Inference reads a checkpoint's card, not its dict: one place knows the keys."""
    readers = [p.relative_to(ROOT).as_posix() for p in [*(PACKAGE / "utils" / "infer").glob("*.py"),
                                                       *(ROOT / "yolotrain" / "app" / f"{c}.py" for c in ("val", "detect", "export"))]
               if "ckpt[" in p.read_text() or "ckpt.get(" in p.read_text()]
    assert readers == []


def test_no_library_module_reads_rank_from_the_environment():
    readers = [p.relative_to(ROOT).as_posix() for p in LIBRARY if "WORLD_SIZE" in p.read_text()]
    assert readers == ["yolotrain/utils/core/dist.py"]


def test_functions_and_modules_stay_small():
    """No function over 60 lines and no module over 400 in the CLIs, models/ and utils/: each is read in one view."""
    files = [ROOT / f"{c}.py" for c in CLIS] + LIBRARY
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
    wrong = [f"{p.relative_to(ROOT)} imports {m}" for p in _checked_files() for m, _ in _imports(p) if m in CLIS]
    assert wrong == []


def _checked_files() -> list[Path]:
    """Every Python file of the checkout that is the project's: the package, the root scripts, the tests, the
    benches and the examples (walked from the real folders, never through the top-level links)."""
    files = [*LIBRARY, *ROOT.glob("*.py")]
    files += [p for d in ("tests", "bench", "examples") for p in (ROOT / d).rglob("*.py")]
    assert len(files) > 200 and not any(p.relative_to(ROOT).parts[0] in TOP_LEVEL for p in files)
    return files


def test_no_file_imports_a_top_level_utils_or_models():
    """Statically, so a slip fails here rather than loading a second copy of a module through the checkout's links
    (pytest's pythonpath has the top folder), or YOLOv5's utils where its checkout is first on sys.path. YOLOv5's
    module names in foreign checkpoints are strings the weights reader matches, never imports."""
    wrong = [f"{p.relative_to(ROOT)}:{node.lineno} imports {m}" for p in _checked_files()
             for m, node in _all_imports(ast.parse(p.read_text())) if m.split(".")[0] in TOP_LEVEL]
    assert wrong == []


def test_the_top_level_folders_are_links_into_the_package():
    """The card's layout (utils/, models/, hyps/, data/ at the top) with one source tree: each is the package's."""
    for name in (*TOP_LEVEL, "hyps", "data"):
        assert (ROOT / name).is_symlink() and (ROOT / name).resolve() == (PACKAGE / name).resolve(), name



def test_the_package_lists_only_its_library_modules():
    """What a documentation tool or pkgutil walk sees in a checkout: the library, never setup.py, the tests or a
    root script (tests/test_package.py checks the installed form lists the same)."""
    probe = "import pkgutil, yolotrain; print(*sorted(m.name for m in pkgutil.iter_modules(yolotrain.__path__)))"
    listed = run([sys.executable, "-c", probe]).stdout.split()
    assert set(listed) == LIBRARY_MODULES


def test_yolov5s_typed_paths_name_the_shipped_files_from_any_folder(tmp_path, monkeypatch):
    """--cfg models/yolov5s.yaml and --hyp hyps/hyp.scratch-low.yaml, typed as in YOLOv5, work outside a checkout
    (installed: tests/test_package.py trains with both) and a file of that path in the folder still wins."""
    from yolotrain.models.parse import load_model_yaml
    from yolotrain.utils.core.fileio import ROOT as SHIPPED, shipped

    monkeypatch.chdir(tmp_path)
    assert shipped("hyps/hyp.scratch-low.yaml", "hyps") == SHIPPED / "hyps" / "hyp.scratch-low.yaml"
    assert shipped("hyp.v8.yaml", "hyps") == SHIPPED / "hyps" / "hyp.v8.yaml"
    assert shipped("other/hyp.v8.yaml", "hyps") == Path("other/hyp.v8.yaml")  # only the shipped folder's name
    assert load_model_yaml("models/yolov5s.yaml")[1] == str(SHIPPED / "models" / "yolov5s.yaml")
    (tmp_path / "hyps").mkdir()
    (tmp_path / "hyps" / "hyp.scratch-low.yaml").write_text("lr0: 0.02\n")
    assert shipped("hyps/hyp.scratch-low.yaml", "hyps") == Path("hyps/hyp.scratch-low.yaml")
