"""The evaluation set: the first ``eval.max_rows`` rows of a dataset, in manifest order (sample
id order, no shuffle), cut into batches of ``eval.batch_rows``: the same rows, in the same
batches, at any world size.

Read once per run by one Ray task (``read_batches``) that returns one object per batch; the
driver keeps only the references (``eval_batch_refs``) and each rank fetches its batches. Runs
in a read task; no Ray import at the top.
"""

from __future__ import annotations

import math
import os

import numpy as np

from raytrain_sys.data.manifest import DOCUMENTS_FORMAT, DatasetManifest
from raytrain_sys.data.order import Segment
from raytrain_sys.errors import DataError, SpecError

VAL_DIR = "val"  # where prepare-data writes the validation split (data.prepare.VAL_DIR)


def eval_dataset_uri(spec) -> str:
    """``eval.dataset``, or the prepared validation split beside the training data."""
    if spec.eval.dataset:
        return spec.eval.dataset
    path = spec.data.path.rstrip("/")
    return f"{path}/{VAL_DIR}" if path.startswith("s3://") else os.path.join(os.path.abspath(path), VAL_DIR)


def plan(manifest: DatasetManifest, max_rows: int, batch_rows: int) -> tuple[int, int]:
    """(rows, batches) of the evaluation set."""
    rows = min(max_rows or manifest.num_rows, manifest.num_rows)
    return rows, math.ceil(rows / batch_rows)


def read_batches(dataset_uri: str, manifest: DatasetManifest, rows: int, batch_rows: int,
                 s3_endpoint_url: str, transform) -> tuple:
    """The evaluation batches' columns, one dict per batch (a Ray task with num_returns=batches)."""
    from raytrain_sys.data.reads import transform_rows
    from raytrain_sys.data.shards import read_columns

    parts, left, first_id = [], rows, 0
    for i, shard in enumerate(manifest.shards):
        if left <= 0:
            break
        take = min(left, shard.num_rows)
        parts.append(read_columns(dataset_uri, manifest, Segment(i, 0, take, first_id), s3_endpoint_url))
        left -= take
        first_id += shard.num_rows
    columns = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    if transform:
        columns = transform_rows(transform, columns)
    batches = tuple({k: np.ascontiguousarray(v[b:b + batch_rows]) for k, v in columns.items()}
                    for b in range(0, rows, batch_rows))
    return batches if len(batches) > 1 else batches[0]


def open_eval_set(spec):
    """(dataset uri, manifest with the job's columns) of the evaluation set; raises naming
    ``eval.dataset`` when it is missing or cannot be evaluated."""
    from raytrain_sys.data.shards import read_manifest
    from raytrain_sys.data.table import select_columns

    uri = eval_dataset_uri(spec)
    try:
        manifest = read_manifest(uri, spec.data.s3_endpoint_url)
    except DataError as exc:
        raise SpecError("eval.dataset", f"{exc} (\"\" means the validation split <data.path>/val that "
                                        f"prepare-data writes; give a dataset directory)") from None
    if manifest.format == DOCUMENTS_FORMAT:
        raise SpecError("eval.dataset", f"{uri} holds documents, which become rows only in training "
                                        f"(data.sequences); evaluate on a rows dataset")
    return uri, select_columns(manifest, spec.data.columns, uri)


def eval_batch_refs(spec, uri: str, manifest: DatasetManifest) -> list:
    """Start reading the evaluation set; one object reference per batch."""
    import ray

    rows, count = plan(manifest, spec.eval.max_rows, spec.eval.batch_rows)
    # The training reads' resources (data.read_resources): by default no CPU, so that the read
    # never waits behind trainers holding every CPU (they wait for it in their first evaluation).
    res = spec.data.read_resources
    options = {"num_returns": count, "num_cpus": res.get("CPU", 0)}
    if any(k != "CPU" for k in res):
        options["resources"] = {k: v for k, v in res.items() if k != "CPU"}
    task = ray.remote(max_retries=3)(read_batches).options(**options)
    refs = task.remote(uri, manifest, rows, spec.eval.batch_rows, spec.data.s3_endpoint_url,
                       spec.data.transform or None)
    return list(refs) if count > 1 else [refs]
