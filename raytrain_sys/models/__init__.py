"""Model registry: the one place that turns a ModelSpec into a module.

The trainer calls build_model() and model_flops_per_token() and never names a model class.
"""

from __future__ import annotations

from typing import Callable

import torch.nn as nn

from raytrain_sys.errors import SpecError
from raytrain_sys.models import cnn, gpt
from raytrain_sys.spec import ModelSpec


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


MODEL_BUILDERS: dict[str, Callable[[ModelSpec], nn.Module]] = {"gpt": build_gpt, "cnn": build_cnn}

# Training FLOPs per token, for throughput and MFU reports without naming the model.
MODEL_FLOPS_PER_TOKEN: dict[str, Callable[[ModelSpec], int]] = {
    "gpt": lambda spec: gpt.flops_per_token(_gpt_config(spec)),
    "cnn": lambda spec: cnn.flops_per_sample(_cnn_config(spec)),  # a "token" is one image
}


def _lookup(table: dict, model_spec: ModelSpec):
    try:
        return table[model_spec.name]
    except KeyError:
        raise SpecError("model.name", f"unknown model {model_spec.name!r}; "
                        f"allowed: {', '.join(sorted(table))}") from None


def build_model(model_spec: ModelSpec) -> nn.Module:
    """A freshly initialized model; its weights are decided by torch.manual_seed beforehand."""
    return _lookup(MODEL_BUILDERS, model_spec)(model_spec)


def model_flops_per_token(model_spec: ModelSpec) -> int:
    return _lookup(MODEL_FLOPS_PER_TOKEN, model_spec)(model_spec)


__all__ = ["MODEL_BUILDERS", "build_model", "build_gpt", "build_cnn", "model_flops_per_token"]
