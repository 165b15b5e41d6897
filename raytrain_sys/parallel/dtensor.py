"""``is_dtensor``: the DTensor check that does not import ``torch.distributed.tensor``; and
``forget_meshes``, which a worker calls when its process group is re-created.

Importing ``torch.distributed.tensor`` (and with it dynamo, sympy and the DTensor op table) costs
seconds, and the code that asks "is this a DTensor?" (gradient clipping, checkpoint pieces,
LAMB's norms) is imported by every driver too, through the worker module, where nothing is ever
sharded. A DTensor can only exist once its module was imported by whoever made it (TP, FSDP2, a
sharded checkpoint), so while the module is absent the answer is no, and the import is left to
the code that makes DTensors.
"""

from __future__ import annotations

import sys

_MODULE = "torch.distributed.tensor"


def is_dtensor(t: object) -> bool:
    """``isinstance(t, DTensor)``, without importing DTensor's module when nothing can be one."""
    cls = getattr(sys.modules.get(_MODULE), "DTensor", None)  # None until that module has run
    return cls is not None and isinstance(t, cls)


def forget_meshes() -> None:
    """Drop DTensor's cached sharding decisions: to be called once the process group is gone.

    DTensor caches, per operator and input specs, the output specs it decided, each holding the
    DeviceMesh it was decided on; and meshes compare equal by shape, ranks and axis names, not
    by their process groups. After ``destroy_process_group`` and a new group, an operator on the
    new mesh's DTensors finds the old decision and returns a DTensor on the *old* mesh, whose
    groups are named by a counter that restarts with each group: its collectives then run on
    whatever group of the new world has that name, or fail with "Could not resolve the process
    group registered under the name 8" when the new world made fewer groups (issue 29: PP2 x
    FSDP2 re-formed, its gradient norm's all-reduce). Both caches (Python's and the C++ fast
    path's) are per thread: this clears the calling thread's, the one that trains.
    """
    if sys.modules.get(_MODULE) is None:  # no DTensor was ever made here: nothing cached
        return
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()


__all__ = ["forget_meshes", "is_dtensor"]
