"""A job's live numbers for the jobs page: from its runner while it runs, else its summary.json.

Owns: where ``GET /v1/progress`` finds a job's progress (``monitor.report.progress``: recent
losses, throughput, per-rank step times, cost). Reads only, never the store: the API hands it
the job records it may show (its team's, or all for the admin).

* A job with a live runner (starting, running, pausing, cancelling, resuming) is asked
  (``JobRunner.progress``, answered from the Supervisor's summary in memory) with a short
  timeout: a busy or lost runner makes the page show the last answer, never hang the API.
* Otherwise (paused, ended) the job's summary.json, read once: the run dir under the spec's
  ``output_dir`` whose summary names the job's MLflow run (its final numbers, which the
  runner's last answer may have missed); the runner's last answer when there is none.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import threading
from typing import Optional

import ray

from raytrain_sys.control.run_record import SUMMARY_FILE
from raytrain_sys.monitor.report import progress
from raytrain_sys.service.model import JobRecord, JobState
from raytrain_sys.service.runner import find_runner

log = logging.getLogger(__name__)

RUNNER_ANSWER_S = 2.0  # a runner answers from memory in milliseconds; longer means busy or lost
LIVE_STATES = frozenset({JobState.STARTING, JobState.RUNNING, JobState.PAUSING, JobState.CANCELLING,
                         JobState.RESUMING})


class ProgressSource:
    """Callable ``(job) -> progress dict or None``; keeps each job's newest answer."""

    def __init__(self):
        self._lock = threading.Lock()
        self._live: dict[int, dict] = {}  # the runner's newest answer
        self._final: dict[int, dict] = {}  # a job not running: its summary.json's, read once

    def __call__(self, job: JobRecord) -> Optional[dict]:
        if job.state in LIVE_STATES:
            answer = self._ask_runner(job.id)
            with self._lock:
                self._final.pop(job.id, None)  # running again (resumed): its summary will change
                if answer is not None:
                    self._live[job.id] = answer
                return self._live.get(job.id)
        with self._lock:
            final = self._final.get(job.id)
        if final is None and job.mlflow_run_id:
            final = summary_progress(job)
            if final is not None:
                with self._lock:
                    self._final[job.id] = final
        if final is None:
            with self._lock:
                return self._live.get(job.id)
        return final

    @staticmethod
    def _ask_runner(job_id: int) -> Optional[dict]:
        runner = find_runner(job_id)
        if runner is None:
            return None
        try:
            return ray.get(runner.progress.remote(), timeout=RUNNER_ANSWER_S)
        except Exception as exc:  # noqa: BLE001: the page shows the last answer; the reconciler handles a lost runner
            log.debug("job %d: no progress from its runner (%s)", job_id, str(exc).splitlines()[0])
            return None


def summary_progress(job: JobRecord) -> Optional[dict]:
    """The job's progress from the newest summary.json under its spec's output_dir that names
    its MLflow run; None when there is none."""
    spec = json.loads(job.spec)
    output_dir = spec.get("output_dir") or ""
    found = []
    for path in glob.glob(os.path.join(output_dir, "*", SUMMARY_FILE)):
        try:
            with open(path) as f:
                summary = json.load(f)
        except (OSError, ValueError):
            continue
        if summary.get("mlflow_run_id") == job.mlflow_run_id:
            found.append((os.path.getmtime(path), summary))
    if not found:
        return None
    summary = max(found, key=lambda f: f[0])[1]
    return progress(summary, int((spec.get("train") or {}).get("max_steps", 0)))
