"""Whether a lost driver's workers can be adopted (``control.adoption.agreement``): pure cases on
the workers' own answers (``TrainWorker.adoption_state``). The whole adoption, on a real cluster,
is in test_driver_loss.py (a CLI driver) and test_service_runner.py (a job's runner)."""

from __future__ import annotations

import json

import pytest

from raytrain_sys.control.adoption import agreement, completable
from raytrain_sys.control.worker import results_kept

HASH = "h1"


def rank(r: int, world: int = 2, step: int = 18, idle: bool = True, generation: int = 1,
         training_hash: str = HASH) -> dict:
    return {"rank": r, "world_size": world, "generation": generation, "step": step, "idle": idle,
            "lease": 3, "replicated": True, "training_hash": training_hash, "running": None}


def began(r: int, lease: int = 4, first: int = 18, rows: tuple = (8, 16), world: int = 2) -> dict:
    """A rank that began lease ``lease`` (steps ``first`` on, its rows ``rows``) and waits in it."""
    return {**rank(r, world=world, step=first, idle=False), "lease": lease, "running": (lease, first, 6, *rows)}


@pytest.mark.parametrize("states, expected", [
    # Every rank of the group, between leases, at one step: adopted.
    ({0: rank(0), 1: rank(1)}, ""),
    ({7: rank(1), 3: rank(0)}, ""),  # slots are not ranks
    # A rank still in the lease the lost driver sent: asked again until it ends.
    ({0: rank(0), 1: rank(1, idle=False)}, "busy: rank(s) 1 still in a lease"),
    # The driver lost between two leases: rank 1 began lease 4, rank 0's call of it was dropped.
    ({0: rank(0), 1: {**rank(1, idle=False), "lease": 4}}, "split: rank(s) 1 began a lease that the others never got"),
    # ...whereas both in lease 3 (one still in its last step): the lease ends, they agree.
    ({0: rank(0, step=18), 1: rank(1, step=17, idle=False)}, "busy: rank(s) 1 still in a lease"),
    # A rank lost with the driver (its node): the group cannot go on as it is.
    ({0: rank(0, world=3), 1: rank(1, world=3)}, "2 of its 3 ranks are left (ranks [0, 1])"),
    # Ranks of two process groups (a rebuild the driver died in the middle of).
    ({0: rank(0, generation=2), 1: rank(1, generation=1)}, "its ranks are of different process groups"),
    # A rank that failed a step the others finished (a lease that began on one only).
    ({0: rank(0, step=18), 1: rank(1, step=17)}, "its ranks hold different steps (17, 18)"),
    # A resume that changes a training setting: the ranks were started without it.
    ({0: rank(0, training_hash="h0"), 1: rank(1, training_hash="h0")},
     "the resume changes the training settings its ranks were started with"),
])
def test_whether_the_lost_drivers_workers_can_be_driven_on(states, expected):
    verdict = agreement(states, HASH)
    assert verdict.startswith(expected) and (expected or verdict == ""), verdict


def test_a_rank_keeps_enough_results_for_an_adoption_after_a_lagging_record():
    """A lease of 6 steps after 200 others: the steps since a record that lags them by 150 are
    all still kept, so the adopting Supervisor has every step's loss."""
    kept = {s: {"loss_all": float(s)} for s in range(0, 1200)}
    kept = results_kept(kept, newest_from=1194, first=1200)
    assert all(s in kept for s in range(1050, 1200))


EVEN = [(0, 8), (8, 16)]  # two ranks' rows of a global batch of 16, as a resume deals them


@pytest.mark.parametrize("states, rows, expected", [
    # Rank 0's call of lease 4 (a generator) was dropped with the driver, rank 1's ran: completed.
    ({0: rank(0), 1: began(1)}, EVEN, ""),
    ({5: rank(0, world=3), 6: began(1, world=3, rows=(5, 10)), 7: began(2, world=3, rows=(10, 16))},
     [(0, 5), (5, 10), (10, 16)], ""),
    # Rank 0 began it: its reports went to the lost driver, no new call can follow them.
    ({0: began(0, rows=(0, 8)), 1: rank(1)}, EVEN, "rank 0 began it"),
    # The ranks that began one are in different leases (or one reports none).
    ({0: rank(0, world=3), 1: began(1, world=3, rows=(5, 10)), 2: began(2, lease=5, world=3, rows=(10, 16))},
     [(0, 5), (5, 10), (10, 16)], "the ranks that began it are not all in one lease"),
    # The lost driver had dealt the rows unevenly (a rebalance): the missing part is unknown.
    ({0: rank(0), 1: began(1, rows=(6, 16))}, EVEN, "its rows were dealt otherwise"),
    ({0: rank(0), 1: began(1)}, None, "its rows were dealt otherwise"),
])
def test_whether_a_lease_that_split_the_ranks_can_be_completed(states, rows, expected):
    assert agreement(states, HASH).startswith("split") or expected == "rank 0 began it"
    verdict = completable(states, rows)
    assert verdict.startswith(expected) and (expected or verdict == ""), verdict


def test_the_sample_log_says_how_far_the_lost_driver_wrote_and_loses_a_line_it_cut_short(tmp_path):
    """An adopting Supervisor writes the sample ids of the steps the lost driver had not written
    (``Steps.adopt``): the log's newest step is read from its end, and a last line the driver
    was killed in the middle of is removed, to be written again whole."""
    from raytrain_sys.control.supervisor.steps import sampled_through

    path = tmp_path / "sample_ids.jsonl"
    assert sampled_through(str(path)) == 0
    lines = [json.dumps({"step": s, "ranks": [[s * 10, s * 10 + 1]]}) + "\n" for s in range(1, 9)]
    path.write_text("".join(lines) + '{"step": 9, "ranks": [[90')
    assert sampled_through(str(path)) == 8
    assert path.read_text() == "".join(lines)
    assert sampled_through(str(path)) == 8
