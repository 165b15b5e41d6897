"""The training worker: one Ray actor per GPU or CPU slot.

The actor keeps the model and optimizer in memory across steps and across process-group
rebuilds. The driver hands it a rank, world size, master address/port and a generation number;
the worker tears down and re-creates its process group and wraps the same module again.

Control calls (node info, ping) run in their own concurrency group, so they are answered while a
step is blocked inside a collective.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
from datetime import timedelta
from typing import Any

import numpy as np
import ray
import torch
import torch.distributed as dist

from raytrain_sys.parallel.backend import choose_backend
from raytrain_sys.parallel.ddp import parallelize_ddp
from raytrain_sys.spec import JobSpec, from_dict
from raytrain_sys.train.optim import build_optimizer, lr_at
from raytrain_sys.train.tasks import task_for

log = logging.getLogger(__name__)

TRAIN_STATE_FILE = "train_state.pt"
# How long joining a process group may wait for the other members (see setup_group).
RENDEZVOUS_TIMEOUT_S = 30.0


def _step_seed(seed: int, step: int, rank: int) -> int:
    # Dropout masks as a pure function of (seed, step, rank): nothing to save for an exact resume.
    return (seed * 1_000_003 + step * 10_007 + rank) % (2**63 - 1)


@ray.remote(concurrency_groups={"control": 2})
class TrainWorker:
    def __init__(self, spec_dict: dict[str, Any]):
        self.spec: JobSpec = from_dict(spec_dict)
        threads = max(1, int(self.spec.resources.cpus_per_worker))
        torch.set_num_threads(threads)
        self.rank = -1
        self.world_size = 0
        self.generation = -1
        self.device = "cpu"
        self.model: torch.nn.Module | None = None
        self.ddp: torch.nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.step_done = 0  # optimizer steps applied to this replica's state
        self.task = task_for(self.spec.model.name)

    # ------------------------------------------------------------------ control path
    @ray.method(concurrency_group="control")
    def node_info(self) -> dict[str, Any]:
        import psutil

        return {"ip": ray.util.get_node_ip_address(), "node_id": ray.get_runtime_context().get_node_id(),
                "pid": os.getpid(), "create_time": psutil.Process().create_time()}

    def prepare(self) -> dict[str, Any]:
        """Build model and optimizer now, while the group trains without this worker: joining
        later costs a process-group rebuild and a state sync, not a model build. Returns
        ``node_info()``."""
        if self.model is None:
            self._select_device()
            self._build()
        return self.node_info()

    @ray.method(concurrency_group="control")
    def free_port(self) -> int:
        with socket.socket() as s:
            s.bind(("", 0))
            return s.getsockname()[1]

    @ray.method(concurrency_group="control")
    def ping(self) -> int:
        return self.step_done

    # ------------------------------------------------------------------ group lifecycle
    def setup_group(self, rank: int, world_size: int, master_addr: str, master_port: int,
                    generation: int) -> dict[str, Any]:
        """(Re)join the process group of ``generation``; build model and optimizer on first use."""
        if dist.is_initialized():
            dist.destroy_process_group()
        choice = self._select_device()
        # The supervisor's step deadline acts long before the collective timeout; it only
        # bounds a lost peer. The rendezvous gets a short one of its own: a member that dies
        # during it would otherwise hold every other member inside init_process_group (and
        # their actors' next calls behind it) for the whole collective timeout.
        collective = timedelta(seconds=max(60.0, self.spec.train.step_timeout_s))
        rendezvous = min(collective, timedelta(seconds=RENDEZVOUS_TIMEOUT_S))
        try:
            from torch.distributed.distributed_c10d import _set_pg_timeout
        except ImportError:  # a torch without it: one timeout for both
            _set_pg_timeout, rendezvous = None, collective
        dist.init_process_group(choice.backend, init_method=f"tcp://{master_addr}:{master_port}",
                                rank=rank, world_size=world_size, timeout=rendezvous)
        if _set_pg_timeout is not None and rendezvous != collective:
            _set_pg_timeout(collective)
        self.rank, self.world_size, self.generation = rank, world_size, generation
        if self.model is None:
            self._build()
        self.ddp = parallelize_ddp(self.model, self.device)
        return {"rank": rank, "backend": choice.backend, "device": self.device}

    def _select_device(self):
        choice = choose_backend(self.spec.parallel.backend, torch.cuda.is_available(),
                                self.spec.resources.gpus_per_worker)
        self.device = choice.device
        if self.device.startswith("cuda"):
            torch.cuda.set_device(torch.device(self.device))
        return choice

    def _build(self) -> None:
        # Build order (torchtitan): model, parallelize, optimizer last.
        from raytrain_sys.models import build_model

        torch.manual_seed(self.spec.train.seed)
        self.model = build_model(self.spec.model).to(self.device)
        if self.spec.train.precision == "fp64":
            self.model = self.model.double()
        self.optimizer = build_optimizer(self.model, self.spec.optim)

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    # ------------------------------------------------------------------ the step
    def train_step(self, step: int, batch: dict[str, np.ndarray], global_units: int) -> dict[str, float]:
        """One optimizer step on this rank's share of step ``step``'s global batch.

        Each micro-batch's summed loss is scaled by world_size / global_units: DDP averages
        gradients over ranks, so the result is the gradient of the global mean loss whatever the
        shares, equal to the single-process one.
        """
        assert self.ddp is not None and self.optimizer is not None, "setup_group first"
        t0 = time.perf_counter()
        spec = self.spec
        lr = lr_at(step, spec.optim, spec.train.max_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        torch.manual_seed(_step_seed(spec.train.seed, step, self.rank))

        # The arrays arrive read-only from Ray's object store; torch.tensor copies them.
        tensors = {k: torch.tensor(v, device=self.device) for k, v in batch.items()}
        rows = len(next(iter(tensors.values())))
        scale = self.world_size / global_units
        micro = spec.train.micro_batch_size or rows
        starts = list(range(0, rows, micro))
        autocast = (torch.autocast(device_type=self.device.split(":")[0], dtype=torch.bfloat16)
                    if spec.train.precision == "bf16" else contextlib.nullcontext())
        self.ddp.train()
        try:
            loss_sum = self._forward_backward(tensors, starts, micro, scale, autocast)
        except BaseException:
            # A peer died mid-step: this half-done step is discarded; the rebuild starts clean.
            self.optimizer.zero_grad(set_to_none=True)
            raise
        max_norm = spec.optim.grad_clip if spec.optim.grad_clip > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step_done = step + 1
        return {"loss_sum": loss_sum, "rows": float(rows), "grad_norm": float(grad_norm), "lr": lr,
                "compute_s": time.perf_counter() - t0}

    def _forward_backward(self, tensors, starts, micro, scale, autocast) -> float:
        loss_sum = 0.0
        for i, start in enumerate(starts):
            chunk = {k: v[start:start + micro] for k, v in tensors.items()}
            # Gradients are all-reduced once per step, on the last micro-batch.
            sync = contextlib.nullcontext() if i == len(starts) - 1 else self.ddp.no_sync()
            with sync:
                with autocast:
                    loss = self.task.loss_sum(self.ddp, chunk)
                (loss * scale).backward()
            loss_sum += loss.item()
        return loss_sum

    # ------------------------------------------------------------------ state
    def _state(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optim": self.optimizer.state_dict(),
                "step": self.step_done}

    def save_checkpoint(self, store_uri: str, s3_endpoint_url: str, step: int) -> list[dict]:
        """Write this replica's state into the checkpoint of ``step`` (data only; no manifest)."""
        from raytrain_sys.checkpoint.checkpointer import Checkpointer
        from raytrain_sys.checkpoint.store import open_store

        assert self.step_done == step, f"asked to save step {step}, replica holds {self.step_done}"
        ckpt = Checkpointer(open_store(store_uri, s3_endpoint_url), keep_last=None)  # writes only
        return [ckpt.write_state(step, TRAIN_STATE_FILE, self._state())]

    def load_checkpoint(self, checkpoint_uri: str, s3_endpoint_url: str) -> int:
        from raytrain_sys.checkpoint.checkpointer import open_checkpoint

        ckpt, info = open_checkpoint(checkpoint_uri, s3_endpoint_url)
        state = ckpt.load_state(info, TRAIN_STATE_FILE)
        if self.model is None:
            self._build()
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optim"])
        self.step_done = int(state["step"])
        return self.step_done

    def sync_state(self, src_rank: int) -> int:
        """Make this replica equal to ``src_rank``'s: the survivor that holds the newest step.

        Parameters go tensor by tensor (in place, so DDP and the optimizer keep their
        references); the optimizer state, whose layout a newcomer lacks, goes as one object.
        The schedule and dropout RNG are functions of the step, and the data cursor lives in the
        Supervisor, so nothing else needs to travel.
        """
        with torch.no_grad():
            for tensor in self.model.state_dict().values():
                dist.broadcast(tensor, src=src_rank)
        box = [{"optim": self.optimizer.state_dict(), "step": self.step_done}
               if self.rank == src_rank else None]
        dist.broadcast_object_list(box, src=src_rank)
        if self.rank != src_rank:
            self.optimizer.load_state_dict(box[0]["optim"])
            self.step_done = int(box[0]["step"])
        self.optimizer.zero_grad(set_to_none=True)
        return self.step_done

    def parameters(self) -> dict[str, np.ndarray]:
        """A copy of the parameters, for tests and export."""
        return {k: v.detach().cpu().numpy().copy() for k, v in self.model.state_dict().items()}
