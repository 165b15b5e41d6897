"""NCCL/gloo selection: the CUDA path cannot run here, its choice is tested."""

import pytest

from raytrain_sys.errors import SpecError
from raytrain_sys.parallel.backend import choose_backend


def test_auto_takes_nccl_on_cuda_workers():
    assert choose_backend("auto", cuda_available=True, gpus_per_worker=1).backend == "nccl"
    assert choose_backend("auto", True, 1, local_gpu_index=3).device == "cuda:3"


@pytest.mark.parametrize("cuda,gpus", [(False, 0), (False, 1), (True, 0)])
def test_auto_takes_gloo_on_cpu(cuda, gpus):
    choice = choose_backend("auto", cuda, gpus)
    assert (choice.backend, choice.device) == ("gloo", "cpu")


def test_nccl_without_cuda_names_the_field():
    with pytest.raises(SpecError, match="parallel.backend"):
        choose_backend("nccl", cuda_available=False, gpus_per_worker=0)


def test_gloo_on_gpus_keeps_tensors_on_the_gpu():
    assert choose_backend("gloo", True, 1).device == "cuda:0"


@pytest.mark.parametrize("requested, cuda, gpus, backend, env, abort_releases", [
    ("auto", True, 1, "nccl", {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}, True),
    ("nccl", True, 1, "nccl", {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}, True),
    ("auto", False, 0, "gloo", {}, False),
    ("gloo", True, 1, "gloo", {}, False),
], ids=[
    "CUDA workers: NCCL, its watchdog cleaning up and raising in the waiting thread (the process and its "
    "state live on), and a waiting rank released by aborting its communicators",
    "NCCL asked for on CUDA workers: the same",
    "CPU workers: gloo, nothing to set; a waiting rank is released by the hung peer's end, gloo's abort "
    "leaves a waiting collective where it is",
    "gloo asked for on CUDA workers: the same as on CPU",
])
def test_how_a_rank_waiting_on_a_hung_peer_is_released(requested, cuda, gpus, backend, env, abort_releases):
    choice = choose_backend(requested, cuda, gpus)
    assert (choice.backend, choice.env, choice.abort_releases) == (backend, env, abort_releases)
