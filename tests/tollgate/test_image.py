"""The Dockerfile's steps, checked without a Docker engine.

The image must be able to run Triton on a GPU: Triton compiles its CUDA driver stub with a C compiler
at the first kernel launch, and ``python:3.11-slim`` has none. These tests read the Dockerfile, then
replay its steps in a clean virtualenv: the files its ``COPY`` lines bring, its ``pip install`` line,
then from outside the source tree the ahead-of-time compile of the installed kernels for sm_90 and
the build of Triton's CUDA driver stub with the installed Triton.

The replay installs the CPU build of torch (``TORCH_CONSTRAINTS=constraints/cpu.txt``, the image's
documented CPU variant): PyPI's CUDA build is gigabytes. Triton, which does the compiling, is the same
version in both constraint files (checked below). The virtualenv starts with the project's runtime
dependencies (and nothing else: not the test extras) linked from this environment
(``tests.installed_dists``), so the ``pip install`` line resolves against them rather than an index;
``scripts/bootstrap.sh`` resolves the same requirements and constraints from the index on every run.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from tests.installed_dists import link_dependencies

ROOT = Path(__file__).resolve().parents[2]


def instructions() -> list[tuple[str, str]]:
    """The Dockerfile as (INSTRUCTION, arguments), continuation lines joined, comments dropped."""
    lines, current = [], ""
    for raw in (ROOT / "Dockerfile").read_text().splitlines():
        line = raw.strip()
        if not current and (not line or line.startswith("#")):
            continue
        current += line.removesuffix("\\").strip() + " "
        if not line.endswith("\\"):
            lines.append(current.strip())
            current = ""
    return [(line.split(maxsplit=1)[0].upper(), line.split(maxsplit=1)[1]) for line in lines]


def build_args() -> dict[str, str]:
    return dict(arg.split("=", 1) for kind, arg in instructions() if kind == "ARG" and "=" in arg)


def pins(path: Path) -> dict[str, str]:
    found = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, version = line.split("==")
            found[name.strip()] = version.strip()
    return found


def pip_install_step() -> str:
    return next(arg for kind, arg in instructions() if kind == "RUN" and arg.startswith("pip install"))


def test_the_image_installs_a_c_compiler_and_libc_headers():
    apt = next(arg for kind, arg in instructions() if kind == "RUN" and "apt-get install" in arg)
    install = apt.split("apt-get install", 1)[1].split("&&", 1)[0]
    packages = {word for word in install.split() if not word.startswith("-")}
    assert {"gcc", "libc6-dev"} <= packages
    assert "rm -rf /var/lib/apt/lists" in apt


def test_torch_and_triton_are_pinned_for_cuda_and_agree_with_the_cpu_pins():
    assert build_args()["TORCH_CONSTRAINTS"] == "constraints/cuda.txt"
    assert "-c ${TORCH_CONSTRAINTS}" in pip_install_step()
    cuda, cpu = pins(ROOT / "constraints/cuda.txt"), pins(ROOT / "constraints/cpu.txt")
    assert set(cuda) == set(cpu) == {"torch", "triton"}
    assert cuda["triton"] == cpu["triton"], "the image must compile kernels with the Triton the tests use"
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    ranges = {r.name: r.specifier for r in map(Requirement, project)}
    for name, version in cuda.items():
        assert version in ranges[name], f"{name}=={version} is outside pyproject's {ranges[name]}"


def test_the_image_copies_every_package_the_project_installs():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = {p.rstrip("*") for p in config["tool"]["setuptools"]["packages"]["find"]["include"]}
    copied = {Path(shlex.split(arg)[0]).name for kind, arg in instructions() if kind == "COPY"}
    copied |= {word for kind, arg in instructions() if kind == "COPY" for word in shlex.split(arg)[:-1]}
    assert packages | {"constraints", "pyproject.toml", "README.md"} <= copied


@pytest.fixture(scope="module")
def image(tmp_path_factory) -> Path:
    """A virtualenv holding what the image's ``pip install`` line installs from what it ``COPY``s."""
    base = tmp_path_factory.mktemp("image")
    app = base / "app"
    app.mkdir()
    for kind, arg in instructions():
        if kind != "COPY":
            continue
        *sources, dest = shlex.split(arg)
        target = app / dest if dest not in (".", "./") else app
        for source in sources:
            src = ROOT / source
            if src.is_dir():
                shutil.copytree(src, target, ignore=shutil.ignore_patterns("__pycache__"), dirs_exist_ok=True)
            else:
                target.mkdir(parents=True, exist_ok=True)
                shutil.copy(src, target / src.name)
    venv = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    site_packages = subprocess.run([str(venv / "bin" / "python"), "-c", "import sysconfig; "
                                    "print(sysconfig.get_path('purelib'))"], capture_output=True, text=True,
                                   check=True).stdout.strip()  # fmt: skip
    link_dependencies(Path(site_packages), "tollgate")
    env = {**os.environ, "PATH": f"{venv / 'bin'}{os.pathsep}{os.environ['PATH']}",
           "TORCH_CONSTRAINTS": "constraints/cpu.txt"}  # fmt: skip
    env.pop("PYTHONPATH", None)
    step = pip_install_step()
    # --no-compile: the bytecode pip writes for every installed module (torch's included) halves the
    # install's time here and changes nothing that is installed.
    proc = subprocess.run(["bash", "-c", f"{step} -q --no-compile"], cwd=app, env=env, capture_output=True,
                          text=True, timeout=1200)  # fmt: skip
    assert proc.returncode == 0, f"{step} failed:\n{proc.stderr[-4000:]}"
    check = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "check"], capture_output=True,
                           text=True)  # fmt: skip
    assert check.returncode == 0, check.stdout
    return venv


