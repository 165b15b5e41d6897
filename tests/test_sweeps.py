"""Sweeps without a cluster: the sweep spec refuses bad input naming the field before any trial
starts; a valid one round-trips through the store's JSON and sets each trial's fields; the
sweep record's guarded lifecycle and the (sweep, trial) pair that makes a re-driven trial find
its job, on SQLite and PostgreSQL."""

from __future__ import annotations

import copy
import json

import pytest

from raytrain_sys.errors import JobStateConflict, ServiceInputError
from raytrain_sys.service.model import JobState, SweepState, Team, TransitionNotAllowed
from raytrain_sys.service.store import Store
from raytrain_sys.sweeps.spec import parse_sweep, sweep_from_dict, trial_spec, tune_space

BASE = {"name": "tiny", "data": {"path": "/data/tiny"},
        "model": {"block_size": 32, "n_layer": 1, "n_head": 2, "n_embd": 32},
        "train": {"max_steps": 20, "global_batch_size": 8},
        "eval": {"every_steps": 5, "max_rows": 16},
        "checkpoint": {"every_steps": 5},
        "resources": {"num_workers": 1}, "elastic": {"min_workers": 1, "max_workers": 2}}
SWEEP = {"name": "lr-wd", "base": BASE, "metric": "eval_loss", "mode": "min", "num_samples": 3,
         "space": {"optim.lr": {"loguniform": [1e-4, 1e-2]}, "optim.weight_decay": {"grid": [0.0, 0.1]}}}


def with_(**changes) -> dict:
    raw = copy.deepcopy(SWEEP)
    for key, value in changes.items():
        if value is None:
            raw.pop(key, None)
        else:
            raw[key] = value
    return raw


def base_with(section: str, **fields) -> dict:
    base = copy.deepcopy(BASE)
    base.setdefault(section, {}).update(fields)
    return base


REFUSALS = [
    ("a field the job spec does not have", with_(space={"optim.lrr": {"uniform": [0.1, 0.2]}}),
     "space.optim.lrr", "did you mean 'lr'"),
    ("an empty range", with_(space={"optim.lr": {"uniform": [0.2, 0.2]}}), "space.optim.lr.uniform",
     "empty range"),
    ("a log-uniform range reaching 0", with_(space={"optim.lr": {"loguniform": [0, 0.1]}}),
     "space.optim.lr.loguniform", "above 0"),
    ("an empty choice", with_(space={"optim.lr": {"choice": []}}), "space.optim.lr.choice", "non-empty"),
    ("an unknown domain", with_(space={"optim.lr": {"normal": [0, 1]}}), "space.optim.lr", "loguniform"),
    ("a value the job spec refuses", with_(space={"model.n_head": {"choice": [2, 3]}}), "space.model.n_head",
     "value 3"),
    ("a field the service sets for each trial", with_(space={"output_dir": {"choice": ["a", "b"]}}),
     "space.output_dir", "the service sets it"),
    ("a metric the trials never report", with_(metric="val_accuracy"), "metric", "eval_loss"),
    ("a metric with no evaluation in the base", with_(base=base_with("eval", every_steps=0)), "metric",
     "base.eval.every_steps is 0"),
    ("a mode that is neither min nor max", with_(mode="lowest"), "mode", "min or max"),
    ("an unknown sweep field", with_(samples=3), "samples", "unknown sweep field"),
    ("no space", with_(space=None), "space", "missing"),
    ("an unknown scheduler", with_(scheduler="hyperband"), "scheduler", "asha, fifo, pbt"),
    ("a field of another scheduler", with_(scheduler={"type": "asha", "quantile_fraction": 0.2}),
     "scheduler.quantile_fraction", "not a field of the asha scheduler"),
    ("PBT with a base that never checkpoints", with_(scheduler="pbt", base=base_with("checkpoint", every_steps=0)),
     "base.checkpoint.every_steps", "committed checkpoint"),
    ("PBT's interval between checkpoints", with_(scheduler={"type": "pbt", "perturbation_interval_steps": 7}),
     "scheduler.perturbation_interval_steps", "multiple of base.checkpoint.every_steps"),
    ("a worker cap below one trial", with_(max_workers=0), "max_workers", "one trial's size"),
    ("a base spec field out of range", with_(base=base_with("train", max_steps=-1)), "base.train.max_steps", ""),
    ("zero samples", with_(num_samples=0), "num_samples", "1..1000"),
    ("more trials than a sweep holds", with_(num_samples=600), "num_samples", "1200 trials"),
]


