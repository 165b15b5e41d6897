"""Every strategy and hybrid trains 10 steps to the single-process parameters (issue 5, test 1).

A tiny GPT (4 layers, n_embd 32, block 16) on gloo ranks; the reference is one process over the
whole global batch. fp64 throughout, so the tolerance can be tight: rtol 1e-9 where the measured
differences are ~1e-12 (see tests/parallel_common.py for why fp32 would need ~1e-4).
Lossy gradient compression (fp16, PowerSGD) is held to stated, looser bounds.
"""

from __future__ import annotations

import pytest
import torch

from raytrain_sys.spec import ParallelSpec
from tests.parallel_common import RTOL_FP64, STEPS, deviation, reference, reform_and_train, train_and_report
from tests.parallel_harness import run_on_ranks

CASES = [
    # id, world, spec, micro_batch_size
    ("ddp", 2, dict(strategy="ddp"), 0),
    ("ddp_accum", 2, dict(strategy="ddp"), 2),  # gradient accumulation over micro-batches
    ("fsdp_full_shard", 2, dict(strategy="fsdp"), 0),
    ("fsdp_zero2_ac_accum", 2, dict(strategy="fsdp", reshard_after_forward=False,
                                    activation_checkpointing=True), 2),
    ("tp_sp", 2, dict(tp=2), 0),
    ("pp_gpipe", 2, dict(pp=2, pp_schedule="gpipe"), 0),
    ("pp_1f1b", 2, dict(pp=2, pp_schedule="1f1b", microbatches=4), 0),
    ("pp_interleaved", 2, dict(pp=2, pp_schedule="interleaved_1f1b", pp_stages_per_rank=2), 0),
    ("hsdp", 4, dict(strategy="hsdp", fsdp=2), 0),
    ("dp_x_tp", 4, dict(strategy="ddp", tp=2), 0),
    ("pp_x_fsdp", 4, dict(strategy="fsdp", pp=2), 0),
    ("pp_x_ddp", 4, dict(strategy="ddp", pp=2, pp_schedule="gpipe"), 0),
    ("fsdp_x_tp_ac", 4, dict(strategy="fsdp", tp=2, activation_checkpointing=True), 0),
]


def assert_matches_reference(out: dict, optim_name: str = "adamw") -> None:
    ref, ref_losses = reference(optim_name=optim_name)
    assert out["params"].keys() == ref.keys()
    for k in ref:
        torch.testing.assert_close(out["params"][k], ref[k], rtol=RTOL_FP64, atol=1e-12,
                                   msg=lambda m: f"{k}: {m}")
    torch.testing.assert_close(torch.tensor(out["losses"]), torch.tensor(ref_losses),
                               rtol=RTOL_FP64, atol=0)
    assert ref_losses[-1] < 0.8 * ref_losses[0]  # it really trained


@pytest.mark.parametrize("name,world,par,micro", CASES, ids=[c[0] for c in CASES])
def test_strategy_matches_single_process(name, world, par, micro):
    out = run_on_ranks(world, train_and_report, ParallelSpec(**par), micro_batch_size=micro)[0]
    assert_matches_reference(out)


def test_pp_x_fsdp_rebuilt_on_new_process_groups_trains_like_one_process():
    """A survivor re-forms the same layout on new groups (issue 29): DTensor's cache of sharding
    decisions handed the gradients of the rebuilt model the old groups' mesh, and the gradient
    norm failed ("Could not resolve the process group registered under the name 8")."""
    losses = run_on_ranks(4, reform_and_train, ParallelSpec(strategy="fsdp", pp=2))[0]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference()[1][:len(losses)]),
                               rtol=RTOL_FP64, atol=0)


LARGE_BATCH_CASES = [
    # LAMB's and LARS's trust ratio needs each parameter's whole norm: sharded (FSDP), split
    # by columns and rows (TP), or cut into stages (PP), every layout must take one process's step.
    ("lamb_fsdp", 2, dict(strategy="fsdp"), "lamb"),
    ("lamb_tp_sp", 2, dict(tp=2), "lamb"),
    ("lars_fsdp_x_tp", 4, dict(strategy="fsdp", tp=2), "lars"),
    ("lars_pp_1f1b", 2, dict(pp=2, pp_schedule="1f1b", microbatches=4), "lars"),
]


