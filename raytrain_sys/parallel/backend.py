"""The one place that decides NCCL or gloo, and the device a worker computes on."""

from __future__ import annotations

from dataclasses import dataclass

from raytrain_sys.errors import SpecError


@dataclass(frozen=True)
class BackendChoice:
    backend: str  # torch.distributed backend name
    device: str  # "cuda:<local index>" or "cpu"


def choose_backend(requested: str, cuda_available: bool, gpus_per_worker: float,
                   local_gpu_index: int = 0) -> BackendChoice:
    """``auto`` takes NCCL on CUDA workers and gloo otherwise; explicit choices are checked.

    NCCL and gloo run the same contract (same collectives, same process-group lifecycle); only
    the device of the tensors differs.
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
        return BackendChoice("nccl", f"cuda:{local_gpu_index}")
    if requested == "gloo":
        return BackendChoice("gloo", f"cuda:{local_gpu_index}" if has_gpu else "cpu")
    raise SpecError("parallel.backend", f"got {requested!r}; allowed: auto, gloo, nccl")
