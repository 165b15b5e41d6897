"""Flavors and worker shapes: the kinds of node a job's workers run on, and what one worker asks.

Owns: ``WorkerShape`` (a worker's CPUs, GPUs, memory, accelerator and market, from its spec's
``resources``), ``ResourceFlavor`` (an entry of the service's flavor table, Kueue's
ResourceFlavor: which shapes it takes, ``refuses``, its price and autoscaling ceiling), the
table's checks (``flavor_from_dict``, ``check_flavor_table``), why a shape fits no flavor
(``no_flavor_reason``, ``shape_refusal``), and ``FlavorState``: one flavor with its capacity as a
scheduling pass sees it. Pure: no Ray, no SQL, no clock.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from typing import Optional

from raytrain_sys.control.node_roles import MARKETS  # a flavor's market: Ray's ray.io/market-type values
from raytrain_sys.errors import ServiceInputError, quote
from raytrain_sys.service.bounds import name_problem
from raytrain_sys.spec import ACCELERATOR_TYPE_PATTERN


RESOURCES = ("workers", "cpu", "gpu", "memory_gb")
# The one flavor of a service with no flavor table: it counts workers of any shape, on any node,
# with the team's nominal_workers (and limits) as its quota: the service as it was before flavors.
DEFAULT_FLAVOR = "default"
ANY_MARKET = "any"  # a job's market when either will do (the flavor table's order decides)
MAX_AMOUNT = 1e9  # a quota or a ceiling in cpu, gpu or GB: beyond any cluster, within a double
ACCELERATOR_PATTERN = f"^{ACCELERATOR_TYPE_PATTERN}$"  # the spec's resources.accelerator_type
_ACCELERATOR_RE = re.compile(ACCELERATOR_PATTERN)


@dataclass(frozen=True)
class WorkerShape:
    """What one worker of a job asks, from its spec's ``resources``: CPUs, GPUs, memory, the
    accelerator type (``""``: any) and the market (spot, on-demand, or ``any``). It decides which
    flavors the job may draw from (``ResourceFlavor.refuses``) and how much of each it counts."""

    cpu: float = 1.0
    gpu: float = 0.0
    memory_gb: float = 0.0
    accelerator: str = ""
    market: str = ANY_MARKET

    def __post_init__(self) -> None:
        # Looked up for every quota and capacity sum of a pass: one dict, made once.
        object.__setattr__(self, "_amounts", {"workers": 1.0, "cpu": self.cpu, "gpu": self.gpu,
                                              "memory_gb": self.memory_gb})

    def amount(self, resource: str) -> float:
        """What one worker counts of ``resource`` (``workers``: one)."""
        return self._amounts[resource]

    def describe(self) -> str:
        parts = [f"{self.cpu:g} CPU"] + ([f"{self.gpu:g} {self.accelerator or 'GPU'}"] if self.gpu else [])
        parts += [f"{self.memory_gb:g} GB"] if self.memory_gb else []
        return " + ".join(parts) + ("" if self.market == ANY_MARKET else f", {self.market}")


DEFAULT_SHAPE = WorkerShape()


def amount_problem(value: object, what: str) -> Optional[str]:
    """Why ``value`` is not an amount of a resource (cpu, gpu, GB; a flavor's or a quota's), or None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not 0 <= value <= MAX_AMOUNT:
        return f"got {quote(value)}; {what} is a number in 0..{MAX_AMOUNT:g}"
    return None


