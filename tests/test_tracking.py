"""The MLflow run record: what a user sees in MLflow and what `resume` reads back.

Every test runs against a real store: a SQLite file in tmp_path and, where the behaviour could
differ over HTTP (artifact proxying, REST error codes), a real `mlflow server`.
"""

from __future__ import annotations

import os
import socket
import threading
import time
import uuid

import pytest
from mlflow import MlflowClient

from raytrain_sys.errors import TrackingError
from tests.fixtures.mlflow_server import running_mlflow_server
from raytrain_sys.spec import JobSpec, from_dict
from raytrain_sys.tracking.mlflow_store import TRUNCATION_MARKER, check_reachable
from raytrain_sys.tracking.mlflow_tracker import (
    CHECKPOINT_STEP_METRIC,
    PLOTS_EVERY_S,
    TAG_CHECKPOINT_ROOT,
    TAG_GIT_COMMIT,
    TAG_LATEST_CHECKPOINT,
    TAG_RESUME_COUNT,
    TAG_RUN_DIR,
    TAG_SPEC_HASH,
    TAG_STATE,
    TAG_TRAINING_HASH,
    Tracker,
    default_tracking_uri,
    resume_override_tag,
)


@pytest.fixture(scope="module")
def sqlite_uri(tmp_path_factory) -> str:
    # One database for the module: creating one runs MLflow's migrations (about 5 s here).
    # Each test uses its own experiment.
    return default_tracking_uri(str(tmp_path_factory.mktemp("sqlite-store") / "out"))


@pytest.fixture(params=["sqlite", "server"])
def tracking_uri(request, tmp_path, monkeypatch) -> str:
    # Run from an empty directory so that a stray ./mlruns would be noticed.
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    if request.param == "server":
        return request.getfixturevalue("mlflow_server")
    return request.getfixturevalue("sqlite_uri")


def _experiment() -> str:
    return f"test-{uuid.uuid4().hex[:8]}"  # the server is shared by the whole session


def _start(uri: str, experiment: str, spec: JobSpec, tmp_path) -> Tracker:
    return Tracker.start(
        uri, experiment, "unit", spec,
        tags={TAG_GIT_COMMIT: "abc123", TAG_CHECKPOINT_ROOT: str(tmp_path / "ckpt")},
        artifact_root=str(tmp_path / "out" / "mlartifacts"),
    )


def _runs(uri: str, experiment: str) -> list:
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(experiment)
    return list(client.search_runs([exp.experiment_id]))


def test_run_record_shows_params_metrics_tags_and_checkpoints(tracking_uri, tmp_path):
    spec = JobSpec()
    experiment = _experiment()
    tracker = _start(tracking_uri, experiment, spec, tmp_path)
    tracker.set_tags({TAG_RUN_DIR: str(tmp_path / "run")})
    for step in (1, 2, 3):
        tracker.log_metrics(step, {"loss": 4.0 / step, "tokens_per_s": 1000.0 + step})
    tracker.record_checkpoint(2, "file:///ckpt/step-2", {"world_size": 2})
    tracker.log_event(2, "resizing", "worker 1 died")
    tracker.record_checkpoint(3, "file:///ckpt/step-3", {"world_size": 1})
    tracker.finish("FINISHED")
    assert tracker.dropped_batches == 0

    [run] = _runs(tracking_uri, experiment)
    assert run.info.run_id == tracker.run_id
    assert run.info.status == "FINISHED"
    assert run.data.params["train.global_batch_size"] == "32"
    assert run.data.params["model.n_layer"] == "4"
    assert run.data.tags[TAG_GIT_COMMIT] == "abc123"
    assert run.data.tags[TAG_SPEC_HASH] == spec.spec_hash()
    assert run.data.tags[TAG_TRAINING_HASH] == spec.training_hash()
    assert run.data.tags[TAG_STATE] == "resizing"
    history = MlflowClient(tracking_uri).get_metric_history(run.info.run_id, "loss")
    assert [(m.step, m.value) for m in history] == [(1, 4.0), (2, 2.0), (3, 4.0 / 3)]
    ckpt_history = MlflowClient(tracking_uri).get_metric_history(run.info.run_id,
                                                                 CHECKPOINT_STEP_METRIC)
    assert sorted(m.step for m in ckpt_history) == [2, 3]

    record = Tracker.lookup(tracking_uri, tracker.run_id)
    assert record.status == "FINISHED"
    assert from_dict(record.spec_dict) == spec
    assert [(c["step"], c["uri"], c["world_size"]) for c in record.checkpoint_records] == [
        (2, "file:///ckpt/step-2", 2), (3, "file:///ckpt/step-3", 1),
    ]
    assert record.latest_checkpoint_uri == "file:///ckpt/step-3"
    assert record.run_dir == str(tmp_path / "run")
    assert record.tags[TAG_LATEST_CHECKPOINT] == "file:///ckpt/step-3"
    assert [(e["step"], e["state"], e["reason"]) for e in record.events] == [
        (2, "resizing", "worker 1 died"),
    ]
    assert not (tmp_path / "cwd" / "mlruns").exists()


