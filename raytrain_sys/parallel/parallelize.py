"""The parallelize function: one entry point from (model, mesh, spec) to a trainable replica.

Order of application (torchtitan's, each step needing the previous one's result):
  1. pipeline split: trim the model to this rank's stages (names unchanged);
  2. tensor parallel (+ sequence parallel): parameters become DTensors on the "tp" axis;
  3. activation checkpointing: wraps block forwards, so it must see the TP'd blocks and be seen
     by FSDP; then torch.compile (``compile_model``) of each block, or of the whole model when it
     has no blocks (Module.compile: in place, parameter names unchanged);
  4. data parallel: FSDP2 per block then root (fsdp / hsdp), or DDP (ddp), on the data axes;
  5. pipeline stages and schedule over the "pp" axis, around the wrapped stage modules.
The optimizer is built last, by the caller, from ``parameters_for_optimizer()`` or
``optimizer_module()`` (DDP and FSDP2 keep those tensors for the life of the wrap).

The worker sees one object, ``ParallelModel``, whatever the strategy:

    pm = parallelize(model, mesh, spec.parallel, device, task=task, precision=spec.train.precision)
    optimizer = build_optimizer(pm.optimizer_module(), spec.optim)
    index, size = pm.data_shard()                   # which slice of the global batch to take
    loss_sum = pm.forward_backward(rows, global_units, micro_batch_size)
    grad_norm = pm.clip_grad_norm_(max_norm)
    optimizer.step(); optimizer.zero_grad(set_to_none=True)

Only what plain DDP uses is imported at the top. Pipelining, tensor parallel, FSDP2 and DCP pull
in DTensor and torch._dynamo, about 2 s of imports, and every driver imports this module through
the worker's (the Ray actor class) without ever training: they are imported where a layout or a
call needs them, DTensor checks go through ``is_dtensor`` (raytrain_sys.parallel.dtensor), and a
worker imports its layout's share ahead of joining with ``import_for``.
"""

from __future__ import annotations

import contextlib
import os
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from raytrain_sys.parallel import mesh as meshlib
from raytrain_sys.parallel import phases
from raytrain_sys.parallel.dtensor import is_dtensor
from raytrain_sys.parallel.fsdp import apply_ddp, apply_fsdp
from raytrain_sys.parallel.timing import StepClock
from raytrain_sys.spec import ParallelSpec

if TYPE_CHECKING:
    from raytrain_sys.parallel import pp as pplib


