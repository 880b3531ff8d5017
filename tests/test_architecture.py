"""The package's imports flow one way, down the layers of docs/architecture.md, with no circle.

The imports are read from the source (``ast``), every one counted: at module level and inside
functions (an import on use is still a dependency), but not those under ``if TYPE_CHECKING:``
(never executed: a type named for a checker). ``from P import name`` is an import of ``P.name``
when that is a module (a ``.py`` file, a package or a C helper's ``.c`` source), else of ``P``.
"""

from __future__ import annotations

import ast
import graphlib
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = "engram_offload"
SOURCE = Path(__file__).resolve().parents[1] / "src" / PACKAGE

# Bottom to top: a unit (a top-level module or folder of the package) may import units of the
# layers below its own. Units of one layer import each other only where the layer says so.
LAYERS: list[tuple[str, tuple[str, ...], bool]] = [
    # (layer, its units, whether its units may import each other)
    ("shared facts", ("errors", "units", "atomic", "machine", "_native"), True),
    ("host buffers", ("buffers",), False),
    ("Engram math", ("engram",), False),
    ("table format", ("table",), False),
    ("cluster pool", ("pool",), False),
    ("storage", ("tiers", "cache"), False),
    ("device path", ("gpu",), False),
    ("serving", ("serving",), False),
    ("planner", ("planner",), False),
    ("engine integrations", ("integrations",), False),
    ("benchmark", ("bench",), False),
    ("trained model", ("model",), False),
    ("command line and public names", ("commands", "cli", "__init__"), True),
]
PUBLIC_API = "__init__"  # the unit of the package's own names (its __init__.py, loading them on use)


@dataclass(frozen=True)
class Import:
    importer: str  # dotted module
    imported: str  # dotted module
    line: int