def test_resume_reopens_the_same_run_and_records_overrides(tracking_uri, tmp_path):
    experiment = _experiment()
    spec = JobSpec()
    first = _start(tracking_uri, experiment, spec, tmp_path)
    first.log_metrics(1, {"loss": 3.0})
    first.record_checkpoint(100, "file:///ckpt/step-100", {})
    first.log_event(100, "failed", "node lost")
    first.finish("FAILED")

    raised = from_dict({"train": {"max_steps": 600}})
    resumed = Tracker.resume(tracking_uri, first.run_id, raised)
    assert resumed.run_id == first.run_id
    [run] = _runs(tracking_uri, experiment)  # no second run
    assert run.info.status == "RUNNING"
    assert run.data.params["train.max_steps"] == "300"  # a param is never re-logged
    assert run.data.tags[resume_override_tag(1, "train.max_steps")] == "600"
    assert run.data.tags[TAG_RESUME_COUNT] == "1"
    assert run.data.tags[TAG_GIT_COMMIT] == "abc123"

    resumed.log_metrics(101, {"loss": 2.5})
    resumed.record_checkpoint(200, "file:///ckpt/step-200", {})
    resumed.finish("FINISHED")

    record = Tracker.lookup(tracking_uri, first.run_id)
    assert record.status == "FINISHED"
    assert record.spec_dict["train"]["max_steps"] == 600
    assert from_dict(record.spec_dict) == raised
    assert record.original_spec_dict["train"]["max_steps"] == 300
    assert [c["step"] for c in record.checkpoint_records] == [100, 200]  # earlier ones kept
    assert record.latest_checkpoint_uri == "file:///ckpt/step-200"
    assert [e["state"] for e in record.events] == ["failed"]
    history = MlflowClient(tracking_uri).get_metric_history(first.run_id, "loss")
    assert [m.step for m in history] == [1, 101]

    # A second resume with the same spec counts up and overrides again against the first params.
    Tracker.resume(tracking_uri, first.run_id, raised).finish("FINISHED")
    tags = Tracker.lookup(tracking_uri, first.run_id).tags
    assert tags[TAG_RESUME_COUNT] == "2"
    assert tags[resume_override_tag(2, "train.max_steps")] == "600"
    assert len(_runs(tracking_uri, experiment)) == 1


def test_lookup_of_unknown_run_names_the_store(tracking_uri, tmp_path):
    _start(tracking_uri, _experiment(), JobSpec(), tmp_path).finish("FINISHED")
    missing = uuid.uuid4().hex
    with pytest.raises(TrackingError, match=f"no MLflow run {missing} in .*check --tracking-uri"):
        Tracker.lookup(tracking_uri, missing)
    with pytest.raises(TrackingError, match="no MLflow run"):
        Tracker.resume(tracking_uri, missing, JobSpec())


def test_long_param_is_truncated_but_the_spec_is_kept_whole(sqlite_uri, tmp_path):
    uri = sqlite_uri
    spec = from_dict({"data": {"path": "d/" + "x" * 7000}})
    tracker = _start(uri, _experiment(), spec, tmp_path)
    tracker.finish("FINISHED")
    param = MlflowClient(uri).get_run(tracker.run_id).data.params["data.path"]
    assert param.endswith(TRUNCATION_MARKER) and len(param) <= 6000
    assert from_dict(Tracker.lookup(uri, tracker.run_id).spec_dict) == spec


def test_a_rejected_metric_is_dropped_and_counted_not_raised(sqlite_uri, tmp_path):
    uri = sqlite_uri
    tracker = _start(uri, _experiment(), JobSpec(), tmp_path)
    tracker.log_metrics(1, {"bad name!": 1.0})  # MLflow refuses the key: a permanent error
    assert tracker.flush(timeout_s=30)
    tracker.log_metrics(2, {"loss": 1.0})
    tracker.finish("FINISHED")
    assert tracker.dropped_batches == 1
    history = MlflowClient(uri).get_metric_history(tracker.run_id, "loss")
    assert [m.step for m in history] == [2]


