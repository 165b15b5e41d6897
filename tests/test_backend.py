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
