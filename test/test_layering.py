"""The import rules between the layers (docs/structures.md), and the size limit of source files.

Read with ``ast``, so every import counts, also those inside functions and under ``if``:

- each layer imports only the packages of its row in docs/structures.md's table (besides
  Python's standard library);
- the library (``sgl_ecospec/`` without ``sgl_ecospec/lab/``) imports none of transformers,
  sglang, the lab, the SGLang plugin or the CPU development mode;
- the lab (``sgl_ecospec/lab/``) never imports the plugin or the CPU development mode;
- the plugin and the CPU mode (``python/``) never import the lab, nor run it (no string
  naming a lab module, such as ``-m sgl_ecospec.lab.cli``);
- only the plugin's ``register`` (``sglang_ecospec/__init__.py``) imports the CPU mode;
- no import loops among the project's modules (``sgl_ecospec/`` and ``python/``).
"""

import ast
import graphlib
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = ROOT / "sgl_ecospec"
LAB = LIBRARY / "lab"
PYTHON = ROOT / "python"
PLUGINS = ("sglang_ecospec", "sglang_ecospec_cpu")
LIBRARY_FORBIDDEN = ("transformers", "sglang", "sgl_ecospec.lab", *PLUGINS)
PLUGIN = PYTHON / "sglang_ecospec"
CPU_MODE = PYTHON / "sglang_ecospec_cpu"
LAB_MODULE = "sgl_ecospec.lab"
# Each layer's third-party packages (docs/structures.md's table); the standard library and the
# project's own packages aside, which the rules above govern.
ALLOWED = {
    "library": {"torch", "numpy", "scipy", "safetensors", "triton"},
    "lab": {"torch", "numpy", "safetensors", "transformers", "matplotlib", "tqdm"},
    "plugin": {"torch", "sglang", "transformers", "prometheus_client"},
    "CPU mode": {"torch", "sglang", "sgl_kernel", "safetensors", "transformers"},
}
PROJECT = ("sgl_ecospec", *PLUGINS)
MAX_LINES = 500
SIZE_CHECKED = ("sgl_ecospec", "python", "csrc", "scripts")
SIZE_SUFFIXES = (".py", ".cpp", ".cu", ".cuh", ".h")


def imported_modules(path: Path, root: Path = ROOT) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in the file; relative ones are resolved."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = ".".join(path.relative_to(root).with_suffix("").parts)
    if path.name != "__init__.py":
        package = package.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = resolve(node, package)
            # `from pkg import mod` imports pkg.mod when mod is a module: count both names.
            found.append((node.lineno, base))
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return found


def module_name(path: Path, root: Path) -> str:
    """``sgl_ecospec/ops/__init__.py`` -> ``sgl_ecospec.ops`` (``root``: the folder on sys.path)."""
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules(root: Path = ROOT) -> dict[str, Path]:
    """Every module of the library, the lab, the plugin and the CPU mode, by its name."""
    library = sorted((root / "sgl_ecospec").rglob("*.py"))
    plugins = sorted((root / "python").rglob("*.py"))
    modules = {module_name(path, root): path for path in library}
    modules.update({module_name(path, root / "python"): path for path in plugins})
    return modules


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the project modules it imports (every import, also inside functions).

    An edge is the module an import statement executes, resolved as Python does:
    ``import a.b`` and ``from a.b import f`` import ``a.b``; ``from a import b`` imports the
    module ``a.b`` when ``b`` is one, else the package ``a`` (its ``__init__``, for a name it
    defines or re-exports); relative imports are resolved. The parent packages that Python
    initialises first on the way to a submodule are not edges: a package's ``__init__``
    importing its own submodules to re-export their names is the standard pattern, not a loop.
    A module importing a name from an ancestor package's ``__init__`` is an edge to that
    package, so a submodule taking a re-exported name from its own package (whose
    ``__init__`` imports the submodule) is reported as a loop: import the sibling directly.
    Imports of anything outside ``modules`` (torch, the ``_C`` extension) are ignored.
    """
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                edges.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = resolve(node, package)
                for alias in node.names:
                    submodule = f"{base}.{alias.name}"
                    edges.add(submodule if submodule in modules else base)
        graph[name] = {m for m in edges if m in modules and m != name}
    return graph


def resolve(node: ast.ImportFrom, package: str) -> str:
    """The absolute module of a ``from ... import`` inside ``package``."""
    if not node.level:
        return node.module or ""
    parts = package.split(".")
    parent = ".".join(parts[: len(parts) - node.level + 1])
    return f"{parent}.{node.module}" if node.module else parent


def import_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import loop of ``graph`` (its modules, the first repeated at the end), or None."""
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as exc:
        return exc.args[1]
    return None


