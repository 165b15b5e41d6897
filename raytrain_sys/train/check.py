"""Checks of a model, a task and rows together: before a run (``check_job_inputs``, in pre-flight)
and before a long run, by the user (``check_task``).

``check_task`` is the exactness contract of ``raytrain_sys.train.tasks`` put to the test: the
gradient one worker computes over a global batch must equal the one N workers compute from their
uneven shares (each rank's summed loss scaled by N / global units, then averaged by the
all-reduce, exactly as ``ParallelModel.forward_backward`` does) and the one micro-batches
accumulate. It runs in one process, in float64, with no process group: the arithmetic of the ranks,
not their transport, is what a task can get wrong (a mean instead of a sum, batch statistics,
units that are not a sum over rows).
"""

from __future__ import annotations

import copy
import logging
from typing import Any, Iterable

import numpy as np
import torch

from raytrain_sys.errors import SpecError, UserError

log = logging.getLogger(__name__)

# Above this many parameters the pre-flight check does not build the model on the driver's CPU
# (a meta build still checks the factory): a driver may not have the memory of a worker.
PREFLIGHT_MAX_PARAMS = 200_000_000
PREFLIGHT_ROWS = 4  # rows the pre-flight check runs the task on


class TaskCheckFailed(UserError):
    """A task broke the exactness contract (``check_task``)."""


def _tensors(batch: dict[str, np.ndarray], float_dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in batch.items():
        t = torch.tensor(np.asarray(v))
        if float_dtype is not None and t.is_floating_point():
            t = t.to(float_dtype)
        out[k] = t
    return out


def _rows(batch: dict[str, Any]) -> int:
    return len(next(iter(batch.values())))


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
            for n, p in model.named_parameters() if p.requires_grad}


def _slice(batch: dict[str, np.ndarray], sl: slice) -> dict[str, np.ndarray]:
    return {k: v[sl] for k, v in batch.items()}


def check_task(task, model: torch.nn.Module, batch: dict[str, np.ndarray],
               world_sizes: Iterable[int] = (2, 3), micro_batch_rows: Iterable[int] = (1,),
               rtol: float = 1e-9, atol: float = 1e-12) -> dict[str, float]:
    """Check that ``task`` trains ``model`` on ``batch`` (a dict of column arrays, a global batch)
    with the same gradient on 1 worker as on each of ``world_sizes`` workers and with micro-batches
    of ``micro_batch_rows`` rows. The model is copied to float64 (the check wants no rounding
    noise) and left unchanged; keep dropout at 0 for it. Returns the largest relative difference
    per case; raises ``TaskCheckFailed`` naming the case and the parameter when one differs, or
    when ``units`` is not a sum over rows."""
    from raytrain_sys.data.order import deal
    from raytrain_sys.data.reads import row_units

    rows = _rows(batch)
    model = copy.deepcopy(model).double()
    model.train()
    units = int(task.units(batch))
    if units <= 0:
        raise TaskCheckFailed(f"task.units gave {units} for {rows} rows; it must count the terms "
                              f"loss_sum adds up (at least one)")
    per_row = row_units(task, batch)
    if int(per_row.sum()) != units:
        raise TaskCheckFailed(f"task units are not a sum over rows: units(batch) = {units}, the "
                              f"rows' units add up to {int(per_row.sum())}")

    def gradient(cuts: list[list[slice]]) -> dict[str, torch.Tensor]:
        """``cuts``: per data-parallel rank, its micro-batches. What the ranks accumulate, averaged."""
        model.zero_grad(set_to_none=True)
        n = len(cuts)
        for micro in cuts:
            for sl in micro:
                part = _slice(batch, sl)
                if not _rows(part):
                    continue
                loss = task.loss_sum(model, _tensors(part, torch.float64))
                (loss * n / units / n).backward()  # scale n / units, then DDP's mean over n
        return _grads(model)

    reference = gradient([[slice(0, rows)]])
    report: dict[str, float] = {}
    cases = [(f"{n} workers", [[sl] for sl in deal(rows, n)]) for n in world_sizes if n <= rows]
    for m in micro_batch_rows:
        cases.append((f"micro-batches of {m} rows", [[slice(a, min(a + m, rows)) for a in range(0, rows, m)]]))
    for name, cuts in cases:
        got = gradient(cuts)
        worst = 0.0
        for key, ref in reference.items():
            diff = (got[key] - ref).abs()
            scale = ref.abs()
            if not torch.all(diff <= atol + rtol * scale):
                raise TaskCheckFailed(
                    f"{name}: the gradient of {key} differs from one worker's (max abs difference "
                    f"{float(diff.max()):.3g}, values up to {float(scale.max()):.3g}): loss_sum must "
                    f"be a sum over rows of terms that depend on their row only (reduction='sum', no "
                    f"batch statistics), and units(batch) the count of those terms")
            worst = max(worst, float((diff / scale.clamp_min(atol)).max()) if diff.numel() else 0.0)
        report[name] = worst
    model.zero_grad(set_to_none=True)
    return report


