"""Cost per token (resources.cost_per_worker_hour): what summary.json, MLflow and the arithmetic
report. The metrics side (raytrain_cost_* in Prometheus) is checked in tests/test_prometheus.py."""

from __future__ import annotations

import os
import signal

import pytest

from raytrain_sys.monitor.cost import CostMeter
from tests.ft_common import ft_spec, run_with_events
from tests.helpers import read_summary

pytestmark = pytest.mark.warm_workers  # passes on warm spares too: RTS_TESTS_WARM_WORKERS=1 (conftest.py)

PRICE = 3.6  # dollars a worker-hour: 0.001 $ a worker-second
STEPS = 12
TOKENS_PER_STEP = 8 * 32  # tiny_spec: 8 rows of 33 tokens, 32 targets each


def test_a_flavors_price_makes_spot_and_on_demand_tokens_cost_apart():
    """The job service prices a run as the flavor it runs on (ResourceFlavor.usd_per_worker_hour,
    set as resources.cost_per_worker_hour at launch): the same worker and the same tokens cost a
    fifth on spot of what they cost on demand here."""
    from raytrain_sys.service.flavors import ResourceFlavor, WorkerShape

    shape = WorkerShape(cpu=4.0, gpu=1.0, memory_gb=16.0, accelerator="A10G")
    spot = ResourceFlavor("spot-a10g", "spot", "A10G", usd_per_cpu_hour=0.01, usd_per_gpu_hour=0.2,
                          usd_per_memory_gb_hour=0.001)
    on_demand = ResourceFlavor("on-demand-a10g", "on-demand", "A10G", usd_per_cpu_hour=0.05, usd_per_gpu_hour=1.0,
                               usd_per_memory_gb_hour=0.005)
    assert spot.usd_per_worker_hour(shape) == pytest.approx(4 * 0.01 + 0.2 + 16 * 0.001)
    prices = {}
    for flavor in (spot, on_demand):
        meter = CostMeter(flavor.usd_per_worker_hour(shape))
        meter.hold(2, now=0.0)
        meter.committed(1, 1_000_000)
        prices[flavor.market] = meter.record(now=3600.0)["usd_per_million_tokens"]
    assert prices["spot"] == pytest.approx(2 * 0.256) and prices["on-demand"] == pytest.approx(5 * prices["spot"])
    assert ResourceFlavor.implicit().usd_per_worker_hour(shape) == 0.0  # unpriced: the spec's own price stands


def test_cost_integrates_workers_held_and_prices_goodput():
    """Held slots times wall time, idle time included; a restore makes goodput dearer."""
    meter = CostMeter(PRICE)
    meter.hold(2, now=100.0)
    for step in (1, 2, 3):
        meter.committed(step, 1000)
    meter.hold(0, now=110.0)  # every worker lost: nothing held while replacements are asked for
    meter.hold(2, now=115.0)  # replacements placed, restoring step 1
    meter.rewind(1)
    for step in (2, 3):
        meter.committed(step, 1000)
    cost = meter.record(now=125.0)
    assert cost["worker_hours"] == pytest.approx((2 * 10 + 2 * 10) / 3600)
    assert cost["usd"] == pytest.approx(40 * PRICE / 3600)
    assert cost["usd_per_million_tokens"] == pytest.approx(cost["usd"] / 5000 * 1e6)  # 5 steps trained
    assert cost["goodput_usd_per_million_tokens"] == pytest.approx(cost["usd"] / 3000 * 1e6)  # 3 kept
    assert CostMeter(0.0).record(now=1.0) == {}  # no price: no cost reported


def test_priced_run_reports_cost_of_workers_held_and_redone_steps(tiny_dataset, tmp_path, ray_cluster):
    """Every worker killed at step 7: the run restores step 5 and redoes 6..7. The dollars are
    the price times two workers over the run's wall time (the restore's idle time included),
    and the goodput price per token is the plain one times trained / committed tokens."""
    spec = ft_spec(tmp_path, tiny_dataset, STEPS, resources={"cost_per_worker_hour": PRICE})

    def kill_all(sup):
        for w in sup.group.workers:
            os.kill(w.info["pid"], signal.SIGKILL)

    result, sup, _ = run_with_events(spec, {7: kill_all})
    assert result.status == "finished"
    summary = read_summary(result.run_dir)
    cost = summary["cost"]
    assert summary["steps_redone"] == 2
    placed = next(t["time"] for t in summary["transitions"] if "workers placed" in t["reason"])
    wall_s = summary["finished_at"] - placed
    # Two slots held from placement to the end, less the moments with none (killed, not yet
    # replaced) and more while a replacement of a lost one starts: within a tenth.
    assert cost["worker_hours"] == pytest.approx(2 * wall_s / 3600, rel=0.1)
    assert cost["usd"] == pytest.approx(PRICE * cost["worker_hours"], rel=1e-9)
    assert cost["cost_per_worker_hour"] == PRICE
    trained = (STEPS + summary["steps_redone"]) * TOKENS_PER_STEP
    assert cost["usd_per_million_tokens"] == pytest.approx(cost["usd"] / trained * 1e6, rel=1e-9)
    assert cost["goodput_usd_per_million_tokens"] == pytest.approx(
        cost["usd_per_million_tokens"] * (STEPS + summary["steps_redone"]) / STEPS, rel=1e-9)

    from mlflow.tracking import MlflowClient

    history = MlflowClient(summary["tracking_uri"]).get_metric_history(summary["mlflow_run_id"], "cost_usd")
    assert [m.value for m in history] == sorted(m.value for m in history)  # cumulative
    assert max(m.value for m in history) == pytest.approx(cost["usd"], rel=1e-9)  # the last record's


@pytest.mark.parametrize("field, value, message", [
    ("resources.cost_per_worker_hour", -1.0, "resources.cost_per_worker_hour.*0 or more"),
    ("resources.cost_per_worker_hour", "cheap", "resources.cost_per_worker_hour.*expected a number"),
    ("tracking.metrics", "yes", "tracking.metrics.*expected true or false"),
], ids=["a negative price", "a price that is not a number", "a metrics switch that is not a boolean"])
def test_bad_cost_and_metrics_fields_name_the_field(field, value, message):
    from raytrain_sys.errors import SpecError
    from raytrain_sys.spec import from_dict

    section, name = field.split(".")
    with pytest.raises(SpecError, match=message):
        from_dict({section: {name: value}})