def test_plots_are_redrawn_while_training_at_most_every_interval_and_always_at_the_end(sqlite_uri, tmp_path):
    """A checkpoint asks ``plots_due`` before it hands over a snapshot: the first is due, then
    none within PLOTS_EVERY_S of the last redraw while training; the end draws whatever it was
    asked, so a short run's plots are in MLflow once it finished."""
    tracker = _start(sqlite_uri, _experiment(), JobSpec(), tmp_path)
    assert tracker.plots_due()  # the first checkpoint's
    tracker.log_plots({"losses": [2.0]}, at_end=False)
    now = time.monotonic()
    assert not tracker.plots_due() and not tracker.plots_due(now + PLOTS_EVERY_S - 1.0)
    assert tracker.plots_due(now + PLOTS_EVERY_S + 0.01)
    tracker.log_plots({"losses": [2.0, 1.5]}, at_end=False)  # a checkpoint's redraw restarts the wait
    assert not tracker.plots_due(now + PLOTS_EVERY_S - 0.5)
    assert tracker.plots_due(time.monotonic() + PLOTS_EVERY_S + 0.01)
    tracker.log_plots({"losses": [2.0, 1.5, 1.2]})  # the end: always drawn
    tracker.finish("FINISHED")
    client = MlflowClient(sqlite_uri)
    assert [os.path.basename(a.path) for a in client.list_artifacts(tracker.run_id, "plots")] == ["loss.png"]


