"""``rts.run`` and ``rts.resume``: the library's two calls, as a notebook or script makes them.

Thin on purpose: the spec in any of its forms becomes a validated ``JobSpec``, then the
Supervisor runs it (``raytrain_sys.control.supervisor``), exactly as ``raytrain-sys run`` does.
"""

from __future__ import annotations

import os
from typing import Any, Callable

from raytrain_sys.spec import JobSpec, apply_overrides, from_dict, load_spec


def as_spec(spec: JobSpec | dict | str | os.PathLike, overrides: list[str] | None = None,
            **objects: Any) -> JobSpec:
    """A validated JobSpec from a JobSpec, a dict of sections, or a YAML file's path, with
    ``--set``-style ``overrides`` and ``objects``: fields given Python objects, the dotted name
    spelled with an underscore (``model_factory=build`` sets ``model.factory``)."""
    if isinstance(spec, (str, os.PathLike)):
        raw = load_spec(spec).to_dict()
    elif isinstance(spec, JobSpec):
        raw = spec.to_dict()
    elif isinstance(spec, dict):
        raw = spec
    else:
        raise TypeError(f"spec must be a JobSpec, a dict or a YAML path, not {type(spec).__name__}")
    raw = apply_overrides(raw, overrides or [])
    for key, obj in objects.items():
        section, _, name = key.partition("_")
        raw.setdefault(section, {})[name] = obj
    return from_dict(raw)


def run(spec: JobSpec | dict | str | os.PathLike, overrides: list[str] | None = None, *,
        on_step: Callable | None = None, requests=None, **objects: Any):
    """Run a job to its end on the cluster the spec names (or a local one) and return its
    ``RunResult``. ``objects``: Python objects for extension points, e.g.
    ``model_factory=build`` or ``train_task=MyTask()``; ``requests``: a ``RunRequests`` another
    thread uses to pause, cancel or resize the run."""
    from raytrain_sys.control.supervisor import run_job

    return run_job(as_spec(spec, overrides, **objects), on_step=on_step, requests=requests)


def resume(run_id: str, overrides: list[str] | None = None, *, tracking_uri: str = "",
           output_dir: str = "runs", on_step: Callable | None = None, requests=None, **objects: Any):
    """Continue MLflow run ``run_id`` from its newest committed checkpoint, in the same run.
    A run given Python objects for extension points needs them again (``model_factory=build``)."""
    from raytrain_sys.control.supervisor import resume_job

    fields = {key.replace("_", ".", 1): obj for key, obj in objects.items()}
    return resume_job(run_id, tracking_uri=tracking_uri, overrides=overrides, output_dir=output_dir,
                      on_step=on_step, requests=requests, objects=fields)