@dataclass
class ParallelModel:
    """A model replica cut by the mesh, with the calls a training step needs.

    Contract (every method is collective over the world unless noted):
    - ``local_model``: this rank's part of the model under the original parameter names (all
      of it unless pipelined); parameters may be DTensors.
    - ``forward_backward(batch, global_units, micro_batch_size)``: ``batch`` is this rank's rows
      of the step's global batch (the ``data_shard()`` slice; TP/PP peers pass the same rows);
      accumulates into ``.grad`` the gradient of (global summed loss / global_units) and returns
      this shard's summed loss (unscaled), equal on TP/PP peers; sum it over the world on ranks
      where ``is_data_leader`` holds.
    - ``clip_grad_norm_(max_norm)``: global grad norm over every shard and stage; clips in place.
    - ``full_state_dict()``: plain tensors, original names, the whole model, on every rank.
    - ``dcp_state_dict / load_dcp_state_dict / save_dcp / load_dcp``: reshardable checkpoints
      of model + optimizer through torch.distributed.checkpoint.
    """

    mesh: DeviceMesh
    spec: ParallelSpec
    device: str
    local_model: nn.Module
    task: object = None
    precision: str = "fp32"
    ddp_modules: list[nn.Module] = field(default_factory=list)
    fsdp_roots: list[nn.Module] = field(default_factory=list)
    split: pplib.PipelineSplit | None = None
    schedule: object = None
    loss_fn: pplib.SummedLoss | None = None
    tied_group: dist.ProcessGroup | None = None
    dp_allreduce_group: dist.ProcessGroup | None = None  # pipeline + ddp: see parallelize()
    # Splits forward_backward into this rank's compute and its exposed gradient-collective wait
    # (read by the worker after each step: ``clock.split()``); raytrain_sys.parallel.timing.
    clock: StepClock = field(default_factory=StepClock)
    _ckpt_group: dist.ProcessGroup | None = None
    _pending_save: Future | None = None

    # ------------------------------------------------------------------ layout
    def data_shard(self) -> tuple[int, int]:
        return meshlib.data_shard(self.mesh)

    @property
    def data_parallel_size(self) -> int:
        return self.data_shard()[1]

    @property
    def is_data_leader(self) -> bool:
        return meshlib.is_data_leader(self.mesh)

    def optimizer_module(self) -> nn.Module:
        return self.local_model

    def parameters_for_optimizer(self) -> list[nn.Parameter]:
        return [p for p in self.local_model.parameters() if p.requires_grad]

    # ------------------------------------------------------------------ the step
    def _autocast(self):
        if self.precision == "bf16":
            return torch.autocast(device_type=self.device.split(":")[0], dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _forward_module(self) -> nn.Module:
        return self.ddp_modules[0] if self.ddp_modules else self.local_model

    def _sync(self, last: bool):
        if self.ddp_modules:
            return contextlib.nullcontext() if last else self.ddp_modules[0].no_sync()
        for root in self.fsdp_roots:
            root.set_requires_gradient_sync(last)
        return contextlib.nullcontext()

    def forward_backward(self, batch: dict[str, torch.Tensor], global_units: int,
                         micro_batch_size: int = 0) -> float:
        scale = self.data_parallel_size / global_units
        self.local_model.train()
        self.clock.start()
        if self.schedule is not None:
            return self._pipeline_forward_backward(batch, scale)
        rows = len(next(iter(batch.values())))
        micro = micro_batch_size or rows
        starts = list(range(0, rows, micro))
        total = torch.zeros((), dtype=torch.float64)
        for i, start in enumerate(starts):
            chunk = {k: v[start:start + micro] for k, v in batch.items()}
            # Gradients are reduced once per step, on the last micro-batch.
            self.clock.mark(phases.FORWARD, i)
            with self._sync(i == len(starts) - 1), self._autocast():
                loss = self.task.loss_sum(self._forward_module(), chunk)
            self.clock.mark(phases.BACKWARD, i)
            (loss * scale).backward()
            total += loss.detach().double().cpu()
        if self.dp_allreduce_group is not None:
            self.clock.grads_ready()
            self.clock.mark(phases.ALL_REDUCE, group=tuple(dist.get_process_group_ranks(self.dp_allreduce_group)))
            _allreduce_grads(self.parameters_for_optimizer(), self.dp_allreduce_group)
        return float(total)

    def _pipeline_forward_backward(self, batch: dict[str, torch.Tensor], scale: float) -> float:
        # Language modelling only: the schedule needs inputs and targets apart, and Task does not
        # split them (NextToken's split is predict token t+1 from tokens <= t).
        rows = batch["tokens"].long()
        inputs, targets = rows[:, :-1], rows[:, 1:]
        microbatches = self.schedule._n_microbatches
        if rows.size(0) < microbatches:
            raise ValueError(f"{rows.size(0)} rows cannot fill {microbatches} pipeline micro-batches;"
                             f" lower parallel.microbatches or raise train.global_batch_size")
        from raytrain_sys.parallel import pp as pplib

        self.loss_fn.scale = scale
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.split.has_first else ()
        kwargs = {"target": targets, "losses": losses} if self.split.has_last else {}
        self.clock.mark(phases.FORWARD)  # and the backward, sends and receives: the schedule's
        with self._autocast():
            self.schedule.step(*args, **kwargs)
        self.clock.grads_ready()  # then the replicas' all-reduce, tied weights' sum, loss broadcast
        if self.dp_allreduce_group is not None:
            _allreduce_grads(self.parameters_for_optimizer(), self.dp_allreduce_group)
        pplib.sync_tied_grads(self.split, self.tied_group)
        total = torch.zeros((), dtype=torch.float64)
        if self.split.has_last:
            total += sum(l.detach().double().cpu() for l in losses) / scale
        pp_group = self.mesh["pp"].get_group()
        dist.broadcast(total, group=pp_group, group_src=meshlib.degree(self.mesh, "pp") - 1)
        return float(total)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> float:
        """torch.nn.utils.clip_grad_norm_ over every shard and stage: sharded DTensor grads
        count their shards once, replicated ones once, and PP stages add up their squares."""
        params = [p for p in self.local_model.parameters() if p.grad is not None]
        skip = None
        if self.split:
            from raytrain_sys.parallel import pp as pplib

            skip = pplib.tied_duplicate(self.split)
        groups: dict[tuple, list[torch.Tensor]] = {}
        for p in params:
            if p is skip:
                continue
            g = p.grad
            key = (id(g.device_mesh), tuple(g.placements)) if is_dtensor(g) else ("plain",)
            groups.setdefault(key, []).append(g)
        sq = torch.zeros((), dtype=torch.float64, device=self.device)
        for grads in groups.values():
            norm = torch.nn.utils.get_total_norm(grads, 2.0)
            if is_dtensor(norm):
                norm = norm.full_tensor()
            sq += norm.double() ** 2
        if meshlib.degree(self.mesh, "pp") > 1:
            dist.all_reduce(sq, group=self.mesh["pp"].get_group())
        total = sq.sqrt()
        if max_norm and max_norm > 0:
            coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)  # torch's clip_grad_norm_ rule
            for p in params:
                p.grad.mul_(coef.to(p.grad.dtype).item())
        return float(total)

    # ------------------------------------------------------------------ state
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model as plain CPU tensors under the original names (for export)."""
        # module.state_dict() keeps the original names (DDP's inner module, FSDP2 and TP
        # register DTensors under them); full_tensor() gathers each over its mesh.
        sd = {k: (v.full_tensor() if is_dtensor(v) else v).detach().cpu().clone()
              for k, v in self.local_model.state_dict().items()}
        if meshlib.degree(self.mesh, "pp") > 1:
            parts: list = [None] * meshlib.degree(self.mesh, "pp")
            dist.all_gather_object(parts, sd, group=self.mesh["pp"].get_group())
            sd = {k: v for part in parts for k, v in part.items()}
        return sd

    def full_optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, dict]:
        """The optimizer state as plain CPU tensors keyed by parameter name (every stage's), on
        every rank: for tests and inspection. A tied parameter appears under its first name."""
        names = {id(p): n for n, p in self.local_model.named_parameters()}
        out = {}
        for p, st in optimizer.state.items():
            out[names[id(p)]] = {k: (v.full_tensor() if is_dtensor(v) else v).detach().cpu().clone()
                                 if isinstance(v, torch.Tensor) else v for k, v in st.items()}
        if meshlib.degree(self.mesh, "pp") > 1:
            parts: list = [None] * meshlib.degree(self.mesh, "pp")
            dist.all_gather_object(parts, out, group=self.mesh["pp"].get_group())
            out = {k: v for part in parts for k, v in part.items()}
        return out

    def memory(self, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
        """This rank's bytes of parameters, gradients and optimizer state (local shards)."""
        from raytrain_sys.parallel.memory import rank_bytes

        return rank_bytes(self.local_model, optimizer).as_dict()

    def dcp_state_dict(self, optimizer: torch.optim.Optimizer) -> dict:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.local_model, optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def load_dcp_state_dict(self, optimizer: torch.optim.Optimizer, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(self.local_model, optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])

    def _checkpoint_group(self) -> dist.ProcessGroup:
        # A group of its own: an async save's collectives run in a background thread and must
        # not interleave with the training step's on the default group.
        if self._ckpt_group is None:
            self._ckpt_group = dist.new_group(backend="gloo")
        return self._ckpt_group

    def save_dcp(self, optimizer: torch.optim.Optimizer, path: str | os.PathLike,
                 async_save: bool = False) -> Future | None:
        """Write a sharded checkpoint to the local directory ``path``. With ``async_save`` the
        tensors are staged (copied) before returning and written in the background; call
        ``wait_for_save()`` (or the returned future's ``result()``) before the next save."""
        import torch.distributed.checkpoint as dcp

        self.wait_for_save()
        state = self.dcp_state_dict(optimizer)
        group = self._checkpoint_group()
        if async_save:
            fut = dcp.async_save(state, checkpoint_id=os.fspath(path), process_group=group)
            self._pending_save = getattr(fut, "upload_completion", fut)
            return self._pending_save
        dcp.save(state, checkpoint_id=os.fspath(path), process_group=group)
        return None

    def wait_for_save(self) -> None:
        if self._pending_save is not None:
            self._pending_save.result()
            self._pending_save = None

    def load_dcp(self, optimizer: torch.optim.Optimizer, path: str | os.PathLike) -> None:
        """Load a checkpoint written by ``save_dcp`` at any layout or world size (DCP reshards)."""
        import torch.distributed.checkpoint as dcp

        self.wait_for_save()
        state = self.dcp_state_dict(optimizer)  # the template: this layout's shards
        names = [list(g["params"]) for g in state["optim"]["param_groups"]]
        dcp.load(state, checkpoint_id=os.fspath(path), process_group=self._checkpoint_group())
        # Hyperparameters come from the checkpoint, the parameter names of each group from this
        # layout: a tied weight is one name in one layout and two (one per stage) in a pipeline.
        for group, own in zip(state["optim"]["param_groups"], names):
            group["params"] = own
        self.load_dcp_state_dict(optimizer, state)


def apply_activation_checkpointing(block: nn.Module) -> None:
    """Recompute ``block``'s activations in backward instead of keeping them.

    The block's own ``forward`` is wrapped (an instance attribute), so parameter names stay
    unchanged and the block's hooks (TP input layouts, FSDP unshard) still run once around it.
    The composable ``torch.distributed._composable.checkpoint`` was tried first: with sequence
    parallel its recompute sees the pre-hook's input, not the hooked one, and fails its shape check.
    """
    import functools

    from torch.utils.checkpoint import checkpoint

    if getattr(block, "_recomputes_activations", False):
        return  # a replicated layout wraps the same blocks again at every rebuild
    inner = block.forward
    block.forward = functools.partial(checkpoint, inner, use_reentrant=False)
    block._recomputes_activations = True


@torch.no_grad()
def _broadcast_params(model: nn.Module, group: dist.ProcessGroup) -> None:
    src = dist.get_global_rank(group, 0)
    for t in list(model.parameters()) + list(model.buffers()):
        dist.broadcast(t._local_tensor if is_dtensor(t) else t, src=src, group=group)


@torch.no_grad()
def _allreduce_grads(params: list[nn.Parameter], group: dist.ProcessGroup) -> None:
    """Average gradients over ``group`` in one flat all-reduce per dtype (what DDP does)."""
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    grads = [p.grad._local_tensor if is_dtensor(p.grad) else p.grad
             for p in params if p.grad is not None]
    n = dist.get_world_size(group)
    for dtype in {g.dtype for g in grads}:
        same = [g for g in grads if g.dtype == dtype]
        flat = _flatten_dense_tensors(same)
        dist.all_reduce(flat, group=group)
        flat.div_(n)
        for g, reduced in zip(same, _unflatten_dense_tensors(flat, same)):
            g.copy_(reduced)


def import_for(parallel_spec: ParallelSpec) -> None:
    """Import now what ``parallelize`` and the optimizer will import for this spec.

    A worker calls it while it waits to join (``TrainWorker.prepare``), so that joining a group
    costs a rebuild and not seconds of imports with every member waiting. torch.optim imports
    torch._dynamo on an optimizer's first construction, and with it FSDP2 and DTensor, whatever
    the strategy; the pipeline and TP modules only their layouts need.
    """
    import torch._dynamo  # noqa: F401

    spec = parallel_spec
    if spec.pp > 1:
        from raytrain_sys.parallel import pp  # noqa: F401
    if spec.tp > 1:
        from raytrain_sys.parallel import tp  # noqa: F401
    if spec.strategy in ("fsdp", "hsdp"):
        import torch.distributed.fsdp  # noqa: F401


def import_for_any() -> None:
    """``import_for`` every layout: a warm spare (raytrain_sys.control.spares) does it while it
    waits for a job, whatever that job's layout will be."""
    import torch.distributed.fsdp  # noqa: F401
    import torch._dynamo  # noqa: F401

    from raytrain_sys.extensions import build_model  # noqa: F401
    import raytrain_sys.models  # noqa: F401
    from raytrain_sys.parallel import pp, tp  # noqa: F401


def wrap_blocks(model: nn.Module, parallel_spec: ParallelSpec) -> list[nn.Module]:
    """The repeated blocks: FSDP units and what activation checkpointing recomputes.
    ``parallel.fsdp_wrap`` names their classes for any model (inner ones first, as FSDP2 wants
    them); without it, a GPT's layers, and a model without blocks is one unit."""
    if parallel_spec.fsdp_wrap:
        wanted = set(parallel_spec.fsdp_wrap)
        found = [m for m in model.modules() if type(m).__name__ in wanted and m is not model]
        return found[::-1]  # modules() lists parents before children
    return list(model.transformer.h.values()) if hasattr(model, "transformer") else []


def _compile(blocks: list[nn.Module], model: nn.Module) -> None:
    # A replicated layout wraps the same modules again at every rebuild: compile them once.
    for m in blocks or [model]:
        if getattr(m, "_compiled_call_impl", None) is None:
            m.compile()


def parallelize(model: nn.Module, mesh: DeviceMesh, parallel_spec: ParallelSpec, device: str,
                task=None, precision: str = "fp32", compile_model: bool = False,
                clock: StepClock | None = None) -> ParallelModel:
    """Cut ``model`` (built and initialized identically on every rank) by ``mesh``.

    The model is changed in place (pipeline stages drop layers, TP/FSDP swap parameters for
    DTensors); build the optimizer from the result, not before. ``clock``: the step timer the
    model's gradient reductions report to (a new one when not given).
    """
    spec = parallel_spec
    assert tuple(mesh.mesh_dim_names) == meshlib.MESH_AXES, f"mesh axes {mesh.mesh_dim_names}"
    pp = meshlib.degree(mesh, "pp")
    tp = meshlib.degree(mesh, "tp")
    dp, fsdp = meshlib.degree(mesh, "dp"), meshlib.degree(mesh, "fsdp")

    if (tp > 1 or pp > 1) and not hasattr(model, "transformer"):
        raise ValueError(f"tensor and pipeline plans exist for the GPT only, not {type(model).__name__}")

    # 1. pipeline split (names unchanged: layers are deleted from a ModuleDict keyed by index)
    split = None
    if pp > 1:
        from raytrain_sys.parallel import pp as pplib

        split = pplib.split_gpt(model, meshlib.local_index(mesh, "pp"), pp, spec.pp_schedule,
                                spec.pp_stages_per_rank)
    stage_modules: list[nn.Module] = split.modules if split else [model]
    # The repeated blocks (FSDP units, activation checkpointing); a pipeline stage's are those
    # it kept. A model without them (the CNN) is one FSDP unit and recomputes nothing.
    blocks = wrap_blocks(model, spec)

    # 2. tensor parallel + sequence parallel
    if tp > 1:
        from raytrain_sys.parallel.tp import apply_tp

        apply_tp(model, meshlib.submesh(mesh, "tp"))

    # 3. activation checkpointing: recompute each block's activations in backward
    if spec.activation_checkpointing:
        for block in blocks:
            apply_activation_checkpointing(block)
    if compile_model:
        _compile(blocks, model)

    # 4. data parallel
    pm = ParallelModel(mesh=mesh, spec=spec, device=device, local_model=model, task=task,
                       precision=precision, split=split, clock=clock or StepClock())
    if spec.strategy in ("fsdp", "hsdp") and dp * fsdp > 1:
        dp_mesh = meshlib.submesh(mesh, "dp", "fsdp") if spec.strategy == "hsdp" else meshlib.submesh(mesh, "fsdp")
        apply_fsdp(blocks, stage_modules, dp_mesh, spec.reshard_after_forward, spec.mixed_precision)
        pm.fsdp_roots = stage_modules
    elif spec.strategy == "ddp" and dp > 1 and (split is not None or tp > 1):
        # Replicas without the DDP module, one flat all-reduce of the gradients after backward:
        # - in a pipeline schedule DDP fails from the second step in torch 2.13 (the schedule
        #   runs every forward under no_sync, DDP never rebuilds its buckets, its reducer asserts);
        # - on a TP model DDP(device_mesh=...) swaps DTensor parameters for new local Parameter
        #   objects around every forward, so an optimizer built once updates stale tensors and
        #   state_dict() loses the TP parameters.
        # What is lost is DDP's overlap of the all-reduce with backward, and its comm hooks.
        pm.dp_allreduce_group = meshlib.submesh(mesh, "dp").get_group()
        _broadcast_params(model, pm.dp_allreduce_group)
    elif spec.strategy == "ddp" and dp > 1:
        dp_mesh = meshlib.submesh(mesh, "dp")
        stage_modules = [apply_ddp(m, dp_mesh, device, spec.comm_hook, spec.powersgd_rank,
                                   spec.powersgd_start_iter, pm.clock) for m in stage_modules]
        pm.ddp_modules = stage_modules

    # 5. pipeline schedule
    if split is not None:
        pp_group = mesh["pp"].get_group()
        stages = [pplib.PipelineStage(m, s, split.num_stages, torch.device(device), group=pp_group)
                  for m, s in zip(stage_modules, split.stage_ids)]
        v = len(split.stage_ids)
        pm.loss_fn = pplib.SummedLoss()
        pm.schedule = pplib.build_schedule(stages, spec.pp_schedule, spec.microbatches or pp * v,
                                           pm.loss_fn)
        pm.tied_group = pplib.tied_pair_group(mesh) if split.tied else None
    return pm


__all__ = ["ParallelModel", "import_for", "parallelize"]
