#!/usr/bin/env bash
# Runs the test suite. FAST=1 deselects the slow multi-node / end-to-end tests.
set -euo pipefail
cd "$(dirname "$0")/.."
args=(-q -p no:cacheprovider --durations=15)
if [ "${FAST:-0}" = "1" ]; then args+=(-m "not slow"); fi
exec python -m pytest "${args[@]}" "$@"
