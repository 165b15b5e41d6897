"""Closing a data stream early lets its running reads finish instead of cancelling them.

Ray 2.60's cancel of a task whose reply is in flight can kill the driver on a Ray core check
(raytrain_sys.data.stream explains); the data plane closes streams on every seek. Each read here
leaves a marker when it starts and one when it ends: a read cancelled (its worker killed) never
leaves the second.
"""

from __future__ import annotations

import os
import time

from raytrain_sys.data.stream import iter_blocks_closing_quietly

READ_S = 1.0


def _marked_read(batch, marker_dir: str):
    i = int(batch["i"][0])
    open(os.path.join(marker_dir, f"start-{i}"), "w").close()
    time.sleep(READ_S)
    open(os.path.join(marker_dir, f"done-{i}"), "w").close()
    return batch


def _markers(marker_dir: str, kind: str) -> set[int]:
    return {int(n.split("-")[1]) for n in os.listdir(marker_dir) if n.startswith(kind + "-")}


def test_closing_early_waits_for_running_reads(ray_cluster, tmp_path):
    import ray.data

    ray.data.DataContext.get_current().enable_progress_bars = False
    marker_dir = str(tmp_path)
    ds = ray.data.from_items([{"i": i} for i in range(8)], override_num_blocks=8).map_batches(
        _marked_read, batch_size=1, num_cpus=0, compute=ray.data.TaskPoolStrategy(size=2),
        fn_kwargs={"marker_dir": marker_dir})
    stream = iter_blocks_closing_quietly(ds, batch_size=None, prefetch_batches=1)
    next(stream)
    # Reads after the first are under way (the pool keeps two running): wait until one started
    # and has not ended, so that the close below meets a running read.
    deadline = time.monotonic() + 30
    while not (_markers(marker_dir, "start") - _markers(marker_dir, "done")):
        assert time.monotonic() < deadline, "no read was running: the test proves nothing"
        time.sleep(0.02)
    running = _markers(marker_dir, "start") - _markers(marker_dir, "done")

    t0 = time.monotonic()
    stream.close()
    closed_in = time.monotonic() - t0

    started, done = _markers(marker_dir, "start"), _markers(marker_dir, "done")
    assert running <= done, f"reads {sorted(running - done)} were cancelled, not waited for"
    assert started == done, f"reads {sorted(started - done)} started and never ended"
    assert closed_in < READ_S + 5, f"closing took {closed_in:.1f} s"
    # Nothing new starts once the stream is closing: 8 reads were planned, few ran.
    time.sleep(READ_S)
    assert _markers(marker_dir, "start") == started
    assert len(started) < 8, f"{len(started)} of 8 reads ran"