def _run_installed(venv: Path, args: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TRITON_INTERPRET")}
    return subprocess.run([str(venv / "bin" / "python"), *args], cwd=cwd, env=clean | env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip


# Both tests use one virtualenv: one xdist worker builds it, not each.
@pytest.mark.xdist_group("image")
@pytest.mark.slow  # a fresh virtualenv and the sm_90 compiles
def test_the_installed_kernels_compile_for_sm90(image, tmp_path):
    where = _run_installed(image, ["-c", "import kernels; print(kernels.__file__)"], tmp_path,
                           TRITON_INTERPRET="0")  # fmt: skip
    assert where.stdout.startswith(str(image)), where.stdout + where.stderr
    # An empty Triton cache, as in a new container: every kernel is compiled and assembled here, none
    # found already compiled by this machine's other runs. One shape's kernels (every kernel the engine
    # launches): what this shows is that the installed package compiles; tests/kernels/test_aot_compile.py
    # compiles every served shape for both architectures from the source tree.
    proc = _run_installed(image, ["-m", "kernels.aot", "--arch", "90", "--dtype", "bfloat16", "--shape",
                                  "llama3-8b"], tmp_path, TRITON_INTERPRET="0",
                          TRITON_CACHE_DIR=str(tmp_path / "triton-cache"))  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert re.search(r"\d+ specialisations compiled, 0 unfit to launch", proc.stdout)


@pytest.mark.xdist_group("image")
@pytest.mark.slow  # a fresh virtualenv and a C build
def test_the_installed_triton_builds_its_cuda_driver_stub(image, tmp_path):
    """The C build Triton runs at a GPU's first launch (``CudaUtils``), with the installed Triton and
    the compiler the image installs. ``libcuda.so.1`` is the NVIDIA driver's library, which the
    container runtime mounts on a GPU host; here an empty library of that name stands in at link time."""
    stub = tmp_path / "driver"
    stub.mkdir()
    (stub / "empty.c").write_text("")
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(stub / "libcuda.so.1"), str(stub / "empty.c")],
                   check=True)  # fmt: skip
    script = f"""
import os, shutil, sys
from triton.backends.nvidia import driver
from triton.runtime.build import _build
out = {str(tmp_path / "build")!r}
os.makedirs(out)
src = shutil.copy(os.path.join(driver.dirname, "driver.c"), out)
so = _build("cuda_utils", src, out, [driver.libdevice_dir, {str(stub)!r}], driver.include_dirs,
            driver.libraries, [])
print(so)
"""
    proc = _run_installed(image, ["-c", script], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    built = Path(proc.stdout.strip().splitlines()[-1])
    undefined = subprocess.run(["nm", "-D", "--undefined-only", str(built)], capture_output=True, text=True)
    assert "cuModuleLoadData" in undefined.stdout  # resolved from the real driver at load time
