"""The plots and ``raytrain-sys report``: what a user looks at after (and during) a run.

A real run on the session cluster with its real MLflow store: the plots appear in the MLflow run
while it trains (after its first checkpoint) and again at the end; ``raytrain-sys report`` (the
installed CLI, in a subprocess) prints the run's numbers from a run dir or from its MLflow run id
and writes the PNGs. The per-rank breakdown is drawn from the ``rank_times`` records of the
per-rank timings (written by the Supervisor, which measures the step breakdown; given by hand
in the second test) and left out when a summary has none; drawn in a child process as the
tracker does, a drawing that fails is one error naming its cause.
"""

from __future__ import annotations

import os
import signal
import struct
import subprocess
import sys

import pytest
from mlflow import MlflowClient

from raytrain_sys.monitor.plots import write_plots, write_plots_apart
from raytrain_sys.monitor.report import summary_rows
from tests.ft_common import supervisor_with_events
from tests.helpers import read_summary, tiny_spec

STEPS = 12
RUN_PLOTS = {"loss.png", "throughput.png", "world_size.png"}  # any run's
# A real run measures each rank's step breakdown (rank_times): it gets the per-rank plot too.
TIMED_RUN_PLOTS = RUN_PLOTS | {"rank_breakdown.png"}


def png_size(path: str) -> tuple[int, int]:
    """(width, height) of a PNG file; asserts it is one."""
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    return struct.unpack(">II", head[16:24])


def plots_in_mlflow(client: MlflowClient, run_id: str) -> set[str]:
    return {os.path.basename(a.path) for a in client.list_artifacts(run_id, "plots")}


def report_cli(*args: str) -> subprocess.CompletedProcess:
    env = os.environ | {"PYTHONPATH": os.getcwd()}
    return subprocess.run([sys.executable, "-m", "raytrain_sys.cli.main", "report", *args],
                          capture_output=True, text=True, timeout=120, env=env)


def test_a_run_has_its_plots_in_mlflow_while_it_trains_and_a_report_after(ray_cluster, tiny_dataset, tmp_path):
    spec = tiny_spec(tmp_path, tiny_dataset, train={"max_steps": STEPS, "log_every_steps": 4},
                     checkpoint={"every_steps": 5})
    during: dict[str, set[str]] = {}

    def after_first_checkpoint(sup):
        sup.tracker.flush(timeout_s=60)
        during["plots"] = plots_in_mlflow(MlflowClient(sup.tracking_uri), sup.summary.mlflow_run_id)

    sup, _ = supervisor_with_events(spec, {8: after_first_checkpoint})
    result = sup.run()
    assert result.status == "finished"
    assert during["plots"] == TIMED_RUN_PLOTS, "no plots in MLflow after the checkpoint at step 5"

    summary = read_summary(result.run_dir)
    assert len(summary["step_times"]) == STEPS and all(t > 0 for t in summary["step_times"])
    client = MlflowClient(summary["tracking_uri"])
    assert plots_in_mlflow(client, result.mlflow_run_id) == TIMED_RUN_PLOTS
    # The end's redraw replaced the checkpoint's: the loss plot in MLflow is the final one.
    local = client.download_artifacts(result.mlflow_run_id, "plots/loss.png", str(tmp_path))
    assert png_size(local) == (700, 320)

    by_dir = report_cli(result.run_dir, "--out", str(tmp_path / "report"))
    assert by_dir.returncode == 0, by_dir.stderr
    table = dict(line.split(None, 1) for line in by_dir.stdout.splitlines()[:3])
    assert table["status"] == "finished", by_dir.stdout
    assert table["steps"] == str(STEPS)
    losses = summary["losses"]
    assert f"loss         {losses[0]:.4f} -> {losses[-1]:.4f}" in by_dir.stdout
    assert "world sizes  2..2, last 2" in by_dir.stdout
    assert f"{summary['throughput']['tokens_per_s']:,.0f}" in by_dir.stdout
    assert sorted(os.listdir(tmp_path / "report")) == sorted(TIMED_RUN_PLOTS)

    by_run_id = report_cli(result.mlflow_run_id, "--tracking-uri", summary["tracking_uri"])
    assert by_run_id.returncode == 0, by_run_id.stderr
    assert by_run_id.stdout.splitlines()[:9] == by_dir.stdout.splitlines()[:9]
    assert sorted(os.listdir(os.path.join(result.run_dir, "plots"))) == sorted(TIMED_RUN_PLOTS)

    wrong = report_cli(str(tmp_path / "no-such-run"))
    assert wrong.returncode == 2 and "--tracking-uri" in wrong.stderr and len(wrong.stderr.splitlines()) == 1


def _rank_times(step_s: dict[int, float]) -> dict:
    """Per-rank records in the shape the step breakdown writes (rank_times of summary.json)."""
    return {str(r): {"node": f"node-{r}", "data_wait_s": 0.002, "compute_s": s * 0.6, "collective_s": s * 0.3,
                     "optimizer_s": s * 0.1 - 0.002, "step_s": s} for r, s in step_s.items()}


