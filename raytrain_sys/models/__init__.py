"""Model registry: named model factories, each with its task and what else the trainer may ask.

The built-in GPT and CNN are two registered factories like any other; ``model.factory`` (an
import path, or a callable from Python) builds a model that is not registered
(``raytrain_sys.extensions``, which looks registered names up here). The trainer calls
extensions.build_model() and model_flops_per_token() and never names a model class.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch.nn as nn

from raytrain_sys import spec as speclib
from raytrain_sys.errors import SpecError
from raytrain_sys.models import cnn, gpt
from raytrain_sys.spec import ModelSpec


@dataclass(frozen=True)
class RegisteredModel:
    factory: Callable[[ModelSpec], nn.Module]
    task: Callable[[], object]  # a fresh Task for this model (the loss it trains on)
    flops_per_token: Callable[[ModelSpec], int] | None = None  # for MFU; None = not reported
    parallel_plans: bool = False  # has tensor and pipeline plans (parallel.tp / parallel.pp)


MODELS: dict[str, RegisteredModel] = {}
MODEL_BUILDERS: dict[str, Callable[[ModelSpec], nn.Module]] = {}


def register_model(name: str, factory: Callable[[ModelSpec], nn.Module], task: Callable[[], object],
                   flops_per_token: Callable[[ModelSpec], int] | None = None,
                   parallel_plans: bool = False) -> None:
    """Make ``model.name: <name>`` build ``factory(model_section)`` and train it with ``task()``.

    A registration lives in the process that makes it: register at the import of a module the
    workers import too, or use ``model.factory`` (an import path), which needs no registration."""
    MODELS[name] = RegisteredModel(factory, task, flops_per_token, parallel_plans)
    MODEL_BUILDERS[name] = factory
    speclib.REGISTERED_MODELS.add(name)
    if parallel_plans:
        speclib.MODELS_WITH_PARALLEL_PLANS.add(name)


def registered(name: str) -> RegisteredModel:
    try:
        return MODELS[name]
    except KeyError:
        raise SpecError("model.name", f"unknown model {name!r}; registered: "
                        f"{', '.join(sorted(MODELS))}, or set model.factory") from None


def _gpt_config(model_spec: ModelSpec) -> gpt.GPTConfig:
    return gpt.GPTConfig(
        vocab_size=model_spec.vocab_size,
        block_size=model_spec.block_size,
        n_layer=model_spec.n_layer,
        n_head=model_spec.n_head,
        n_embd=model_spec.n_embd,
        dropout=model_spec.dropout,
        bias=model_spec.bias,
    )


def build_gpt(model_spec: ModelSpec) -> gpt.GPT:
    if model_spec.n_embd % model_spec.n_head != 0:
        raise SpecError("model.n_embd", f"{model_spec.n_embd} is not a multiple of "
                        f"model.n_head ({model_spec.n_head}); pick n_embd = n_head * head size")
    return gpt.GPT(_gpt_config(model_spec))


def _cnn_config(model_spec: ModelSpec) -> cnn.CNNConfig:
    # A classifier's output vocabulary is its classes; n_embd is the conv width. block_size and
    # n_head do not apply.
    return cnn.CNNConfig(num_classes=model_spec.vocab_size, width=model_spec.n_embd,
                         n_layer=model_spec.n_layer, dropout=model_spec.dropout)


def build_cnn(model_spec: ModelSpec) -> cnn.CNN:
    return cnn.CNN(_cnn_config(model_spec))


def _next_token():
    from raytrain_sys.train.tasks import NextToken

    return NextToken()


def _classify():
    from raytrain_sys.train.tasks import Classify

    return Classify("image", "label")


# Training FLOPs per token, for throughput and MFU reports without naming the model.
register_model("gpt", build_gpt, _next_token, lambda spec: gpt.flops_per_token(_gpt_config(spec)),
               parallel_plans=True)
register_model("cnn", build_cnn, _classify,
               lambda spec: cnn.flops_per_sample(_cnn_config(spec)))  # a "token" is one image


def build_model(model_spec: ModelSpec) -> nn.Module:
    """A freshly initialized registered model; its weights are decided by torch.manual_seed
    beforehand. A spec's model (``model.factory`` too) is built by
    ``raytrain_sys.extensions.build_model``, which looks registered names up here: the arrow
    runs from extensions to the registry only."""
    if model_spec.factory:
        raise ValueError("model.factory is set: build it with raytrain_sys.extensions.build_model")
    return registered(model_spec.name).factory(model_spec)


def model_flops_per_token(model_spec: ModelSpec) -> int:
    """0 when unknown (a model.factory model): no MFU is reported."""
    if model_spec.factory:
        return 0
    flops = registered(model_spec.name).flops_per_token
    return flops(model_spec) if flops else 0


__all__ = ["MODELS", "MODEL_BUILDERS", "RegisteredModel", "build_model", "build_gpt", "build_cnn",
           "model_flops_per_token", "register_model", "registered"]
