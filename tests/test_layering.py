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
    "fastdata.formats": ("torch", "fastdata.codecs", "fastdata.converters", "fastdata.loading", "fastdata.measure"),
    "fastdata.codecs": ("torch", "fastdata.converters", "fastdata.loading", "fastdata.measure"),
    "fastdata.converters": ("torch", "fastdata.loading", "fastdata.measure"),
    "fastdata.loading": ("fastdata.converters", "fastdata.measure"),
    "fastdata.errors": ("torch", "numpy", "fastdata.formats"),
    "fastdata._cpu": ("torch", "numpy"),
    "fastdata._optional": ("torch",),
}


def loaded_modules(module):
    """Import ``module`` in a fresh interpreter; return the names in its ``sys.modules`` afterwards."""
    code = f"import json, sys, {module}; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    return json.loads(out)


def rules_for(module):
    return [banned for layer, bans in FORBIDDEN.items()
            if module == layer or module.startswith(layer + ".") for banned in bans]


@pytest.mark.parametrize("module", [m for m in MODULES if rules_for(m)])
def test_module_imports_only_the_layers_below(module):
    loaded = loaded_modules(module)
    broken = [banned for banned in rules_for(module)
              if any(name == banned or name.startswith(banned + ".") for name in loaded)]
    assert not broken, f"importing {module} loads {broken}"


def test_every_package_module_is_covered_or_top_level():
    """A new subpackage must get a rule here before it can land."""
    packages = {m.rsplit(".", 1)[0] for m in MODULES if m.count(".") >= 2}
    assert packages <= set(FORBIDDEN) | {"fastdata.measure"}, packages - set(FORBIDDEN)


def imports_of(module):
    """Return the fastdata modules that ``module``'s source imports anywhere, function bodies included."""
    spec = importlib.util.find_spec(module)
    tree = ast.parse(pathlib.Path(spec.origin).read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in names if name in MODULES and name != module}


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


def test_importing_fastdata_loads_nothing_heavy():
    loaded = loaded_modules("fastdata")
    assert not [name for name in ("torch", "h5py", "pyarrow", "PIL", "numpy") if name in loaded]
