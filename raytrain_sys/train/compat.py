"""Does a job spec fit the dataset it names? Checked in pre-flight, before any Ray resource.

One function per dataset format: token rows need a next-token model whose context matches the
row length; documents need a next-token model and a way to make rows of them (data.sequences);
WebDataset samples need a classifier whose task finds its columns in the manifest and whose output
covers every class.
"""

from __future__ import annotations

from raytrain_sys.data.manifest import (DOCUMENTS_FORMAT, TABLE_FORMAT, TOKENS_FORMAT,
                                        WEBDATASET_FORMAT, DatasetManifest)
from raytrain_sys.errors import DataError, SpecError
from raytrain_sys.spec import JobSpec


def _task(spec: JobSpec):
    from raytrain_sys.extensions import resolve_task

    return resolve_task(spec)


def _rows_only(spec: JobSpec, what: str) -> None:
    if spec.data.sequences != "rows":
        raise SpecError("data.sequences", f"got {spec.data.sequences!r}; dataset {spec.data.path} "
                        f"holds {what}, trained as they are: use rows (packing and bucketing make "
                        f"rows of a documents dataset: prepare-data --format documents)")


def _check_tokens(spec: JobSpec, manifest: DatasetManifest) -> None:
    from raytrain_sys.train.tasks import NextToken

    _rows_only(spec, f"fixed rows of {manifest.row_len} tokens")
    if spec.train.task or spec.model.factory:
        return  # your task on token rows: pre-flight runs it on a few of them
    if not isinstance(_task(spec), NextToken):
        raise SpecError("model.name", f"got {spec.model.name!r}; dataset {spec.data.path} holds "
                        f"token rows, which train a next-token model (gpt)")
    if manifest.row_len != spec.model.block_size + 1:
        raise SpecError("model.block_size",
                        f"got {spec.model.block_size}; dataset {spec.data.path} holds rows of "
                        f"{manifest.row_len} tokens, so block_size must be "
                        f"{manifest.row_len - 1} (or re-run prepare-data with --row-len)")


def _check_documents(spec: JobSpec, manifest: DatasetManifest) -> None:
    from raytrain_sys.train.tasks import NextToken

    if not isinstance(_task(spec), NextToken):
        raise SpecError("model.name", f"got {spec.model.name!r}; dataset {spec.data.path} holds "
                        f"token documents, which train a next-token model (gpt)")
    if spec.data.sequences == "rows":
        raise SpecError("data.sequences", f"got 'rows'; dataset {spec.data.path} holds documents of "
                        f"varying length: set pack, pack_masked or bucket to make rows of them")
    if "document_lengths" not in manifest.extra:
        raise DataError(f"dataset {spec.data.path} has no document length index in its manifest; "
                        f"re-run prepare-data --format documents")


def _check_webdataset(spec: JobSpec, manifest: DatasetManifest) -> None:
    from raytrain_sys.train.tasks import Classify

    _rows_only(spec, "labelled samples")
    task = _task(spec)
    if not isinstance(task, Classify) and (spec.train.task or spec.model.factory):
        return  # your task on these samples: pre-flight runs it on a few of them
    if not isinstance(task, Classify):
        raise SpecError("model.name", f"got {spec.model.name!r}; dataset {spec.data.path} holds "
                        f"labelled samples, which train a classifier (cnn)")
    fields = manifest.extra.get("fields", {})
    for column in (task.input_key, task.label_key):
        if column not in fields:
            raise DataError(f"dataset {spec.data.path} has no column {column!r} (it has "
                            f"{', '.join(fields) or 'none'}); model {spec.model.name!r} needs it")
    num_classes = int(manifest.extra.get("num_classes", 0))
    # Classifiers read their class count from model.vocab_size: the size of the output vocabulary.
    if num_classes > spec.model.vocab_size:
        raise SpecError("model.vocab_size", f"got {spec.model.vocab_size}; dataset {spec.data.path} "
                        f"has {num_classes} classes, so the classifier needs vocab_size >= {num_classes}")


def _check_table(spec: JobSpec, manifest: DatasetManifest) -> None:
    from raytrain_sys.data.table import select_columns

    _rows_only(spec, "rows of your own Parquet files")
    select_columns(manifest, spec.data.columns, spec.data.path)  # every column named exists


_CHECKS = {TOKENS_FORMAT: _check_tokens, DOCUMENTS_FORMAT: _check_documents,
           WEBDATASET_FORMAT: _check_webdataset, TABLE_FORMAT: _check_table}


def check_spec_against_manifest(spec: JobSpec, manifest: DatasetManifest) -> None:
    """Raise SpecError (naming the field) or DataError if the spec cannot train on the dataset."""
    try:
        check = _CHECKS[manifest.format]
    except KeyError:
        raise DataError(f"dataset {spec.data.path} has format {manifest.format!r}; this version "
                        f"reads {', '.join(_CHECKS)}") from None
    check(spec, manifest)