def is_within(module: str, forbidden: str) -> bool:
    return module == forbidden or module.startswith(forbidden + ".")


def violations(files, forbidden, root: Path = ROOT) -> list[str]:
    bad = []
    for path in files:
        for line, module in imported_modules(path, root):
            hit = next((f for f in forbidden if is_within(module, f)), None)
            if hit:
                bad.append(f"{path.relative_to(root)}:{line} imports {module}")
    return sorted(set(bad))


def library_files(root: Path = LIBRARY, lab: Path = LAB) -> list[Path]:
    return [p for p in sorted(root.rglob("*.py")) if lab not in p.parents]


def test_library_imports_no_lab_plugin_transformers_or_sglang():
    files = library_files()
    assert len(files) > 10, files
    bad = violations(files, LIBRARY_FORBIDDEN)
    assert not bad, "the library must not import these:\n" + "\n".join(bad)


def test_lab_never_imports_the_plugin():
    files = sorted(LAB.rglob("*.py"))
    assert files
    bad = violations(files, PLUGINS)
    assert not bad, "the lab must not import the plugin:\n" + "\n".join(bad)


def layer_files() -> dict[str, list[tuple[Path, Path]]]:
    """Each layer's files, with the folder on sys.path they are imported from."""
    return {
        "library": [(path, ROOT) for path in library_files()],
        "lab": [(path, ROOT) for path in sorted(LAB.rglob("*.py"))],
        "plugin": [(path, PYTHON) for path in sorted(PLUGIN.rglob("*.py"))],
        "CPU mode": [(path, PYTHON) for path in sorted(CPU_MODE.rglob("*.py"))],
    }


def foreign_imports(files: list[tuple[Path, Path]], allowed: set[str]) -> list[str]:
    """Imports of packages neither in ``allowed``, the standard library nor the project."""
    known = allowed | set(sys.stdlib_module_names) | set(PROJECT)
    bad = []
    for path, root in files:
        for line, module in imported_modules(path, root):
            if module and module.partition(".")[0] not in known:
                bad.append(f"{path.relative_to(root)}:{line} imports {module}")
    return sorted(set(bad))


def test_each_layer_imports_only_the_packages_its_row_names():
    for layer, files in layer_files().items():
        assert len(files) > 4, layer
        bad = foreign_imports(files, ALLOWED[layer])
        assert not bad, f"the {layer} may import only {sorted(ALLOWED[layer])}:\n" + "\n".join(bad)


def lab_mentions(path: Path, root: Path) -> list[str]:
    """Where a module's code names the lab as a string (``"-m", "sgl_ecospec.lab.cli"``,
    ``importlib.import_module("sgl_ecospec.lab...")``); docstrings may describe it."""
    tree = ast.parse(path.read_text(), filename=str(path))
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    return [
        f"{path.relative_to(root)}:{node.lineno} names {node.value!r}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and LAB_MODULE in node.value
        and id(node) not in docstrings
    ]


def test_the_plugin_and_cpu_mode_never_import_or_run_the_lab():
    files = layer_files()["plugin"] + layer_files()["CPU mode"]
    bad = [b for path, root in files for b in violations([path], (LAB_MODULE,), root)]
    bad += [mention for path, root in files for mention in lab_mentions(path, root)]
    assert not bad, "the plugin must not import or run the lab:\n" + "\n".join(bad)


def test_the_lab_check_sees_nested_imports_and_module_strings(tmp_path):
    plugin = tmp_path / "sglang_ecospec"
    plugin.mkdir()
    (plugin / "a.py").write_text(
        '"""Docs may name sgl_ecospec.lab."""\n'
        "def f():\n"
        "    from sgl_ecospec.lab import cli\n"
        "    return ['python', '-m', 'sgl_ecospec.lab.cli', 'calibrate']\n"
    )
    (plugin / "b.py").write_text("import sgl_ecospec.costmodel\n")
    files = sorted(plugin.glob("*.py"))
    assert violations(files, (LAB_MODULE,), tmp_path) == [
        "sglang_ecospec/a.py:3 imports sgl_ecospec.lab",
        "sglang_ecospec/a.py:3 imports sgl_ecospec.lab.cli",
    ]
    assert [m for path in files for m in lab_mentions(path, tmp_path)] == [
        "sglang_ecospec/a.py:4 names 'sgl_ecospec.lab.cli'"
    ]
    assert foreign_imports([(plugin / "a.py", tmp_path)], set()) == []
    (plugin / "c.py").write_text("import os\nimport requests.adapters\n")
    assert foreign_imports([(plugin / "c.py", tmp_path)], {"torch"}) == [
        "sglang_ecospec/c.py:2 imports requests.adapters"
    ]


