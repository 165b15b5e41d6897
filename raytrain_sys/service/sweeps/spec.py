"""A sweep's spec: a base job spec, a search space over its dotted fields, what to optimize, how
many trials and which Tune scheduler decides. Validated whole before any trial starts.

Owns: the sweep spec's fields and their checks (``parse_sweep``: every refusal a
``ServiceInputError`` naming the field, as the API's 400 and the CLI's exit 2 show it), the
space's translation into Ray Tune's search space (``tune_space``), a trial's job spec from
Tune's config (``trial_spec``) and the spec a sweep's record stores (``spec_of``). Pure: no Ray,
no store, no clock (Ray Tune's ``tune`` module is imported only by ``tune_space``).

The spec (YAML or a mapping)::

    name: lr-wd                     # the sweep's name (default: the base spec's)
    base: {...}                     # a job spec (jobs/tinygpt.yaml's fields); a file path in a sweep file
    space:                          # dotted job-spec fields, each one domain:
      optim.lr: {loguniform: [1.0e-4, 1.0e-2]}
      optim.weight_decay: {choice: [0.0, 0.1]}
      model.n_layer: {grid: [2, 4]}   # every value (Tune's grid_search), times num_samples
      train.seed: {randint: [0, 100]} # Tune's randint: high excluded
      optim.warmup_steps: {uniform: [0, 50]}
    metric: eval_loss               # an evaluation metric as MLflow logs it: eval_<task's metric>
    mode: min                       # min | max
    num_samples: 6
    scheduler: asha                 # asha (default) | fifo | pbt, or a mapping {type: asha, ...}
    max_workers: 4                  # optional: the sweep's trials hold at most this many workers together
    keep_stopped: false             # true: a trial the scheduler stops is paused, not cancelled

Each trial is a job of ``base`` with the space's values set; the scheduler's ``time_attr`` is the
trial's committed ``step``, so ASHA's rungs and PBT's intervals count optimizer steps.
"""

from __future__ import annotations

import copy
import json
import math
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

from raytrain_sys.errors import ServiceInputError, quote
from raytrain_sys.spec import RESUME_CHANGEABLE

if TYPE_CHECKING:
    from raytrain_sys.service.model import SweepRecord

DOMAINS = ("grid", "choice", "uniform", "loguniform", "randint")
SCHEDULERS = ("asha", "fifo", "pbt")
MODES = ("min", "max")
MAX_TRIALS = 1_000  # a sweep of more trials is a queue of its own: submit it in parts
MAX_SPACE_KEYS = 64  # the space's fields: far more than any sweep tunes at once
MAX_DOMAIN_VALUES = 1_000  # a grid's or a choice's values: each is checked against the base spec
# Fields a trial must not take from the space: the service sets them (its run's place and name) or
# they would make every trial the same job (pause with a request, not a step).
FIXED_FIELDS = ("name", "output_dir", "train.stop_at_step", "checkpoint.uri", "checkpoint.resume_from",
                "checkpoint.resume_changes", "tracking")
SWEEP_FIELDS = ("name", "base", "space", "metric", "mode", "num_samples", "scheduler", "max_workers",
                "keep_stopped")
REQUIRED_FIELDS = ("base", "space", "metric")
NAME_MAX_CHARS = 200
MAX_SWEEP_WORKERS = 100_000  # the API's bound on any count of workers (service/bounds.MAX_WORKERS)
SCHEDULER_FIELDS = {
    "asha": ("type", "grace_period_steps", "reduction_factor"),
    "fifo": ("type",),
    "pbt": ("type", "perturbation_interval_steps", "quantile_fraction", "resample_probability"),
}


