"""The import rule of the package: each layer imports only the layers below it (see STYLE.md)."""

import ast
import importlib.util
import json
import pathlib
import pkgutil
import subprocess
import sys

import pytest

import fastdata

MODULES = sorted(info.name for info in pkgutil.walk_packages(fastdata.__path__, "fastdata.")
                 if info.name != "fastdata.__main__")

# package -> what importing any of its modules must never load
FORBIDDEN = {
    "fastdata.formats": ("torch", "fastdata.codecs", "fastdata.converters", "fastdata.reading", "fastdata.loading",
                         "fastdata.measure"),
    "fastdata.codecs": ("torch", "fastdata.converters", "fastdata.reading", "fastdata.loading", "fastdata.measure"),
    "fastdata.converters": ("torch", "fastdata.loading", "fastdata.measure"),
    "fastdata.storage": ("torch", "fsspec", "fastdata.codecs", "fastdata.converters", "fastdata.reading",
                         "fastdata.loading", "fastdata.measure"),
    "fastdata.reading": ("torch", "fastdata.loading", "fastdata.converters", "fastdata.measure"),
    "fastdata.loading": ("fastdata.converters", "fastdata.measure"),
    "fastdata.errors": ("torch", "numpy", "fastdata.formats"),
    "fastdata._cpu": ("torch", "numpy"),
    "fastdata._processes": ("torch", "numpy"),
    "fastdata._optional": ("torch",),
}


def loaded_modules(module):
    """Import ``module`` in a fresh interpreter; return the names in its ``sys.modules`` afterwards."""
    code = f"import json, sys, {module}; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    return json.loads(out)


_PROBE = """
import importlib, json, sys
banned = sys.argv[1].split(",")
for module in sys.argv[2:]:
    importlib.import_module(module)
    loaded = [name for name in banned if any(m == name or m.startswith(name + ".") for m in sys.modules)]
    print(json.dumps([module, loaded]))
"""


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
@pytest.mark.integration
def test_each_layer_imports_only_the_layers_below(layer):
    """Import the layer's modules one by one in a fresh interpreter; none may load a banned module.

    One interpreter per layer rather than per module keeps this in the edit
    loop; a banned module is blamed on the first module whose import loaded it.
    """
    modules = [m for m in MODULES if m == layer or m.startswith(layer + ".")]
    out = subprocess.run([sys.executable, "-c", _PROBE, ",".join(FORBIDDEN[layer]), *modules],
                         check=True, capture_output=True, text=True).stdout
    first = {}
    for module, loaded in map(json.loads, out.splitlines()):
        for name in loaded:
            first.setdefault(name, module)
    assert not first, "; ".join(f"importing {module} loads {name}" for name, module in first.items())


def test_every_package_module_is_covered_or_top_level():
    """A new subpackage must get a rule here before it can land."""
    packages = {m.rsplit(".", 1)[0] for m in MODULES if m.count(".") >= 2}
    assert packages <= set(FORBIDDEN) | {"fastdata.measure"}, packages - set(FORBIDDEN)


def imported_names(module):
    """Return every name ``module``'s source imports anywhere (``from a import b``: a and a.b), function bodies too."""
    spec = importlib.util.find_spec(module)
    tree = ast.parse(pathlib.Path(spec.origin).read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def imports_of(module):
    """Return the fastdata modules that ``module``'s source imports anywhere, function bodies included."""
    return {name for name in imported_names(module) if name in MODULES and name != module}


def test_no_import_cycles():
    """No chain of imports, not even one through a function-level import, leads back to its start."""
    graph = {module: imports_of(module) for module in MODULES}
    done, stack = set(), []

    def visit(module):
        if module in stack:
            raise AssertionError("import cycle: " + " -> ".join([*stack[stack.index(module):], module]))
        if module not in done:
            stack.append(module)
            for imported in sorted(graph[module]):
                visit(imported)
            stack.pop()
            done.add(module)

    for module in MODULES:
        visit(module)


@pytest.mark.integration
def test_importing_fastdata_loads_nothing_heavy():
    loaded = loaded_modules("fastdata")
    assert not [name for name in ("torch", "h5py", "pyarrow", "PIL", "numpy") if name in loaded]


# modules that may import by name: the lazy public API, optional extras, and installed versions
IMPORTS_BY_NAME = {"fastdata", "fastdata._optional", "fastdata.measure.machine"}


def test_no_module_imports_another_by_name():
    """importlib hides an import from the cycle check above; only the lazy API and the extras may use it."""
    users = [module for module in MODULES if any(name.split(".")[0] == "importlib" for name in imported_names(module))]
    assert set(users) <= IMPORTS_BY_NAME, sorted(set(users) - IMPORTS_BY_NAME)

