"""The job spec: one typed description of a training job.

The YAML files in ``jobs/`` are the user-facing form of exactly these dataclasses. Each field
carries its type, default and description; from them pydantic checks every field's type
(``from_dict``), and the same model gives the JSON schema (``json_schema``) that the job
service's API publishes and ``docs/spec_reference.md`` is written from. The allowed values,
ranges and rules across fields are ``raytrain_sys.spec_rules``. Loading checks every field
before any Ray resource is taken, and every error names the dotted field, the value given and
what is allowed.

The sections are plain dataclasses that pydantic validates (a ``TypeAdapter`` built at the first
``from_dict``), not pydantic classes: making one from Python, copying it (``dataclasses.replace``)
and sending it to a worker stay what they were, and importing this module imports no pydantic.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import hashlib
import json
import os
from dataclasses import dataclass, field
from typing import Any

import yaml

from raytrain_sys.errors import SpecError, quote
from raytrain_sys.spec_fields import (Checked, Integer, Names, Number, Section, described, extension_point, refusal,
                                      written_in_place)
from raytrain_sys.spec_rules import (ACCELERATOR_TYPE_PATTERN, ALLOWED_CHOICES, MODELS_WITH_PARALLEL_PLANS,  # noqa: F401
                                     NON_NEGATIVE_FIELDS, POSITIVE_FIELDS, PYTHON_OBJECT_PREFIX, REGISTERED_MODELS,
                                     RESUME_CHANGEABLE, describe_object, import_path_of, plain_value, validate,
                                     validate_parallel)


@dataclass
class ModelSpec(Checked):
    """Your model: ``factory: "mypkg.models:build"`` names a callable that receives this section (your own fields in ``args``) and returns a ``torch.nn.Module``; from Python, pass the callable itself (``rts.run(spec, model_factory=build)``). Without a factory, ``name`` picks a registered model (``gpt``, ``cnn``, or one added by ``raytrain_sys.models.register_model``). A factory that does not import, raises, or returns something else fails before training, naming this field. DDP and FSDP work for any module (``parallel.fsdp_wrap``); TP and PP plans exist for ``gpt`` only.

    The other fields configure the registered models.
    """

    name: str = described("gpt",
        "A registered model (gpt, cnn; raytrain_sys.models.register_model adds more) or, with model.factory set, a "
        "free label for your own model")
    factory: Any = extension_point("",
        '"pkg.module:callable" (or, from Python, the callable itself): called with this section, returns an '
        'nn.Module. "" = the registered factory named by model.name')
    args: dict = described({}, 'free-form, for your factory (model.args["width"])')
    vocab_size: Integer = described(256, "byte-level tokens")
    block_size: Integer = described(128, "context length in tokens")
    n_layer: Integer = described(4, "transformer blocks (GPT) or conv layers (CNN)")
    n_head: Integer = described(4, "attention heads; must divide n_embd (and be divisible by parallel.tp)")
    n_embd: Integer = described(128, "model width (GPT) or conv channels (CNN)")
    dropout: Number = described(0.0, "0 keeps runs bitwise reproducible without saving dropout masks")
    bias: bool = described(False, "biases in Linear/LayerNorm; off is a little faster and as good (nanoGPT)")


@dataclass
class DataSpec(Checked):
    """Your data: a dataset directory with ``manifest.json``, written by ``raytrain-sys prepare-data`` (token rows, documents, WebDataset) or, for Parquet files you already have (local or s3://), by ``prepare-data --index DIR`` (only the manifest is written). ``columns`` picks the columns read; ``transform: "mypkg.data:fn"`` runs ``fn(row) -> row`` on every row inside the read tasks, before the task sees it (keep it a pure function of the row: rows are read again after a failure). A file whose schema differs from the manifest's stops the run, naming the file."""

    path: str = described("data/stdlib", "dataset dir (local or s3://) holding manifest.json + shards")
    seed: Integer = described(0, "the global order is a pure function of (manifest, seed, epoch)")
    shuffle_window: Integer = described(8192, "rows permuted together; larger mixes better, costs memory")
    shuffle_block_rows: Integer = described(256, "rows read as one unit when blocks are permuted; ~ a row group")
    prefetch_steps: Integer = described(4, "global batches read ahead of the trainers")
    log_sample_ids: bool = described(False, "write the ids each rank consumed per committed step")
    s3_endpoint_url: str = described("", "for s3:// data; \"\" uses AWS_ENDPOINT_URL or AWS's default")
    on_bad_shard: str = described("fail",
        "fail: a missing/truncated/corrupt shard stops the run, naming shard and cursor. skip: its samples leave the "
        "stream from that point, recorded in <run_dir>/skipped_samples.jsonl.")
    read_timeout_s: Number = described(60.0,
        "A read (a chunk of rows read, decoded and transformed in a read task) that the trainers wait for and that "
        "has run this long is hung (a data.transform in a loop, a stuck filesystem): its stack is kept "
        "(summary.json's read_hangs, the log), its task ended and the read made again; a second hang of the same read"
        " stops the run, naming where it was stuck")
    sequences: str = described("rows",
        "How rows are made. rows: the dataset's own fixed-length rows. For a documents dataset (prepare-data --format"
        " documents): pack = documents concatenated and cut into rows of model.block_size + 1 tokens; pack_masked = "
        "pack, positions restarting and attention stopping at document boundaries; bucket = a row per document (cut "
        "when longer), rows of similar length batched together, each batch padded to its longest row. shuffle_window "
        "and shuffle_block_rows then count documents.")
    num_readers: Integer = described(3,
        "Read tasks running at once; each reads a chunk of windows into Ray's object store.")
    read_resources: dict = described({},
        'Ray resources of each read task. {} reserves no CPU (a read is short and mostly I/O, and must not wait '
        'behind trainers holding every CPU); {"CPU": 1}, or a custom resource that only CPU-only nodes offer (e.g. '
        '{"data_reader": 1}), moves reading and decoding off the trainers.')
    columns: Names = described([],
        "Columns a read delivers (a table dataset: prepare-data --index); [] = every column")
    transform: Any = extension_point("",
        '"pkg.module:fn" (or a callable): fn(row: dict of column -> value) -> dict, run on every row in the read '
        'tasks, before the task counts loss units; must be a pure function of the row')
    delivery: str = described("refs",
        "How a rank gets its rows. refs: the driver sends object references and row ranges, the rank fetches its rows"
        " from the object store, node to node. driver: the driver fetches the rows and sends them as task arguments "
        "(every byte through one process; kept to measure against).")


@dataclass
class EarlyStopSpec(Checked):
    """Stop when eval.metric has not improved by more than min_delta for patience evaluations."""

    patience: Integer = described(0, "evaluations without improvement before the run stops; 0 = never stop early")
    min_delta: Number = described(0.0, "an improvement smaller than this does not count")


@dataclass
class TrainSpec(Checked):
    """Your task: ``task: "mypkg.tasks:MyTask"`` names a class (built with ``task_args``) with ``units(batch) -> int`` and ``loss_sum(model, batch) -> scalar tensor``, both sums over rows (``raytrain_sys.train.tasks.Task``): that is what keeps gradients exact at any world size; ``rts.check_task(task, model, batch)`` checks it on your rows. Gradient accumulation: ``micro_batch_size`` rows per forward pass, whatever the world size; the global batch stays ``global_batch_size``."""

    max_steps: Integer = described(300, "optimizer steps of the whole run (the LR schedule spans them)")
    global_batch_size: Integer = described(32, "rows per optimizer step, constant whatever the world size")
    micro_batch_size: Integer = described(0, "rows per forward pass on a rank; 0 = the rank's whole share")
    precision: str = described("fp32", "fp32 | bf16 (autocast) | fp64 (numerics checks: no rounding noise)")
    seed: Integer = described(1234, "model init and dropout")
    log_every_steps: Integer = described(10, "progress lines and summary.json throughput refresh")
    step_timeout_s: Number = described(600.0,
        "a step's deadline until one is learned from the job's steps (warm-up, compilation), and the most a learned "
        "one can be (elastic.hang_floor_s)")
    stop_at_step: Integer = described(0, "pause: stop after this many committed steps, with a checkpoint; 0 = run on")
    run_ahead: bool = described(True, "send step k+1 while step k runs (boundaries with work excepted); same results")
    steps_per_call: Integer = described(0,
        "Steps one call to each worker carries (a lease). 0 = auto: one step until step times are known, then as many"
        " as fit in 10 s (1000 at most, and no more than the data read ahead), so the driver's per-call cost (~0.5 ms"
        " per worker) is shared by many steps; a boundary with work (drain, pause, newcomers) cuts a lease short at "
        "the end of the step in flight.")
    task: Any = extension_point("",
        "\"pkg.module:Class\" of a Task (raytrain_sys.train.tasks: units + loss_sum), built with train.task_args, or "
        "from Python a Task object. \"\" = the registered model's own task")
    task_args: dict = described({}, "keyword arguments of train.task's class")
    compile: bool = described(False,
        "torch.compile the model (Module.compile: parameter names and checkpoints unchanged); the first step includes"
        " the compile time, reported as summary.json compile_s")
    early_stop: Section[EarlyStopSpec] = field(default_factory=EarlyStopSpec)  # patience, min_delta: see train.early_stop


@dataclass
class EvalSpec(Checked):
    """Evaluation during training: the task's metrics over the same rows at any world size."""

    every_steps: Integer = described(0, "evaluate after every this many committed steps (and at the end); 0 = never")
    dataset: str = described("", 'dataset dir (local or s3://) with manifest.json; "" = <data.path>/val')
    max_rows: Integer = described(0, "the first rows of the dataset (manifest order); 0 = all of them")
    batch_rows: Integer = described(32,
        "rows per forward pass; a batch goes whole to one rank, so results never depend on the world")
    metric: str = described("loss", "what keep_best and early stop watch: loss, or accuracy (classification)")


@dataclass
class ParallelSpec(Checked):
    """How the world is cut: one DeviceMesh with axes ("pp", "dp", "fsdp", "tp").

    ``strategy`` says how the data-parallel ranks treat parameters: ddp replicates them, fsdp
    shards them (FSDP2), hsdp shards within groups of ``fsdp`` ranks and replicates across
    groups. ``tp`` and ``pp`` stack on top of any of the three. A data-parallel degree left
    unset takes the rest of the world, so a job keeps working when the world is resized.
    """

    strategy: str = described("ddp", "ddp | fsdp | hsdp: replicate, shard, or shard within groups")
    backend: str = described("auto", "auto = nccl when CUDA is present, gloo otherwise")
    dp: Integer | None = described(None, "replicas (DDP ranks, HSDP groups); None = the rest of the world")
    fsdp: Integer | None = described(None, "ranks a parameter is sharded over; None = rest (fsdp), 1 (ddp)")
    tp: Integer = described(1, "tensor-parallel degree; must divide model.n_head")
    pp: Integer = described(1, "pipeline stages' ranks; must not exceed model.n_layer")
    pp_schedule: str = described("1f1b", "1f1b: GPipe's bubble with activations of only pp micro-batches")
    pp_stages_per_rank: Integer = described(2, "interleaved_1f1b only: virtual stages per rank (bubble / v)")
    microbatches: Integer = described(0, "pipeline micro-batches per step; 0 = pp x stages per rank (fills it)")
    reshard_after_forward: bool = described(True, "true = FSDP full shard; false = ZeRO-2-like (more memory)")
    activation_checkpointing: bool = described(False, "recompute blocks in backward: memory for ~1/3 compute")
    mixed_precision: str = described("none", "none | bf16: FSDP params in bf16, gradients reduced in fp32")
    comm_hook: str = described("none", "none | fp16 | powersgd: DDP gradient compression")
    powersgd_rank: Integer = described(1, "PowerSGD matrix approximation rank (1 = most compression)")
    powersgd_start_iter: Integer = described(10, "plain all-reduce for this many steps first (PowerSGD paper)")
    fsdp_wrap: Names = described([],
        "Module class names FSDP wraps as units (and activation checkpointing recomputes), e.g. [Block]; [] = the "
        "registered model's blocks (GPT layers), or the whole model as one unit")

    def data_parallel_size(self, world_size: int) -> int:
        return world_size // (self.tp * self.pp)

    def world_granularity(self) -> int:
        """Worlds must be multiples of this: the degrees that do not follow the world size."""
        return self.tp * self.pp * (self.dp or 1) * (self.fsdp or 1)

    def usable_world_size(self, available: int) -> int:
        """The largest world <= ``available`` the degrees can run on (0 if none)."""
        for world in range(available, 0, -1):
            try:
                self.degrees(world)
                return world
            except SpecError:
                continue
        return 0

    def degrees(self, world_size: int, source: str = "") -> dict[str, int]:
        """Mesh shape for ``world_size``, in mesh order pp, dp, fsdp, tp (all four always).
        ``source`` names the field the world size came from, for error messages."""
        where = "parallel"
        workers = f"{world_size} workers" + (f" ({source}={world_size})" if source else "")
        fixed = self.tp * self.pp
        if world_size % fixed:
            raise SpecError(where, f"tp x pp = {self.tp} x {self.pp} = {fixed} does not divide "
                                   f"the world of {workers}")
        data = world_size // fixed
        if self.strategy == "ddp":
            dp, fsdp = (self.dp or data), (self.fsdp or 1)
        elif self.strategy == "fsdp":
            dp, fsdp = (self.dp or 1), (self.fsdp or data)
        else:  # hsdp: the shard group is a fixed size (often the ranks of one node)
            fsdp = self.fsdp or 0
            if fsdp < 1:
                raise SpecError("parallel.fsdp", "strategy hsdp needs the shard group size "
                                                 "(e.g. the workers of one node)")
            if data % fsdp:
                raise SpecError("parallel.fsdp", f"got {quote(fsdp)}; must divide the data-parallel "
                                                 f"size {data} (= {workers} / tp / pp)")
            dp = self.dp or data // fsdp
        if dp * fsdp != data:
            raise SpecError(where, f"pp x dp x fsdp x tp = {self.pp} x {dp} x {fsdp} x {self.tp}"
                                   f" = {self.pp * dp * fsdp * self.tp} but the world has "
                                   f"{workers}; leave dp unset to follow the world")
        return {"pp": self.pp, "dp": dp, "fsdp": fsdp, "tp": self.tp}


@dataclass
class OptimSpec(Checked):
    """The optimizer and its learning rate: a linear warmup, then a cosine decay."""

    name: str = described("adamw", "decoupled weight decay; the usual choice for transformers")
    lr: Number = described(3e-3, "peak learning rate, reached after warmup_steps")
    min_lr_ratio: Number = described(0.1, "cosine decays to lr * min_lr_ratio")
    warmup_steps: Integer = described(20, "linear warmup from 0, then cosine decay to lr * min_lr_ratio")
    weight_decay: Number = described(0.1,
        "on parameters of 2+ dims only (matrices, embeddings); never biases or norms")
    beta1: Number = described(0.9, "Adam first-moment decay")
    beta2: Number = described(0.95, "second-moment decay; 0.95 is steadier than 0.999 for LMs (GPT-3)")
    eps: Number = described(1e-8, "Adam denominator floor")
    grad_clip: Number = described(1.0, "max global grad norm; 0 disables clipping")
    momentum: Number = described(0.9, "LARS only: heavy-ball momentum")
    trust_coefficient: Number = described(0.001, "LARS only: eta, the layer-wise step = eta x ||w|| / ||g||")
    lr_scaling: str = described("none",
        "none | linear | sqrt: lr is the peak LR at lr_base_batch_size rows and is scaled to train.global_batch_size "
        "(linear for SGD/LARS, sqrt for Adam-type); warmup still applies")
    lr_base_batch_size: Integer = described(0, "the global batch optim.lr was tuned for (lr_scaling needs it)")


@dataclass
class CheckpointSpec(Checked):
    """Where and how often checkpoints are written, and which one a run resumes from."""

    uri: str = described("", 'local dir or s3://bucket/prefix; "" = <run_dir>/checkpoints')
    every_steps: Integer = described(100, "0 = only on clean exit")
    keep_last: Integer = described(3, "older complete checkpoints are deleted; the newest never is")
    s3_endpoint_url: str = described("", "\"\" uses AWS_ENDPOINT_URL or AWS's default")
    resume_from: str = described("",
        "\"\" = fresh start, \"latest\" = newest complete in uri, or a URI (another run's checkpoint: its state is "
        "saved in this run's own root before the first step, so this run never needs it again)")
    save_on_exit: bool = described(True, "a checkpoint of the last committed step when the run ends or pauses")
    on_corrupt: str = described("fail",
        'resume_from=latest whose newest checkpoint fails the pre-flight check (a file missing or of another size '
        'than its manifest says) or its load (a file of another sha256): "fail" names the newest intact older one; '
        '"previous" resumes from it, recorded in MLflow')
    keep_best: bool = described(False,
        "also keep the checkpoint of the best eval.metric (saved when an evaluation improves on it)")
    async_save: bool = described(False,
        "periodic checkpoints (every_steps) copy each rank's state to host memory at the step boundary, the only "
        "stall, and write it in the background while training goes on; the manifest is written once every rank's file"
        " is durable. A save due while the previous one is still being written waits for it (one snapshot per rank). "
        "Final, pause and drain saves stay synchronous: they must be durable before the workers go")
    stage_dir: str = described("",
        "\"write locally, upload later\": each rank writes its file to this local directory first and uploads it from"
        " there (the snapshot's memory is freed once the file is on disk; for slow object stores); \"\" = upload from"
        " memory")
    resume_changes: Names = described([],
        "fields this run may hold other values of than the checkpoint it resumes from (a PBT exploit: the donor "
        "trial's checkpoint, continued with mutated values): optim.lr, optim.min_lr_ratio, optim.warmup_steps, "
        "optim.grad_clip only, which a resume reads from the spec at every step; [] = every training field as the "
        "checkpoint's")
    peer_copies: Integer = described(-1,
        "each rank's blocks of the state copied to a peer's host memory (on another node when there is one) after "
        "every step, so that a lost rank's shard comes back from its copy with no step redone "
        "(raytrain_sys.control.peer_copies): 1 on, 0 off, -1 on for a layout whose shards have no replica (fsdp, tp "
        "or pp > 1 without a second data-parallel group) where every node has the room (4 copies a rank within half "
        "of the memory available: else off, said in the log and summary.json's peer_copies)")


@dataclass
class ElasticSpec(Checked):
    """Survivors keep training while replacements start: a dead worker costs no committed step."""

    min_workers: Integer = described(1, "below this the run waits for workers, then stops with a checkpoint")
    max_workers: Integer = described(0, "grow up to this when the cluster gains room; 0 = resources.num_workers")
    max_failures: Integer = described(20, "membership failures tolerated per failure_window_s")
    failure_window_s: Number = described(3600.0, "the sliding window elastic.max_failures counts in")
    below_min_timeout_s: Number = described(300.0, "wait this long for workers when below min_workers")
    hang_floor_s: Number = described(5.0,
        "A step that makes no progress for its deadline is hung: the median of the job's steady step times plus "
        "hang_factor spreads (a robust sigma, at least a tenth of the median), never under hang_floor_s; raise the "
        "floor for a job whose ranks may legitimately stall apart for long (5 s: 9x the longest silence of a "
        "3,000-step run at load 8 on 2 cores, 0.54 s)")
    hang_factor: Number = described(10.0, "see hang_floor_s")
    drain_poll_s: Number = described(1.0, "how often draining (preempted) nodes are looked up")
    orphan_timeout_s: Number = described(60.0,
        "How long a run's node agents keep its ranks and slots once the process that drives it (a CLI driver, a "
        "notebook, a job's runner) is gone and no other took the run over; then they end it")
    straggler_policy: str = described("none",
        "What to do with a rank whose compute is slow for its rows (a slow node, not a data imbalance; "
        "docs/STRAGGLERS.md): none (flag it only), rebalance (deal it fewer rows of the same global batch, in "
        "proportion to measured speed) or replace (drain it, ask for a replacement)")
    straggler_margin: Number = described(0.5,
        "A rank is a straggler when its mean compute time over the window exceeds the median of its peers' by this "
        "fraction (0.5: 1.5x); 0 turns detection off")
    straggler_window_steps: Integer = described(10, "committed steps the straggler means are taken over")
    fault_slow_rank: Integer = described(-1,
        "Test only: the worker holding this rank in the run's first process group computes fault_slow_factor times "
        "slower (a sleep in proportion to its compute); -1 = off")
    fault_slow_factor: Number = described(2.0, "see fault_slow_rank")
    fault_copy_delay_s: Number = described(0.0,
        "Test only: a peer holds each peer copy it receives only after this many seconds (a copy still in flight that"
        " long, for a fault to land in); 0 = off")


@dataclass
class TrackingSpec(Checked):
    """The run's MLflow record and its Prometheus metrics."""

    enabled: bool = described(True, "false: no MLflow at all (summary.json is still written)")
    uri: str = described("", '"" = sqlite:///<output_dir>/mlflow.db; or http://host:port of mlflow server')
    experiment: str = described("raytrain-sys", "MLflow experiment, created if missing")
    run_name: str = described("", '"" = the job name plus a timestamp')
    parent_run_id: str = described("",
        "An MLflow run this run is a child of (the tag mlflow.parentRunId): a sweep's trials name their sweep's run; "
        "\"\" = none")
    metrics: bool = described(True,
        "Prometheus metrics through Ray's metrics agent (raytrain_* series, labels job, team, rank, node; see "
        "monitoring/); false = none, e.g. to measure their cost")


@dataclass
class ResourcesSpec(Checked):
    """The workers: how many, what each one reserves, and the Ray cluster and nodes they run on."""

    num_workers: Integer = described(2, "workers at the start: one Ray actor per GPU or CPU slot")
    cpus_per_worker: Number = described(1.0, "also the worker's torch thread count")
    gpus_per_worker: Number = described(0.0, "> 0 on a CUDA machine selects NCCL (parallel.backend auto)")
    memory_per_worker_gb: Number = described(0.0,
        "Memory reserved for each worker, in GB (Ray's logical memory resource, on its placement bundle); 0 = none "
        "reserved. The job service counts it in quotas of flavors that count memory_gb")
    accelerator_type: str = described("",
        'The GPU type the workers need: nodes whose Ray label ray.io/accelerator-type is this (Ray sets it from the '
        'GPU it finds: A10G, L4, H100...); needs gpus_per_worker > 0; "" = any GPU')
    market: str = described("any",
        "spot | on-demand | any: the nodes (Ray label ray.io/market-type) the workers may run on; the job service "
        "draws a job of any market from the first flavor in its table with room")
    peak_tflops_per_worker: Number = described(0.0,
        "Peak dense TFLOP/s of one worker's device at the training precision, for the MFU metric (e.g. 989 for an "
        "H100 SXM in bf16); 0 = MFU not reported")
    cost_per_worker_hour: Number = described(0.0,
        "Price of one worker slot for an hour, in dollars, for summary.json's cost (dollars, $ per million tokens and"
        " its goodput form); 0 = cost not reported")
    placement_strategy: str = described("PACK", "PACK | SPREAD | STRICT_PACK | STRICT_SPREAD")
    start_timeout_s: Number = described(60.0, "wait this long for the cluster to hold the whole group")
    ray_address: str = described("", "\"\" = RAY_ADDRESS or a running job's cluster, else start a local one")
    local_num_cpus: Integer = described(0, "CPUs of a locally started cluster; 0 = this machine's count")
    worker_niceness: Integer | None = described(0,
        "Scheduling priority (nice, -20..19) of the training workers. Ray starts its worker processes at nice 15, so "
        "that a worker busy on every core loses the CPU to each daemon or driver wake-up, and the ranks waiting for "
        "it at the next collective lose it too. 0 = normal priority; null = keep Ray's. Lowering it needs the right "
        "to (root or CAP_SYS_NICE); without it the worker keeps Ray's and says so once.")


@dataclass
class JobSpec(Checked):
    """A training job: its name, where its runs go, and a section for each part of it."""

    name: str = described("job", "the job's name: no spaces or slashes")
    output_dir: str = described("runs", "run directories, the default MLflow store and checkpoints")
    model: Section[ModelSpec] = field(default_factory=ModelSpec)
    data: Section[DataSpec] = field(default_factory=DataSpec)
    train: Section[TrainSpec] = field(default_factory=TrainSpec)
    eval: Section[EvalSpec] = field(default_factory=EvalSpec)
    parallel: Section[ParallelSpec] = field(default_factory=ParallelSpec)
    optim: Section[OptimSpec] = field(default_factory=OptimSpec)
    checkpoint: Section[CheckpointSpec] = field(default_factory=CheckpointSpec)
    elastic: Section[ElasticSpec] = field(default_factory=ElasticSpec)
    tracking: Section[TrackingSpec] = field(default_factory=TrackingSpec)
    resources: Section[ResourcesSpec] = field(default_factory=ResourcesSpec)

    # ----- derived views -----
    def to_dict(self) -> dict[str, Any]:
        """Every field; a Python object given for an extension point (a notebook's model factory
        or task) stays the object, so that Ray carries it to the workers by value."""
        return dataclasses.asdict(self)

    def plain_dict(self) -> dict[str, Any]:
        """``to_dict`` with such objects replaced by their description ("python:module.name"):
        the form YAML, JSON, hashes, checkpoints and MLflow hold."""
        return plain_value(self.to_dict())

    def flat(self) -> dict[str, Any]:
        """Dotted keys to leaf values, the form MLflow params take."""
        out: dict[str, Any] = {}

        def walk(prefix: str, value: Any) -> None:
            if isinstance(value, dict):
                for k, v in value.items():
                    walk(f"{prefix}.{k}" if prefix else k, v)
            else:
                out[prefix] = value

        walk("", self.plain_dict())
        return out

    def training_hash(self) -> str:
        """Hash of the fields that decide the trained numbers (not where things are written).

        A checkpoint records it; resuming with a different training hash is refused unless the
        user asks for it, because the result would no longer equal an uninterrupted run.
        """
        keep = {k: v for k, v in self.plain_dict().items() if k in TRAINING_SECTIONS}
        # Fields added later count only when not at their default: checkpoints written before
        # they existed still match.
        defaults = JobSpec().plain_dict()
        later = {"model": ("factory", "args"), "data": ("sequences", "columns", "transform"),
                 "train": ("task", "task_args", "compile")}

        def changed(section: str, k: str, v: Any) -> bool:
            return k in later.get(section, ()) and v != defaults[section][k]

        keep["model"] = {k: v for k, v in keep["model"].items()
                         if k not in later["model"] or changed("model", k, v)}
        keep["data"] = {k: v for k, v in keep["data"].items()
                        if k in ("seed", "shuffle_window", "shuffle_block_rows") or changed("data", k, v)}
        keep["train"] = {
            k: v for k, v in keep["train"].items()
            if k in ("global_batch_size", "precision", "seed") or changed("train", k, v)
        }
        blob = json.dumps(keep, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def spec_hash(self) -> str:
        blob = json.dumps(self.plain_dict(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


TRAINING_SECTIONS = ("model", "data", "train", "optim")


# ----------------------------------------------------------------------------- loading

@functools.cache
def _adapter() -> Any:
    """Pydantic's validator of a whole spec, built once: the first spec a process checks pays
    for it (pydantic's import and the schema's build), none after."""
    from pydantic import TypeAdapter

    return TypeAdapter(Section[JobSpec])


def prepare_checks() -> None:
    """Build the spec's checker now (``_adapter``), ahead of the first ``from_dict``: a process
    that waits for a job (a warm spare, a spare runner) pays it while no one waits."""
    _adapter()


def from_dict(raw: Any) -> JobSpec:
    """A checked JobSpec from its sections: plain data (YAML's, JSON's), and Python objects for
    the extension points. Pydantic checks each field's type, then ``spec_rules.validate`` the
    rest; the first refusal is a SpecError naming its field."""
    from pydantic import ValidationError

    try:
        spec = _adapter().validate_python(raw)
    except ValidationError as exc:
        raise refusal(JobSpec, raw, exc.errors(include_url=False, include_context=False, include_input=False)) from None
    return validate(spec)


def json_schema() -> dict[str, Any]:
    """The JSON schema of a job spec's sections as a client sends them: every field with its
    type, default and description, and the allowed values and bounds ``spec_rules`` checks.
    Each section is written in place (no ``$ref``), so that a larger document (the job
    service's OpenAPI) can hold it whole."""
    schema = written_in_place(_adapter().json_schema())["anyOf"][0]  # from_dict takes None too: every default

    def at(dotted: str) -> dict[str, Any]:
        node = schema
        for part in dotted.split("."):
            node = node["anyOf"][0] if "anyOf" in node and "properties" in node["anyOf"][0] else node
            node = node["properties"][part]
        return node

    for dotted, allowed in ALLOWED_CHOICES.items():
        at(dotted)["enum"] = list(allowed)
    for dotted in POSITIVE_FIELDS:
        at(dotted)["exclusiveMinimum"] = 0
    for dotted in NON_NEGATIVE_FIELDS:
        at(dotted)["minimum"] = 0
    return schema


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
    raw = copy.deepcopy(raw)  # plain data, and any Python object given for an extension point
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
    return from_text(read_spec_file(path), overrides, field="SPEC", source=os.fspath(path))


def read_spec_file(path: str | os.PathLike) -> str:
    """A spec file's text; a SpecError on ``SPEC`` when the path does not exist, or is a
    directory (naming the YAML files in it, and --working-dir for a job's code)."""
    path = os.fspath(path)
    if os.path.isdir(path):
        found = sorted(n for n in os.listdir(path) if n.endswith((".yaml", ".yml")))[:3]
        holds = f" (it holds {', '.join(found)})" if found else ""
        raise SpecError("SPEC", f"{path!r} is a directory{holds}: give the job's spec file, e.g. "
                                f"{os.path.join(path, found[0] if found else 'job.yaml')}; a job's code travels "
                                f"with `jobs submit --working-dir {path}`")
    if not os.path.exists(path):
        raise SpecError("SPEC", f"file {path!r} does not exist")
    with open(path) as f:
        return f.read()


def parse_yaml(text: str, *, field: str = "spec", source: str = "the spec") -> Any:
    """The value YAML ``text`` holds; text that does not parse is a SpecError on ``field`` naming
    ``source`` (and the line and column), never another exception (a number too long for Python,
    nesting past its recursion limit)."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise SpecError(field, f"{source} is not valid YAML{where}: {problem}") from None
    except (ValueError, RecursionError) as exc:  # a number over Python's 4,300 digits, a bad date, deep nesting
        problem = str(exc).split(";")[0] if str(exc) else "nested deeper than Python reads"
        raise SpecError(field, f"{source} is not valid YAML: {problem}") from None


def from_text(text: str, overrides: list[str] | None = None, *, field: str = "spec",
              source: str = "the spec") -> JobSpec:
    """A job spec from its YAML text (a file's, or one sent to the job service), with overrides,
    validated. Text that is not YAML, or not a mapping, is a SpecError on ``field`` naming
    ``source`` (and the line and column)."""
    raw = parse_yaml(text, field=field, source=source)
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise SpecError(field, f"{source} must hold a mapping of sections, got {type(raw).__name__}")
    return from_dict(apply_overrides(raw, overrides or []))


def to_yaml(spec: JobSpec) -> str:
    return yaml.safe_dump(spec.plain_dict(), sort_keys=False)