def sweep_json_schema() -> dict:
    """The sweep mapping as JSON Schema can say it (the API's OpenAPI document): its fields and
    those required, each one's type and the bounds that do not depend on the base spec. What
    only the base can decide (a space field's values, the metric a trial reports, a scheduler's
    step counts) ``parse_sweep`` checks. Every rule here is one ``parse_sweep`` holds a sweep to."""
    fixed = "|".join(re.escape(f) for f in FIXED_FIELDS)
    values = {"type": "array", "minItems": 1, "maxItems": MAX_DOMAIN_VALUES}
    def ends(kind: str) -> dict:
        return {"type": "array", "minItems": 2, "maxItems": 2, "items": {"type": kind}}
    domain = {"type": "object", "minProperties": 1, "maxProperties": 1, "additionalProperties": False,
              "properties": {"grid": values, "choice": values, "uniform": ends("number"),
                             "loguniform": ends("number"), "randint": ends("integer")},
              "description": "one of {grid: [...]}, {choice: [...]}, {uniform: [low, high]}, "
                             "{loguniform: [low, high]}, {randint: [low, high]}"}
    scheduler = {"type": "object", "additionalProperties": False, "properties": {
        "type": {"enum": list(SCHEDULERS)},
        "grace_period_steps": {"type": "integer", "minimum": 1}, "reduction_factor": {"type": "integer", "minimum": 2,
                                                                                       "maximum": 100},
        "perturbation_interval_steps": {"type": "integer", "minimum": 1},
        "quantile_fraction": {"type": "number", "minimum": 0, "maximum": 0.5},
        "resample_probability": {"type": "number", "minimum": 0, "maximum": 1}},
        "description": "asha's fields, fifo's, or pbt's (docs/SWEEPS.md)"}
    return {
        "type": "object", "required": list(REQUIRED_FIELDS), "additionalProperties": False,
        "properties": {
            "name": {"type": "string", "maxLength": NAME_MAX_CHARS, "description": "default: the base spec's name"},
            "base": {"type": "object", "description": "the job spec every trial runs (docs/spec_reference.md)"},
            "space": {"type": "object", "minProperties": 1, "maxProperties": MAX_SPACE_KEYS,
                      "propertyNames": {"pattern": r"^[^.]+(\.[^.]+)*$", "not": {"pattern": rf"^({fixed})(\..*)?$"}},
                      "additionalProperties": domain,
                      "description": "dotted job-spec fields of the base, each with its domain"},
            "metric": {"type": "string", "description": "an evaluation metric the trials report (eval_loss, ...)"},
            "mode": {"enum": list(MODES)},
            "num_samples": {"type": "integer", "minimum": 1, "maximum": MAX_TRIALS},
            "scheduler": {"anyOf": [{"enum": list(SCHEDULERS)}, scheduler]},
            "max_workers": {"anyOf": [{"type": "integer", "minimum": 1, "maximum": MAX_SWEEP_WORKERS},
                                      {"type": "null"}],
                            "description": "the most workers its trials hold together; at least one trial's size"},
            "keep_stopped": {"type": "boolean"}},
        "description": "a sweep spec (docs/SWEEPS.md)"}


@dataclass(frozen=True)
class Domain:
    """One field's values: ``grid`` and ``choice`` list them, the ranges are ``(low, high)``."""

    kind: str
    values: tuple

    def candidates(self) -> tuple:
        """Values that stand for the domain when the base spec checks them: each listed value,
        or a range's two ends."""
        return self.values


@dataclass(frozen=True)
class SchedulerSpec:
    type: str = "asha"
    # ASHA: a trial's first rung at this many committed steps (0: the base's first evaluation, the
    # earliest point a trial has a metric), each next rung reduction_factor times further.
    grace_period_steps: int = 0
    reduction_factor: int = 2  # Tune's default is 4; 2 halves the trials per rung, right for sweeps of ~8
    # PBT: exploit and explore every this many steps (0: the base's checkpoint interval, the
    # finest point a clone can start from a committed checkpoint).
    perturbation_interval_steps: int = 0
    quantile_fraction: float = 0.25  # Tune's default: the bottom quarter copies the top quarter
    resample_probability: float = 0.25  # Tune's default


