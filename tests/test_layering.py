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
        for needle in ("if not HAVE_EXTENSION", "if HAVE_EXTENSION", "uses_kernels("):
            assert needle not in text or path.name == "compile.py" and needle == "if HAVE_EXTENSION", \
                f"{path.relative_to(PKG)} decides kernels vs reference itself ({needle!r}); use _kernels.use_kernels"


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
