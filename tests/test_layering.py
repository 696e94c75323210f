"""The package's floors (docs/architecture.md, "Floors"): each imports only floors below it (imports inside
functions and under TYPE_CHECKING count too), no module imports itself back through others, only the
platform layer and the attention/ops choice ask which kind of device they are on, and the serving package never
imports the demo models' training scripts (the repository's demo/). A file longer than MAX_LINES is reported as a
warning, not a failure: a cohesive class is worth more than the cap."""

from __future__ import annotations

import ast
import re
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "tessera"
# Top-level modules and packages of tessera -> floor; the module `tessera` itself (its lazy exports) is on top.
FLOORS = {
    "version": 1, "messages": 1, "platform": 1, "constrained": 1,
    "config": 2, "server_flags": 2, "multimodal": 2,
    "cache": 3, "layers": 3, "distributed": 3,
    "models": 4,
    "worker": 5, "scheduler": 5,
    "frontend": 6, "entrypoints": 6, "lang": 6,
    "cli": 7, "__main__": 7, "bench": 7, "demo": 7,
}
# Packages on one floor that must not import each other either.
APART = [{"worker", "scheduler"}, {"frontend", "worker"}]
# The only files (outside bench/, which measures devices) that ask which kind of device they are on.
DEVICE_KIND_FILES = {"platform/device.py", "platform/cpu_kernels.py", "layers/attention/__init__.py"}
DEVICE_KIND = re.compile(r"torch\.cuda|\bis_cuda\b|\.is_cpu\b|device\.type\b|\.type\s*[!=]=|[\"']cuda[\"']")
MAX_LINES = 450  # past it, a warning that asks whether the file still does one thing


class LongFileWarning(UserWarning):
    """A file past MAX_LINES: worth a look, not a failure."""


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _resolve(name: str) -> str | None:
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str, source: str, is_pkg: bool = False) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")[: len(module.split(".")) - node.level + (1 if is_pkg else 0)]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            names = [f"{prefix}.{a.name}" if f"{prefix}.{a.name}" in MODULES else prefix for a in node.names]
        else:
            continue
        for name in names:
            target = _resolve(name) if name.startswith("tessera") else None
            if target and target != module:
                found.add(target)
    return found


GRAPH = {m: _imports(m, p.read_text(), p.name == "__init__.py") for m, p in MODULES.items()}


def _top(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_every_package_has_a_floor():
    assert sorted({_top(m) for m in MODULES if _top(m)} - set(FLOORS)) == []


def test_imports_point_down():
    up = []
    for src, targets in GRAPH.items():
        if not _top(src):
            continue  # the package's lazy top-level exports
        for dst in targets:
            a, b = _top(src), _top(dst)
            if not b:
                up.append(f"{src} -> {dst} (the package itself)")
            elif a != b and (FLOORS[b] > FLOORS[a] or {a, b} in APART):
                up.append(f"{src} (floor {FLOORS[a]}) -> {dst} (floor {FLOORS[b]})")
    assert up == []


def test_no_import_circles():
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in GRAPH:
        if v not in index:
            visit(v)
    assert circles == []


def test_only_the_platform_layer_and_the_attention_choice_ask_for_the_device_kind():
    asking = {str(p.relative_to(ROOT)) for p in MODULES.values()
              if not str(p.relative_to(ROOT)).startswith("bench/") and DEVICE_KIND.search(p.read_text())}
    assert asking <= DEVICE_KIND_FILES, sorted(asking - DEVICE_KIND_FILES)


def test_the_package_never_imports_the_training_scripts():
    importing = []
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            importing += [f"{module} -> {n}" for n in names if n.split(".")[0] == "demo"]
    assert importing == []


def _long_files(paths, root: Path = ROOT) -> dict[str, int]:
    """Files past MAX_LINES, longest first: name under root -> lines."""
    long = {str(p.relative_to(root)): n for p in paths if (n := len(p.read_text().splitlines())) > MAX_LINES}
    return dict(sorted(long.items(), key=lambda kv: -kv[1]))


def test_long_files_are_reported():
    """A report, not a check: each long file is a warning in pytest's summary."""
    for name, n in _long_files(MODULES.values()).items():
        warnings.warn(f"{name}: {n} lines (> {MAX_LINES}): does it still do one thing?", LongFileWarning,
                      stacklevel=1)


def test_the_checks_can_fail(tmp_path):
    """The import reader sees function-level and relative imports, and the device pattern its spellings."""
    src = "def f():\n    from tessera.worker import model_worker\nfrom . import media\n"
    found = _imports("tessera.multimodal.processors.base", src)
    assert "tessera.worker.model_worker" in found and "tessera.multimodal.processors" in found
    for spelling in ('x.device.type == "cpu"', "t.is_cuda", "torch.cuda.synchronize()", "x.is_cpu"):
        assert DEVICE_KIND.search(spelling)
    (tmp_path / "long.py").write_text("x = 1\n" * (MAX_LINES + 1))
    (tmp_path / "short.py").write_text("x = 1\n" * MAX_LINES)
    assert _long_files(sorted(tmp_path.iterdir()), tmp_path) == {"long.py": MAX_LINES + 1}