def test_only_the_plugins_register_imports_the_cpu_mode():
    importers = set()
    for files in layer_files().values():
        for path, root in files:
            if CPU_MODE in path.parents:
                continue
            for _, module in imported_modules(path, root):
                if is_within(module, "sglang_ecospec_cpu"):
                    importers.add(str(path.relative_to(ROOT)))
    assert importers == {"python/sglang_ecospec/__init__.py"}


def test_the_check_sees_imports_inside_functions(tmp_path):
    # The checker itself: a nested import, a relative import into the lab and a `from` import.
    lib = tmp_path / "sgl_ecospec"
    (lib / "lab").mkdir(parents=True)
    (lib / "lab" / "x.py").write_text("import sglang_ecospec.routing\n")
    (lib / "a.py").write_text("def f():\n    if True:\n        import transformers\n")
    (lib / "b.py").write_text("from .lab import x\n")
    (lib / "c.py").write_text("from sglang.srt import utils\nimport torch\n")
    bad = violations(library_files(lib, lib / "lab"), LIBRARY_FORBIDDEN, tmp_path)
    lab_bad = violations(sorted((lib / "lab").rglob("*.py")), PLUGINS, tmp_path)
    assert [b.split(" imports ")[0] for b in bad] == [
        "sgl_ecospec/a.py:3",
        "sgl_ecospec/b.py:1",
        "sgl_ecospec/b.py:1",
        "sgl_ecospec/c.py:1",
        "sgl_ecospec/c.py:1",
    ], bad
    assert lab_bad == ["sgl_ecospec/lab/x.py:1 imports sglang_ecospec.routing"]


def test_no_import_loops():
    graph = import_graph(project_modules())
    assert len(graph) > 100 and graph["sgl_ecospec.lab.cli"], graph
    cycle = import_cycle(graph)
    assert cycle is None, "an import loop: " + " -> ".join(cycle)


def test_the_loop_check_sees_loops_through_functions_and_package_inits(tmp_path):
    def write(files: dict[str, str]) -> list[str] | None:
        for name, text in files.items():
            path = tmp_path / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        return import_cycle(import_graph(project_modules(tmp_path)))

    # A package re-exporting its submodules' names, which import their siblings: no loop.
    assert (
        write(
            {
                "sgl_ecospec/__init__.py": "from .a import f\nfrom sgl_ecospec.b import g\n",
                "sgl_ecospec/a.py": "from . import b\nimport torch\n",
                "sgl_ecospec/b.py": "import sgl_ecospec._C\n",
                "python/sglang_ecospec/__init__.py": "def register():\n    from . import c\n",
                "python/sglang_ecospec/c.py": "from sgl_ecospec.a import f\n",
            }
        )
        is None
    )
    # b takes a name from the package's __init__, which imports b.
    cycle = write({"sgl_ecospec/b.py": "from sgl_ecospec import f\n"})
    assert sorted(set(cycle)) == ["sgl_ecospec", "sgl_ecospec.b"], cycle
    # A loop through an import inside a function, across the two roots.
    write({"sgl_ecospec/b.py": "import sgl_ecospec._C\n"})
    cycle = write({"python/sglang_ecospec/d.py": "def f():\n    import sglang_ecospec.c\n"})
    assert cycle is None
    cycle = write({"python/sglang_ecospec/c.py": "from sglang_ecospec import d\n"})
    assert sorted(set(cycle)) == ["sglang_ecospec.c", "sglang_ecospec.d"], cycle


def test_no_source_file_over_500_lines():
    too_long = []
    for top in SIZE_CHECKED:
        for path in sorted((ROOT / top).rglob("*")):
            if path.suffix in SIZE_SUFFIXES and path.is_file():
                lines = len(path.read_text(errors="replace").splitlines())
                if lines > MAX_LINES:
                    too_long.append(f"{path.relative_to(ROOT)}: {lines} lines")
    assert not too_long, f"source files over {MAX_LINES} lines:\n" + "\n".join(too_long)
