#!/usr/bin/env bash
# Installs raytrain-sys into ./.venv (created if missing). `install.sh dev` adds the test tools.
# Safe to re-run: pip only checks what is already there.
set -euo pipefail
cd "$(dirname "$0")/.."

extra=""
if [ "${1:-}" = "dev" ]; then extra="[dev]"; fi
# The service store's tests start a real PostgreSQL server (initdb, pg_ctl) of their own.
if [ -n "$extra" ] && ! command -v initdb >/dev/null && ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then
    if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null; then
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null
    else
        echo "warning: PostgreSQL's initdb not found; install postgresql for tests/test_service_store.py" >&2
    fi
fi
# The observability tests run a real Prometheus and load the jobs page in headless Chromium; the
# GCS restart test keeps the cluster's tables in a real Redis (Ray's GCS fault tolerance).
want=()
if [ -n "$extra" ]; then
    command -v prometheus >/dev/null || want+=(prometheus)
    command -v chromium >/dev/null || want+=(chromium)
    command -v redis-server >/dev/null || want+=(redis-server)
fi
if [ "${#want[@]}" -gt 0 ]; then
    if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null; then
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${want[@]}" >/dev/null
    else
        echo "warning: ${want[*]} not found; the Prometheus, jobs-page or GCS restart tests will be skipped" >&2
    fi
fi
if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
quiet=(-q --disable-pip-version-check)
# torch first and pinned: 2.13.0 resolves to the CPU wheel on these machines, while an open range
# (or a bare `torch` pulled in by another package) would download a multi-GB CUDA build.
pip install "${quiet[@]}" torch==2.13.0 2>&1 | grep -v "WARNING: Location" || true
pip install "${quiet[@]}" -e ".${extra}" 2>&1 | grep -v "WARNING: Location" || true
python -c "import torch, ray, mlflow, pyarrow; print('installed: torch', torch.__version__, '| ray', ray.__version__, '| mlflow', mlflow.__version__, '| pyarrow', pyarrow.__version__)"
