"""docs/architecture.md's rules, executable: the import contracts in pyproject.toml (``lint-imports``), a
layer for every module, no import cycles between the project's modules, and the web processes' freedom
from torch at run time."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parents[1]
IMPORT_LINTER = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["importlinter"]
PACKAGES = tuple(IMPORT_LINTER["root_packages"])


def test_import_contracts_are_kept():
    here = str(Path(sys.executable).parent)
    binary = shutil.which("lint-imports", path=here) or shutil.which("lint-imports")
    assert binary, "lint-imports not found: install the test extras (import-linter)"
    proc = subprocess.run([binary, "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    assert "0 broken" in proc.stdout


def test_every_module_sits_in_a_layer():
    """A module no layer names escapes the layers contract (``lint-imports`` checks only the imports
    between the modules it names): a new module must be placed, as its package or by its own name."""
    (layers,) = [c["layers"] for c in IMPORT_LINTER["contracts"] if c["type"] == "layers"]
    named = {m for layer in layers for m in re.split(r"\s*[|:]\s*", layer.strip())}
    graph = grimp.build_graph(*PACKAGES)

    def placed(module: str) -> bool:
        parts = module.split(".")
        return any(".".join(parts[:i]) in named for i in range(1, len(parts) + 1))

    containers = {m.rsplit(".", i)[0] for m in named for i in range(1, m.count(".") + 1)}
    assert sorted(m for m in graph.modules if not placed(m) and m not in containers) == []


def _cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    edges = {m: sorted(graph.find_modules_directly_imported_by(m) & graph.modules) for m in graph.modules}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, 0)]
        while work:
            node, i = work.pop()
            if i == 0:
                index[node] = low[node] = len(index)
                stack.append(node)
                on_stack.add(node)
            if i < len(edges[node]):
                work.append((node, i + 1))
                child = edges[node][i]
                if child not in index:
                    work.append((child, 0))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
    return found


def test_no_import_cycles_between_modules():
    """Counting imports inside functions and under TYPE_CHECKING: a cycle hidden there still ties
    the modules' designs together."""
    graph = grimp.build_graph(*PACKAGES)
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle(tmp_path):
    modules = {"a": "import pkg.b", "b": "def f():\n    import pkg.c", "c": "import pkg.a"}
    for name, imports in modules.items():
        (tmp_path / "pkg").mkdir(exist_ok=True)
        (tmp_path / "pkg" / f"{name}.py").write_text(imports + "\n")
    (tmp_path / "pkg" / "__init__.py").write_text("")
    sys.path.insert(0, str(tmp_path))
    try:
        assert _cycles(grimp.build_graph("pkg", cache_dir=None)) == [["pkg.a", "pkg.b", "pkg.c"]]
    finally:
        sys.path.remove(str(tmp_path))


def test_the_gateway_the_dashboard_and_the_worker_start_without_torch():
    """The static contract, checked at run time: importing the app and its extensions, the Celery
    worker's task modules and the engine's torch-free face loads neither torch nor triton."""
    script = """
import sys
import tollgate.gateway_app, gateway.batches.tasks, billing.tasks
import tollgate.worker, engine.protocol, engine.tokenizer, engine.kv.block_hash
app = tollgate.gateway_app.create_app()
loaded = sorted(m for m in ("torch", "triton", "kernels", "transformers") if m in sys.modules)
print(loaded)
sys.exit(1 if loaded else 0)
"""
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