@dataclass(frozen=True)
class SweepSpec:
    name: str
    base: dict  # the validated job spec as plain data (requests.parse_spec's, local paths absolute)
    space: dict  # dotted field -> Domain, in the spec's order
    metric: str
    mode: str
    num_samples: int
    scheduler: SchedulerSpec = field(default_factory=SchedulerSpec)
    max_workers: Optional[int] = None
    keep_stopped: bool = False

    @property
    def trial_count(self) -> int:
        """How many trials Tune makes: num_samples times every combination of the grids."""
        grids = [len(d.values) for d in self.space.values() if d.kind == "grid"]
        return self.num_samples * math.prod(grids)

    @property
    def max_steps(self) -> int:
        return int(self.base["train"]["max_steps"])

    def to_dict(self) -> dict:
        """Plain data (the store's JSON): the inverse of ``parse_sweep`` on a validated spec."""
        return {"name": self.name, "base": self.base,
                "space": {k: {d.kind: list(d.values)} for k, d in self.space.items()},
                "metric": self.metric, "mode": self.mode, "num_samples": self.num_samples,
                "scheduler": {k: v for k, v in vars(self.scheduler).items()
                              if k in SCHEDULER_FIELDS[self.scheduler.type]},
                "max_workers": self.max_workers, "keep_stopped": self.keep_stopped}


def parse_sweep(raw: Any, *, base_dir: Optional[str] = None) -> SweepSpec:
    """The sweep spec of ``raw`` (a mapping), validated; ``ServiceInputError`` on the first
    wrong field (``base.<field>`` for the base spec, ``space.<dotted field>`` for a domain)."""
    from raytrain_sys.service.requests import parse_spec  # the one job-spec check the service makes

    if not isinstance(raw, dict):
        raise ServiceInputError("sweep", f"must be a mapping of sweep fields, got {type(raw).__name__}")
    for key in raw:
        if key not in SWEEP_FIELDS:
            raise ServiceInputError(str(key)[:64], f"unknown sweep field; allowed: {', '.join(SWEEP_FIELDS)}")
    for required in REQUIRED_FIELDS:
        if required not in raw:
            raise ServiceInputError(required, "missing: a sweep names its base job spec, its space and its metric")
    base_raw = raw["base"]
    if not isinstance(base_raw, dict):
        raise ServiceInputError("base", f"must be a job spec's mapping, got {type(base_raw).__name__}")
    base = _job_spec(parse_spec, base_raw, base_dir, "base").to_dict()
    space = _space(raw["space"], base_raw, base_dir, parse_spec)
    mode = raw.get("mode", "min")
    if mode not in MODES:
        raise ServiceInputError("mode", f"got {quote(mode)}; must be min or max")
    metric = _metric(raw["metric"], base)
    num_samples = _int("num_samples", raw.get("num_samples", 1), 1, MAX_TRIALS)
    scheduler = _scheduler(raw.get("scheduler", "asha"), base, space)
    max_workers = raw.get("max_workers")
    if max_workers is not None:
        min_trial = int(base["elastic"]["min_workers"] if base["elastic"]["max_workers"]
                        else base["resources"]["num_workers"])
        max_workers = _int("max_workers", max_workers, min_trial, MAX_SWEEP_WORKERS,
                           low_name=f"one trial's size ({min_trial}: base.elastic.min_workers or "
                                    f"base.resources.num_workers)")
    keep_stopped = raw.get("keep_stopped", False)
    if not isinstance(keep_stopped, bool):
        raise ServiceInputError("keep_stopped", f"got {quote(keep_stopped)}; must be true or false")
    name = raw.get("name", base["name"])
    if not isinstance(name, str) or not name.strip() or len(name) > NAME_MAX_CHARS or "\n" in name:
        raise ServiceInputError("name", f"got {quote(name)}; a sweep's name is one line of 1-200 characters")
    sweep = SweepSpec(name=name, base=base, space=space, metric=metric, mode=mode, num_samples=num_samples,
                      scheduler=scheduler, max_workers=max_workers, keep_stopped=keep_stopped)
    if sweep.trial_count > MAX_TRIALS:
        raise ServiceInputError("num_samples", f"{num_samples} samples times the grids' "
                                               f"{sweep.trial_count // num_samples} combinations make "
                                               f"{sweep.trial_count} trials; at most {MAX_TRIALS}")
    return sweep


