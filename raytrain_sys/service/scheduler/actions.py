"""The scheduler's output: what one pass asks the reconciler to do to each job.

Owns ``Admit``, ``Grow``, ``Shrink``, ``Pause`` and ``Wait`` (with a ``WaitCause``), each with
its sentence for people (``__str__``), and ``Action``, their union; the reconciler carries them
out, and an unknown one raises there. Pure values: no Ray, no SQL, no clock.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from raytrain_sys.service.flavors import DEFAULT_FLAVOR
from raytrain_sys.service.model import WaitCause


@dataclass(frozen=True)
class Admit:
    """Start a queued job (or resume a paused one from its checkpoint) on ``workers`` of
    ``flavor``; ``provisioning``: admitted against capacity not up yet (autoscaling), so its
    workers wait for nodes."""

    job_id: int
    workers: int
    reason: str
    flavor: str = DEFAULT_FLAVOR
    provisioning: bool = False

    def __str__(self) -> str:
        where = "" if self.flavor == DEFAULT_FLAVOR else f" of {self.flavor}"
        return f"admit job {self.job_id} on {self.workers} workers{where}: {self.reason}"


@dataclass(frozen=True)
class Grow:
    """Add workers to a running elastic job, up to ``to_workers`` in all."""

    job_id: int
    to_workers: int
    reason: str

    def __str__(self) -> str:
        return f"grow job {self.job_id} to {self.to_workers} workers: {self.reason}"


@dataclass(frozen=True)
class Shrink:
    """Drain a running elastic job down to ``to_workers`` at a step boundary (no work lost)."""

    job_id: int
    to_workers: int
    reason: str

    def __str__(self) -> str:
        return f"shrink job {self.job_id} to {self.to_workers} workers: {self.reason}"


@dataclass(frozen=True)
class Pause:
    """Checkpoint a running job, release its workers, queue it to resume later."""

    job_id: int
    reason: str
    work_at_risk_worker_s: float = 0.0  # workers x seconds since its last durable checkpoint

    def __str__(self) -> str:
        return f"pause job {self.job_id}: {self.reason}"


@dataclass(frozen=True)
class Wait:
    """Leave a waiting job waiting, and say why: ``cause`` for machines (a metric label, a
    filter), ``reason`` the sentence for people."""

    job_id: int
    cause: WaitCause
    reason: str

    def __str__(self) -> str:
        return f"job {self.job_id} waits ({self.cause.value}): {self.reason}"


Action = Union[Admit, Grow, Shrink, Pause, Wait]

__all__ = ["Admit", "Grow", "Shrink", "Pause", "Wait", "Action"]
