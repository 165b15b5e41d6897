"""Run a function on N gloo ranks (CPU), for the parallelism tests.

Starting N processes that import torch costs seconds each on a 2-core machine, so a pool of
ranks per world size lives for the whole test session: each rank joins one process group
(FileStore in a temp dir) once and then runs the functions it is sent. A function that fails on
any rank tears the pool down (its peers may be stuck in a collective); the next call starts a
fresh one. Functions must be importable (module level) so they pickle by reference.
"""

from __future__ import annotations

import atexit
import os
import queue
import tempfile
import traceback
from datetime import timedelta

import torch.multiprocessing as mp

JOB_TIMEOUT_S = 240.0  # one function on every rank; generous for a loaded 2-core machine
COLLECTIVE_TIMEOUT_S = 120  # a rank stuck in a collective gives up after this


def _rank_main(rank: int, world_size: int, store_path: str, inbox, outbox) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # N ranks on 2 cores: more threads only contend
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    while True:
        job = inbox.get()
        if job is None:
            break
        fn, args, kwargs = job
        try:
            outbox.put((rank, True, fn(*args, **kwargs)))
        except BaseException:  # noqa: BLE001 - reported to the parent, which fails the test
            outbox.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


class RankPool:
    def __init__(self, world_size: int):
        self.world_size = world_size
        ctx = mp.get_context("spawn")
        self._dir = tempfile.mkdtemp(prefix="rts-ranks-")
        self._outbox = ctx.Queue()
        self._inboxes = [ctx.Queue() for _ in range(world_size)]
        self._procs = [ctx.Process(target=_rank_main, daemon=True,
                                   args=(r, world_size, os.path.join(self._dir, "store"),
                                         self._inboxes[r], self._outbox))
                       for r in range(world_size)]
        for p in self._procs:
            p.start()

    def run(self, fn, *args, **kwargs) -> list:
        """fn(*args, **kwargs) on every rank; the results in rank order."""
        for inbox in self._inboxes:
            inbox.put((fn, args, kwargs))
        results: dict[int, object] = {}
        errors: list[str] = []
        while len(results) + len(errors) < self.world_size:
            try:
                rank, ok, value = self._outbox.get(timeout=JOB_TIMEOUT_S if not errors else 10)
            except queue.Empty:
                errors.append(f"ranks {sorted(set(range(self.world_size)) - set(results))} did "
                              f"not answer (stuck in a collective?)")
                break
            if ok:
                results[rank] = value
            else:
                errors.append(f"rank {rank}:\n{value}")
        if errors:
            raise RuntimeError(f"{fn.__name__} failed on {self.world_size} ranks:\n" + "\n".join(errors))
        return [results[r] for r in range(self.world_size)]

    def alive(self) -> bool:
        return all(p.is_alive() for p in self._procs)

    def close(self) -> None:
        for inbox, p in zip(self._inboxes, self._procs):
            if p.is_alive():
                inbox.put(None)
        for p in self._procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()


_POOLS: dict[int, RankPool] = {}
MAX_POOLS = 2  # the 2- and 4-rank pools stay; an 8-rank pool displaces the oldest


def run_on_ranks(world_size: int, fn, *args, **kwargs) -> list:
    pool = _POOLS.get(world_size)
    if pool is not None and not pool.alive():
        pool.close()
        pool = None
    if pool is None:
        while len(_POOLS) >= MAX_POOLS:
            _POOLS.pop(next(iter(_POOLS))).close()
        pool = _POOLS[world_size] = RankPool(world_size)
    try:
        return pool.run(fn, *args, **kwargs)
    except BaseException:
        _POOLS.pop(world_size, None)
        pool.close()
        raise


def close_pools() -> None:
    while _POOLS:
        _POOLS.popitem()[1].close()


atexit.register(close_pools)
