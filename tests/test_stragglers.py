"""Per-rank step breakdown and stragglers (elastic.straggler_policy), on the session cluster.

A test-only fault switch (elastic.fault_slow_rank) makes one rank's compute take twice as long.
The job's model (tests/straggler_model.py) adds device time per token to the tiny GPT, as an
accelerator would: on this shared 2-core machine the ranks' own CPU compute contends for the
same cores, which would hide what moving rows away from a slow rank buys on a real cluster.
What a user would notice: the slow rank is named in summary.json within 20 steps (with its
compute high and its collective wait low, its peers the reverse), ``rebalance`` makes the steps
at least 30% faster than ``none`` while the final parameters stay those of the uninterrupted
run, ``replace`` swaps the slow worker out without losing a step, and a rank that merely got
more rows is not taken for a slow node.
"""

from __future__ import annotations

import json
import logging
import os
import statistics

import numpy as np
import pytest

from raytrain_sys.control.supervisor import Supervisor
from raytrain_sys.control.supervisor.stragglers import (IMBALANCE, SLOW, RankMeans, find_stragglers,
                                                        rebalanced_rows)
from raytrain_sys.data.order import deal, weighted_rows
from raytrain_sys.errors import SpecError
from tests.ft_common import run_with_events, wait_for_a_ready_newcomer, wait_until
from tests.helpers import assert_params_close, exported_series, final_params, read_summary, tiny_spec

pytestmark = pytest.mark.warm_workers  # passes on warm spares too: RTS_TESTS_WARM_WORKERS=1 (conftest.py)

STEPS = 24
SLOW_RANK = 1
WORKERS = 3  # with two, a 2x rank caps what rebalancing can win at 33%: 40% with three


def slow_spec(tmp_path, dataset, policy: str, **sections):
    base = dict(model={"factory": "tests.straggler_model:build", "args": {"s_per_token": 1.5e-3}},
                train={"task": "raytrain_sys.train.tasks:NextToken", "max_steps": STEPS,
                       "global_batch_size": 24, "precision": "fp64", "log_every_steps": 5},
                data={"log_sample_ids": True},
                resources={"num_workers": WORKERS},
                elastic={"straggler_policy": policy, "fault_slow_rank": SLOW_RANK},
                tracking={"enabled": policy == "rebalance"})  # MLflow is checked once, there
    for k, v in sections.items():
        base[k] = {**base.get(k, {}), **v}
    return tiny_spec(tmp_path, dataset, **base)


def run(spec, events=None):
    """(result, summary, step time of each committed step)."""
    times = []
    if events:
        result, _, _ = run_with_events(spec, events)
    else:
        result = Supervisor(spec, on_step=lambda r: times.append(r.step_time_s)).run()
    assert result.status == "finished" and result.committed_steps == STEPS, result
    return result, read_summary(result.run_dir), times


def sample_log(result) -> list[list[list[int]]]:
    """Per committed step, the sample ids of each data-parallel rank (sample_ids.jsonl)."""
    with open(os.path.join(result.run_dir, "sample_ids.jsonl")) as f:
        return [json.loads(line)["ranks"] for line in f]


def same_samples(result, reference) -> list[list[int]]:
    """Every step trained the reference's samples in the reference's order (exactly once);
    returns the rows each rank got per step."""
    steps, ref = sample_log(result), sample_log(reference)
    assert [sum(ranks, []) for ranks in steps] == [sum(ranks, []) for ranks in ref]
    return [[len(ids) for ids in ranks] for ranks in steps]


@pytest.fixture(scope="module")
def unmitigated(ray_cluster, tiny_dataset, tmp_path_factory):
    """The slow rank left alone (policy none): the reference parameters and step times."""
    return run(slow_spec(tmp_path_factory.mktemp("none"), tiny_dataset, "none"))


# ----------------------------------------------------------------------------- on the cluster