def _job_spec(parse_spec, raw: dict, base_dir: Optional[str], where: str):
    """``parse_spec``'s job spec, its refusals renamed from ``spec.<field>`` to ``<where>.<field>``."""
    try:
        return parse_spec(raw, base_dir)
    except ServiceInputError as exc:
        name = exc.field.split(".", 1)[1] if exc.field.startswith("spec.") else ""
        raise ServiceInputError(f"{where}.{name}" if name else where, exc.message) from None


def set_field(raw: dict, dotted: str, value: Any) -> dict:
    """A copy of the spec mapping ``raw`` with ``dotted`` set to ``value`` (sections made as needed)."""
    out = copy.deepcopy(raw)
    node = out
    parts = dotted.split(".")
    for part in parts[:-1]:
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ServiceInputError(f"space.{dotted}", f"'{part}' is not a section of the job spec")
        node = child
    node[parts[-1]] = value
    return out


def get_field(raw: dict, dotted: str) -> Any:
    """The value of ``dotted`` in the spec mapping ``raw``; None where a section or the field is missing."""
    node = raw
    for part in dotted.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def _space(raw: Any, base_raw: dict, base_dir: Optional[str], parse_spec) -> dict:
    if not isinstance(raw, dict) or not raw:
        raise ServiceInputError("space", "must map dotted job-spec fields (e.g. optim.lr) to a domain "
                                         f"({', '.join(DOMAINS)})")
    if len(raw) > MAX_SPACE_KEYS:
        raise ServiceInputError("space", f"{len(raw)} fields; at most {MAX_SPACE_KEYS}")
    space = {}
    for key, value in raw.items():
        where = f"space.{str(key)[:64]}"
        if not isinstance(key, str) or not key or any(not p for p in key.split(".")):
            raise ServiceInputError(where, "a field of the space is a dotted job-spec field, e.g. optim.lr")
        if key in FIXED_FIELDS or any(key.startswith(f + ".") for f in FIXED_FIELDS):
            raise ServiceInputError(where, f"the service sets it for each trial; a space may not ({', '.join(FIXED_FIELDS)})")
        domain = _domain(where, value)
        for candidate in domain.candidates():
            try:
                _job_spec(parse_spec, set_field(base_raw, key, candidate), base_dir, "base")
            except ServiceInputError as exc:
                if exc.field in (f"base.{key}", "base") or exc.field.startswith(f"base.{key}."):
                    raise ServiceInputError(where, f"value {quote(candidate)}: {exc.message}") from None
                raise ServiceInputError(where, f"value {quote(candidate)} makes {exc.field} wrong: "
                                               f"{exc.message}") from None
        space[key] = domain
    return space


def _domain(where: str, value: Any) -> Domain:
    if not isinstance(value, dict) or len(value) != 1 or next(iter(value)) not in DOMAINS:
        raise ServiceInputError(where, f"got {quote(value)}; a domain is one of {{{': [...]}, {'.join(DOMAINS)}: [...]}} "
                                       f"e.g. {{loguniform: [1.0e-4, 1.0e-2]}}")
    kind, values = next(iter(value.items()))
    if not isinstance(values, list) or not values:
        raise ServiceInputError(f"{where}.{kind}", f"got {quote(values)}; must be a non-empty list")
    if kind in ("grid", "choice"):
        if len(values) > MAX_DOMAIN_VALUES:
            raise ServiceInputError(f"{where}.{kind}", f"{len(values)} values; at most {MAX_DOMAIN_VALUES}")
        return Domain(kind, tuple(values))
    if len(values) != 2 or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        raise ServiceInputError(f"{where}.{kind}", f"got {quote(values)}; a range is [low, high], two numbers")
    low, high = values
    if not (math.isfinite(low) and math.isfinite(high)) or not low < high:
        raise ServiceInputError(f"{where}.{kind}", f"got {quote(values)}; an empty range: low must be below high")
    if kind == "loguniform" and low <= 0:
        raise ServiceInputError(f"{where}.{kind}", f"got {quote(values)}; a log-uniform range is above 0")
    if kind == "randint":
        if not all(isinstance(v, int) or float(v).is_integer() for v in values):
            raise ServiceInputError(f"{where}.{kind}", f"got {quote(values)}; randint's ends are integers")
        return Domain(kind, (int(low), int(high)))  # Tune's randint excludes high: the largest value drawn is high - 1
    return Domain(kind, (float(low), float(high)))


