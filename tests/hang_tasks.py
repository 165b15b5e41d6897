"""Test tasks (``train.task: "tests.hang_tasks:..."``) that hang one rank once, the way a user's
code can: the tiny GPT's next-token loss, unchanged, except on rank ``rank`` at its ``at_call``-th
loss in its process. Once per run, whichever process gets there first: the marker file in
``marker_dir`` is claimed atomically, so a replacement that takes the rank's number does not hang
again. The file holds when the hang began (unix seconds)."""

from __future__ import annotations

import contextlib
import os
import tempfile
import time

import torch.distributed as dist

from raytrain_sys.train.tasks import NextToken

MARKER = "hang-began"


def began_at(marker_dir: str) -> float:
    """When the hang began (the marker's time), or 0.0 when it did not."""
    try:
        with open(os.path.join(marker_dir, MARKER)) as f:
            return float(f.read() or 0.0)
    except FileNotFoundError:
        return 0.0


class _OnceOnRank(NextToken):
    def __init__(self, marker_dir: str, rank: int = 1, at_call: int = 20):
        self.marker_dir, self.rank, self.at_call, self.calls = marker_dir, rank, at_call, 0

    def _now(self) -> bool:
        """Whether this call is the one that hangs (and, if so, it is claimed)."""
        self.calls += 1
        if self.calls < self.at_call or not dist.is_initialized() or dist.get_rank() != self.rank:
            return False
        return _claim(self.marker_dir)


def _claim(marker_dir: str) -> bool:
    """Claim the hang (the marker created atomically, holding when it began); False when a process
    claimed it already."""
    try:
        fd = os.open(os.path.join(marker_dir, MARKER), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    os.write(fd, repr(time.time()).encode())
    os.close(fd)
    return True


class StuckInLoss(_OnceOnRank):
    """The loss never returns (a sleep far longer than any test)."""

    def loss_sum(self, model, batch):
        if self._now():
            time.sleep(3600)
        return super().loss_sum(model, batch)


class SkipsAllReduce(_OnceOnRank):
    """The forward runs under DDP's ``no_sync``: this rank's backward hands no bucket to the
    all-reduce that its peers wait in, and it goes on to the step's agreement."""

    def loss_sum(self, model, batch):
        if self._now():
            with model.no_sync():
                return super().loss_sum(model, batch)
        return super().loss_sum(model, batch)


# A read that never returns: ``data.transform: "tests.hang_tasks:stuck_once_in_a_read_task"``,
# armed by the test (``arm_read_hang``): the first row it sees in a read task (never in the
# driver, which makes a job's first read itself) sleeps far longer than any test; once per arming,
# claimed like the ranks' hang. A fixed place both processes know: a read task gets no argument.
READ_HANG_DIR = os.path.join(tempfile.gettempdir(), "raytrain-sys-tests-read-hang")


def arm_read_hang() -> str:
    """Arm the read hang (its marker cleared); returns the directory ``began_at`` reads."""
    os.makedirs(READ_HANG_DIR, exist_ok=True)
    for name in (MARKER, "armed"):
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(READ_HANG_DIR, name))
    open(os.path.join(READ_HANG_DIR, "armed"), "w").close()
    return READ_HANG_DIR


def disarm_read_hang() -> None:
    with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(READ_HANG_DIR, "armed"))


def stuck_once_in_a_read_task(row: dict) -> dict:
    if os.path.exists(os.path.join(READ_HANG_DIR, "armed")) and _in_a_ray_task() and _claim(READ_HANG_DIR):
        time.sleep(3600)
    return row


def _in_a_ray_task() -> bool:
    from ray._private import worker

    return worker.global_worker.mode == worker.WORKER_MODE