@pytest.mark.parametrize("raw, field, words", [r[1:] for r in REFUSALS], ids=[r[0] for r in REFUSALS])
def test_a_bad_sweep_is_refused_naming_its_field(raw, field, words):
    with pytest.raises(ServiceInputError) as caught:
        parse_sweep(raw, base_dir="/tmp")
    assert caught.value.field == field, caught.value
    assert words in caught.value.message, caught.value


def test_a_sweep_round_trips_and_sets_each_trials_fields():
    sweep = parse_sweep(SWEEP, base_dir="/tmp")
    assert sweep.trial_count == 6  # 3 samples x 2 grid values
    assert sweep.scheduler.type == "asha" and sweep.scheduler.grace_period_steps == 5  # the first evaluation
    again = sweep_from_dict(json.loads(json.dumps(sweep.to_dict())))
    assert again == sweep
    spec = trial_spec(sweep, {"optim.lr": 0.004, "optim.weight_decay": 0.1, "trial_id": "x"})
    assert spec["optim"]["lr"] == 0.004 and spec["optim"]["weight_decay"] == 0.1
    assert sweep.base["optim"]["lr"] != 0.004  # the base is left as it was
    space = tune_space(sweep)
    assert set(space) == {"optim.lr", "optim.weight_decay"}
    assert space["optim.weight_decay"] == {"grid_search": [0.0, 0.1]}


@pytest.fixture(params=["sqlite", "postgres"])
def store(request, tmp_path):
    url = f"sqlite:///{tmp_path}/service.db" if request.param == "sqlite" else request.getfixturevalue("postgres_url")
    s = Store.open(url)
    for name in ("a", "b"):
        try:
            s.add_team(Team(name, 4))
        except ServiceInputError:  # the PostgreSQL database is shared by the module's tests
            pass
    yield s
    s.close()


def _trial(store: Store, sweep_id: int, trial_id: str, team: str = "a"):
    return store.submit(team=team, name=f"trial {trial_id}", spec="{}", min_workers=1, max_workers=2,
                        actor="sweep-runner", sweep_id=sweep_id, trial_id=trial_id)


def test_a_sweep_moves_only_along_its_edges_and_a_trial_re_attaches(store):
    sweep = store.submit_sweep(team="a", name="lr-wd", spec="{}", priority=3, max_workers=4,
                               storage_path="/tmp/tune", actor="a")
    assert sweep.state is SweepState.QUEUED and sweep.runner_restarts == 0
    with pytest.raises(TransitionNotAllowed):
        store.transition_sweep(sweep.id, SweepState.QUEUED, SweepState.FINISHED, actor="x", reason="no")
    with pytest.raises(JobStateConflict, match="is queued, not running"):
        store.transition_sweep(sweep.id, SweepState.RUNNING, SweepState.PAUSED, actor="x", reason="no")
    running = store.transition_sweep(sweep.id, SweepState.QUEUED, SweepState.RUNNING, actor="reconciler",
                                     reason="sweep runner started", mlflow_parent_run_id="abc")
    assert running.state is SweepState.RUNNING and running.mlflow_parent_run_id == "abc"

    first = _trial(store, sweep.id, "t0001")
    again = _trial(store, sweep.id, "t0001")  # a restored runner drives the same trial
    other = _trial(store, sweep.id, "t0002")
    assert again.id == first.id and other.id != first.id
    assert (first.sweep_id, first.trial_id) == (sweep.id, "t0001")
    assert [j.id for j in store.trials(sweep.id)] == [first.id, other.id]
    with pytest.raises(ServiceInputError, match="team a's"):
        _trial(store, sweep.id, "t0003", team="b")

    store.transition_sweep(sweep.id, SweepState.RUNNING, SweepState.CANCELLED, actor="a", reason="cancelled by a")
    with pytest.raises(JobStateConflict, match="submits no more trials"):
        _trial(store, sweep.id, "t0004")
    assert _trial(store, sweep.id, "t0001").id == first.id  # an existing trial is still found
    assert [(t.from_state, t.to_state) for t in store.sweep_history(sweep.id)] == [
        (None, SweepState.QUEUED), (SweepState.QUEUED, SweepState.RUNNING),
        (SweepState.RUNNING, SweepState.CANCELLED)]
    assert store.job(first.id).state is JobState.QUEUED
    assert sweep.id in [s.id for s in store.sweeps(team="a")]
    assert sweep.id not in [s.id for s in store.sweeps(states=[SweepState.RUNNING])]