def reported_metrics(base: dict) -> tuple[str, ...]:
    """The metrics a trial of ``base`` reports, as MLflow logs them (``eval_<name>``): its
    evaluation's loss, the task's perplexity or its own eval metric. None without evaluations."""
    if not base["eval"]["every_steps"]:
        return ()
    names = ["loss"]
    if base["eval"]["metric"] not in names:
        names.append(base["eval"]["metric"])
    try:
        from raytrain_sys.extensions import resolve_task
        from raytrain_sys.spec import from_dict

        if getattr(resolve_task(from_dict(base)), "reports_perplexity", False):
            names.append("perplexity")
    except Exception:  # a task the service cannot import: only what the spec itself names
        pass
    return tuple(f"eval_{n}" for n in names)


def _metric(metric: Any, base: dict) -> str:
    reported = reported_metrics(base)
    if not reported:
        raise ServiceInputError("metric", f"got {quote(metric)}, which the trials never report: the base spec "
                                          f"evaluates never (base.eval.every_steps is 0); set it, e.g. "
                                          f"eval.every_steps: 10")
    if metric not in reported:
        raise ServiceInputError("metric", f"got {quote(metric)}, which the trials never report; they report "
                                          f"{', '.join(reported)}")
    return metric


def _int(where: str, value: Any, low: int, high: int, low_name: str = "") -> int:
    """An integer field: an integral float (``4.0``) is its int, as JSON Schema's ``integer`` and
    the API's other integer fields take it."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ServiceInputError(where, f"got {quote(value)}; must be an integer")
    if not low <= value <= high:
        raise ServiceInputError(where, f"got {quote(value)}; must be in {low_name or low}..{high}")
    return value


def _scheduler(raw: Any, base: dict, space: dict) -> SchedulerSpec:
    where = "scheduler.type" if isinstance(raw, dict) else "scheduler"
    if isinstance(raw, str):
        raw = {"type": raw}
    if not isinstance(raw, dict) or raw.get("type", "asha") not in SCHEDULERS:
        got = raw.get("type") if isinstance(raw, dict) else raw
        raise ServiceInputError(where, f"got {quote(got)}; one of {', '.join(SCHEDULERS)}")
    kind = raw.get("type", "asha")
    for key in raw:
        if key not in SCHEDULER_FIELDS[kind]:
            raise ServiceInputError(f"scheduler.{str(key)[:64]}", f"not a field of the {kind} scheduler; allowed: "
                                                                  f"{', '.join(SCHEDULER_FIELDS[kind])}")
    max_steps = int(base["train"]["max_steps"])
    every_eval = int(base["eval"]["every_steps"])
    every_ckpt = int(base["checkpoint"]["every_steps"])
    out = SchedulerSpec(type=kind)
    if kind == "asha":
        grace = _int("scheduler.grace_period_steps", raw.get("grace_period_steps", every_eval), 1, max_steps)
        factor = _int("scheduler.reduction_factor", raw.get("reduction_factor", 2), 2, 100)
        out = SchedulerSpec(type=kind, grace_period_steps=grace, reduction_factor=factor)
    if kind == "pbt":
        if not every_ckpt:
            raise ServiceInputError("base.checkpoint.every_steps", "is 0; PBT clones a trial from a committed "
                                                                   "checkpoint: set it, e.g. checkpoint.every_steps: 10")
        interval = _int("scheduler.perturbation_interval_steps",
                        raw.get("perturbation_interval_steps", every_ckpt), 1, max_steps)
        if interval % every_ckpt:
            raise ServiceInputError("scheduler.perturbation_interval_steps",
                                    f"got {interval}; a multiple of base.checkpoint.every_steps ({every_ckpt}), so "
                                    f"every exploit starts from a checkpoint committed at that step")
        if interval % every_eval:
            raise ServiceInputError("scheduler.perturbation_interval_steps",
                                    f"got {interval}; a multiple of base.eval.every_steps ({every_eval}), so the "
                                    f"metric compared is the one at that step")
        if all(d.kind == "grid" for d in space.values()):
            raise ServiceInputError("space", "PBT mutates choice and range fields; this space has grids only")
        for key in ("quantile_fraction", "resample_probability"):
            value = raw.get(key, getattr(SchedulerSpec, key))
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value <= (
                    0.5 if key == "quantile_fraction" else 1):
                raise ServiceInputError(f"scheduler.{key}", f"got {quote(value)}; a fraction in "
                                                            f"0..{0.5 if key == 'quantile_fraction' else 1}")
        for key, domain in space.items():
            if domain.kind != "grid" and not continues_a_checkpoint(base, key, domain):
                raise ServiceInputError(f"space.{key}", f"PBT mutates it, and an exploit continues the donor's "
                                                        f"checkpoint, which another value of it would not "
                                                        f"(a resume takes only {', '.join(RESUME_CHANGEABLE)} "
                                                        f"from the spec); make it a grid, or leave it out")
        out = SchedulerSpec(type=kind, perturbation_interval_steps=interval,
                            quantile_fraction=float(raw.get("quantile_fraction", SchedulerSpec.quantile_fraction)),
                            resample_probability=float(raw.get("resample_probability",
                                                               SchedulerSpec.resample_probability)))
    return out


def continues_a_checkpoint(base: dict, key: str, domain: Domain) -> bool:
    """Whether a run of ``base`` with any value of ``domain`` at ``key`` may resume another's
    checkpoint (a PBT exploit): the field is one a resume reads from the spec
    (``RESUME_CHANGEABLE``), or no value of it changes the training settings a checkpoint
    records (``training_hash``: an eval or logging field)."""
    from raytrain_sys.spec import from_dict

    if key in RESUME_CHANGEABLE:
        return True
    same = from_dict(base).training_hash()
    return all(from_dict(set_field(base, key, value)).training_hash() == same for value in domain.candidates())


def resume_changes(sweep: SweepSpec) -> list[str]:
    """The fields a PBT segment's job may hold other values of than its donor's checkpoint (its
    ``checkpoint.resume_changes``): the mutated fields a resume reads from the spec."""
    return [key for key, d in sweep.space.items() if d.kind != "grid" and key in RESUME_CHANGEABLE]


def tune_space(sweep: SweepSpec) -> dict:
    """Ray Tune's ``param_space``: one flat key per dotted field (the trial's config keeps them
    flat, and ``trial_spec`` sets them back). PBT's mutations are the same domains
    (``pbt_mutations``) and are left out of the space's grids."""
    from ray import tune

    make = {"grid": lambda v: tune.grid_search(list(v)), "choice": lambda v: tune.choice(list(v)),
            "uniform": lambda v: tune.uniform(*v), "loguniform": lambda v: tune.loguniform(*v),
            "randint": lambda v: tune.randint(*v)}
    return {key: make[d.kind](d.values) for key, d in sweep.space.items()}


