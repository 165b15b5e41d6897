"""The job spec's rules that are not a field's type: the allowed words, the ranges, and the
checks across fields (a degree that must divide another, a worker count the batch must feed).

Owns: ``validate``, run on every spec after pydantic has checked each field's type
(``raytrain_sys.spec.from_dict``), and ``validate_parallel`` (the world's shape); how a Python
object given for an extension point is named (``describe_object``, ``import_path_of``). Each
refusal is a ``SpecError`` naming the dotted field, the value given and what to do.

Imports nothing of raytrain_sys but errors.py: ``raytrain_sys.spec`` imports this module, never
the other way round (a worker checks a spec without importing torch, Ray or the service).
"""

from __future__ import annotations

import re
from typing import Any

from raytrain_sys.errors import SpecError, quote

# A raytrain_sys.spec.JobSpec: named, not imported (that module imports this one, for its rules).
JobSpec = Any

# The training fields a resume reads from the spec at each step rather than from the checkpoint
# (the learning-rate schedule's and the clipping's: ``lr_at``, the step's clip), so a run may
# resume another's checkpoint with other values of them (``checkpoint.resume_changes``). The
# optimizer's group hyperparameters (weight_decay, betas, eps) are not: a restore loads them
# from the checkpoint.
RESUME_CHANGEABLE = ("optim.lr", "optim.min_lr_ratio", "optim.warmup_steps", "optim.grad_clip")
# Ray's accelerator types (ray.util.accelerators: A10G, H100, TPU-V4...), as node labels carry them.
ACCELERATOR_TYPE_PATTERN = r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}"

# model.name values with a registered factory (raytrain_sys.models.register_model adds to it;
# kept here so that a spec is checked without importing torch), and those with TP/PP plans.
REGISTERED_MODELS: set[str] = {"gpt", "cnn"}
MODELS_WITH_PARALLEL_PLANS: set[str] = {"gpt"}
PYTHON_OBJECT_PREFIX = "python:"  # how a Python object given for an extension point is recorded


def describe_object(obj: Any) -> str:
    """``python:module.qualname`` of a callable or object given from Python (never imported
    back: a run that used one is resumed by giving it again)."""
    target = obj if callable(obj) and hasattr(obj, "__qualname__") else type(obj)
    return f"{PYTHON_OBJECT_PREFIX}{getattr(target, '__module__', '?')}.{getattr(target, '__qualname__', '?')}"


def import_path_of(obj: Any) -> str | None:
    """"module:qualname" when importing it gives back ``obj`` itself (a top-level function or
    class of an importable module), else None (a notebook's function, a lambda, an instance)."""
    import importlib

    module, qual = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if not module or not qual or module == "__main__" or "<" in qual:
        return None
    try:
        found: Any = importlib.import_module(module)
        for part in qual.split("."):
            found = getattr(found, part)
    except Exception:
        return None
    return f"{module}:{qual}" if found is obj else None


