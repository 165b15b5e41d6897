"""A user's own code, outside the raytrain-sys package: a model factory, a task and a row
transform for a small tabular classification set, and the script that writes that set as
Parquet (any Parquet files would do: raytrain-sys only indexes them).

    python tabular.py data                       # data/*.parquet (train) and data/val/*.parquet
    raytrain-sys prepare-data --index data       # manifest.json beside the files, not rewritten
    raytrain-sys prepare-data --index data/val
    raytrain-sys run job.yaml
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

FEATURES, CLASSES = 8, 4


# ----------------------------------------------------------------------------- model.factory
class MLP(nn.Module):
    def __init__(self, in_features: int, hidden: int, classes: int, depth: int):
        super().__init__()
        self.blocks = nn.ModuleList(Block(in_features if i == 0 else hidden, hidden) for i in range(depth))
        self.head = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class Block(nn.Module):
    """The unit parallel.fsdp_wrap names: [Block]."""

    def __init__(self, d_in: int, d_out: int):
        super().__init__()
        self.linear = nn.Linear(d_in, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.linear(x))


def build_mlp(model) -> nn.Module:
    """model.factory: called with the job's model section; model.args holds our own fields."""
    args = model.args
    return MLP(args.get("in_features", FEATURES), args.get("hidden", 32), args.get("classes", CLASSES),
               args.get("depth", 2))


# ----------------------------------------------------------------------------- train.task
class WeightedClassification:
    """train.task: cross-entropy with a weight per row (column "weight", made by the transform).

    Exact at any world size because both sums run over rows: units are rows, the loss is a
    summed (never averaged) weighted cross-entropy."""

    def __init__(self, input_key: str = "features", label_key: str = "label"):
        self.input_key, self.label_key = input_key, label_key

    def units(self, batch) -> int:
        return int(len(batch[self.label_key]))

    def row_units(self, batch) -> np.ndarray:
        return np.ones(len(batch[self.label_key]), dtype=np.int64)

    def _logits(self, model, batch):
        dtype = next(model.parameters()).dtype
        return model(batch[self.input_key].to(dtype))

    def loss_sum(self, model, batch) -> torch.Tensor:
        logits = self._logits(model, batch)
        per_row = F.cross_entropy(logits, batch[self.label_key].long(), reduction="none")
        return (per_row * batch["weight"].to(per_row.dtype)).sum()

    def eval_sums(self, model, batch) -> dict:
        logits = self._logits(model, batch)
        labels = batch[self.label_key].long()
        return {"loss_sum": float(self.loss_sum(model, batch)),
                "accuracy": float((logits.argmax(-1) == labels).sum())}


# ----------------------------------------------------------------------------- data.transform
def standardize(row: dict) -> dict:
    """data.transform, run on every row in the read tasks: features scaled, a weight added."""
    x = np.asarray(row["features"], dtype=np.float32)
    return {"features": (x - 0.5) / 0.3, "label": row["label"],
            "weight": np.float32(1.0 + (row["label"] == 0))}


# ----------------------------------------------------------------------------- the data
def write_dataset(out: str | Path, rows: int = 2048, val_rows: int = 256, files: int = 4, seed: int = 0) -> None:
    """A synthetic task: the label is which quarter of a fixed projection the features fall in."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(seed)
    w = rng.normal(size=FEATURES)

    def table(n: int) -> pa.Table:
        x = rng.random((n, FEATURES), dtype=np.float32)
        score = (x - 0.5) @ w
        label = np.digitize(score, np.quantile(score, [0.25, 0.5, 0.75])).astype(np.int64)
        features = pa.FixedSizeListArray.from_arrays(pa.array(x.ravel()), FEATURES)
        return pa.table({"features": features, "label": label, "note": [f"row {i}" for i in range(n)]})

    out = Path(out)
    (out / "val").mkdir(parents=True, exist_ok=True)
    per_file = rows // files
    for i in range(files):
        pq.write_table(table(per_file), out / f"part-{i:03d}.parquet", row_group_size=128)
    pq.write_table(table(val_rows), out / "val" / "part-000.parquet", row_group_size=128)


if __name__ == "__main__":
    write_dataset(sys.argv[1] if len(sys.argv) > 1 else "data")
