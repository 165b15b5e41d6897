"""The training state inside a checkpoint: pieces files, one per writing rank.

Each writing rank's file holds ``{"step", "rank", "world_size", "pieces"}`` where ``pieces`` maps
``model/<name>`` and ``optim/<name>/<key>`` to blocks of the global tensors with their offsets
(raytrain_sys.parallel.reshard). Together the files of a checkpoint hold every block once,
whatever the layout that wrote them; reading assembles the full state, from which any layout or
world size takes its own blocks. Every file is sha256-checked against the manifest and loaded
with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import re

import torch

from raytrain_sys.checkpoint.checkpointer import Checkpointer, CheckpointInfo
from raytrain_sys.errors import CheckpointError

PIECES_NAME = re.compile(r"^pieces_rank\d+\.pt$")


def pieces_files(info: CheckpointInfo) -> list[str]:
    return sorted(r["name"] for r in info.manifest.get("files", []) if PIECES_NAME.match(r.get("name", "")))


def read_full_state(ckpt: Checkpointer, info: CheckpointInfo) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint's state, whole (``model/...`` and ``optim/...`` keys)."""
    from raytrain_sys.parallel.reshard import assemble, pieces_from_plain

    names = pieces_files(info)
    if not names:
        listed = [r.get("name") for r in info.manifest.get("files", [])]
        raise CheckpointError(f"checkpoint {info.uri} holds no state files ({listed}): it was "
                              f"written by an older raytrain-sys; start a new run")
    sets = []
    for name in names:
        state = ckpt.load_state(info, name)
        if int(state.get("step", -1)) != info.step:
            raise CheckpointError(f"checkpoint {info.uri}: {name} holds step {state.get('step')}, "
                                  f"the manifest says {info.step}; resume from an older checkpoint")
        sets.append(pieces_from_plain(state["pieces"]))
    full, missing = assemble(sets)
    if missing:
        raise CheckpointError(f"checkpoint {info.uri} is incomplete: no file covers all of "
                              f"{missing[:3]}{' ...' if len(missing) > 3 else ''}; resume from an "
                              f"older checkpoint")
    return full


def model_state_dict(full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The model's consolidated state_dict (original parameter names) from a full state."""
    return {k[len("model/"):]: v for k, v in full.items() if k.startswith("model/")}