@pytest.mark.slow  # a run each, 30-50 s on the shared machine
def test_slow_rank_is_found_and_its_peers_wait_for_it(unmitigated):
    _, summary, _ = unmitigated
    first = summary["stragglers"][0]
    assert (first["rank"], first["kind"], first["action"]) == (SLOW_RANK, SLOW, "none")
    assert first["step"] <= 20 and first["ratio"] > 1.5
    assert not [e for e in summary["stragglers"] if e["rank"] != SLOW_RANK]
    # The breakdown says why: the slow rank computes, its peers wait in the gradient all-reduce.
    times = summary["rank_times"]
    slow, peers = times[str(SLOW_RANK)], [t for r, t in times.items() if r != str(SLOW_RANK)]
    assert set(slow) == {"node", "data_wait_s", "compute_s", "collective_s", "optimizer_s", "step_s"}
    for peer in peers:
        assert slow["compute_s"] > 1.5 * peer["compute_s"]
        assert peer["collective_s"] > 3 * slow["collective_s"]
    history = summary["rank_times_history"]
    assert [h["step"] for h in history] == list(range(5, STEPS + 1, 5)) and history[-1]["ranks"] == times
    # The gauge, as Prometheus would scrape it from Ray's metrics agents.
    # Every rank's series exists from the first refresh (0 unless flagged): wait for the 1 to be exported.
    series = wait_until(lambda: [s for s in exported_series("raytrain_straggler_flagged", f'rank="{SLOW_RANK}"')
                                 if s.endswith(" 1.0")],
                        timeout_s=30.0)
    assert series and series[0].endswith(" 1.0") and 'job="t"' in series[0] and 'team="-"' in series[0]


