"""No driver abort on a seek: 180 random seeks with reads in flight, in fresh driver processes.

Before the data plane moved to its own read tasks, every seek closed a Ray Data stream, whose
stock shutdown force-cancels the reads still running; in Ray 2.60 a cancel that meets a reply in
flight aborts the calling process (task_manager.cc "Tried to complete task that was not
pending"), about once in three suite runs. The race needs what the suite has: several Ray
nodes, reads on other nodes than the driver's, a loaded machine, and reads that end just as a
stream is closed. This test gives it all four (tests/seek_stress.py in its stock mode aborted
one driver in ten under them):
the session cluster (a 0-CPU head and 1-CPU nodes: reads that ask for CPU land on the nodes),
a CPU hog beside the drivers, and resizes and a bad shard among the seeks. Each driver replaces
``ray.cancel`` with a failure (tests/seek_stress.py), so a cancel brought back into the data path
fails here loudly rather than aborting one run in many: a cancel is caught at the first seek that
makes one, so three drivers (one of each kind: a bad shard or not, reads asking CPU or not) are
enough; five took 160 s of the suite's 52 min on a clean clone (2026-12-07).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import numpy as np

from raytrain_sys.data.prepare import prepare_text_dataset
from raytrain_sys.data.shards import read_manifest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DRIVERS, SEEKS = 3, 60


def _hog(seconds: float) -> subprocess.Popen:
    code = f"import time\nt=time.time()\nwhile time.time()-t<{seconds}: pass\n"
    return subprocess.Popen([sys.executable, "-c", code])


def test_180_seeks_with_reads_in_flight_never_abort_the_driver(ray_cluster, tmp_path):
    dataset = str(tmp_path / "tokens")
    prepare_text_dataset(dataset, row_len=65, rows_per_shard=512, max_bytes=400_000)
    bad = str(tmp_path / "bad")
    shutil.copytree(dataset, bad)
    m = read_manifest(bad)
    with open(os.path.join(bad, m.shards[2].path), "r+b") as f:  # garbage mid-shard, same size
        f.seek(m.shards[2].num_bytes // 3)
        f.write(np.random.default_rng(0).integers(0, 256, 2000, dtype=np.uint8).tobytes())

    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    hog = _hog(600)
    done, failures = 0, []
    t0 = time.monotonic()
    try:
        for i in range(DRIVERS):
            with_bad = i % 2 == 1
            # The conditions under which the stock Ray Data shutdown aborted its driver here (one
            # 60-seek driver in ten, `python -m tests.seek_stress --mode raydata --readers 8
            # --read-jitter-ms 40`): 8 reads at a time, each of a random length up to 40 ms, and a
            # random pause up to 40 ms before each seek, so that reads end around it.
            cmd = [sys.executable, "-m", "tests.seek_stress", "--address", ray_cluster,
                   "--dataset", bad if with_bad else dataset, "--seeks", str(SEEKS), "--seed", str(i),
                   "--readers", "8", "--read-jitter-ms", "40", "--read-cpus", "0.25" if i % 3 else "0"]
            if with_bad:
                cmd += ["--bad-shard", "2", "--run-dir", str(tmp_path / f"run{i}")]
                os.makedirs(tmp_path / f"run{i}", exist_ok=True)
            proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
            out = proc.stdout + proc.stderr
            if proc.returncode != 0 or "SEEKS_DONE" not in proc.stdout:
                failures.append(f"driver {i}: exit {proc.returncode}\n{out[-3000:]}")
                continue
            done += int(proc.stdout.split("SEEKS_DONE")[1].split()[0])
    finally:
        hog.kill()
        hog.wait()
    assert not failures, "\n\n".join(failures)
    assert done == DRIVERS * SEEKS, f"{done} seeks done"
    print(f"{done} seeks in {DRIVERS} fresh drivers, {time.monotonic() - t0:.0f} s, no abort")
