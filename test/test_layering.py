"""The import rules between the layers (docs/structures.md), and the size limit of source files.

Read with ``ast``, so every import counts, also those inside functions and under ``if``:

- the library (``sgl_ecospec/`` without ``sgl_ecospec/lab/``) imports none of transformers,
  sglang, the lab, the SGLang plugin or the CPU development mode;
- the lab (``sgl_ecospec/lab/``) never imports the plugin or the CPU development mode.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = ROOT / "sgl_ecospec"
LAB = LIBRARY / "lab"
PLUGINS = ("sglang_ecospec", "sglang_ecospec_cpu")
LIBRARY_FORBIDDEN = ("transformers", "sglang", "sgl_ecospec.lab", *PLUGINS)
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
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parent = ".".join(parts[: len(parts) - node.level + 1])
                base = f"{parent}.{base}" if base else parent
            # `from pkg import mod` imports pkg.mod when mod is a module: count both names.
            found.append((node.lineno, base))
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return found


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


def test_no_source_file_over_500_lines():
    too_long = []
    for top in SIZE_CHECKED:
        for path in sorted((ROOT / top).rglob("*")):
            if path.suffix in SIZE_SUFFIXES and path.is_file():
                lines = len(path.read_text(errors="replace").splitlines())
                if lines > MAX_LINES:
                    too_long.append(f"{path.relative_to(ROOT)}: {lines} lines")
    assert not too_long, f"source files over {MAX_LINES} lines:\n" + "\n".join(too_long)
