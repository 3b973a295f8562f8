"""The package's layering: no import circle (function-level imports included), the op layer's leaf imports only
torch, every wrapper takes the kernels-or-reference decision from one place (Note [kernels or reference]), the run
log package imports neither its writers' nor its readers' side, and no hookstats module uses a deprecated path."""
import ast
import pathlib

import pytest
import torch

import hookstats
from hookstats import _kernels

PKG = pathlib.Path(hookstats.__file__).parent


def _module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _internal_imports(path: pathlib.Path) -> set:
    """The hookstats modules `path` imports anywhere in its body (module level or inside functions)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] == "hookstats"}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod.split(".")[0] != "hookstats":
                continue
            for a in node.names:  # `from . import reference` names a module; `from ._ops import stats` a name
                sub = f"{mod}.{a.name}"
                out.add(sub if (PKG.parent / (sub.replace(".", "/") + ".py")).exists()
                        or (PKG.parent / sub.replace(".", "/")).is_dir() else mod)
    return {m for m in out if m != name}


def _graph() -> dict:
    graph = {}
    for path in PKG.rglob("*.py"):
        graph[_module_name(path)] = _internal_imports(path)
    return graph


def _parents(mod: str) -> list:
    """Importing a.b.c runs a/__init__ and a/b/__init__ first: those edges are not circles of the code's making."""
    parts = mod.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def test_no_import_circle():
    graph = _graph()
    state: dict = {}
    stack: list = []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for n in sorted(graph.get(m, ())):
            if n not in graph or n in _parents(m):
                continue
            if state.get(n) == 1:
                cycle = stack[stack.index(n):] + [n]
                pytest.fail("import circle: " + " -> ".join(cycle))
            if not state.get(n):
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if not state.get(m):
            visit(m)


# The old paths of the run log (hookstats.runlog), kept for one release as warning shims.
DEPRECATED_MODULES = ("hookstats.monitor.table", "hookstats.export.jsonl", "hookstats.export.parquet",
                      "hookstats.export.log", "hookstats.export._columns")
DEPRECATED_EXPORT_NAMES = ("read_log", "read_run", "find_log", "RunTable", "RunLog", "read_jsonl", "PARQUET_NAME")


def _reach(graph: dict, start: str) -> set:
    """The modules start imports, directly or through others (a package's own parents not followed: see _parents)."""
    seen, todo = set(), [start]
    while todo:
        m = todo.pop()
        for n in graph.get(m, ()):
            if n not in seen and n not in _parents(m):
                seen.add(n)
                todo.append(n)
    return seen


def test_runlog_imports_no_exporter_and_no_monitor():
    """Both the writers (Monitor exporters) and the readers (report, analysis) import the run log: it imports
    neither hookstats.export nor the Monitor, directly or through another module."""
    graph = _graph()
    runlog = [m for m in graph if m == "hookstats.runlog" or m.startswith("hookstats.runlog.")]
    assert {"hookstats.runlog", "hookstats.runlog.schema", "hookstats.runlog.read"} <= set(runlog)
    for m in runlog:
        bad = sorted(n for n in _reach(graph, m) if n in ("hookstats.monitor.core", "hookstats.export")
                     or n.startswith("hookstats.export."))
        assert not bad, f"{m} imports {bad}"


def test_runlog_needs_no_op_layer():
    """A log reader needs no compiled extension: the run log reaches the field specification (_fields.py, which
    imports no torch and no hookstats module), never the op layer that loads _C."""
    graph = _graph()
    assert graph["hookstats._fields"] == set()
    top = {(n.module or "").split(".")[0] if isinstance(n, ast.ImportFrom) else a.name.split(".")[0]
           for n in ast.parse((PKG / "_fields.py").read_text()).body if isinstance(n, (ast.Import, ast.ImportFrom))
           for a in n.names}
    assert top <= {"__future__", "math", "typing"}, top
    for m in [m for m in graph if m == "hookstats.runlog" or m.startswith("hookstats.runlog.")]:
        bad = sorted(n for n in _reach(graph, m) if n in ("hookstats._ops", "hookstats._kernels", "hookstats._types",
                                                          "hookstats.reference", "hookstats.monitor"))
        assert not bad, f"{m} imports {bad}"


