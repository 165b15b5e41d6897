"""The jobs' live numbers for the jobs page: from their runners while they run, else summary.json.

Owns: where ``GET /v1/progress`` finds the progress of the jobs it lists
(``monitor.report.progress``: recent losses, throughput, per-rank step times, cost), as
``model.JobProgress``. Reads only, never the store: the API hands it the job records it may show
(its team's, or all for the admin).

* The jobs with a live runner (starting, running, pausing, cancelling, resuming) have their
  runners asked all at once (``JobRunner.progress``, answered from the Supervisor's summary in
  memory) and waited for together, within one bound from the poll's start, finding the runners
  included (``RUNNER_ANSWER_S``): a busy or lost runner costs a poll that bound once, however many
  jobs run (each asked in turn with its own timeout, ten jobs on two busy cores took 20 s). A
  job whose runner did not answer in time is listed with its last answer and ``answering``
  false; its question stays out, and a later poll takes its answer instead of asking again (at
  most one question in flight a runner, however long it is busy).
* A runner is found by the service's own handle to it (``runner_of``: the reconciler's, no Ray
  call), else the handle found at an earlier poll, else by name (``names.find_runners``).
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
import time
from typing import Any, Callable, Optional

import ray

from raytrain_sys.control.run_record import SUMMARY_FILE
from raytrain_sys.monitor.report import progress
from raytrain_sys.service.model import JobProgress, JobRecord, JobState
from raytrain_sys.service.names import find_runners

log = logging.getLogger(__name__)

# A runner answers from memory in milliseconds; longer means busy or lost. One bound for all the
# runners of a poll, from its start: the page's poll answers within it and the API's own work.
RUNNER_ANSWER_S = 2.0
LIVE_STATES = frozenset({JobState.STARTING, JobState.RUNNING, JobState.PAUSING, JobState.CANCELLING,
                         JobState.RESUMING})


class ProgressSource:
    """Callable ``(jobs) -> {job id: JobProgress}`` for every job given; keeps each job's newest
    answer and the question still out to a runner that has not answered. Polls may overlap (one
    API thread each): they share the questions out."""

    def __init__(self, runner_of: Optional[Callable[[int], Any]] = None, answer_s: float = RUNNER_ANSWER_S):
        self.runner_of = runner_of or (lambda job_id: None)
        self.answer_s = answer_s
        self._lock = threading.Lock()
        self._live: dict[int, tuple[dict, float]] = {}  # the runner's newest answer, and when (unix s)
        self._final: dict[int, dict] = {}  # a job not running: its summary.json's, read once
        self._handles: dict[int, Any] = {}  # runners found by name, kept while they answer
        self._asked: dict[int, Any] = {}  # job id -> the question out to its runner, not answered yet

    def __call__(self, jobs: list[JobRecord]) -> dict[int, JobProgress]:
        deadline = time.monotonic() + self.answer_s
        live = {job.id for job in jobs if job.state in LIVE_STATES}
        with self._lock:
            for job in jobs:
                if job.id in live:
                    self._final.pop(job.id, None)  # running again (resumed): its summary will change
                else:  # no runner to ask any more
                    self._handles.pop(job.id, None)
                    self._asked.pop(job.id, None)
        answered = self._ask(sorted(live), deadline)
        return {job.id: (self._newest(job.id, job.id in answered) if job.id in live else self._ended(job))
                for job in jobs}

    def _ask(self, job_ids: list[int], deadline: float) -> set[int]:
        """Ask the runners of ``job_ids`` (a question already out is not asked again) and wait
        for their answers until ``deadline``; the jobs whose runners answered."""
        with self._lock:
            asked = {j: self._asked[j] for j in job_ids if j in self._asked}
            handles = {j: h for j in job_ids if j not in asked
                       and (h := self.runner_of(j) or self._handles.get(j)) is not None}
        unknown = [j for j in job_ids if j not in asked and j not in handles]
        if unknown:  # each by its name (milliseconds), the spare runners once for the rest
            found = find_runners(unknown, spare_wait_s=max(0.0, min(1.0, deadline - time.monotonic()) / 2))
            handles.update(found)
        for job_id, handle in handles.items():
            asked[job_id] = handle.progress.remote()
        with self._lock:
            self._handles.update((j, h) for j, h in handles.items())
            self._asked.update((j, asked[j]) for j in handles)
        if not asked:
            return set()
        ready, _ = ray.wait(list(asked.values()), num_returns=len(asked),
                            timeout=max(0.0, deadline - time.monotonic()))
        ready, answered = set(ready), set()
        for job_id, ref in asked.items():
            if ref not in ready:
                continue  # still busy: its question stays out for the next poll
            try:
                answer = ray.get(ref)  # ready: no wait
            except Exception as exc:  # noqa: BLE001: lost or failing; the reconciler handles a lost runner
                log.debug("job %d: no progress from its runner (%s)", job_id, str(exc).splitlines()[0])
                answer = exc
            with self._lock:
                if self._asked.get(job_id) is ref:
                    del self._asked[job_id]
                if isinstance(answer, Exception):
                    self._handles.pop(job_id, None)  # found again (by name) at the next poll
                    continue
                if answer is not None:
                    self._live[job_id] = (answer, time.time())
            answered.add(job_id)
        return answered

    def _newest(self, job_id: int, answering: bool) -> JobProgress:
        with self._lock:
            numbers, at_s = self._live.get(job_id, (None, None))
        return JobProgress(numbers, answering, at_s)

    def _ended(self, job: JobRecord) -> JobProgress:
        with self._lock:
            final = self._final.get(job.id)
        if final is None and job.mlflow_run_id:
            final = summary_progress(job)
            if final is not None:
                with self._lock:
                    self._final[job.id] = final
        if final is None:
            return self._newest(job.id, None)
        return JobProgress(final)


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