def pbt_mutations(sweep: SweepSpec) -> dict:
    """PBT's ``hyperparam_mutations``: every field of the space that is not a grid."""
    from ray import tune

    make = {"choice": lambda v: list(v), "uniform": lambda v: tune.uniform(*v),
            "loguniform": lambda v: tune.loguniform(*v), "randint": lambda v: tune.randint(*v)}
    return {key: make[d.kind](d.values) for key, d in sweep.space.items() if d.kind != "grid"}


def trial_spec(sweep: SweepSpec, config: dict, sweep_id: int, trial_id: str, parent_run_id: str = "",
               segment: int = 0, donor_checkpoint: str = "") -> dict:
    """The job spec of the trial Tune configured: the base with each of the space's fields set
    to its value in ``config`` (keys the space does not name are Tune's own and ignored), named
    for its trial, in a directory of its own (``<output_dir>/sweep-<id>/<trial>``: its run dir
    and checkpoints), and tracked in the base's MLflow store as a child of the sweep's run.
    A PBT segment after the first (``segment`` > 0) runs in ``<trial>/segment-<n>`` and starts
    from ``donor_checkpoint`` (the donor trial's committed checkpoint), with its mutated values
    allowed to differ from that checkpoint's (``checkpoint.resume_changes``)."""
    spec = sweep.base
    for key in sweep.space:
        if key in config:
            spec = set_field(spec, key, _plain(config[key]))
    spec = copy.deepcopy(spec)
    spec["name"] = f"{sweep.base['name']}-{trial_id}" + (f"-s{segment}" if segment else "")
    spec["output_dir"] = f"{sweep.base['output_dir']}/sweep-{sweep_id}/{trial_id}" + (
        f"/segment-{segment}" if segment else "")
    spec["tracking"]["uri"] = tracking_uri(sweep)
    spec["tracking"]["parent_run_id"] = parent_run_id
    if segment:
        spec["checkpoint"]["resume_from"] = donor_checkpoint
        spec["checkpoint"]["resume_changes"] = resume_changes(sweep)
    return spec


