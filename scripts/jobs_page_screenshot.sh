#!/usr/bin/env bash
# Refresh docs/img/jobs_page.png: the jobs page of a real service with a job held mid-run,
# as tests/test_jobs_page.py sees it in headless Chromium (needs the Debian chromium package
# and a Python env with raytrain-sys installed; about two minutes).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p docs/img
JOBS_PAGE_SCREENSHOT="$PWD/docs/img/jobs_page.png" PYTHONPATH="$PWD" \
    python -m pytest -q -p no:cacheprovider tests/test_jobs_page.py
echo "wrote docs/img/jobs_page.png"
