"""The three extension points, resolved: your model (``model.factory``), your task
(``train.task``) and your rows (``data.transform``).

Owns turning a spec's import path ("pkg.module:name") or a Python object into the thing it
names, and every error about that: a path that does not import, a factory that raises or returns
something that is not a module, a task without the protocol's methods. Each error is a
``SpecError`` naming the field and the cause, raised on the driver in pre-flight (before any Ray
resource) and again, the same, wherever a worker or read task resolves the same field.

Imports nothing heavy at the top: the CLI checks a spec before torch is imported.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

from raytrain_sys.errors import SpecError, UserError
from raytrain_sys.spec import PYTHON_OBJECT_PREFIX, JobSpec, ModelSpec


def resolve(ref: Any, field: str) -> Any:
    """The object ``ref`` names: "pkg.module:attr.attr" imported, or ``ref`` itself when it is
    already an object (given from Python).

    A module not found is looked for once more with the working directory on ``sys.path``: a
    console script (``raytrain-sys run``) does not put it there the way ``python -m`` does, and
    Ray's workers of a job have the driver's working directory on theirs."""
    if not isinstance(ref, str):
        return ref
    if ref.startswith(PYTHON_OBJECT_PREFIX):
        raise SpecError(field, f"{ref[len(PYTHON_OBJECT_PREFIX):]} was a Python object given from "
                               f"Python, which a spec file cannot name: give the object again "
                               f"(rts.run / rts.resume(..., spec=...)) or an import path "
                               f"\"package.module:name\"")
    module_name, _, attr = ref.partition(":")
    try:
        module = _import(module_name)
    except ModuleNotFoundError as exc:
        raise SpecError(field, f"cannot import {module_name!r} for {ref!r} ({exc}); put its "
                               f"directory on PYTHONPATH or run from it (with ray job submit or "
                               f"raytrain-sys jobs submit: --working-dir)") from None
    except Exception as exc:
        raise SpecError(field, f"importing {module_name!r} for {ref!r} raised {type(exc).__name__}: "
                               f"{exc}") from None
    found: Any = module
    for part in attr.split("."):
        try:
            found = getattr(found, part)
        except AttributeError:
            raise SpecError(field, f"module {module_name!r} has no {attr!r} (from {ref!r})") from None
    return found


def _import(module_name: str):
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        cwd = os.getcwd()
        top = module_name.split(".")[0]
        if exc.name not in (top, module_name) or cwd in sys.path:
            raise
        sys.path.append(cwd)
        return importlib.import_module(module_name)


def _name(ref: Any) -> str:
    return ref if isinstance(ref, str) else getattr(ref, "__qualname__", type(ref).__name__)


# ----------------------------------------------------------------------------- model
def model_field(model_spec: ModelSpec) -> str:
    return "model.factory" if model_spec.factory else "model.name"


def model_factory(model_spec: ModelSpec):
    """The callable that builds the model: ``model.factory``, or the registered one."""
    if model_spec.factory:
        factory = resolve(model_spec.factory, "model.factory")
        if not callable(factory):
            raise SpecError("model.factory", f"{_name(model_spec.factory)} is a "
                                             f"{type(factory).__name__}, not a callable")
        return factory
    from raytrain_sys.models import registered

    return registered(model_spec.name).factory


def build_model(model_spec: ModelSpec):
    """A freshly built model; its weights are decided by torch.manual_seed beforehand."""
    import torch.nn as nn

    field = model_field(model_spec)
    factory = model_factory(model_spec)
    try:
        model = factory(model_spec)
    except UserError:
        raise
    except Exception as exc:
        raise SpecError(field, f"{_name(model_spec.factory or factory)} raised {type(exc).__name__}: "
                               f"{exc}") from exc
    if not isinstance(model, nn.Module):
        raise SpecError(field, f"{_name(model_spec.factory or factory)} returned a "
                               f"{type(model).__name__}, not a torch.nn.Module")
    return model


# ----------------------------------------------------------------------------- task
def resolve_task(spec: JobSpec):
    """The job's Task: ``train.task`` (a class built with ``train.task_args``, or an object),
    or the registered model's own."""
    ref = spec.train.task
    if not ref:
        from raytrain_sys.models import registered

        return registered(spec.model.name).task()
    obj = resolve(ref, "train.task")
    if isinstance(obj, type) or (callable(obj) and not hasattr(obj, "loss_sum")):
        try:
            obj = obj(**spec.train.task_args)
        except Exception as exc:
            raise SpecError("train.task", f"{_name(ref)}(**train.task_args={spec.train.task_args}) "
                                          f"raised {type(exc).__name__}: {exc}") from None
    missing = [m for m in ("units", "loss_sum") if not callable(getattr(obj, m, None))]
    if missing:
        raise SpecError("train.task", f"{_name(ref)} has no {' or '.join(missing)}: a task is "
                                      f"units(batch) -> int and loss_sum(model, batch) -> summed loss "
                                      f"(see raytrain_sys.train.tasks.Task)")
    return obj


# ----------------------------------------------------------------------------- rows
def resolve_transform(spec: JobSpec):
    """``data.transform`` as a callable, or None."""
    if not spec.data.transform:
        return None
    fn = resolve(spec.data.transform, "data.transform")
    if not callable(fn):
        raise SpecError("data.transform", f"{_name(spec.data.transform)} is not a callable")
    return fn