def tracking_uri(sweep: SweepSpec) -> str:
    """Where the sweep's runs are recorded: the base spec's tracking.uri, else the default store
    of its output_dir."""
    from raytrain_sys.tracking.mlflow_tracker import default_tracking_uri

    return sweep.base["tracking"]["uri"] or default_tracking_uri(sweep.base["output_dir"])


def _plain(value: Any) -> Any:
    """A numpy scalar (Tune's samplers draw them) as the Python number the spec stores."""
    return value.item() if hasattr(value, "item") and not isinstance(value, (list, dict, str)) else value


def sweep_from_dict(data: dict) -> SweepSpec:
    """A stored sweep spec (``SweepSpec.to_dict``'s JSON, validated when it was submitted)."""
    sched = data["scheduler"]
    return SweepSpec(name=data["name"], base=data["base"],
                     space={k: _stored_domain(v) for k, v in data["space"].items()},
                     metric=data["metric"], mode=data["mode"], num_samples=data["num_samples"],
                     scheduler=SchedulerSpec(**sched), max_workers=data["max_workers"],
                     keep_stopped=data["keep_stopped"])


def spec_of(sweep: SweepRecord) -> SweepSpec:
    """The spec a sweep's record stores (``SweepSpec.to_dict``'s JSON)."""
    return sweep_from_dict(json.loads(sweep.spec))


def _stored_domain(value: dict) -> Domain:
    kind, values = next(iter(value.items()))
    return Domain(kind, tuple(values))



def load_sweep_file(path: str) -> dict:
    """A sweep file's mapping, its ``base`` read when it names a job spec file (relative to the
    sweep file's directory): what a client sends, since the service cannot read the client's
    files. Refusals are ``ServiceInputError`` on ``SWEEP`` or ``base``."""
    import os

    from raytrain_sys.errors import SpecError
    from raytrain_sys.spec import parse_yaml, read_spec_file

    try:
        raw = parse_yaml(read_spec_file(path), field="SWEEP", source=os.fspath(path))
        if not isinstance(raw, dict):
            raise ServiceInputError("SWEEP", f"{path} must hold a mapping of sweep fields, got {type(raw).__name__}")
        base = raw.get("base")
        if isinstance(base, str):
            base_path = base if os.path.isabs(base) else os.path.join(os.path.dirname(os.path.abspath(path)), base)
            raw["base"] = parse_yaml(read_spec_file(base_path), field="base", source=base_path)
    except SpecError as exc:
        raise ServiceInputError(exc.field, str(exc).split(": ", 1)[-1]) from None
    return raw