# ----------------------------------------------------------------------------- pre-flight
def warm_up() -> None:
    """What a new process pays once at its first run, paid ahead by a process that waits for
    one (a spare runner, a warm spare worker): the preflight builds the model on the meta device, and torch's first
    meta-device ``normal_`` imports its meta kernels (about 800 modules: 0.7-1.3 s on an idle
    core, several seconds on a core a training job keeps busy); then a forward and backward of
    a tiny model: the preflight's task check, or a worker's first step (autograd's first use);
    and the spec's checker (``spec.prepare_checks``: pydantic's import and the model's build,
    0.15 s on an idle core), which the job's spec meets first when it comes."""
    from raytrain_sys.extensions import build_model
    from raytrain_sys.spec import ModelSpec, prepare_checks

    prepare_checks()

    tiny = ModelSpec(block_size=4, n_layer=1, n_head=1, n_embd=4, vocab_size=8)
    with torch.device("meta"):
        build_model(tiny)
    model = build_model(tiny)
    model(torch.zeros(1, 4, dtype=torch.long)).float().sum().backward()


def check_job_inputs(spec, manifest, task) -> None:
    """Build the model and run the task on a few rows of the dataset, on the driver, so that a
    factory that fails, a task that does not fit the rows, or a missing column stops the run
    before any Ray resource is taken, naming the field."""
    from raytrain_sys.extensions import build_model, model_field

    field = model_field(spec.model)
    with torch.device("meta"):
        try:
            meta = build_model(spec.model)
        except SpecError:
            meta = None  # may be the meta device itself: the CPU build below tells
    if meta is not None:
        _check_fsdp_wrap(spec, meta)
        if sum(p.numel() for p in meta.parameters()) > PREFLIGHT_MAX_PARAMS:
            return
    torch.manual_seed(spec.train.seed)
    model = build_model(spec.model)
    if meta is None:
        _check_fsdp_wrap(spec, model)
    if not any(p.requires_grad for p in model.parameters()):
        raise SpecError(field, "the model has no trainable parameters")
    if spec.train.precision == "fp64":
        model = model.double()
    if spec.data.sequences != "rows":
        return  # rows are made of documents by the read tasks: NextToken reads them
    from raytrain_sys.data.reads import sample_rows
    from raytrain_sys.data.shards import BadShardError

    try:
        rows = sample_rows(spec, manifest, PREFLIGHT_ROWS)
    except BadShardError as exc:
        # The first shard is bad: data.on_bad_shard decides, in the step that reads it.
        log.warning("pre-flight could not read rows to check the task on: %s", exc)
        return
    check_task_on_rows(task, model, rows, spec)


def check_task_on_rows(task, model: torch.nn.Module, rows: dict[str, np.ndarray], spec) -> None:
    from raytrain_sys.data.reads import row_units

    label = spec.train.task or f"the task of model.name {spec.model.name}"
    where = "train.task" if spec.train.task else "model.name"
    columns = ", ".join(rows) or "none"
    try:
        units = task.units(rows)
        per_row = row_units(task, rows)
    except KeyError as exc:
        raise SpecError(where, f"{label} reads column {exc} that the rows do not have (they have: "
                               f"{columns}; see data.columns and data.transform)") from None
    except Exception as exc:
        raise SpecError(where, f"{label}: units() raised {type(exc).__name__}: {exc}") from None
    n = _rows(rows)
    if isinstance(units, bool) or not isinstance(units, (int, np.integer)) or units < 0:
        raise SpecError(where, f"{label}: units() returned {units!r} for {n} rows; it must be a "
                               f"whole number of loss terms, 0 or more")
    if per_row.shape != (n,) or int(per_row.sum()) != int(units):
        raise SpecError(where, f"{label}: units() gives {units} for {n} rows but its per-row units "
                               f"(row_units, or units() of each row) add up to {int(per_row.sum())} "
                               f"over {per_row.shape[0] if per_row.ndim else 0} rows; units must be a "
                               f"sum over the batch's rows")
    dtype = next(model.parameters()).dtype
    try:
        loss = task.loss_sum(model, _tensors(rows, dtype if dtype == torch.float64 else None))
    except KeyError as exc:
        raise SpecError(where, f"{label} reads column {exc} that the rows do not have (they have: "
                               f"{columns}; see data.columns and data.transform)") from None
    except Exception as exc:
        raise SpecError(where, f"{label}: loss_sum(model, batch of {n} rows with columns {columns}) "
                               f"raised {type(exc).__name__}: {exc}") from None
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise SpecError(where, f"{label}: loss_sum returned {shape}; it must be a scalar tensor "
                               f"(the summed loss of the rows)")
    if not loss.requires_grad:
        raise SpecError(where, f"{label}: loss_sum's result does not depend on the model's "
                               f"parameters (no gradient)")


def _check_fsdp_wrap(spec, model: torch.nn.Module) -> None:
    names = spec.parallel.fsdp_wrap
    if not names:
        return
    present = {type(m).__name__ for m in model.modules()}
    missing = [n for n in names if n not in present]
    if missing:
        raise SpecError("parallel.fsdp_wrap", f"no module of class {', '.join(missing)} in the model "
                                              f"(its classes: {', '.join(sorted(present))})")