def test_per_rank_breakdown_drawn_when_recorded_and_cost_and_stragglers_reported(tmp_path):
    base = {"job": "t", "status": "finished", "committed_steps": 20, "losses": [2.0 - i * 0.05 for i in range(20)],
            "world_sizes": [2] * 20, "step_times": [0.1] * 20, "throughput": {"tokens_per_s": 800, "step_time_s": 0.1}}
    assert {os.path.basename(p) for p in write_plots(base, str(tmp_path / "plain"))} == RUN_PLOTS
    assert "cost" not in dict(summary_rows(base)) and "stragglers" not in dict(summary_rows(base))

    timed = base | {"rank_times": _rank_times({0: 0.1, 1: 0.2}),
                    "rank_times_history": [{"step": s, "ranks": _rank_times({0: 0.1, 1: 0.1 if s < 10 else 0.2})}
                                           for s in range(4, 21, 4)],
                    "cost": {"usd": 0.5, "usd_per_million_tokens": 31.25, "goodput_usd_per_million_tokens": 40.0},
                    "stragglers": [{"step": 12, "rank": 1, "node": "node-1", "kind": "slow_rank", "ratio": 2.0,
                                    "action": "none"}]}
    written = write_plots_apart(timed, str(tmp_path / "timed"))  # as the tracker draws them: in a child process
    assert {os.path.basename(p) for p in written} == RUN_PLOTS | {"rank_breakdown.png"}
    width, height = png_size(str(tmp_path / "timed" / "rank_breakdown.png"))
    assert width == 700 and height > 320  # two panels: the breakdown bars and the heat map
    rows = dict(summary_rows(timed))
    assert rows["cost"] == "$0.5000 ($31.2500 / M tokens, goodput $40.0000 / M tokens)"
    assert rows["stragglers"] == "1 events (ranks 1)"
    assert "peer copies" not in rows and rows["recoveries"] == "0 (0 steps redone)"

    with pytest.raises(RuntimeError, match="drawing the plots failed: .*Error"):
        write_plots_apart(base | {"losses": "not a list of numbers"}, str(tmp_path / "broken"))


def test_one_drawing_process_serves_every_redraw_and_is_replaced_when_it_dies_or_hangs(tmp_path):
    """The redraws of a process go to one child, kept between them (its imports paid once); a
    child that died is started again, and one that outlives a redraw's timeout is ended."""
    from raytrain_sys.monitor import plots

    base = {"losses": [2.0, 1.5, 1.2], "world_sizes": [2, 2, 2]}
    assert write_plots_apart(base, str(tmp_path / "a"))
    first = plots._DRAWER._proc.pid
    assert write_plots_apart(base, str(tmp_path / "b")) and plots._DRAWER._proc.pid == first
    with pytest.raises(RuntimeError, match="drawing the plots failed: ValueError"):
        write_plots_apart(base | {"losses": "not a list of numbers"}, str(tmp_path / "c"))
    assert plots._DRAWER._proc.pid == first  # an error in a figure is the caller's, not the child's end
    os.kill(first, signal.SIGKILL)
    plots._DRAWER._proc.wait()
    assert {os.path.basename(p) for p in write_plots_apart(base, str(tmp_path / "d"))} == {"loss.png", "world_size.png"}
    second = plots._DRAWER._proc
    assert second.pid != first
    with pytest.raises(RuntimeError, match=r"no plots within 0.001 s"):
        write_plots_apart(base, str(tmp_path / "e"), timeout_s=0.001)
    assert second.poll() is not None and plots._DRAWER._proc is None  # ended, not left drawing
    assert write_plots_apart(base, str(tmp_path / "f"))


def test_the_report_says_where_each_recovery_took_its_state_from_and_who_holds_whose_copy():
    run = {"job": "t", "status": "finished", "committed_steps": 20, "steps_redone": 2,
           "transitions": [{"state": s} for s in ("running", "rebuilding", "running", "rebuilding", "restoring")],
           "recoveries": [{"step": 9, "lost": [1], "from": "peer copies", "steps_redone": 0},
                          {"step": 15, "lost": [1, 2], "from": "checkpoint", "steps_redone": 2}],
           "peer_copies": {"peers": [1, 2, 3, 0], "bytes_per_copy_estimate": 5 * 2**20}}
    rows = dict(summary_rows(run))
    assert rows["recoveries"] == "2 (2 steps redone; from peer copies 1, checkpoint 1)"
    assert rows["peer copies"] == "rank -> peer 0->1, 1->2, 2->3, 3->0, about 5.0 MB a copy"
    off = "peer copies off: about 4 x 900 MB a rank would take more than 50% of the memory available on node ab"
    assert dict(summary_rows(run | {"peer_copies": {"off": off}}))["peer copies"] == off


def test_the_live_page_lists_a_read_found_hung_beside_the_ranks_with_its_top_frame():
    from raytrain_sys.monitor.report import progress

    top = {"file": "/u/mypkg/data.py", "line": 12, "function": "clean"}
    hung = {"step": 9, "slot": 3, "rank": 1, "reason": "hung: stuck", "top_frame": {"file": "t.py", "line": 1,
                                                                                  "function": "loss_sum"}}
    run = {"committed_steps": 20, "recoveries": [{"step": 9, "hung": [hung]}],
           "read_hangs": [{"step": 14, "reason": "a read of window 3 ... stuck in clean", "top_frame": top}]}
    stacks = progress(run)["stacks"]
    assert [(s["step"], s["kind"], s["rank"], s["top"]) for s in stacks] == [
        (9, "hung", 1, "t.py:1 in loss_sum"), (14, "read", None, "/u/mypkg/data.py:12 in clean")]
