"""What ``scripts/gpu-check`` would fail to import on a GPU machine, found on this one.

A lent GPU machine has a CUDA + PyTorch image and no network: beyond the image, only the wheels that
``scripts/gpu-wheels`` downloads are there (gpu-check installs them). A project module imported at the
top of a test module, a conftest or a benchmark that the image lacks stops the whole step there (a
test module that fails to import makes pytest collect nothing), and costs a lent GPU's minutes to find.

Run as a script with the test paths and benchmark scripts of gpu-check's plan: it installs an import
hook that refuses every third-party top-level module imported *from the project's own files* unless the
image or the wheels provide it (a third-party package importing its own dependencies is not judged),
collects the tests (``pytest --collect-only``), imports each script, and prints one JSON object:
``{"refused": {module: [importing file, ...]}, "collect_rc": int}``.

    python tests/gpu_imports.py [--root DIR] tests/kernels tests/engine/test_overlap.py benchmarks/kernels.py

``--root`` (default: this checkout) is the tree whose files count as the project's.
"""

from __future__ import annotations

import importlib.abc
import importlib.metadata
import importlib.util
import json
import re
import sys
from collections import defaultdict
from pathlib import Path

from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
# Distributions a CUDA + PyTorch image brings (the one gpu-check last ran on had these, among others);
# scripts/gpu-wheels carries the project's other dependencies.
GPU_IMAGE = (
    "torch", "triton", "numpy", "transformers", "tokenizers", "safetensors", "huggingface-hub", "jinja2",
    "markupsafe", "pytest", "pytest-xdist", "pytest-timeout", "execnet", "pluggy", "iniconfig", "packaging",
    "pyyaml", "regex", "requests", "tqdm", "filelock", "fsspec", "psutil", "prometheus-client", "httpx",
    "httpcore", "anyio", "h11", "idna", "certifi", "click", "typing-extensions", "aiohttp", "sympy",
    "networkx", "pillow", "scipy", "setuptools",
)  # fmt: skip
PROJECT = {"engine", "kernels", "gateway", "billing", "tollgate", "admin_ui", "benchmarks", "tests",
           "migrations", "gpu_report"}  # fmt: skip


def wheel_distributions() -> set[str]:
    """The distributions ``scripts/gpu-wheels`` downloads (its ``packages=( ... )`` list)."""
    text = (ROOT / "scripts" / "gpu-wheels").read_text()
    listed = re.search(r"^packages=\((.*?)^\)", text, re.M | re.S)
    assert listed is not None, "scripts/gpu-wheels has no packages=( ... ) list"
    names = [re.split(r"[=<>!~\[]", word.strip("\"'"))[0] for word in listed.group(1).split()]
    return {canonicalize_name(n) for n in names if n}


def available_modules() -> set[str]:
    """Top-level modules the image's distributions and the carried wheels provide (as installed here)."""
    allowed = {canonicalize_name(d) for d in GPU_IMAGE} | wheel_distributions()
    return {module for module, dists in importlib.metadata.packages_distributions().items()
            if any(canonicalize_name(d) in allowed for d in dists)}  # fmt: skip


class RefuseMissing(importlib.abc.MetaPathFinder):
    """Refuses a top-level third-party module that the project's own code imports and the GPU machine
    would not have; records who asked."""

    def __init__(self, allowed: set[str], root: Path) -> None:
        self.allowed = allowed | PROJECT | set(sys.stdlib_module_names)
        self.root = root
        self.refused: dict[str, set[str]] = defaultdict(set)

    def find_spec(self, fullname, path=None, target=None):  # noqa: ANN001, ANN201 - the finder protocol
        if "." in fullname or fullname in self.allowed or fullname.startswith("_"):
            return None
        importer = _importer(self.root)
        if importer is None:
            return None
        self.refused[fullname].add(str(importer.relative_to(self.root)))
        raise ModuleNotFoundError(f"No module named {fullname!r} on the GPU machine", name=fullname)


def _importer(root: Path) -> Path | None:
    """The project file whose import statement is running (None: a third-party or stdlib module's)."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith("<frozen"):
        frame = frame.f_back
    if frame is None:
        return None
    filename = Path(frame.f_code.co_filename)
    if not filename.is_absolute():
        return None
    filename = filename.resolve()
    if root not in filename.parents or ".venv" in filename.parts or "site-packages" in filename.parts:
        return None
    return filename


def main(argv: list[str]) -> int:
    import pytest

    root = ROOT
    if argv[:1] == ["--root"]:
        root, argv = Path(argv[1]).resolve(), argv[2:]
    hook = RefuseMissing(available_modules(), root)
    sys.meta_path.insert(0, hook)
    sys.path.insert(0, str(root))
    tests = [a for a in argv if not a.endswith(".py") or Path(a).name.startswith("test_")]
    scripts = [a for a in argv if a not in tests]
    rc = pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", *tests]) if tests else 0
    for script in scripts:
        spec = importlib.util.spec_from_file_location(f"gpu_check_{Path(script).stem}", root / script)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up while it executes
        try:
            spec.loader.exec_module(module)
        except ModuleNotFoundError:
            pass  # recorded by the hook
    print(json.dumps({"refused": {m: sorted(f) for m, f in hook.refused.items()}, "collect_rc": int(rc)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
