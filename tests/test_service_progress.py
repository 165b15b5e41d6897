"""``GET /v1/progress`` (the jobs page's poll) with runners that answer, runners that stop
answering and a runner that died, on the session cluster: stand-in runners (named as a job's
runner is, answering ``progress()`` as one does) and the real API with its ``ProgressSource``.

What a user would notice: the page's poll answers within one bound however many runners are
silent (it used to wait 2 s for each in turn), lists every job, shows a silent or lost runner's
job with its last numbers and says it is not answering, and asks a busy runner no more questions
while one is out."""

from __future__ import annotations

import time

import pytest
import ray

from raytrain_sys.control.spares import NAMESPACE
from raytrain_sys.service import requests as user_requests
from raytrain_sys.service.api import serve
from raytrain_sys.service.client import Client
from raytrain_sys.service.model import JobState
from raytrain_sys.service.teams import Team
from raytrain_sys.service.names import runner_name
from raytrain_sys.service.progress import RUNNER_ANSWER_S, ProgressSource
from raytrain_sys.service.store import Store

SILENT = 3  # runners that answer once, then never in time: asked in turn, each cost the poll 2 s


@ray.remote(num_cpus=0, max_concurrency=4)
class StandInRunner:
    """Answers ``progress()`` as a job's runner does (from memory, at once) ``answers`` times,
    then never in time (a runner busy or stuck); counts the questions it was asked."""

    def __init__(self, numbers: dict, answers: int):
        self.numbers, self.answers, self.asked = numbers, answers, 0

    def progress(self) -> dict:
        self.asked += 1
        if self.asked > self.answers:
            time.sleep(600)
        return self.numbers

    def questions(self) -> int:
        return self.asked


def numbers(step: int) -> dict:
    return {"status": "running", "step": step, "max_steps": 100, "world_size": 2, "losses": [[step, 2.5]]}


@pytest.fixture()
def store(tmp_path):
    store = Store.open(f"sqlite:///{tmp_path}/svc.db")
    yield store
    store.close()


def test_silent_and_lost_runners_cost_a_poll_one_bound_and_their_jobs_stay_listed(ray_cluster, store, tmp_path):
    store.add_team(Team("a", 8))
    token = store.issue_token("a")
    spec = {"name": "j", "train": {"max_steps": 100}}
    jobs = [user_requests.submit(store, team="a", spec=spec, by="a").id for _ in range(SILENT + 3)]
    for job in jobs[:-1]:  # the last stays queued: no runner to ask
        for state in (JobState.STARTING, JobState.RUNNING):
            store.transition(job, store.job(job).state, state, actor="reconciler", reason=f"test: {state.value}")
    answering, lost, silent, queued = jobs[0], jobs[1], jobs[2:-1], jobs[-1]
    runners = {job: StandInRunner.options(name=runner_name(job), namespace=NAMESPACE).remote(
        numbers(job), 1 if job in silent else 10**6) for job in jobs[:-1]}
    try:
        ray.get([r.questions.remote() for r in runners.values()])  # every stand-in up
        with serve(store, "127.0.0.1", 0, log_dir=tmp_path / "logs", progress=ProgressSource()) as handle:
            client = Client(handle.url, token)
            first = {item["job"]["id"]: item for item in client.progress()}
            assert {j: (first[j]["answering"], first[j]["progress"]) for j in jobs} == \
                {**{j: (True, numbers(j)) for j in jobs[:-1]}, queued: (None, None)}
            ray.kill(runners[lost], no_restart=True)

            for _ in range(2):  # the silent runners' questions stay out, asked once
                t0 = time.monotonic()
                items = client.progress()
                took = time.monotonic() - t0
                # One bound for all the silent runners, not one each (before: SILENT x 2 s).
                assert took < 2 * RUNNER_ANSWER_S, f"the poll took {took:.2f} s"
                shown = {item["job"]["id"]: item for item in items}
                assert sorted(shown) == jobs  # none missing
                assert shown[answering]["answering"] is True and shown[queued]["answering"] is None
                for job in [lost, *silent]:  # their last numbers, said to be old
                    assert (shown[job]["answering"], shown[job]["progress"]) == (False, numbers(job))
                    assert shown[job]["progress_at_s"] == first[job]["progress_at_s"]
                assert shown[answering]["progress_at_s"] > first[answering]["progress_at_s"]
            assert ray.get([runners[job].questions.remote() for job in silent]) == [2] * SILENT
    finally:
        for runner in runners.values():
            ray.kill(runner, no_restart=True)
