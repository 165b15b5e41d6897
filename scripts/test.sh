#!/usr/bin/env bash
# Installs (into ./.venv, if needed) and runs the test suite.
#   FAST=1          deselect the slow multi-node chaos / long end-to-end tests (marked in their
#                   files, or listed in tests/long_tests.txt): under 10 min on 2 cores
#   SKIP_INSTALL=1  use the active Python environment as it is
# Extra arguments go to pytest, e.g. `bash scripts/test.sh tests/test_order.py -x`.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${SKIP_INSTALL:-0}" != "1" ]; then
    bash scripts/install.sh dev
    # shellcheck disable=SC1091
    . .venv/bin/activate
fi
args=(-q -p no:cacheprovider --durations=40)
if [ "${FAST:-0}" = "1" ]; then args+=(-m "not slow"); fi
if [ "$#" -eq 0 ]; then args+=(tests notebooks --nbmake); fi
exec python -m pytest "${args[@]}" "$@"