@dataclass(frozen=True)
class ResourceFlavor:
    """A kind of node a job's workers run on, in the service's flavor table (Kueue's
    ResourceFlavor): its market and accelerator (``""``: CPU only), written on nodes as Ray's
    labels (``control/node_roles.Flavor``); which ``resources`` quotas count on it; the price of
    each resource an hour (spot and on-demand priced apart, so cost per token follows where a
    job ran); and, for autoscaling, the most of each resource its node groups can reach
    (``max_*``; None: what Ray's cluster config says, else what is up now).

    The implicit flavor (``implicit()``: ``DEFAULT_FLAVOR``, no market) is the service without a
    table: it counts workers, fits every job and selects no node."""

    name: str
    market: str
    accelerator: str = ""
    resources: tuple[str, ...] = ("cpu", "gpu")
    usd_per_cpu_hour: float = 0.0
    usd_per_gpu_hour: float = 0.0
    usd_per_memory_gb_hour: float = 0.0
    max_cpu: Optional[float] = None
    max_gpu: Optional[float] = None
    max_memory_gb: Optional[float] = None

    @classmethod
    def implicit(cls) -> "ResourceFlavor":
        return cls(DEFAULT_FLAVOR, "", resources=("workers",))

    @property
    def is_implicit(self) -> bool:
        return self.market == ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "resources", tuple(self.resources))
        if self.is_implicit:
            return
        problem = name_problem(self.name, "flavor name")
        if problem or self.name == DEFAULT_FLAVOR:
            raise ServiceInputError("flavor.name", problem or f"got {quote(self.name)}; reserved: the service's "
                                                              f"flavor when it has no table")
        if self.market not in MARKETS:
            raise ServiceInputError("flavor.market", f"got {quote(self.market)}; one of {', '.join(MARKETS)}")
        if self.accelerator and (not isinstance(self.accelerator, str) or not _ACCELERATOR_RE.fullmatch(self.accelerator)):
            raise ServiceInputError("flavor.accelerator", f"got {quote(self.accelerator)}; Ray's accelerator type "
                                                          f"(e.g. A10G, H100), or empty for CPU nodes")
        unknown = [r for r in self.resources if r not in RESOURCES]
        if not self.resources or unknown or len(set(self.resources)) != len(self.resources):
            raise ServiceInputError("flavor.resources", f"got {quote(list(self.resources))}; one or more of "
                                                        f"{', '.join(RESOURCES)}, each once")
        for field in ("usd_per_cpu_hour", "usd_per_gpu_hour", "usd_per_memory_gb_hour", "max_cpu", "max_gpu",
                      "max_memory_gb"):
            value = getattr(self, field)
            if value is None and field.startswith("max_"):
                continue
            problem = amount_problem(value, "it")
            if problem:
                raise ServiceInputError(f"flavor.{field}", problem)

    def refuses(self, shape: WorkerShape) -> Optional[str]:
        """Why a worker of ``shape`` cannot draw from this flavor, or None: the market must match
        (``any`` takes either); a GPU worker needs a GPU flavor of its accelerator type (any, if it
        names none); a CPU worker draws from CPU flavors, so GPU nodes stay for GPU jobs."""
        if self.is_implicit:
            return None
        if shape.market != ANY_MARKET and shape.market != self.market:
            return f"{self.name} is {self.market}, the job asks resources.market={shape.market}"
        if shape.gpu > 0:
            if not self.accelerator:
                return f"{self.name} has no GPUs, the job asks resources.gpus_per_worker={shape.gpu:g}"
            if shape.accelerator and shape.accelerator != self.accelerator:
                return f"{self.name} has {self.accelerator}, the job asks resources.accelerator_type={shape.accelerator}"
        elif self.accelerator:
            return f"{self.name} is a GPU flavor ({self.accelerator}), the job asks no GPU"
        return None

    def node_selector(self) -> dict[str, str]:
        """The job spec's fields that put its workers on this flavor's nodes (the worker group
        turns them into its placement groups' label selector); none for the implicit flavor."""
        if self.is_implicit:
            return {}
        return {"resources.market": self.market, **({"resources.accelerator_type": self.accelerator}
                                                    if self.accelerator else {})}

    def usd_per_worker_hour(self, shape: WorkerShape) -> float:
        """What a worker of ``shape`` costs an hour here (0: the flavor has no price)."""
        return (shape.cpu * self.usd_per_cpu_hour + shape.gpu * self.usd_per_gpu_hour
                + shape.memory_gb * self.usd_per_memory_gb_hour)

    def ceiling(self) -> dict[str, float]:
        """The configured ceiling per resource (only those set)."""
        caps = {"cpu": self.max_cpu, "gpu": self.max_gpu, "memory_gb": self.max_memory_gb}
        return {r: v for r, v in caps.items() if v is not None}


