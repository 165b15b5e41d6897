"""What a model is trained to do: the loss over a batch of columns, and its normalizer.

A task turns a batch (a dict of arrays, as the data plane delivers it) into a *summed* loss and
counts the units that sum runs over. The Supervisor counts units over the whole global batch
(numpy, no tensors) and every rank divides by that count, so uneven shares and gradient
accumulation give exactly the single-process gradient of the global mean loss.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F


class Task(Protocol):
    def units(self, batch: dict[str, np.ndarray]) -> int: ...

    def loss_sum(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor: ...


def _at_least_fp32(logits: torch.Tensor) -> torch.Tensor:
    # The loss of low-precision logits is taken in fp32; fp64 (numerics checks) stays fp64.
    return logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits


class NextToken:
    """Language modelling: rows of T+1 tokens, predict token t+1 from tokens <= t."""

    def units(self, batch: dict[str, np.ndarray]) -> int:
        tokens = batch["tokens"]
        return int(tokens.shape[0] * (tokens.shape[1] - 1))

    def loss_sum(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        rows = batch["tokens"].long()
        logits = _at_least_fp32(model(rows[:, :-1]))
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), rows[:, 1:].reshape(-1),
                               reduction="sum")


class Classify:
    """Classification: an input column and an integer label per row."""

    def __init__(self, input_key: str = "image", label_key: str = "label"):
        self.input_key, self.label_key = input_key, label_key

    def units(self, batch: dict[str, np.ndarray]) -> int:
        return int(batch[self.label_key].shape[0])

    def loss_sum(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        dtype = next(model.parameters()).dtype
        logits = _at_least_fp32(model(batch[self.input_key].to(dtype)))
        return F.cross_entropy(logits, batch[self.label_key].long(), reduction="sum")


# Model name -> task. The model registry stays architecture only.
TASKS: dict[str, Task] = {"gpt": NextToken(), "cnn": Classify("image", "label")}


def task_for(model_name: str) -> Task:
    return TASKS[model_name]
