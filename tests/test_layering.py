"""The architecture's rules, checked on the source (docs/architecture.md): layers import only downwards, no
import cycle, no module uses another module's private names, ``pallas_kernels`` imports nothing from
``minicpm_jax``, no code outside the backend switch compares kernel-backend names, no library file over
700 lines."""

from __future__ import annotations

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("minicpm_jax", "pallas_kernels", "checkpoints_convert", "benchmarks", "tests")
LIBRARY = ("minicpm_jax", "pallas_kernels", "checkpoints_convert")
MAX_LINES = 700
BACKEND_MODULE = "pallas_kernels.backend"
BACKEND_NAMES = {"xla", "pallas", "triton", "mosaic", "mosaic_gpu"}

# Layers, lowest first; a module may import modules of its own layer or of the layers listed as below it.
LAYERS = {
    "config": ("minicpm_jax.errors", "minicpm_jax.config", "minicpm_jax.rope_config", "minicpm_jax.quant"),
    "kernels": ("pallas_kernels",),
    "io": ("minicpm_jax.io",),
    "model": ("minicpm_jax.model", "minicpm_jax.infllm"),
    "engine": ("minicpm_jax.engine", "minicpm_jax.tokenizer"),
    "train": ("minicpm_jax.train",),  # beside the engine, above it: it drives the engine for self-distillation
    "surfaces": ("minicpm_jax.cli", "minicpm_jax.run", "minicpm_jax.server", "minicpm_jax.perplexity",
                 "minicpm_jax.train_eagle", "checkpoints_convert"),
    "api": ("minicpm_jax",),  # the package's __init__: the public API re-exports
    "benchmarks": ("benchmarks",),
    "tests": ("tests",),
}
MAY_IMPORT = {
    "config": {"config"},
    "kernels": {"kernels"},
    "io": {"config", "io"},
    "model": {"config", "kernels", "io", "model"},
    "engine": {"config", "kernels", "model", "engine"},  # not io: the engine knows no checkpoint format
    "train": {"config", "kernels", "model", "engine", "train"},  # not io: drafts are written by the model's loader
    "surfaces": {"config", "kernels", "io", "model", "engine", "train", "surfaces", "api"},
    "api": {"config", "kernels", "io", "model", "engine", "train", "surfaces", "api"},
    "benchmarks": {"config", "kernels", "io", "model", "engine", "train", "surfaces", "api", "benchmarks"},
    "tests": set(LAYERS),
}


def _modules() -> dict[str, str]:
    """``{module name: file}`` of every Python file of the project's packages."""
    out = {}
    for pkg in PACKAGES:
        for dirpath, _, files in os.walk(os.path.join(ROOT, pkg)):
            for f in files:
                if f.endswith(".py"):
                    rel = os.path.relpath(os.path.join(dirpath, f), ROOT)[:-3].replace(os.sep, ".")
                    out[rel[: -len(".__init__")] if rel.endswith(".__init__") else rel] = os.path.join(dirpath, f)
    return out


MODULES = _modules()
TREES = {name: ast.parse(open(path, encoding="utf-8").read(), path) for name, path in MODULES.items()}


def _layer(module: str) -> str:
    best, best_len = None, -1
    for layer, prefixes in LAYERS.items():
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best_len:
                best, best_len = layer, len(p)
    return best