def plain_value(value: Any) -> Any:
    """``value`` with each Python object in it replaced by its description (``describe_object``):
    the form YAML, JSON, hashes, checkpoints and MLflow hold."""
    if isinstance(value, dict):
        return {k: plain_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain_value(v) for v in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return describe_object(value)


ALLOWED_CHOICES: dict[str, tuple[str, ...]] = {
    "train.precision": ("fp32", "bf16", "fp64"),
    "parallel.strategy": ("ddp", "fsdp", "hsdp"),
    "parallel.pp_schedule": ("gpipe", "1f1b", "interleaved_1f1b"),
    "parallel.mixed_precision": ("none", "bf16"),
    "parallel.comm_hook": ("none", "fp16", "powersgd"),
    "parallel.backend": ("auto", "gloo", "nccl"),
    "optim.name": ("adamw", "lamb", "lars"),
    "optim.lr_scaling": ("none", "linear", "sqrt"),
    "resources.placement_strategy": ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"),
    "resources.market": ("any", "spot", "on-demand"),
    "eval.metric": ("loss", "accuracy"),
    "data.on_bad_shard": ("fail", "skip"),
    "checkpoint.on_corrupt": ("fail", "previous"),
    "data.sequences": ("rows", "pack", "pack_masked", "bucket"),
    "data.delivery": ("refs", "driver"),
    "elastic.straggler_policy": ("none", "rebalance", "replace"),
}

# Fields that must be above 0, and fields that must be 0 or more (checked after the types).
POSITIVE_FIELDS = [
    "model.vocab_size", "model.block_size", "model.n_layer", "model.n_head", "model.n_embd",
    "data.shuffle_window", "data.shuffle_block_rows", "data.prefetch_steps", "data.num_readers",
    "data.read_timeout_s",
    "train.max_steps", "train.global_batch_size", "train.log_every_steps", "train.step_timeout_s",
    "eval.batch_rows",
    "optim.lr", "optim.eps",
    "checkpoint.keep_last",
    "resources.num_workers", "resources.cpus_per_worker", "resources.start_timeout_s",
    "elastic.max_failures", "elastic.failure_window_s", "elastic.below_min_timeout_s",
    "elastic.hang_floor_s", "elastic.hang_factor", "elastic.straggler_window_steps",
    "elastic.fault_slow_factor", "elastic.orphan_timeout_s",
]
NON_NEGATIVE_FIELDS = [
    "model.dropout", "train.micro_batch_size", "train.stop_at_step", "train.steps_per_call", "optim.min_lr_ratio", "optim.warmup_steps",
    "optim.weight_decay", "optim.grad_clip", "optim.momentum", "optim.trust_coefficient",
    "optim.lr_base_batch_size", "checkpoint.every_steps", "resources.gpus_per_worker",
    "resources.local_num_cpus", "resources.peak_tflops_per_worker", "resources.cost_per_worker_hour",
    "resources.memory_per_worker_gb", "elastic.min_workers", "elastic.max_workers", "elastic.drain_poll_s",
    "elastic.straggler_margin", "elastic.fault_copy_delay_s", "eval.every_steps", "eval.max_rows", "train.early_stop.patience", "train.early_stop.min_delta",
]


def _get(spec: JobSpec, dotted: str) -> Any:
    obj: Any = spec
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def validate(spec: JobSpec) -> JobSpec:
    """Range and cross-field checks; raises SpecError naming the field."""
    for dotted, allowed in ALLOWED_CHOICES.items():
        value = _get(spec, dotted)
        if value not in allowed:
            raise SpecError(dotted, f"got {quote(value)}; allowed: {', '.join(allowed)}")
    for dotted in POSITIVE_FIELDS:
        value = _get(spec, dotted)
        if not value > 0:
            raise SpecError(dotted, f"got {quote(value)}; must be greater than 0")
    for dotted in NON_NEGATIVE_FIELDS:
        value = _get(spec, dotted)
        if value < 0:
            raise SpecError(dotted, f"got {quote(value)}; must be 0 or more")
    if not spec.name or any(c in spec.name for c in "/\\ ") or not spec.name.isprintable():
        raise SpecError("name", f"got {quote(spec.name)}; use a non-empty name without spaces or slashes")
    if spec.model.n_embd % spec.model.n_head:
        raise SpecError(
            "model.n_head",
            f"got {quote(spec.model.n_head)}; must divide model.n_embd={spec.model.n_embd}",
        )
    if spec.model.dropout >= 1:
        raise SpecError("model.dropout", f"got {quote(spec.model.dropout)}; must be below 1")
    if spec.optim.lr_scaling != "none" and spec.optim.lr_base_batch_size < 1:
        raise SpecError("optim.lr_base_batch_size",
                        f"got {quote(spec.optim.lr_base_batch_size)}; optim.lr_scaling="
                        f"{spec.optim.lr_scaling} scales optim.lr from the global batch it was tuned "
                        f"for: give that batch size")
    for changed in spec.checkpoint.resume_changes:
        if changed not in RESUME_CHANGEABLE:
            raise SpecError("checkpoint.resume_changes", f"got {quote(changed)}; a resume takes only "
                                                         f"{', '.join(RESUME_CHANGEABLE)} from the spec "
                                                         f"rather than from the checkpoint")
    if spec.optim.min_lr_ratio > 1:
        raise SpecError("optim.min_lr_ratio", f"got {quote(spec.optim.min_lr_ratio)}; must be at most 1")
    if spec.optim.warmup_steps > spec.train.max_steps:
        raise SpecError(
            "optim.warmup_steps",
            f"got {quote(spec.optim.warmup_steps)}; must not exceed train.max_steps={spec.train.max_steps}",
        )
    if spec.resources.num_workers > spec.train.global_batch_size:
        raise SpecError(
            "resources.num_workers",
            f"got {quote(spec.resources.num_workers)}; every worker needs at least one row of "
            f"train.global_batch_size={spec.train.global_batch_size}",
        )
    e, n = spec.elastic, spec.resources.num_workers
    if e.max_workers and e.max_workers < n:
        raise SpecError("elastic.max_workers",
                        f"got {quote(e.max_workers)}; must be 0 or at least resources.num_workers={n}")
    if e.min_workers > n:
        raise SpecError("elastic.min_workers",
                        f"got {quote(e.min_workers)}; must not exceed resources.num_workers={n}")
    if max(e.max_workers, n) > spec.train.global_batch_size:
        raise SpecError("elastic.max_workers",
                        f"got {quote(e.max_workers)}; every worker needs at least one row of "
                        f"train.global_batch_size={spec.train.global_batch_size}")
    if e.fault_slow_factor < 1:
        raise SpecError("elastic.fault_slow_factor", f"got {quote(e.fault_slow_factor)}; must be at least 1 (1: no slowdown)")
    if e.fault_slow_rank < -1:
        raise SpecError("elastic.fault_slow_rank", f"got {quote(e.fault_slow_rank)}; must be a rank, or -1 for off")
    accelerator = spec.resources.accelerator_type
    if accelerator and not re.fullmatch(ACCELERATOR_TYPE_PATTERN, accelerator):
        raise SpecError("resources.accelerator_type", f"got {quote(accelerator)}; Ray's accelerator type, as its "
                                                      f"node label ray.io/accelerator-type reads (e.g. A10G, H100)")
    if accelerator and not spec.resources.gpus_per_worker:
        raise SpecError("resources.accelerator_type", f"got {quote(accelerator)} with resources.gpus_per_worker=0; "
                                                      f"a GPU type needs GPUs: set gpus_per_worker, or leave it empty")
    nice = spec.resources.worker_niceness
    if nice is not None and not -20 <= nice <= 19:
        raise SpecError("resources.worker_niceness", f"got {quote(nice)}; must be in -20..19, or null for Ray's")
    if not spec.data.path:
        raise SpecError("data.path", "is empty; give a dataset directory (see `raytrain-sys prepare-data`)")
    for name, amount in spec.data.read_resources.items():
        if not isinstance(name, str) or isinstance(amount, bool) or not isinstance(amount, (int, float)) \
                or amount < 0:
            raise SpecError(f"data.read_resources.{name}",
                            f"got {quote(amount)}; a Ray resource name mapped to a number of 0 or more, "
                            f"e.g. {{CPU: 1}} or {{data_reader: 1}}")
    if spec.checkpoint.peer_copies not in (-1, 0, 1):
        raise SpecError("checkpoint.peer_copies", f"got {spec.checkpoint.peer_copies}; 1 (on), 0 (off) or -1 "
                        "(on for a layout whose shards have no replica)")
    if "://" in spec.checkpoint.stage_dir:
        raise SpecError("checkpoint.stage_dir", f"got {quote(spec.checkpoint.stage_dir)}; a local directory on "
                                                f"each worker's node, or \"\" to upload from memory")
    if spec.data.sequences != "rows":
        _validate_sequences(spec)
    _validate_extensions(spec)
    _validate_eval(spec)
    validate_parallel(spec)
    return spec


def _extension_point(spec: JobSpec, dotted: str, example: str, objects_allowed: bool) -> None:
    """An extension field holds "pkg.module:name" or, from Python, the object itself; an
    importable object is recorded by its import path (so YAML, MLflow and resume can name it)."""
    section, name = dotted.split(".")
    value = getattr(getattr(spec, section), name)
    if isinstance(value, (dict, list, tuple, int, float)):  # data (YAML, JSON): never an object given from Python
        raise SpecError(dotted, f"got {quote(value)}; expected an import path \"package.module:name\", e.g. {example}")
    if isinstance(value, str):
        if value and not value.startswith(PYTHON_OBJECT_PREFIX) and \
                not re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*", value):
            raise SpecError(dotted, f"got {quote(value)}; expected an import path \"package.module:name\", "
                                    f"e.g. {example}")
        return
    if not objects_allowed:
        raise SpecError(dotted, f"got {type(value).__name__}; expected an import path string")
    path = import_path_of(value)
    if path is not None:
        setattr(getattr(spec, section), name, path)


def _validate_extensions(spec: JobSpec) -> None:
    _extension_point(spec, "model.factory", '"mypkg.models:build"', True)
    _extension_point(spec, "train.task", '"mypkg.tasks:MyTask"', True)
    _extension_point(spec, "data.transform", '"mypkg.data:fn"', True)
    if not spec.model.factory and spec.model.name not in REGISTERED_MODELS:
        raise SpecError("model.name", f"got {quote(spec.model.name)}; registered models: "
                                      f"{', '.join(sorted(REGISTERED_MODELS))}, or set model.factory "
                                      f"to build your own (\"mypkg.models:build\")")
    if spec.model.factory and not spec.train.task:
        raise SpecError("train.task", "a model built by model.factory needs a task (the loss it is "
                                      "trained on): set train.task, e.g. raytrain_sys.train.tasks:Classify "
                                      "with train.task_args {input_key: x, label_key: y}, or your own")
    if spec.train.task_args and not isinstance(spec.train.task, str):
        raise SpecError("train.task_args", "build the task object yourself when you pass one from Python")


def _validate_eval(spec: JobSpec) -> None:
    ev = spec.eval
    if spec.checkpoint.keep_best and not ev.every_steps:
        raise SpecError("checkpoint.keep_best", "keeps the checkpoint of the best evaluation: set "
                                                "eval.every_steps too")
    if spec.train.early_stop.patience and not ev.every_steps:
        raise SpecError("train.early_stop.patience", "stops on evaluations: set eval.every_steps too")
    if ev.every_steps and spec.parallel.pp > 1:
        raise SpecError("eval.every_steps", f"evaluation runs plain forward passes; with parallel.pp="
                                            f"{spec.parallel.pp} the model is split into a pipeline "
                                            f"schedule: set eval.every_steps: 0")


def _validate_sequences(spec: JobSpec) -> None:
    """Rows made of documents: next-token rows whose padding and boundaries only the task sees."""
    seq = spec.data.sequences
    if spec.model.name != "gpt":
        raise SpecError("data.sequences", f"got {quote(seq)}; documents make token rows for a next-token "
                                          f"model (gpt), not {quote(spec.model.name)}")
    if spec.data.on_bad_shard == "skip":
        raise SpecError("data.on_bad_shard", f"got 'skip'; with data.sequences={seq} a skipped shard "
                                             f"would re-pack rows already trained on: use 'fail'")
    # The pipeline schedule carries token rows only, without the padding mask or document ids.
    if spec.parallel.pp > 1:
        raise SpecError("data.sequences", f"got {quote(seq)}; pipeline parallel (parallel.pp="
                                          f"{spec.parallel.pp}) trains on stored rows only: use rows")
    # Bucketed batches change width every step (sequence parallel splits it) and document masks
    # have not been run through the tensor-parallel attention.
    if spec.parallel.tp > 1 and seq != "pack":
        raise SpecError("data.sequences", f"got {quote(seq)}; with parallel.tp={spec.parallel.tp} use "
                                          f"pack or rows")


def validate_parallel(spec: JobSpec) -> None:
    """Checks of ``parallel`` against the model and the worker counts, before any resource."""
    par, model = spec.parallel, spec.model
    for name in ("dp", "fsdp"):
        value = getattr(par, name)
        if value is not None and value < 1:
            raise SpecError(f"parallel.{name}", f"got {quote(value)}; must be 1 or more, or left unset "
                                                f"to take the rest of the world")
    for name in ("tp", "pp", "pp_stages_per_rank", "powersgd_rank"):
        if getattr(par, name) < 1:
            raise SpecError(f"parallel.{name}", f"got {quote(getattr(par, name))}; must be 1 or more")
    for name in ("microbatches", "powersgd_start_iter"):
        if getattr(par, name) < 0:
            raise SpecError(f"parallel.{name}", f"got {quote(getattr(par, name))}; must be 0 or more")
    if par.strategy == "ddp" and (par.fsdp or 1) > 1:
        raise SpecError("parallel.fsdp", f"got {quote(par.fsdp)} with strategy ddp, which replicates "
                                         f"parameters; use strategy fsdp or hsdp to shard them")
    if par.strategy == "fsdp" and (par.dp or 1) > 1:
        raise SpecError("parallel.dp", f"got {quote(par.dp)} with strategy fsdp; replicas of sharded "
                                       f"groups are strategy hsdp")
    if par.strategy == "hsdp" and not par.fsdp:
        raise SpecError("parallel.fsdp", "strategy hsdp needs the shard group size "
                                         "(e.g. the workers of one node)")
    for name in ("tp", "pp"):
        if getattr(par, name) > 1 and (model.factory or model.name not in MODELS_WITH_PARALLEL_PLANS):
            which = (f"model.factory {quote(plain_value(model.factory))}" if model.factory
                     else f"model.name {quote(model.name)}")
            raise SpecError(f"parallel.{name}", f"got {quote(getattr(par, name))}; {which} has no tensor or "
                                                f"pipeline plan (models with one: "
                                                f"{', '.join(sorted(MODELS_WITH_PARALLEL_PLANS))}); "
                                                f"use strategy ddp, fsdp or hsdp with {name}: 1")
    if model.n_head % par.tp:
        raise SpecError("parallel.tp", f"got {quote(par.tp)}; must divide model.n_head={model.n_head} "
                                       f"(each tensor-parallel rank holds whole heads)")
    if par.pp > model.n_layer:
        raise SpecError("parallel.pp", f"got {quote(par.pp)}; must not exceed model.n_layer="
                                       f"{model.n_layer} (every stage holds at least one layer)")
    stages_per_rank = par.pp_stages_per_rank if par.pp_schedule == "interleaved_1f1b" else 1
    if par.pp > 1 and par.pp_schedule == "interleaved_1f1b" and model.n_layer % (par.pp * stages_per_rank):
        raise SpecError("parallel.pp_stages_per_rank",
                        f"interleaved_1f1b splits model.n_layer={model.n_layer} into pp x "
                        f"pp_stages_per_rank = {par.pp} x {stages_per_rank} equal stages; "
                        f"pick degrees whose product divides n_layer")
    microbatches = par.microbatches or par.pp * stages_per_rank
    if par.pp > 1 and par.pp_schedule != "gpipe" and microbatches < par.pp:
        raise SpecError("parallel.microbatches", f"got {quote(par.microbatches)}; {par.pp_schedule} "
                                                 f"needs at least pp={par.pp} micro-batches")
    if par.mixed_precision != "none":
        if par.strategy == "ddp":
            raise SpecError("parallel.mixed_precision", "is FSDP's parameter/reduce policy and "
                            "needs strategy fsdp or hsdp; for ddp use train.precision: bf16")
        if spec.train.precision != "fp32":
            raise SpecError("parallel.mixed_precision", f"bf16 needs train.precision: fp32 (the "
                            f"master weights), got {spec.train.precision}")
    if par.comm_hook != "none" and par.strategy != "ddp":
        raise SpecError("parallel.comm_hook", f"{par.comm_hook} compresses DDP's all-reduce; "
                                              f"strategy {par.strategy} reduce-scatters instead")
    if par.comm_hook != "none" and (par.tp > 1 or par.pp > 1):
        raise SpecError("parallel.comm_hook", f"{par.comm_hook} is a DDP module hook; with tp or "
                                              f"pp > 1 the replicas all-reduce without that module")
    if par.tp > 1 and model.block_size % par.tp:
        raise SpecError("parallel.tp", f"got {quote(par.tp)}; must divide model.block_size="
                                       f"{model.block_size} (sequence parallel splits the sequence)")
    worlds = {"resources.num_workers": spec.resources.num_workers}
    if spec.elastic.max_workers:
        worlds["elastic.max_workers"] = spec.elastic.max_workers
    for field_name, world in worlds.items():
        shape = par.degrees(world, source=field_name)
        data_size = shape["dp"] * shape["fsdp"]
        rows = spec.train.global_batch_size // data_size
        if rows < 1:
            raise SpecError("train.global_batch_size",
                            f"got {quote(spec.train.global_batch_size)}; each of the {data_size} "
                            f"data-parallel ranks ({field_name}={world}) needs at least one row")
        if par.pp > 1 and rows < microbatches:
            raise SpecError("parallel.microbatches",
                            f"{microbatches} pipeline micro-batches need at least as many rows "
                            f"per data-parallel rank; train.global_batch_size="
                            f"{spec.train.global_batch_size} gives {rows} with {field_name}={world}")


