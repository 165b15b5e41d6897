"""The job spec: one typed description of a training job.

The YAML files in ``jobs/`` are the user-facing form of exactly these dataclasses. Loading
validates every field before any Ray resource is taken, and every error names the dotted field,
the value given and what is allowed.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import os
import types
import typing
from dataclasses import dataclass, field
from typing import Any

import yaml

from raytrain_sys.errors import SpecError


@dataclass
class ModelSpec:
    name: str = "gpt"  # key in raytrain_sys.models.MODEL_BUILDERS
    vocab_size: int = 256  # byte-level tokens
    block_size: int = 128  # context length in tokens
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0  # 0 keeps runs bitwise reproducible without saving dropout masks
    bias: bool = False


@dataclass
class DataSpec:
    path: str = "data/stdlib"  # dataset dir (local or s3://) holding manifest.json + shards
    seed: int = 0  # the global order is a pure function of (manifest, seed, epoch)
    shuffle_window: int = 8192  # rows permuted together; larger mixes better, costs memory
    shuffle_block_rows: int = 256  # rows read as one unit when blocks are permuted; ~ a row group
    prefetch_steps: int = 4  # global batches read ahead of the trainers
    log_sample_ids: bool = False  # write the ids each rank consumed per committed step
    s3_endpoint_url: str = ""  # for s3:// data; "" uses AWS_ENDPOINT_URL or AWS's default


@dataclass
class TrainSpec:
    max_steps: int = 300
    global_batch_size: int = 32  # rows per optimizer step, constant whatever the world size
    micro_batch_size: int = 0  # rows per forward pass on a rank; 0 = the rank's whole share
    precision: str = "fp32"  # fp32 | bf16 (autocast) | fp64 (numerics checks: no rounding noise)
    seed: int = 1234  # model init and dropout
    log_every_steps: int = 10
    step_timeout_s: float = 600.0  # a step slower than this is treated as a hung worker
    stop_at_step: int = 0  # pause: stop after this many committed steps, with a checkpoint; 0 = run on


@dataclass
class ParallelSpec:
    strategy: str = "ddp"  # ddp (fsdp/tp/pp arrive with the parallelism issue)
    backend: str = "auto"  # auto = nccl when CUDA is present, gloo otherwise


@dataclass
class OptimSpec:
    name: str = "adamw"
    lr: float = 3e-3
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 20
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # max global grad norm; 0 disables clipping


@dataclass
class CheckpointSpec:
    uri: str = ""  # local dir or s3://bucket/prefix; "" = <run_dir>/checkpoints
    every_steps: int = 100  # 0 = only on clean exit
    keep_last: int = 3  # older complete checkpoints are deleted; the newest never is
    s3_endpoint_url: str = ""  # "" uses AWS_ENDPOINT_URL or AWS's default
    resume_from: str = ""  # "" = fresh start, "latest" = newest complete in uri, or a URI
    save_on_exit: bool = True


@dataclass
class ElasticSpec:
    min_workers: int = 0  # 0 = resources.num_workers (no elasticity)
    max_workers: int = 0  # 0 = resources.num_workers
    max_failures: int = 3


@dataclass
class TrackingSpec:
    enabled: bool = True
    uri: str = ""  # "" = sqlite:///<output_dir>/mlflow.db; or http://host:port of mlflow server
    experiment: str = "raytrain-sys"
    run_name: str = ""  # "" = the job name plus a timestamp


@dataclass
class ResourcesSpec:
    num_workers: int = 2
    cpus_per_worker: float = 1.0
    gpus_per_worker: float = 0.0
    placement_strategy: str = "PACK"  # PACK | SPREAD | STRICT_PACK | STRICT_SPREAD
    start_timeout_s: float = 60.0  # wait this long for the cluster to hold the whole group
    ray_address: str = ""  # "" = RAY_ADDRESS or a running job's cluster, else start a local one
    local_num_cpus: int = 0  # CPUs of a locally started cluster; 0 = this machine's count


@dataclass
class JobSpec:
    name: str = "job"
    output_dir: str = "runs"  # run directories, the default MLflow store and checkpoints
    model: ModelSpec = field(default_factory=ModelSpec)
    data: DataSpec = field(default_factory=DataSpec)
    train: TrainSpec = field(default_factory=TrainSpec)
    parallel: ParallelSpec = field(default_factory=ParallelSpec)
    optim: OptimSpec = field(default_factory=OptimSpec)
    checkpoint: CheckpointSpec = field(default_factory=CheckpointSpec)
    elastic: ElasticSpec = field(default_factory=ElasticSpec)
    tracking: TrackingSpec = field(default_factory=TrackingSpec)
    resources: ResourcesSpec = field(default_factory=ResourcesSpec)

    # ----- derived views -----
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def flat(self) -> dict[str, Any]:
        """Dotted keys to leaf values, the form MLflow params take."""
        out: dict[str, Any] = {}

        def walk(prefix: str, value: Any) -> None:
            if isinstance(value, dict):
                for k, v in value.items():
                    walk(f"{prefix}.{k}" if prefix else k, v)
            else:
                out[prefix] = value

        walk("", self.to_dict())
        return out

    def training_hash(self) -> str:
        """Hash of the fields that decide the trained numbers (not where things are written).

        A checkpoint records it; resuming with a different training hash is refused unless the
        user asks for it, because the result would no longer equal an uninterrupted run.
        """
        keep = {k: v for k, v in self.to_dict().items() if k in TRAINING_SECTIONS}
        keep["data"] = {k: v for k, v in keep["data"].items() if k in ("seed", "shuffle_window", "shuffle_block_rows")}
        keep["train"] = {
            k: v for k, v in keep["train"].items() if k in ("global_batch_size", "precision", "seed")
        }
        blob = json.dumps(keep, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def spec_hash(self) -> str:
        blob = json.dumps(self.to_dict(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


TRAINING_SECTIONS = ("model", "data", "train", "optim")

ALLOWED_CHOICES: dict[str, tuple[str, ...]] = {
    "train.precision": ("fp32", "bf16", "fp64"),
    "parallel.strategy": ("ddp",),
    "parallel.backend": ("auto", "gloo", "nccl"),
    "optim.name": ("adamw",),
    "resources.placement_strategy": ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"),
    "model.name": ("gpt",),
}

# (field, lower bound, inclusive?) checked after types.
_POSITIVE = [
    "model.vocab_size", "model.block_size", "model.n_layer", "model.n_head", "model.n_embd",
    "data.shuffle_window", "data.shuffle_block_rows", "data.prefetch_steps",
    "train.max_steps", "train.global_batch_size", "train.log_every_steps", "train.step_timeout_s",
    "optim.lr", "optim.eps",
    "checkpoint.keep_last",
    "resources.num_workers", "resources.cpus_per_worker", "resources.start_timeout_s",
    "elastic.max_failures",
]
_NON_NEGATIVE = [
    "model.dropout", "train.micro_batch_size", "train.stop_at_step", "optim.min_lr_ratio", "optim.warmup_steps",
    "optim.weight_decay", "optim.grad_clip", "checkpoint.every_steps", "resources.gpus_per_worker",
    "resources.local_num_cpus", "elastic.min_workers", "elastic.max_workers",
]


# ----------------------------------------------------------------------------- loading

def _type_name(tp: Any) -> str:
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(
        tp, getattr(tp, "__name__", str(tp))
    )


def _coerce(path: str, value: Any, tp: Any) -> Any:
    """Check ``value`` against the annotation ``tp``; allow int where float is expected."""
    if dataclasses.is_dataclass(tp):
        return _from_dict(tp, value, path)
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        for arm in typing.get_args(tp):
            if arm is type(None) and value is None:
                return None
        arms = [a for a in typing.get_args(tp) if a is not type(None)]
        return _coerce(path, value, arms[0])
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is int and isinstance(value, bool):
        raise SpecError(path, f"got {value!r}; expected {_type_name(tp)}")
    if tp in (int, float, str, bool) and not isinstance(value, tp):
        raise SpecError(path, f"got {value!r} ({type(value).__name__}); expected {_type_name(tp)}")
    return value


def _from_dict(cls: type, raw: Any, prefix: str = "") -> Any:
    where = prefix or "the spec"
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise SpecError(where, f"expected a mapping of fields, got {type(raw).__name__} {raw!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in raw.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise SpecError(path, f"unknown field{hint}; allowed: {', '.join(names)}")
        kwargs[key] = _coerce(path, value, hints[key])
    return cls(**kwargs)


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
            raise SpecError(dotted, f"got {value!r}; allowed: {', '.join(allowed)}")
    for dotted in _POSITIVE:
        value = _get(spec, dotted)
        if not value > 0:
            raise SpecError(dotted, f"got {value!r}; must be greater than 0")
    for dotted in _NON_NEGATIVE:
        value = _get(spec, dotted)
        if value < 0:
            raise SpecError(dotted, f"got {value!r}; must be 0 or more")
    if not spec.name or any(c in spec.name for c in "/\\ "):
        raise SpecError("name", f"got {spec.name!r}; use a non-empty name without spaces or slashes")
    if spec.model.n_embd % spec.model.n_head:
        raise SpecError(
            "model.n_head",
            f"got {spec.model.n_head}; must divide model.n_embd={spec.model.n_embd}",
        )
    if spec.model.dropout >= 1:
        raise SpecError("model.dropout", f"got {spec.model.dropout}; must be below 1")
    if spec.optim.min_lr_ratio > 1:
        raise SpecError("optim.min_lr_ratio", f"got {spec.optim.min_lr_ratio}; must be at most 1")
    if spec.optim.warmup_steps > spec.train.max_steps:
        raise SpecError(
            "optim.warmup_steps",
            f"got {spec.optim.warmup_steps}; must not exceed train.max_steps={spec.train.max_steps}",
        )
    if spec.resources.num_workers > spec.train.global_batch_size:
        raise SpecError(
            "resources.num_workers",
            f"got {spec.resources.num_workers}; every worker needs at least one row of "
            f"train.global_batch_size={spec.train.global_batch_size}",
        )
    if not spec.data.path:
        raise SpecError("data.path", "is empty; give a dataset directory (see `raytrain-sys prepare-data`)")
    return spec


def from_dict(raw: Any) -> JobSpec:
    return validate(_from_dict(JobSpec, raw))


def parse_override(text: str) -> tuple[str, Any]:
    """``a.b=value`` -> ("a.b", value), the value parsed as a YAML scalar."""
    if "=" not in text:
        raise SpecError(text, "an override must look like dotted.key=value")
    key, _, raw = text.partition("=")
    key = key.strip()
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    if value is None:
        value = ""
    return key, value


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    raw = json.loads(json.dumps(raw))  # deep copy of plain data
    for text in overrides:
        key, value = parse_override(text)
        parts = key.split(".")
        node = raw
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise SpecError(key, f"'{part}' is not a section")
            node = child
        node[parts[-1]] = value
    return raw


def load_spec(path: str | os.PathLike, overrides: list[str] | None = None) -> JobSpec:
    """Read a YAML job spec, apply ``--set`` overrides, validate."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise SpecError("SPEC", f"file {path!r} does not exist")
    try:
        with open(path) as f:
            raw = yaml.safe_load(f)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise SpecError("SPEC", f"{path} is not valid YAML{where}: {problem}") from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise SpecError("SPEC", f"{path} must hold a mapping of sections, got {type(raw).__name__}")
    return from_dict(apply_overrides(raw, overrides or []))


def to_yaml(spec: JobSpec) -> str:
    return yaml.safe_dump(spec.to_dict(), sort_keys=False)