def module_names(root: Path) -> set[str]:
    """Every module of the package under ``root``: .py files, packages and C helpers."""
    names = set()
    for path in root.rglob("*"):
        rel = path.relative_to(root.parent)
        if path.suffix == ".py":
            parts = rel.with_suffix("").parts
            names.add(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
        elif path.suffix == ".c" and path.stem.startswith("_"):
            names.add(".".join(rel.with_suffix("").parts))  # a C helper built as this module
    return names


def _type_checking_only(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _walk_runtime(tree: ast.AST):
    """Every node except the bodies of ``if TYPE_CHECKING:`` blocks."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _type_checking_only(child):
                stack.extend(child.orelse)
            else:
                stack.append(child)


def package_imports(root: Path) -> list[Import]:
    """The imports of package modules by package modules (see the module docstring)."""
    modules = module_names(root)
    found = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        is_package = parts[-1] == "__init__"
        name = ".".join(parts[:-1] if is_package else parts)
        here = name if is_package else name.rpartition(".")[0]
        for node in _walk_runtime(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = ".".join(here.split(".")[: len(here.split(".")) - node.level + 1] +
                                    ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            else:
                continue
            for target in targets:
                if (target == PACKAGE or target.startswith(PACKAGE + ".")) and target != name:
                    found.append(Import(name, target, node.lineno))
    return found


def unit_of(module: str) -> str:
    """The top-level module or folder a dotted module belongs to (``__init__``: the package)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else PUBLIC_API


def layer_index() -> dict[str, int]:
    return {unit: i for i, (_, units, _) in enumerate(LAYERS) for unit in units}


def direction_errors(imports: list[Import]) -> list[str]:
    """Imports against the layers: upward, or sideways between units that may not."""
    index = layer_index()
    siblings = {unit: mutual for _, units, mutual in LAYERS for unit in units}
    errors = []
    for imp in imports:
        src, dst = unit_of(imp.importer), unit_of(imp.imported)
        if src == dst:
            continue
        for unit in (src, dst):
            if unit not in index:
                errors.append(f"{unit} is in no layer: place it in LAYERS (tests/test_architecture.py) "
                              "and in docs/architecture.md")
        if src not in index or dst not in index:
            continue
        if index[dst] > index[src]:
            errors.append(f"{imp.importer}:{imp.line} imports {imp.imported}: {src} "
                          f"({LAYERS[index[src]][0]}) is below {dst} ({LAYERS[index[dst]][0]})")
        elif index[dst] == index[src] and not siblings[src]:
            errors.append(f"{imp.importer}:{imp.line} imports {imp.imported}: {src} and {dst} sit beside each "
                          "other and do not import each other")
    return sorted(set(errors))


def circle(imports: list[Import]) -> list[str] | None:
    """One module circle (its modules in import order, the first one again at the end), or None."""
    graph: dict[str, set[str]] = {}
    for imp in imports:
        graph.setdefault(imp.importer, set()).add(imp.imported)
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as error:
        return list(reversed(error.args[1]))  # graphlib lists it from imported to importer
    return None


def test_imports_flow_down_the_layers():
    errors = direction_errors(package_imports(SOURCE))
    assert not errors, "imports against docs/architecture.md's layers:\n" + "\n".join(errors)


def test_no_module_imports_itself_through_others():
    found = circle(package_imports(SOURCE))
    assert found is None, "an import circle: " + " -> ".join(found or [])


def test_every_unit_of_the_package_has_a_layer():
    present = {unit_of(m) for m in module_names(SOURCE)}
    missing = sorted(present - set(layer_index()))
    assert not missing, f"not in any layer: {missing}"


def test_every_layer_of_the_table_is_in_docs_architecture():
    text = (SOURCE.parents[1] / "docs" / "architecture.md").read_text()
    for name, units, _ in LAYERS:
        assert name in text, f"docs/architecture.md does not name the layer {name!r}"
        for unit in units:
            assert f"`{unit}" in text, f"docs/architecture.md does not place {unit!r}"


# The checker itself, on a made-up package: each rule must catch what it is for.

def _fake_package(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / PACKAGE
    for rel, text in {"__init__.py": "", **files}.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_the_checker_finds_an_upward_import_even_inside_a_function(tmp_path):
    root = _fake_package(tmp_path, {
        "engram/__init__.py": "", "engram/rows.py": "def f():\n    from ..serving.store import x\n",
        "serving/__init__.py": "", "serving/store.py": "from ..engram.rows import f\n",
    })
    errors = direction_errors(package_imports(root))
    assert len(errors) == 1 and "engram.rows:2 imports engram_offload.serving.store" in errors[0]


def test_the_checker_lets_a_type_checking_import_through(tmp_path):
    root = _fake_package(tmp_path, {
        "gpu/__init__.py": "",
        "gpu/delivery.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..serving.store import S\n",
        "serving/__init__.py": "", "serving/store.py": "from ..gpu.delivery import x\n",
    })
    imports = package_imports(root)
    assert [(i.importer, i.imported) for i in imports] == [("engram_offload.serving.store",
                                                             "engram_offload.gpu.delivery")]
    assert direction_errors(imports) == []


def test_the_checker_finds_siblings_that_may_not_import_each_other(tmp_path):
    root = _fake_package(tmp_path, {
        "tiers/__init__.py": "", "tiers/memory.py": "from ..cache import row_cache\n",
        "cache/__init__.py": "", "cache/row_cache.py": "",
        "machine.py": "from .errors import E\nfrom . import units\n", "errors.py": "", "units.py": "",
    })
    errors = direction_errors(package_imports(root))
    assert len(errors) == 1 and "tiers and cache sit beside each other" in errors[0]


def test_the_checker_finds_a_circle_and_a_unit_without_a_layer(tmp_path):
    root = _fake_package(tmp_path, {
        "bench/__init__.py": "", "bench/runner.py": "def f():\n    from .ranks import g\n",
        "bench/ranks.py": "def g():\n    from .runner import f\n",
        "newthing/__init__.py": "from ..engram import config\n", "engram/__init__.py": "", "engram/config.py": "",
    })
    imports = package_imports(root)
    ranks, runner = "engram_offload.bench.ranks", "engram_offload.bench.runner"
    assert circle(imports) in ([ranks, runner, ranks], [runner, ranks, runner])
    assert any("newthing is in no layer" in e for e in direction_errors(imports))


@pytest.mark.parametrize("statement, imported", [
    ("from . import _rowcopy", "engram_offload.buffers._rowcopy"),  # a C helper is a module
    ("from .rowcopy import move_rows", "engram_offload.buffers.rowcopy"),  # a name of a module
    ("from .. import errors", "engram_offload.errors"),
    ("import engram_offload.engram.rows", "engram_offload.engram.rows"),
])
def test_the_checker_resolves_what_an_import_names(tmp_path, statement, imported):
    root = _fake_package(tmp_path, {
        "buffers/__init__.py": "", "buffers/_rowcopy.c": "", "buffers/rowcopy.py": "",
        "buffers/user.py": statement + "\n", "errors.py": "", "engram/__init__.py": "", "engram/rows.py": "",
    })
    assert [i.imported for i in package_imports(root) if i.importer.endswith("user")] == [imported]


def test_every_public_name_loads_from_the_package_without_torch_until_used():
    import subprocess
    import sys

    script = ("import sys, engram_offload as e\n"
              "assert 'torch' not in sys.modules and 'numpy' not in sys.modules\n"
              "missing = [n for n in e.__all__ if getattr(e, n, None) is None]\n"
              "assert not missing, missing\n"
              "print(len(e.__all__))")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    documented = {"open_table", "Prefetcher", "NgramHasher", "EngramLayer", "EngramConfig", "shard_columns",
                  "assemble_columns", "cached_token_map", "compress_tokenizer", "write_table", "decode_rows"}
    import engram_offload

    assert documented <= set(engram_offload.__all__)
