"""What redrawing a run's plots at a checkpoint costs the driver's step loop.

At each committed checkpoint the Supervisor hands ``Tracker.log_plots`` a snapshot of its summary
(``RunSummary.snapshot``: the one cost paid on the step loop) and the tracker's writer thread
has the PNGs drawn (``monitor/plots.py``) while the loop goes on. Measured in one invocation, on
a summary of ``--steps`` steps:

  snapshot      the time ``snapshot()`` takes (on the step loop, at each checkpoint);
  draw          the time one redraw takes, on a thread and in a child process;
  loop          a stand-in for the driver's step loop, ``--loop-steps`` iterations of a wait for
                the workers (``--wait-ms``, as the driver blocks in ``ray.get``) and its own
                bookkeeping (``--work-ms`` of Python, as in ``Steps.commit``), timed quiet, then
                while a thread redraws back to back (``write_plots``: it shares the loop's GIL),
                then while a thread has a child process redraw back to back
                (``write_plots_apart``, what the tracker does). Each ratio is the slowdown a step
                sees while a redraw runs (a redraw lasts a second or two; a checkpoint comes every
                ``checkpoint.every_steps``).

    .venv/bin/python benchmarks/plots_overhead.py                 # 100k-step summary
    .venv/bin/python benchmarks/plots_overhead.py --steps 2000

Results go to benchmarks/results/plots_overhead.json (``--out`` to write elsewhere). On a machine
whose cores are all busy the child process competes for CPU instead of the GIL: run it quiet.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import threading
import time

from raytrain_sys.control.run_record import RunSummary
from raytrain_sys.monitor.plots import write_plots, write_plots_apart


def summary_of(steps: int) -> RunSummary:
    rng = random.Random(0)
    return RunSummary(job="bench", run_dir="/tmp", committed_steps=steps,
                      losses=[5.0 / (1 + i / 500) + rng.random() * 0.1 for i in range(steps)],
                      world_sizes=[4] * steps, step_times=[0.1 + rng.random() * 0.01 for _ in range(steps)],
                      throughput={"tokens_per_s": 1e5, "step_time_s": 0.1},
                      transitions=[{"state": "rebuilding", "step": steps // 2, "reason": "", "time": 0.0}])


def loop(iterations: int, wait_s: float, work_s: float) -> float:
    """Seconds per iteration of a wait (GIL released) then ``work_s`` of Python (GIL held)."""
    t0 = time.perf_counter()
    for _ in range(iterations):
        time.sleep(wait_s)
        end = time.perf_counter() + work_s
        while time.perf_counter() < end:
            pass
    return (time.perf_counter() - t0) / iterations


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=100_000, help="steps in the summary drawn")
    p.add_argument("--loop-steps", type=int, default=200)
    p.add_argument("--wait-ms", type=float, default=20.0)
    p.add_argument("--work-ms", type=float, default=1.0)
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "plots_overhead.json"))
    args = p.parse_args()
    summary = summary_of(args.steps)
    out = tempfile.mkdtemp(prefix="plots-bench-")

    t0 = time.perf_counter()
    snap = summary.snapshot()
    snapshot_s = time.perf_counter() - t0
    write_plots(snap, out)  # imports matplotlib once, as the first checkpoint's redraw does
    t0 = time.perf_counter()
    write_plots(snap, out)
    draw_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    write_plots_apart(snap, out)
    apart_s = time.perf_counter() - t0

    wait_s, work_s = args.wait_ms / 1000, args.work_ms / 1000
    quiet = loop(args.loop_steps, wait_s, work_s)
    on_thread = while_redrawing(write_plots, snap, out, lambda: loop(args.loop_steps, wait_s, work_s))
    apart = while_redrawing(write_plots_apart, snap, out, lambda: loop(args.loop_steps, wait_s, work_s))

    print(f"summary of {args.steps:,} steps")
    print(f"  snapshot on the step loop: {snapshot_s * 1000:.1f} ms per checkpoint")
    print(f"  one redraw: {draw_s:.2f} s on a thread, {apart_s:.2f} s in a child process")
    print(f"  loop step ({args.wait_ms:g} ms wait + {args.work_ms:g} ms work): {quiet * 1000:.2f} ms quiet; "
          f"while redrawing on a thread {on_thread * 1000:.2f} ms (ratio {on_thread / quiet:.3f}), "
          f"in a child process {apart * 1000:.2f} ms (ratio {apart / quiet:.3f})")
    figures = {"steps": args.steps, "snapshot_ms": snapshot_s * 1000, "redraw_thread_s": draw_s,
               "redraw_child_s": apart_s, "loop_step_ms": {"quiet": quiet * 1000, "thread": on_thread * 1000,
                                                            "child": apart * 1000},
               "ratio_thread": on_thread / quiet, "ratio_child": apart / quiet, "load_average": os.getloadavg()[0],
               "wait_ms": args.wait_ms, "work_ms": args.work_ms, "loop_steps": args.loop_steps}
    with open(args.out, "w") as f:
        json.dump(figures, f, indent=1)


def while_redrawing(draw, snap: dict, out: str, measure) -> float:
    """``measure()`` while a thread calls ``draw(snap, out)`` back to back."""
    stop = threading.Event()

    def redraw() -> None:
        while not stop.is_set():
            draw(snap, out)

    drawer = threading.Thread(target=redraw, daemon=True)
    drawer.start()
    try:
        return measure()
    finally:
        stop.set()
        drawer.join()


if __name__ == "__main__":
    main()
