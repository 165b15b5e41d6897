"""raytrain-sys: elastic training on Ray and PyTorch.

The public API, the names a user imports (the modules behind them are free to move)::

    import raytrain_sys as rts

    spec = rts.load_spec("jobs/tinygpt.yaml", ["train.max_steps=50"])   # or rts.JobSpec(...), a dict
    result = rts.run(spec, on_step=rts.LiveView())                     # a RunResult
    more = rts.resume(result.mlflow_run_id, overrides=["train.max_steps=80"])
    rts.connect(spec)    # keep one Ray cluster up across runs (a notebook); else each run starts one
    rts.Client(url, token).submit("jobs/tinygpt.yaml", team="research")  # the job service

Extension points: ``model.factory`` (your nn.Module), ``train.task`` (your loss: ``rts.Task``,
checked with ``rts.check_task``), ``data.transform`` (your rows); see docs/spec_reference.md.

Names are imported on first use, so ``import raytrain_sys`` costs no torch, Ray or MLflow import.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from raytrain_sys.version import __version__

# public name -> (module, attribute)
_EXPORTS = {
    "run": ("raytrain_sys.api", "run"),
    "resume": ("raytrain_sys.api", "resume"),
    "connect": ("raytrain_sys.control.worker_group", "connect_ray"),
    "load_spec": ("raytrain_sys.spec", "load_spec"),
    "from_dict": ("raytrain_sys.spec", "from_dict"),
    "JobSpec": ("raytrain_sys.spec", "JobSpec"),
    "Client": ("raytrain_sys.service.client", "Client"),
    "RunRequests": ("raytrain_sys.control.supervisor.requests", "RunRequests"),
    "RunResult": ("raytrain_sys.control.supervisor.supervisor", "RunResult"),
    "StepReport": ("raytrain_sys.control.supervisor.steps", "StepReport"),
    "LiveView": ("raytrain_sys.monitor.live", "LiveView"),
    "Task": ("raytrain_sys.train.tasks", "Task"),
    "NextToken": ("raytrain_sys.train.tasks", "NextToken"),
    "Classify": ("raytrain_sys.train.tasks", "Classify"),
    "check_task": ("raytrain_sys.train.check", "check_task"),
    "register_model": ("raytrain_sys.models", "register_model"),
    "load_model": ("raytrain_sys.checkpoint.export", "load_model"),
    "index_parquet": ("raytrain_sys.data.table", "index_parquet"),
    "UserError": ("raytrain_sys.errors", "UserError"),
    "SpecError": ("raytrain_sys.errors", "SpecError"),
}

__all__ = sorted(_EXPORTS) + ["__version__"]

if TYPE_CHECKING:  # for editors and type checkers; at run time __getattr__ imports on demand
    from raytrain_sys.api import resume, run  # noqa: F401
    from raytrain_sys.checkpoint.export import load_model  # noqa: F401
    from raytrain_sys.control.supervisor.requests import RunRequests  # noqa: F401
    from raytrain_sys.control.supervisor.steps import StepReport  # noqa: F401
    from raytrain_sys.control.supervisor.supervisor import RunResult  # noqa: F401
    from raytrain_sys.control.worker_group import connect_ray as connect  # noqa: F401
    from raytrain_sys.data.table import index_parquet  # noqa: F401
    from raytrain_sys.errors import SpecError, UserError  # noqa: F401
    from raytrain_sys.models import register_model  # noqa: F401
    from raytrain_sys.monitor.live import LiveView  # noqa: F401
    from raytrain_sys.service.client import Client  # noqa: F401
    from raytrain_sys.spec import JobSpec, from_dict, load_spec  # noqa: F401
    from raytrain_sys.train.check import check_task  # noqa: F401
    from raytrain_sys.train.tasks import Classify, NextToken, Task  # noqa: F401


def __getattr__(name: str):
    try:
        module, attr = _EXPORTS[name]
    except KeyError:
        raise AttributeError(f"module 'raytrain_sys' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