def _imports(module: str) -> list[tuple[str, str | None, int]]:
    """``(imported module, imported name or None, line)`` of every import in ``module``, function-level
    imports included (they hide cycles as well as top-level ones)."""
    out = []
    package = module if MODULES[module].endswith("__init__.py") else module.rpartition(".")[0]
    for node in ast.walk(TREES[module]):
        if isinstance(node, ast.Import):
            out += [(a.name, None, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            for a in node.names:
                sub = f"{base}.{a.name}"
                out.append((sub, None, node.lineno) if sub in MODULES else (base, a.name, node.lineno))
    return [(m, n, line) for m, n, line in out if m.split(".")[0] in PACKAGES]


def test_modules_found():
    assert {"minicpm_jax.engine.engine", "pallas_kernels.backend", "benchmarks.spec"} <= set(MODULES)


def test_layers_import_only_downwards():
    bad = []
    for module in MODULES:
        src = _layer(module)
        for target, _, line in _imports(module):
            dst = _layer(target)
            if dst not in MAY_IMPORT[src]:
                bad.append(f"{module}:{line} ({src}) imports {target} ({dst})")
    assert not bad, "\n".join(bad)


def test_no_import_cycle():
    graph = {m: {t for t, _, _ in _imports(m) if t in MODULES and t != m} for m in MODULES}
    state, stack, cycles = {}, [], []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for t in sorted(graph[m]):
            if state.get(t) == "open":
                cycles.append(" -> ".join(stack[stack.index(t):] + [t]))
            elif t not in state:
                visit(t)
        stack.pop()
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert not cycles, "\n".join(cycles)


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def test_no_private_names_across_modules():
    """Neither ``from m import _x`` nor ``m._x`` on an imported project module, in the library, the
    benchmarks or the tests."""
    bad = []
    for module, tree in TREES.items():
        aliases = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.split(".")[0] in PACKAGES:
                        aliases[a.asname or a.name.split(".")[0]] = a.name
            elif isinstance(node, ast.ImportFrom):
                for a in node.names:
                    sub = f"{node.module}.{a.name}"
                    if sub in MODULES:
                        aliases[a.asname or a.name] = sub
        for target, name, line in _imports(module):
            if name is not None and _is_private(name):
                bad.append(f"{module}:{line} imports {name} from {target}")
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _is_private(node.attr) and isinstance(node.value, ast.Name):
                if node.value.id in aliases:
                    bad.append(f"{module}:{node.lineno} uses {aliases[node.value.id]}.{node.attr}")
    assert not bad, "\n".join(bad)


def test_pallas_kernels_import_nothing_from_minicpm_jax():
    bad = [f"{m}:{line} imports {t}" for m in MODULES if m.startswith("pallas_kernels")
           for t, _, line in _imports(m) if not t.startswith("pallas_kernels")]
    assert not bad, "\n".join(bad)


def test_model_and_infllm_import_no_engine_or_cli():
    bad = [f"{m}:{line} imports {t}" for m in MODULES if m.startswith(("minicpm_jax.model", "minicpm_jax.infllm"))
           for t, _, line in _imports(m) if t.startswith(("minicpm_jax.engine", "minicpm_jax.cli"))]
    assert not bad, "\n".join(bad)


def _names_in(node) -> set[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return set().union(*(_names_in(e) for e in node.elts)) if node.elts else set()
    return set()


def test_backend_names_compared_only_in_the_backend_module():
    """Which kernels run is decided in ``pallas_kernels.backend`` alone: nowhere else is a backend name
    compared (``impl == "pallas"``, ``name in ("xla", ...)``)."""
    bad = []
    for module, tree in TREES.items():
        if module == BACKEND_MODULE or module.startswith("tests"):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Compare):
                hit = set().union(*(_names_in(n) for n in [node.left, *node.comparators])) & BACKEND_NAMES
                if hit:
                    bad.append(f"{module}:{node.lineno} compares {sorted(hit)}")
            elif isinstance(node, ast.match_case) and _names_in(getattr(node.pattern, "value", None)) & BACKEND_NAMES:
                bad.append(f"{module}:{node.pattern.lineno} matches a backend name")
    assert not bad, "\n".join(bad)


def test_no_library_file_over_700_lines():
    long = {m: n for m, path in MODULES.items() if m.split(".")[0] in LIBRARY + ("benchmarks",)
            for n in [sum(1 for _ in open(path, encoding="utf-8"))] if n > MAX_LINES}
    assert not long, long


@pytest.mark.parametrize("rule", ["cycle", "private", "layer", "compare"])
def test_the_checks_catch_violations(rule, monkeypatch):
    """Each check fails on a planted violation (a mutation of the source it reads)."""
    planted = {
        "cycle": ("minicpm_jax.config", "from minicpm_jax.quant import QuantSpec\n"),
        "private": ("minicpm_jax.engine.scheduler", "from minicpm_jax.engine.engine import _x\n"),
        "layer": ("minicpm_jax.model.layers", "from minicpm_jax.engine import engine\n"),
        "compare": ("minicpm_jax.model.attention", "ok = impl == 'pallas'\n"),
    }[rule]
    module, code = planted
    tree = ast.parse(open(MODULES[module], encoding="utf-8").read() + "\n" + code)
    monkeypatch.setitem(TREES, module, tree)
    check = {"cycle": test_no_import_cycle, "private": test_no_private_names_across_modules,
             "layer": test_layers_import_only_downwards, "compare": test_backend_names_compared_only_in_the_backend_module}
    with pytest.raises(AssertionError):
        check[rule]()


def test_package_import_is_light_and_every_public_name_resolves():
    """``import minicpm_jax`` imports no JAX (the command-line entry points install their Ctrl-C handler
    first; a Ctrl-C during the heavy imports then ends the run with one line), and each name in
    ``__all__`` is importable from the package."""
    import subprocess
    import sys

    code = ("import sys, minicpm_jax; assert 'jax' not in sys.modules, 'jax imported'; "
            "[getattr(minicpm_jax, n) for n in minicpm_jax.__all__]; assert 'jax' in sys.modules")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr
