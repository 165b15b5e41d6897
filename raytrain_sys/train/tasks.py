"""What a model is trained to do: the loss over a batch of columns, and its normalizer.

A task turns a batch (a dict of arrays, as the data plane delivers it) into a *summed* loss and
counts the units that sum runs over. The Supervisor counts units over the whole global batch
(numpy, no tensors) and every rank divides by that count, so uneven shares and gradient
accumulation give exactly the single-process gradient of the global mean loss.

Your own task (``train.task: "mypkg.tasks:MyTask"``, built with ``train.task_args``) implements
``Task`` below. The contract that keeps gradients exact at any world size, micro-batch size and
after any resize, because a global batch is cut into rows in any way:

1. ``units(batch)`` is a sum over rows: units(A + B) = units(A) + units(B), and ``row_units``,
   if given, returns those per-row terms.
2. ``loss_sum(model, batch)`` is a sum over rows of a term that depends only on that row and the
   model: ``reduction="sum"``, never a mean over the batch, no statistics across rows (BatchNorm
   in training mode, in-batch negatives) and no padding-dependent term.
3. Both see only the columns of the batch (``data.columns``, after ``data.transform``).

``raytrain_sys.train.check.check_task`` tests 1 and 2 on your rows before a long run: it
compares the gradient of one worker with that of N workers and of micro-batches, in-process.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F


class Task(Protocol):
    """The loss a model is trained on. Optional methods, found by name:

    - ``row_units(batch) -> np.ndarray``: each row's units (``units`` is their sum). Counted where
      rows are read, so the driver learns a global batch's units without its rows; a task
      without it is asked ``units`` row by row there.
    - ``eval_sums(model, batch) -> dict[str, float]``: sums over the rows of extra evaluation
      metrics, each reported divided by the evaluation's units (``Classify``: ``accuracy``).
    - ``reports_perplexity = True``: evaluation also reports exp(loss).
    """

    def units(self, batch: dict[str, np.ndarray]) -> int:
        """How many terms ``loss_sum`` adds up for these rows (a sum over rows)."""
        ...

    def loss_sum(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The summed (never averaged) loss of these rows, a scalar tensor."""
        ...


def _at_least_fp32(logits: torch.Tensor) -> torch.Tensor:
    # The loss of low-precision logits is taken in fp32; fp64 (numerics checks) stays fp64.
    return logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits


class NextToken:
    """Language modelling: rows of T+1 tokens, predict token t+1 from tokens <= t.

    Rows made of documents (``data.sequences``) carry more columns, which this task reads and the
    rest of the system just slices with the rows: ``num_tokens``, the real tokens of each row (the
    padding after them is never a target), and for pack_masked ``doc_ids``, the document of every
    token: positions restart at each document, attention stays inside it, and no document's
    first token is predicted from the one before it, so a packed row trains exactly as its
    documents would alone.
    """

    reports_perplexity = True

    def units(self, batch: dict[str, np.ndarray]) -> int:
        return int(self.row_units(batch).sum())

    def row_units(self, batch: dict[str, np.ndarray]) -> np.ndarray:
        tokens = batch["tokens"]
        if "num_tokens" not in batch:
            return np.full(tokens.shape[0], tokens.shape[1] - 1, dtype=np.int64)
        valid = np.arange(1, tokens.shape[1])[None, :] < batch["num_tokens"][:, None]
        if "doc_ids" in batch:
            valid &= batch["doc_ids"][:, 1:] == batch["doc_ids"][:, :-1]
        return valid.sum(axis=1, dtype=np.int64)

    def loss_sum(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        rows = batch["tokens"].long()
        inputs, targets = rows[:, :-1], rows[:, 1:]
        kwargs = {}
        if "num_tokens" in batch:
            # The same targets units() counts: a real next token, in the same document.
            steps = torch.arange(1, rows.size(1), device=rows.device)
            valid = steps[None, :] < batch["num_tokens"][:, None]
            if "doc_ids" in batch:
                docs = batch["doc_ids"]
                valid &= docs[:, 1:] == docs[:, :-1]
                kwargs = {"position_ids": document_positions(docs[:, :-1]),
                          "document_ids": docs[:, :-1]}
            targets = targets.masked_fill(~valid, -100)
        logits = _at_least_fp32(model(inputs, **kwargs))
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1),
                               ignore_index=-100, reduction="sum")


def document_positions(doc_ids: torch.Tensor) -> torch.Tensor:
    """(B, T) document ids -> each token's position counted from its document's first token in
    the row (a document continued from the previous row starts again at 0: it cannot see it)."""
    B, T = doc_ids.shape
    steps = torch.arange(T, device=doc_ids.device).expand(B, T)
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    first = torch.cummax(torch.where(starts, steps, torch.zeros_like(steps)), dim=1).values
    return steps - first


class Classify:
    """Classification: an input column and an integer label per row."""

    def __init__(self, input_key: str = "image", label_key: str = "label"):
        self.input_key, self.label_key = input_key, label_key

    def units(self, batch: dict[str, np.ndarray]) -> int:
        return int(batch[self.label_key].shape[0])

    def row_units(self, batch: dict[str, np.ndarray]) -> np.ndarray:
        return np.ones(batch[self.label_key].shape[0], dtype=np.int64)

    def _logits(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        dtype = next(model.parameters()).dtype
        return _at_least_fp32(model(batch[self.input_key].to(dtype)))

    def loss_sum(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return F.cross_entropy(self._logits(model, batch), batch[self.label_key].long(), reduction="sum")

    def eval_sums(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        logits = self._logits(model, batch)
        labels = batch[self.label_key].long()
        return {"loss_sum": float(F.cross_entropy(logits, labels, reduction="sum")),
                "accuracy": float((logits.argmax(dim=-1) == labels).sum())}
