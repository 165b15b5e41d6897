"""Turning a committed checkpoint back into a model: for `sample`, `export` and notebooks."""

from __future__ import annotations

import os

import torch

from raytrain_sys.checkpoint.checkpointer import Checkpointer, CheckpointInfo, open_checkpoint
from raytrain_sys.checkpoint.store import open_store
from raytrain_sys.checkpoint.state import model_state_dict, read_full_state
from raytrain_sys.errors import CheckpointCorrupt, CheckpointError
from raytrain_sys.spec import JobSpec, from_dict


def find_checkpoint(path: str, s3_endpoint_url: str = "") -> tuple[Checkpointer, CheckpointInfo]:
    """Accept a checkpoint dir, a checkpoint root (newest inside) or a run dir (its checkpoints/)."""
    path = path.rstrip("/")
    if not path.startswith("s3://"):
        path = os.path.abspath(path)
        if os.path.isdir(os.path.join(path, "checkpoints")):
            path = os.path.join(path, "checkpoints")
        if not os.path.exists(path):
            raise CheckpointError(f"no checkpoint at {path}: give a checkpoint directory, a "
                                  f"checkpoint root or a run directory")
    store = open_store(path, s3_endpoint_url)
    if store.exists("manifest.json"):
        return open_checkpoint(path, s3_endpoint_url)
    ckpt = Checkpointer(store, keep_last=1)
    info = ckpt.latest()
    if info is None:
        raise CheckpointError(f"no complete checkpoint under {path} (a checkpoint directory "
                              f"without manifest.json is incomplete and ignored)")
    return ckpt, info


def load_model(path: str, s3_endpoint_url: str = "", model_factory=None
               ) -> tuple[torch.nn.Module, JobSpec, CheckpointInfo]:
    """The model of a checkpoint; ``model_factory``: the callable a run was given from Python
    (a spec records only its name)."""
    from raytrain_sys.extensions import build_model

    ckpt, info = find_checkpoint(path, s3_endpoint_url)
    raw = info.manifest["spec"]
    if model_factory is not None:
        raw = {**raw, "model": {**raw["model"], "factory": model_factory}}
    spec = from_dict(raw)
    model = build_model(spec.model)
    if spec.train.precision == "fp64":
        model = model.double()
    # Whatever layout wrote it (DDP, FSDP, TP, PP): the pieces assemble into the whole model.
    try:
        full = read_full_state(ckpt, info)
    except CheckpointCorrupt as exc:
        raise CheckpointCorrupt(f"{exc}; {ckpt.older_than(info.step, how='give it instead', none='nothing intact to use')}") from None
    model.load_state_dict(model_state_dict(full))
    model.eval()
    return model, spec, info


def export_state_dict(path: str, out: str, s3_endpoint_url: str = "") -> CheckpointInfo:
    """One consolidated state_dict of plain tensors, loadable with torch.load(weights_only=True)."""
    model, _, info = load_model(path, s3_endpoint_url)
    tmp = out + ".tmp"
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, tmp)
    os.replace(tmp, out)
    return info
