"""benchmarks/sweep_ideal.py: the sweep benchmark's grid and ASHA replayed with no overhead, the
yardstick its measured ratios are read against (issue 28). Named cases of the replay's rules."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import sweep_ideal  # noqa: E402

STEPS = 800  # evaluations every 100 steps: ASHA's rungs at 100, 200, 400


def curve(start: float, end: float) -> list[tuple[int, float]]:
    """A loss falling in a straight line from ``start`` at step 100 to ``end`` at step 800."""
    return [(s, start + (end - start) * (s - 100) / 700) for s in range(100, STEPS + 1, 100)]


def test_the_grid_runs_every_trial_to_its_end_four_at_a_time():
    curves = [curve(3.0, 2.5)] * 7 + [curve(2.9, 2.0)]  # the best last in the admission order
    grid = sweep_ideal.replay(curves, threshold=2.0 * 1.02, asha=False, steps=STEPS, slots=4, speed="gpu")
    assert grid.found_s == pytest.approx(2 * STEPS)  # the second wave's end
    assert grid.end_s == pytest.approx(2 * STEPS) and grid.worker_s == pytest.approx(8 * STEPS)
    assert grid.stopped == ()


def test_asha_stops_the_losers_at_the_first_rung_and_finds_a_late_leader_sooner():
    # The leader is ahead at every rung: ASHA never stops it, and the stops of the trials before it
    # admit it early (and free workers it grows into).
    curves = [curve(3.0 + i / 10, 2.5 + i / 10) for i in range(7)] + [curve(2.5, 2.0)]
    grid = sweep_ideal.replay(curves, 2.0 * 1.02, asha=False, steps=STEPS, slots=4, speed="gpu")
    asha = sweep_ideal.replay(curves, 2.0 * 1.02, asha=True, steps=STEPS, slots=4, speed="gpu")
    assert "t00007" not in [t for t, _ in asha.stopped]
    assert len(asha.stopped) >= 3 and all(step < STEPS for _, step in asha.stopped)
    assert asha.found_s < 0.75 * grid.found_s
    assert asha.worker_s < grid.worker_s


def test_asha_can_stop_the_configuration_that_ends_best():
    # Worse than the others at the first rung, best at the end (a large learning rate on a
    # cosine): reported after two better trials at that rung, ASHA stops it, and finds nothing
    # within 2% of the grid's best.
    curves = [curve(2.6, 2.5), curve(2.7, 2.5), curve(3.5, 2.0), curve(2.8, 2.5)]
    asha = sweep_ideal.replay(curves, 2.0 * 1.02, asha=True, steps=STEPS, slots=4, speed="gpu")
    assert ("t00002", 100) in asha.stopped
    assert asha.found_s is None


def test_growth_speeds_a_trial_on_gpus_but_not_on_cores_it_shares():
    one = [curve(2.5, 2.0)]
    gpu = sweep_ideal.replay(one, 2.1, asha=False, steps=STEPS, slots=4, speed="gpu")
    host = sweep_ideal.replay(one, 2.1, asha=False, steps=STEPS, slots=4, speed="host", cores=1.0)
    assert gpu.end_s == pytest.approx(STEPS / 2)  # grown to its 2 workers at once
    assert host.end_s == pytest.approx(STEPS)  # 2 workers on 1 core: no faster
    assert gpu.worker_s == pytest.approx(STEPS) and host.worker_s == pytest.approx(2 * STEPS)


def test_over_orders_counts_every_order_when_there_are_few():
    curves = [curve(3.0, 2.5), curve(2.9, 2.0), curve(3.1, 2.6)]
    every = sweep_ideal.over_orders(curves, 2.0 * 1.02, STEPS, slots=2, speed="gpu")
    assert every["orders"] == 6  # 3! orders, each once
    assert 0 < every["time_mean"] <= 1.0 and every["asha_never_found"] == 0