def test_no_module_imports_a_deprecated_path():
    graph = _graph()
    for m, deps in sorted(graph.items()):
        if m in DEPRECATED_MODULES:
            continue
        assert not deps & set(DEPRECATED_MODULES), f"{m} imports {sorted(deps & set(DEPRECATED_MODULES))}"
    for path in PKG.rglob("*.py"):
        name = _module_name(path)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:
                base = package.split(".")
                mod = ".".join(base[: len(base) - (node.level - 1)] + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod == "hookstats.export":
                moved = sorted({a.name for a in node.names} & set(DEPRECATED_EXPORT_NAMES))
                assert not moved, f"{name} imports {moved} from hookstats.export; they are in hookstats.runlog"


def test_op_layer_leaf_imports_only_torch():
    tree = ast.parse((PKG / "_types.py").read_text())
    top = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            top |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level:
            top.add((node.module or "").split(".")[0])
    assert top <= {"__future__", "math", "typing", "torch"}, top
    assert _internal_imports(PKG / "reference.py") == {"hookstats._types"}


def test_one_place_chooses_kernels_or_reference():
    """Only _kernels decides: no wrapper tests HAVE_EXTENSION or a device itself."""
    for path in PKG.rglob("*.py"):
        if path.name in ("_kernels.py",):
            continue
        text = path.read_text()
        for needle in ("if not HAVE_EXTENSION", "if HAVE_EXTENSION", "HAVE_EXTENSION else", "HAVE_EXTENSION and"):
            assert needle not in text or path.name == "compile.py" and needle == "if HAVE_EXTENSION", \
                f"{path.relative_to(PKG)} decides kernels vs reference itself ({needle!r}); use _kernels.use_kernels"
        # a wrapper that asks the tensor's device picks a path itself (a dispatch key picks the kernel)
        for line in text.splitlines():
            if "use_kernels" not in line and "reference" in line and (".is_cuda" in line or ".device.type" in line):
                raise AssertionError(f"{path.relative_to(PKG)} picks the reference by device: {line.strip()!r}")


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_kernel_devices(device):
    assert _kernels.use_kernels(torch.empty(3, device=device), "stats") is _kernels.HAVE_EXTENSION


def test_other_devices_take_the_reference(monkeypatch):
    """A tensor on a device without kernels (mps, xla, ...) is served by the reference in every wrapper alike."""
    calls = []
    real = _kernels.use_kernels

    def no_kernels(x, op):
        calls.append(op)
        return False

    monkeypatch.setattr(hookstats._ops, "use_kernels", no_kernels)
    monkeypatch.setattr(hookstats.channel, "use_kernels", no_kernels)
    x = torch.tensor([[3.0, -4.0], [0.0, float("nan")]])
    s = hookstats.stats(x)
    assert int(s.numel) == 4 and int(s.nan_count) == 1 and int(s.zero_count) == 1 and s.linf.isnan()
    assert float(hookstats.stats(x[0]).linf) == 4.0
    _, h = hookstats.stats(x, (2, (-4.0, 4.0)))
    assert h.tolist() == [1, 2, 0, 0, 1]
    loc = hookstats.stats(x, locations=True)
    assert int(loc.argmax_abs_index) == 1 and int(loc.first_nonfinite_index) == 3
    c = hookstats.channel_stats(x, 0)
    assert c.absmax.tolist() == [4.0, 0.0] and c.nonfinite.tolist() == [0, 1]
    buf = hookstats.stats_buffer(1)
    hookstats.stats_multi_into([x], buf, [0])
    assert buf[0, 0].item() == 4
    assert {"stats", "channel_stats", "stats_multi_into"} <= set(calls)
    assert real(torch.ones(1), "stats") is _kernels.HAVE_EXTENSION


OPTIONAL = {"pyarrow", "pandas", "tensorboard", "wandb", "matplotlib", "transformers", "lightning",
            "pytorch_lightning", "polars", "duckdb"}
FEATURE_MODULES = ("hookstats.channel", "hookstats.per_sample", "hookstats.monitor.features")


def _import_nodes(tree, in_functions: bool):
    """The import statements that run when the module is imported (in_functions=False: not inside a def), or those
    inside a def (True)."""
    out = []

    def visit(node, inside):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                visit(child, True)
            else:
                if isinstance(child, (ast.Import, ast.ImportFrom)) and inside == in_functions:
                    out.append(child)
                visit(child, inside)

    visit(tree, False)
    return out


def _targets(node, m: str, path: pathlib.Path, paths: dict) -> list:
    """The hookstats modules an import statement of module m loads; `from pkg import Name` where pkg's __getattr__
    loads Name from a submodule counts as that submodule."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.split(".")[0] == "hookstats"]
    package = m if path.name == "__init__.py" else m.rpartition(".")[0]
    if node.level:
        base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
        mod = ".".join(base + ([node.module] if node.module else []))
    else:
        mod = node.module or ""
    if mod.split(".")[0] != "hookstats":
        return []
    out = []
    for a in node.names:
        sub = f"{mod}.{a.name}"
        if sub in paths:
            out.append(sub)
            continue
        lazy = mod
        if mod in paths and paths[mod].name == "__init__.py":
            for fn in ast.parse(paths[mod].read_text()).body:
                if isinstance(fn, ast.FunctionDef) and fn.name == "__getattr__":
                    for n in _import_nodes(fn, True) + _import_nodes(fn, False):
                        if isinstance(n, ast.ImportFrom) and any(x.name == a.name for x in n.names):
                            lazy = ".".join([mod] + ([n.module] if n.module else [])) if n.level == 1 else n.module
        out.append(lazy)
    return out


def _top_level_imports(path: pathlib.Path) -> set:
    """Top-level package names `path` imports when it is imported (not inside a function)."""
    out = set()
    for node in _import_nodes(ast.parse(path.read_text()), False):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif not node.level:
            out.add((node.module or "").split(".")[0])
    return out


def _closure(graph: dict, start: str) -> set:
    seen, todo = set(), [start]
    while todo:
        m = todo.pop()
        for n in graph.get(m, ()):
            if n in graph and n not in seen and n not in _parents(m):  # a/__init__ runs first anyway
                seen.add(n)
                todo.append(n)
    return seen


def _code_names(path: pathlib.Path) -> set:
    """The identifiers (names, attributes, keywords, imported names) and the string constants, docstrings left out, of
    a module's code."""
    tree = ast.parse(path.read_text())
    docs = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and n.body
            and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, ast.keyword) and node.arg:
            names.add(node.arg)
        elif isinstance(node, ast.alias):
            names.add(node.asname or node.name.rpartition(".")[2])
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            names.add(node.value)
    return names