@pytest.mark.slow  # a run each, 30-50 s on the shared machine
def test_rebalance_speeds_steps_up_and_keeps_the_result(unmitigated, tiny_dataset, tmp_path):
    ref_result, _, ref_times = unmitigated
    result, summary, times = run(slow_spec(tmp_path, tiny_dataset, "rebalance"))
    event = summary["stragglers"][0]
    assert (event["rank"], event["kind"], event["action"]) == (SLOW_RANK, SLOW, "rebalance")
    assert event["step"] <= 20
    rows = event["rows"]  # the slow rank's data index is dealt fewer rows of the same batch
    assert sum(rows) == 24 and rows[SLOW_RANK] < min(r for i, r in enumerate(rows) if i != SLOW_RANK)
    # The last third of the run, where the split has been in effect in the rebalanced run.
    late = slice(2 * STEPS // 3, STEPS)
    assert event["step"] <= late.start
    none_s, rebalanced_s = statistics.median(ref_times[late]), statistics.median(times[late])
    print(f"median step time, steps {late.start + 1}..{STEPS}: none {none_s:.3f} s, rebalance "
          f"{rebalanced_s:.3f} s ({rebalanced_s / none_s:.2f}x)")
    assert rebalanced_s <= 0.7 * none_s
    # The same samples in the same order, dealt with fewer rows to the slow rank from the event on.
    rows_per_step = same_samples(result, ref_result)
    assert rows_per_step[event["step"] - 1] == [8, 8, 8] and rows_per_step[-1][SLOW_RANK] < 8
    # The gradient is the same whatever the split (the loss is weighted by units).
    assert_params_close(final_params(result.newest_checkpoint), final_params(ref_result.newest_checkpoint),
                        rtol=1e-6, atol=1e-9)
    from mlflow.tracking import MlflowClient

    tags = MlflowClient(summary["tracking_uri"]).get_run(summary["mlflow_run_id"]).data.tags
    assert f"rank {SLOW_RANK}" in tags["raytrain.straggler"] and "rebalance" in tags["raytrain.straggler"]


@pytest.mark.slow  # a run each, 30-50 s on the shared machine
def test_replace_drains_the_slow_worker_with_no_step_lost(unmitigated, tiny_dataset, tmp_path, caplog):
    ref_result, _, _ = unmitigated
    spec = slow_spec(tmp_path, tiny_dataset, "replace", train={"steps_per_call": 1})
    # Once the slow worker left, hold the step loop until its replacement is up, so that it joins.
    with caplog.at_level(logging.WARNING, logger="raytrain_sys"):
        result, summary, _ = run(spec, events={16: wait_for_a_ready_newcomer})
    events = summary["stragglers"]
    assert [(e["rank"], e["kind"], e["action"]) for e in events] == [(SLOW_RANK, SLOW, "replace")]
    assert events[0]["step"] <= 20
    drained = [t for t in summary["transitions"] if t["state"] == "draining"]
    assert len(drained) == 1 and "straggler" in drained[0]["reason"]
    worlds = summary["world_sizes"]
    assert worlds[0] == WORKERS and worlds[-1] == WORKERS
    # The slow worker left (a group of two), then its replacement joined (three again): on a warm
    # spare it may join before the group of two took a step, so the groups are read off the moves.
    after = summary["transitions"][summary["transitions"].index(drained[0]) + 1:]
    assert after[0]["world"] == WORKERS - 1 and after[-1]["world"] == WORKERS, after
    assert summary["failures"] == 0 and summary["steps_redone"] == 0
    same_samples(result, ref_result)
    assert_params_close(final_params(result.newest_checkpoint), final_params(ref_result.newest_checkpoint),
                        rtol=1e-6, atol=1e-9)
    # Where it spent its steps: its stacks, taken at the verdict, in its event and the log (MLflow
    # is off here: the hangs' test reads the same artifact of a hung worker).
    top = events[0]["top_frame"]
    where = f'line {top["line"]}, in {top["function"]}'
    assert top["function"] and where in events[0]["stack"], events[0]
    assert f"straggler: rank {SLOW_RANK} computes" in caplog.text and where in caplog.text


@pytest.mark.slow  # a run each, 30-50 s on the shared machine
def test_a_rank_with_more_rows_is_not_taken_for_a_slow_node(ray_cluster, tiny_dataset, tmp_path):
    """Four rows over three ranks: rank 0 gets two, the others one. Its compute is twice theirs,
    but per token it is the same: a data imbalance, flagged as such and left alone even under
    ``rebalance``."""
    spec = slow_spec(tmp_path, tiny_dataset, "rebalance", train={"global_batch_size": 4, "max_steps": 16},
                     elastic={"fault_slow_rank": -1}, model={"args": {"s_per_token": 2e-3}})
    result = Supervisor(spec).run()
    summary = read_summary(result.run_dir)
    times = summary["rank_times"]
    assert times["0"]["compute_s"] > 1.5 * max(times["1"]["compute_s"], times["2"]["compute_s"])
    assert summary["stragglers"], "rank 0's compute exceeds the margin: it is flagged, as an imbalance"
    assert {(e["rank"], e["kind"], e["action"]) for e in summary["stragglers"]} == {(0, IMBALANCE, "none")}


# ----------------------------------------------------------------------------- pure parts

def means(*compute_units_rows):
    return [RankMeans(*c) for c in compute_units_rows]


@pytest.mark.parametrize("ranks, expected", [
    (means((1.0, 100, 4), (1.0, 100, 4), (1.0, 100, 4)), []),
    (means((2.0, 100, 4), (1.0, 100, 4), (1.0, 100, 4)), [(0, SLOW)]),
    (means((2.0, 200, 8), (1.0, 100, 4), (1.0, 100, 4)), [(0, IMBALANCE)]),
    (means((1.0, 100, 4), (2.0, 100, 4)), [(1, SLOW)]),
    (means((1.4, 100, 4), (1.0, 100, 4), (1.0, 100, 4)), []),
    (means((1.0, 100, 4),), []),
], ids=["an even group has no straggler",
        "twice the compute for the same tokens is a slow rank",
        "twice the compute for twice the tokens is a data imbalance",
        "with two ranks the peer's time is the median, not the pair's",
        "within the margin is not flagged",
        "one rank has no peers to be slower than"])
def test_find_stragglers(ranks, expected):
    assert [(f.rank, f.kind) for f in find_stragglers(ranks, margin=0.5)] == expected


def test_rebalanced_rows_follow_measured_speed():
    degrees = {"pp": 1, "dp": 3, "fsdp": 1, "tp": 1}
    assert rebalanced_rows(means((1.0, 0, 8), (2.0, 0, 8), (1.0, 0, 8)), degrees, 24) == [10, 5, 9]
    # TP peers share a data index: it is as fast as its slower rank.
    degrees = {"pp": 1, "dp": 2, "fsdp": 1, "tp": 2}
    assert rebalanced_rows(means((1.0, 0, 6), (2.0, 0, 6), (1.0, 0, 6), (1.0, 0, 6)), degrees, 12) == [4, 8]


def test_weighted_rows_are_a_split_of_the_batch():
    for weights in ([1.0, 1.0, 1.0], [1.0, 0.5, 1.0], [3.0, 1e-6], [0.2, 0.3, 0.5, 0.9]):
        rows = weighted_rows(24, weights)
        assert sum(rows) == 24 and min(rows) >= 1
        slices = deal(24, len(rows), rows)
        assert [s.stop - s.start for s in slices] == rows and slices[-1].stop == 24
    assert weighted_rows(24, [1.0, 0.5, 1.0]) == [10, 5, 9]  # 9.6, 4.8, 9.6
    assert weighted_rows(24, [3.0, 1e-6]) == [23, 1]
    with pytest.raises(ValueError):
        deal(24, 3, [10, 10, 10])


@pytest.mark.parametrize("field, value, message", [
    ("straggler_policy", "evict", "allowed: none, rebalance, replace"),
    ("straggler_margin", -0.1, "0 or more"),
    ("straggler_window_steps", 0, "greater than 0"),
    ("fault_slow_factor", 0.5, "at least 1"),
])
def test_straggler_fields_are_validated(tmp_path, tiny_dataset, field, value, message):
    with pytest.raises(SpecError, match=f"elastic.{field}.*{message}"):
        tiny_spec(tmp_path, tiny_dataset, elastic={field: value})


def feed(stragglers, first_step: int, computes: list[float], steps: int, rows: int = 8) -> None:
    """``steps`` committed steps, one a lease, in which rank r's compute took ``computes[r]``."""
    from types import SimpleNamespace

    import numpy as np

    from raytrain_sys.control.worker import AGREED

    world = len(computes)
    members = [SimpleNamespace(info={"ip": f"10.0.0.{r}"}, node_id=f"n{r}") for r in range(world)]
    shares = [slice(r * rows, (r + 1) * rows) for r in range(world)]
    batch = SimpleNamespace(row_units=np.full(world * rows, 32))
    for s in range(first_step, first_step + steps):
        sent = SimpleNamespace(step=s, members=members, shares=shares, batches=[batch])
        parts = [{"compute_s": c, "collective_s": max(computes) - c, "rows": rows} for c in computes]
        report = {"ranks": np.array([[float(p.get(k, 0.0)) for k in AGREED] for p in parts])}  # rank 0's, as sent
        stragglers.observe_reports(sent, [report], generation=1)
        yield stragglers.decide(s + 1)


def test_a_straggler_is_one_event_per_episode_and_rebalanced_until_it_keeps_up(tmp_path, tiny_dataset):
    from raytrain_sys.control.run_record import RunSummary
    from raytrain_sys.control.supervisor.stragglers import Rebalance, Stragglers

    spec = tiny_spec(tmp_path, tiny_dataset, train={"global_batch_size": 24},
                     resources={"num_workers": 3}, elastic={"straggler_policy": "rebalance"})
    summary = RunSummary(job="t", run_dir=str(tmp_path))
    s = Stragglers(spec, summary, tracker=None)
    decisions = list(feed(s, 0, [1.0, 2.0, 1.0], 12))  # 2 warm-up steps, then a full window
    assert decisions[:-1] == [None] * 11 and isinstance(decisions[-1], Rebalance)
    assert decisions[-1].rows == [10, 5, 9]
    # Still too slow under the new split: rebalanced again after a fresh window, not before.
    decisions = list(feed(s, 12, [1.0, 1.8, 1.0], 10))
    assert decisions[:-1] == [None] * 9 and isinstance(decisions[-1], Rebalance)
    # Keeping up: no new event, however long it runs.
    assert list(feed(s, 22, [1.0, 1.1, 1.0], 30)) == [None] * 30
    assert [(e["step"], e["rank"], e["action"]) for e in summary.stragglers] == [(12, 1, "rebalance"),
                                                                                (22, 1, "rebalance")]
    assert summary.rank_times["1"]["compute_s"] == 1.1 and summary.rank_times["1"]["node"] == "10.0.0.1"


def test_an_unmitigated_straggler_is_one_event(tmp_path, tiny_dataset):
    from raytrain_sys.control.run_record import RunSummary
    from raytrain_sys.control.supervisor.stragglers import Stragglers

    spec = tiny_spec(tmp_path, tiny_dataset, resources={"num_workers": 3})
    summary = RunSummary(job="t", run_dir=str(tmp_path))
    assert set(feed(Stragglers(spec, summary, tracker=None), 0, [1.0, 1.0, 2.5], 40)) == {None}
    assert [(e["step"], e["rank"], e["kind"], e["action"]) for e in summary.stragglers] == [(12, 2, SLOW, "none")]


@pytest.mark.parametrize("values", [[1.0, 2.0], [3.0, 1.0, 2.0], [1.0, 1.0, 1.0, 5.0], [2.0, 2.0, 2.0, 2.0, 2.0],
                                    [0.3, 0.1, 0.7, 0.2, 0.9, 0.4], [0.0, 0.0, 4.0, 1.0, 1.0, 4.0, 4.0]],
                         ids=["two ranks", "odd world", "a tie below an outlier", "all equal", "even world",
                              "ties on both sides"])
def test_peer_medians_are_each_ranks_median_of_the_others(values):
    """One sort for every rank gives exactly ``statistics.median`` of its peers' values."""
    from raytrain_sys.control.supervisor.stragglers import peer_medians

    got = peer_medians(np.array(values)).tolist()
    assert got == [statistics.median(values[:r] + values[r + 1:]) for r in range(len(values))]
