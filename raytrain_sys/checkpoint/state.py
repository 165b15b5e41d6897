"""The training state inside a checkpoint: pieces files, one per writing rank.

Each writing rank's file holds ``{"step", "rank", "world_size", "pieces"}`` where ``pieces`` maps
``model/<name>`` and ``optim/<name>/<key>`` to blocks of the global tensors with their offsets
(raytrain_sys.parallel.reshard). Together the files of a checkpoint hold every block once,
whatever the layout that wrote them. A worker resuming at any layout or world size reads them one
at a time and keeps only the parts that fall in its own blocks (``load_blocks``); an export
assembles the full state (``read_full_state``). Every file is sha256-checked against the
manifest and loaded with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import re

import torch

from raytrain_sys.checkpoint.checkpointer import Checkpointer, CheckpointInfo
from raytrain_sys.errors import CheckpointCorrupt, CheckpointError

PIECES_NAME = re.compile(r"^pieces_rank\d+\.pt$")


def pieces_files(info: CheckpointInfo) -> list[str]:
    return sorted(r["name"] for r in info.manifest.get("files", []) if PIECES_NAME.match(r.get("name", "")))


def read_full_state(ckpt: Checkpointer, info: CheckpointInfo) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint's state, whole (``model/...`` and ``optim/...`` keys)."""
    from raytrain_sys.parallel.reshard import assemble, pieces_from_plain

    full, missing = assemble([pieces_from_plain(state["pieces"]) for state in _states(ckpt, info)])
    if missing:
        raise _incomplete(info, missing)
    return full


def _states(ckpt: Checkpointer, info: CheckpointInfo):
    """The checkpoint's pieces files, loaded one at a time, each checked for its step."""
    names = pieces_files(info)
    if not names:
        listed = [r.get("name") for r in info.manifest.get("files", [])]
        raise CheckpointError(f"checkpoint {info.uri} holds no state files ({listed}): it was "
                              f"written by an older raytrain-sys; start a new run")
    for name in names:
        state = ckpt.load_state(info, name)
        if int(state.get("step", -1)) != info.step:
            raise CheckpointCorrupt(f"checkpoint {info.uri}: {name} holds step {state.get('step')}, "
                                    f"the manifest says {info.step}")
        yield state


def _incomplete(info: CheckpointInfo, missing: list[str]) -> CheckpointCorrupt:
    return CheckpointCorrupt(f"checkpoint {info.uri} is incomplete: no file covers all of "
                             f"{missing[:3]}{' ...' if len(missing) > 3 else ''}")


def load_blocks(ckpt: Checkpointer, info: CheckpointInfo, model, optimizer) -> None:
    """Fill ``model``'s (and ``optimizer``'s) blocks of their current layout from the checkpoint,
    one file in memory at a time: each file's pieces are cut to the parts in this rank's blocks
    and dropped. Raises when the files do not cover the blocks, or hold another model."""
    from raytrain_sys.parallel import reshard

    placement, global_shapes = reshard.Placement(model, optimizer), {}
    for state in _states(ckpt, info):
        pieces = reshard.pieces_from_plain(state.pop("pieces"))
        for key, piece in pieces.items():
            placement.take(key, piece)
            global_shapes[key] = piece.global_shape
        del pieces, piece  # before the next file is read
    wants = reshard.wanted_blocks(model, optimizer, set(global_shapes))
    required = reshard.keys_needed(model, optimizer, info.step > 0)
    unknown = sorted(required - wants.keys())
    if unknown:
        raise CheckpointError(f"checkpoint {info.uri} lacks {unknown[:3]}: it was written for "
                              f"another model; resume with the spec that wrote it")
    missing = [k for k, want in sorted(wants.items())
               if not reshard.covers(*reshard.widened(want, global_shapes.get(k)),
                                     placement.boxes.get(k, []))]
    if missing:
        raise _incomplete(info, missing)


def model_state_dict(full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The model's consolidated state_dict (original parameter names) from a full state."""
    return {k[len("model/"):]: v for k, v in full.items() if k.startswith("model/")}