def test_trackers_in_several_threads_keep_their_own_runs(sqlite_uri, tmp_path):
    uri = sqlite_uri
    experiment = _experiment()
    trackers = [_start(uri, experiment, JobSpec(), tmp_path) for _ in range(2)]

    def train(tracker: Tracker, offset: float) -> None:
        for step in range(20):
            tracker.log_metrics(step, {"loss": offset + step})
        tracker.finish("FINISHED")

    threads = [threading.Thread(target=train, args=(t, 100.0 * i)) for i, t in enumerate(trackers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    client = MlflowClient(uri)
    for i, tracker in enumerate(trackers):
        history = client.get_metric_history(tracker.run_id, "loss")
        assert sorted(m.value for m in history) == [100.0 * i + s for s in range(20)]
        assert tracker.dropped_batches == 0
    assert len(_runs(uri, experiment)) == 2


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_server_fails_fast_with_a_clear_error():
    uri = f"http://127.0.0.1:{_closed_port()}"
    started = time.monotonic()
    with pytest.raises(TrackingError, match="cannot reach MLflow server .*tracking-uri"):
        check_reachable(uri)
    with pytest.raises(TrackingError, match="cannot reach MLflow server"):
        Tracker.start(uri, "e", "r", JobSpec(), tags={})
    assert time.monotonic() - started < 12


def test_silent_server_times_out_within_the_bound():
    # Accepts TCP connections (the kernel's backlog) but never answers a request.
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        uri = f"http://127.0.0.1:{listener.getsockname()[1]}"
        started = time.monotonic()
        with pytest.raises(TrackingError, match="did not answer within 1 s"):
            check_reachable(uri, timeout_s=1.0)
        assert time.monotonic() - started < 3


def test_sqlite_store_directory_is_created_or_reported(tmp_path):
    check_reachable(default_tracking_uri(str(tmp_path / "new" / "dir")))
    assert (tmp_path / "new" / "dir").is_dir()
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(TrackingError, match="cannot create the MLflow database directory"):
        check_reachable(default_tracking_uri(str(blocker / "sub")))


# One process of the race below: imports done, it waits at the gate, then opens a run.
OPEN_AT_THE_GATE = """
import os, sys, time
import mlflow.store.tracking.sqlalchemy_store
from raytrain_sys.spec import JobSpec
from raytrain_sys.tracking.mlflow_tracker import Tracker
uri, gate, me = sys.argv[1:4]
open(os.path.join(gate, "ready-" + me), "w").close()
while not os.path.exists(os.path.join(gate, "go")):
    time.sleep(0.001)
print(Tracker.start(uri, "together", "run-" + me, JobSpec(), tags={}).run_id)
"""


def test_runs_opened_at_the_same_moment_on_a_new_sqlite_store_all_open(tmp_path):
    """Three processes open a run on one new SQLite store at the same moment (the jobs of a
    fresh service starting together): each gets its run. Without the store made once under a
    lock, MLflow's migrations ran in all three and two failed ("duplicate column name", "table
    ... already exists"), seen in every one of several tries."""
    import subprocess
    import sys

    uri = default_tracking_uri(str(tmp_path / "runs"))
    procs = [subprocess.Popen([sys.executable, "-c", OPEN_AT_THE_GATE, uri, str(tmp_path), str(i)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(3)]
    try:
        deadline = time.monotonic() + 120
        while not all((tmp_path / f"ready-{i}").exists() for i in range(3)):
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "a process did not get ready"
            time.sleep(0.05)
        (tmp_path / "go").touch()
        outcomes = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            p.kill()
    failed = [next((line for line in reversed(err.splitlines()) if "Error" in line), err[-300:])
              for p, (_, err) in zip(procs, outcomes) if p.returncode != 0]
    assert not failed, failed
    run_ids = {out.strip() for out, _ in outcomes}
    assert len(run_ids) == 3 and {r.info.run_id for r in _runs(uri, "together")} == run_ids


@pytest.mark.slow
def test_training_continues_when_the_server_dies_mid_run(tmp_path_factory):
    with running_mlflow_server(tmp_path_factory.mktemp("dying-mlflow")) as server:
        tracker = _start(server.uri, _experiment(), JobSpec(), tmp_path_factory.mktemp("x"))
        tracker.log_metrics(0, {"loss": 1.0})
        assert tracker.flush(timeout_s=30)
        server.stop()

        started = time.monotonic()
        for step in range(1, 200):
            tracker.log_metrics(step, {"loss": 1.0 / step})
        tracker.record_checkpoint(100, "file:///ckpt/step-100", {})
        tracker.log_event(100, "running", "still training")
        assert time.monotonic() - started < 1.0  # the training loop never waits on MLflow

        started = time.monotonic()
        tracker.finish("FINISHED")  # warns, does not raise, does not wait out the retries
        assert time.monotonic() - started < 15
        assert tracker.dropped_batches >= 1


def test_a_run_begun_in_its_writer_keeps_what_was_logged_before_it_existed(sqlite_uri, tmp_path):
    """Tracker.begin returns before the run exists (the Supervisor trains meanwhile): what is
    logged at once waits behind the opening and lands in the run, in order, with its params."""
    experiment, seen = _experiment(), []
    spec = JobSpec()
    tracker = Tracker.begin(sqlite_uri, experiment, "begun", spec, tags={TAG_GIT_COMMIT: "abc123"},
                            artifact_root=str(tmp_path / "mlartifacts"), on_open=lambda t: seen.append(t.run_id))
    tracker.log_metrics(1, {"loss": 2.0})
    tracker.log_event(1, "running", "training before the run is open")
    assert tracker.opened(timeout_s=60)
    assert tracker.run_id and seen == [tracker.run_id]
    assert tracker.open_span is not None and tracker.open_span[0] <= tracker.open_span[1]
    tracker.finish("FINISHED")
    run = MlflowClient(sqlite_uri).get_run(tracker.run_id)
    assert run.info.status == "FINISHED" and run.data.metrics["loss"] == 2.0
    assert run.data.tags[TAG_STATE] == "running" and run.data.tags[TAG_GIT_COMMIT] == "abc123"
    assert run.data.params["train.max_steps"] == str(spec.train.max_steps)
    assert tracker.dropped_batches == 0


def test_a_run_that_cannot_open_in_its_writer_is_raised_to_the_caller_and_drops_its_writes(sqlite_uri):
    """A begun run whose opening fails (here its experiment is deleted): check_open and opened
    raise the opening's clear TrackingError in the caller's thread; what was logged is dropped
    without a warning each, and finish has no run to mark."""
    experiment = _experiment()
    client = MlflowClient(sqlite_uri)
    client.delete_experiment(client.create_experiment(experiment))
    tracker = Tracker.begin(sqlite_uri, experiment, "never", JobSpec(), tags={})
    tracker.log_metrics(1, {"loss": 2.0})
    with pytest.raises(TrackingError, match=f"experiment '{experiment}' .* is deleted: restore it"):
        tracker.opened(timeout_s=60)
    with pytest.raises(TrackingError, match="is deleted"):
        tracker.check_open()
    tracker.log_metrics(2, {"loss": 1.0})
    assert tracker.run_id == "" and tracker.dropped_batches >= 2
    tracker.finish("FINISHED")  # nothing to mark, no error
