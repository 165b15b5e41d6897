"""``is_dtensor``: the DTensor check that does not import ``torch.distributed.tensor``.

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


__all__ = ["is_dtensor"]