def flavor_from_dict(raw: object, where: str = "flavor") -> ResourceFlavor:
    """A flavor of a table file (``service start --flavors``): its fields, checked, an unknown key
    or a wrong type named (``where``: how the errors name it)."""
    fields = [f for f in ResourceFlavor.__dataclass_fields__]
    if not isinstance(raw, dict):
        raise ServiceInputError(where, f"got {quote(raw)}; a flavor is a mapping of {', '.join(fields)}")
    unknown = sorted(set(map(str, raw)) - set(fields))
    if unknown:
        raise ServiceInputError(f"{where}.{unknown[0]}", f"unknown field; a flavor has {', '.join(fields)}")
    values = dict(raw)
    if isinstance(values.get("resources"), list):
        values["resources"] = tuple(values["resources"])
    for key in ("name", "market", "accelerator"):
        if key in values and not isinstance(values[key], str):
            raise ServiceInputError(f"{where}.{key}", f"got {quote(values[key])}; a string")
    try:
        return ResourceFlavor(**values)
    except TypeError as exc:  # a required field left out
        raise ServiceInputError(where, f"{exc}; a flavor needs at least name and market") from None


def check_flavor_table(flavors: "tuple[ResourceFlavor, ...] | list[ResourceFlavor]") -> tuple[ResourceFlavor, ...]:
    """A flavor table as the service keeps it: names unique, and no two flavors of one market and
    accelerator (they would select the same nodes and count them twice)."""
    names, kinds = set(), {}
    for i, f in enumerate(flavors):
        if f.name in names:
            raise ServiceInputError(f"flavors[{i}].name", f"got {quote(f.name)} twice; each flavor has its own name")
        names.add(f.name)
        kind = (f.market, f.accelerator)
        if kind in kinds:
            raise ServiceInputError(f"flavors[{i}]", f"{f.name} selects the nodes of {kinds[kind]} (market "
                                                     f"{f.market}, accelerator {f.accelerator or 'none'}): one flavor "
                                                     f"per kind of node")
        kinds[kind] = f.name
    return tuple(flavors)


def no_flavor_reason(shape: WorkerShape, flavors: "tuple[ResourceFlavor, ...] | list[ResourceFlavor]") -> str:
    """Why a worker of ``shape`` may draw from none of ``flavors`` (each one's refusal)."""
    if not flavors:
        return "the service has no flavor"
    return "fits no flavor: " + "; ".join(f.refuses(shape) or f.name for f in flavors)


def shape_refusal(shape: WorkerShape, flavors: "tuple[ResourceFlavor, ...] | list[ResourceFlavor]"
                  ) -> Optional[tuple[str, str]]:
    """(the spec field at fault, why) when a worker of ``shape`` may draw from none of ``flavors``;
    None when it may (or the service has no table). The field is the one whose change alone would
    let it: ``resources.market``, else ``resources.accelerator_type``, else
    ``resources.gpus_per_worker``."""
    if not flavors or any(f.refuses(shape) is None for f in flavors):
        return None

    def fits(**change) -> bool:
        return any(f.refuses(replace(shape, **change)) is None for f in flavors)

    if shape.market != ANY_MARKET and fits(market=ANY_MARKET):
        field = "resources.market"
    elif shape.accelerator and fits(accelerator=""):
        field = "resources.accelerator_type"
    else:
        field = "resources.gpus_per_worker"
    return field, f"a worker of {shape.describe()} {no_flavor_reason(shape, flavors)}"


@dataclass(frozen=True)
class FlavorState:
    """One flavor as a scheduling pass sees it: its table entry, the capacity the scheduler may
    give out (``ceiling``: what is up now, or with autoscaling what its node groups can reach)
    and what is up now (``present``; None: the ceiling). Capacity is per resource: ``workers``
    for the implicit flavor, else ``cpu``, ``gpu``, ``memory_gb`` (Ray's CPU, GPU, memory)."""

    flavor: ResourceFlavor
    ceiling: tuple[tuple[str, float], ...]
    present: Optional[tuple[tuple[str, float], ...]] = None

    def __post_init__(self) -> None:
        for name in ("ceiling", "present"):  # a mapping given: kept as sorted pairs (the state hashes)
            value = getattr(self, name)
            if isinstance(value, dict):
                object.__setattr__(self, name, tuple(sorted(value.items())))

    @property
    def name(self) -> str:
        return self.flavor.name

    def capacity(self, present: bool = False) -> dict[str, float]:
        return dict(self.ceiling if not present or self.present is None else self.present)

__all__ = ["RESOURCES", "DEFAULT_FLAVOR", "ANY_MARKET", "MARKETS", "MAX_AMOUNT", "ACCELERATOR_PATTERN", "WorkerShape",
           "DEFAULT_SHAPE", "amount_problem", "ResourceFlavor", "flavor_from_dict", "check_flavor_table",
           "no_flavor_reason", "shape_refusal", "FlavorState"]
