"""The one place that decides NCCL or gloo, and the device a worker computes on; and, with the
backend, how a rank waiting in a collective that a hung peer will never join is released.

The contract both backends keep (raytrain_sys.control.supervisor.liveness): a collective that
cannot complete raises in the training thread, and the rank stays alive with its state, so the
group re-forms around it. What releases it differs:

- gloo: the hung peer's end. Its sockets close and every rank waiting on it fails within
  milliseconds (measured, 3 ranks, torch 2.13); ``ProcessGroupGloo.abort`` leaves a collective
  already waiting where it is, so it is not asked for (``abort_releases`` False).
- NCCL: a dead peer does not fail a waiting collective (NCCL waits until its watchdog's timeout),
  so the waiting ranks' communicators are aborted on their control path
  (``TrainWorker.abort_group``: ``torch.distributed``'s process-group abort), and the watchdog
  runs with ``TORCH_NCCL_ASYNC_ERROR_HANDLING=2`` (clean up only: a collective that times out or
  is aborted raises in the waiting thread and the process lives on, where 1 and 3, the default,
  end the process and the state it holds with it). Set before the process group is made
  (``env``); a value the user exported wins.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from raytrain_sys.errors import SpecError

# NCCL's watchdog on a failed or aborted collective: clean up the communicators and raise in the
# thread that waits (the process, and the state it holds, lives on).
NCCL_ENV = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}


@dataclass(frozen=True)
class BackendChoice:
    backend: str  # torch.distributed backend name
    device: str  # "cuda:<local index>" or "cpu"
    # environment a worker sets (unless already set) before it makes its process group
    env: dict = field(default_factory=dict)
    # whether aborting a rank's process group releases a collective it waits in (see above)
    abort_releases: bool = False


def choose_backend(requested: str, cuda_available: bool, gpus_per_worker: float,
                   local_gpu_index: int = 0) -> BackendChoice:
    """``auto`` takes NCCL on CUDA workers and gloo otherwise; explicit choices are checked.

    NCCL and gloo run the same contract (same collectives, same process-group lifecycle, a
    collective that cannot complete raises and leaves the rank alive); only the device of the
    tensors differs, and how a waiting rank is released (the module's docstring).
    """
    has_gpu = cuda_available and gpus_per_worker > 0
    if requested == "auto":
        requested = "nccl" if has_gpu else "gloo"
    if requested == "nccl":
        if not has_gpu:
            raise SpecError(
                "parallel.backend",
                "nccl needs CUDA workers (resources.gpus_per_worker > 0 on a machine with CUDA); "
                "use gloo or auto on CPU",
            )
        return BackendChoice("nccl", f"cuda:{local_gpu_index}", dict(NCCL_ENV), abort_releases=True)
    if requested == "gloo":
        return BackendChoice("gloo", f"cuda:{local_gpu_index}" if has_gpu else "cpu")
    raise SpecError("parallel.backend", f"got {requested!r}; allowed: auto, gloo, nccl")