@pytest.mark.parametrize("name,world,par,optim_name", LARGE_BATCH_CASES, ids=[c[0] for c in LARGE_BATCH_CASES])
def test_large_batch_optimizers_match_single_process(name, world, par, optim_name):
    out = run_on_ranks(world, train_and_report, ParallelSpec(**par), optim_name=optim_name)[0]
    assert_matches_reference(out, optim_name)


def test_ddp_fp16_hook_is_close():
    """fp16 keeps 11 significant bits: each gradient element is rounded by up to 2^-11 before
    the all-reduce; Adam's per-element normalization turns that into a small change of the step.
    Measured: the final parameters sit 0.5% (of the reference's own distance travelled) away.
    Bound: 2%."""
    ref, _ = reference()
    out = run_on_ranks(2, train_and_report, ParallelSpec(comm_hook="fp16"))[0]
    assert deviation(out["params"], ref) < 0.02


def test_ddp_powersgd_exact_during_warmup():
    """PowerSGD all-reduces uncompressed for its first start_powerSGD_iter steps (the paper's
    warm-up): with it beyond the run, the hook must give the reference exactly."""
    out = run_on_ranks(2, train_and_report, ParallelSpec(comm_hook="powersgd", powersgd_rank=1,
                                                         powersgd_start_iter=STEPS))[0]
    assert_matches_reference(out)


def test_ddp_powersgd_compressed_still_trains():
    """Rank-1 PowerSGD from step 2 is not the reference's gradient (a rank-1 approximation of
    32x32..128x32 matrices, with error feedback), so equality cannot hold. Held instead: the loss
    falls nearly as the reference's does, and the parameters end within 60% of the reference's
    distance travelled (measured 43%; rank 4 gives 22%)."""
    ref, ref_losses = reference()
    out = run_on_ranks(2, train_and_report, ParallelSpec(comm_hook="powersgd", powersgd_rank=1,
                                                         powersgd_start_iter=2))[0]
    assert out["losses"][-1] < 0.85 * out["losses"][0]
    assert out["losses"][-1] < 1.1 * ref_losses[-1]
    assert deviation(out["params"], ref) < 0.6


def test_fsdp_fp32_is_close():
    """The fp32 run, for scale: reduction-order noise amplified by Adam. Elementwise rtol 1e-5
    fails on parameters near zero, so the bound is on the whole: the parameters end within 1e-4
    of the reference's distance travelled (measured 1.5e-6; fp32 vs fp64 references: 2.8e-6)."""
    ref, _ = reference(dtype_name="float32")
    out = run_on_ranks(2, train_and_report, ParallelSpec(strategy="fsdp"), dtype_name="float32")[0]
    assert deviation(out["params"], ref) < 1e-4


def test_fsdp_bf16_mixed_precision_is_close():
    """bf16 parameters in forward and backward (8-bit mantissa: ~0.4% per rounding), gradients
    reduced in fp32 into fp32 master weights. Measured against the fp32 reference: parameters
    4% of the distance travelled away, final loss 0.2% higher. Bounds: 10% and 1%."""
    ref, ref_losses = reference(dtype_name="float32")
    out = run_on_ranks(2, train_and_report, ParallelSpec(strategy="fsdp", mixed_precision="bf16"),
                       dtype_name="float32")[0]
    assert deviation(out["params"], ref) < 0.10
    assert abs(out["losses"][-1] - ref_losses[-1]) < 0.01 * ref_losses[-1]


@pytest.mark.slow
def test_pp_x_fsdp_x_tp_on_8_ranks():
    out = run_on_ranks(8, train_and_report, ParallelSpec(strategy="fsdp", pp=2, tp=2))[0]
    assert_matches_reference(out)