def test_monitor_core_imports_no_feature_module():
    """Note [monitor features]: the core knows features only through the protocol and the registry. Its imports
    (AST, function-level ones included) reach no feature module, and neither the core nor the protocol module it
    imports (feature.py, whose FeatureAccess is the Monitor's base) names a registered feature, a shortcut one
    contributes or a feature's class: each feature brings its own through register_feature."""
    from hookstats.monitor import feature

    graph = _graph()
    reached = _closure(graph, "hookstats.monitor.core") | {"hookstats.monitor.core"}
    assert "hookstats.monitor.feature" in reached
    bad = sorted(m for m in reached if m.startswith(FEATURE_MODULES))
    assert not bad, f"hookstats.monitor.core reaches feature modules {bad}"
    known = set(feature.registered()) | set(feature.shortcuts()) | {
        "ChannelCalibrator", "PerSampleGradNorms", "ChannelStatsFeature", "PerSampleFeature", "LocationsFeature",
        "NonfiniteOpsFeature"}
    assert {"per_sample", "channel_stats", "locations", "nonfinite_ops", "top_samples", "channel_results"} <= known
    for path in (PKG / "monitor" / "core.py", PKG / "monitor" / "feature.py"):
        named = _code_names(path) & known
        assert not named, f"{path.relative_to(PKG)} names features {sorted(named)}"
    shortcuts = {n for n, v in vars(feature.FeatureAccess).items() if callable(v) and not n.startswith("_")}
    assert shortcuts == set(feature.shortcuts()) | {"feature", "feature_results"}


def test_no_python_file_over_500_lines():
    long = {str(p.relative_to(PKG)): n for p in PKG.rglob("*.py") if (n := len(p.read_text().splitlines())) > 500}
    assert not long, f"split these along the data path: {long}"


def test_no_kernel_source_over_500_lines():
    """The C++ and CUDA sources too (csrc/ of the source tree; an installed package has none, and nothing to check)."""
    csrc = PKG.parent / "csrc"
    if not csrc.is_dir():
        pytest.skip("no csrc/ beside the package (an installed wheel)")
    files = [p for ext in ("*.cpp", "*.h", "*.cu", "*.cuh") for p in csrc.rglob(ext)]
    assert files
    long = {str(p.relative_to(csrc)): n for p in files if (n := len(p.read_text().splitlines())) > 500}
    assert not long, f"split these along the data path: {long}"


def test_function_level_imports_only_for_optional_dependencies():
    """A hookstats module is imported inside a function only when importing it (or what it imports when imported)
    needs an optional package; every other import sits at the top, where the import graph shows it."""
    paths = {_module_name(p): p for p in PKG.rglob("*.py")}
    top = {m: {t for n in _import_nodes(ast.parse(p.read_text()), False) for t in _targets(n, m, p, paths)}
           for m, p in paths.items()}
    needs = {m for m, p in paths.items() if _top_level_imports(p) & OPTIONAL}
    needs |= {m for m in paths if _closure(top, m) & needs}
    bad = []
    for m, path in paths.items():
        for node in _import_nodes(ast.parse(path.read_text()), True):
            bad += [f"{m}:{node.lineno} -> {t}" for t in _targets(node, m, path, paths) if t not in needs]
    assert not bad, "function-level imports of modules with no optional dependency: " + ", ".join(sorted(set(bad)))
