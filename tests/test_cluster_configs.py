"""The launcher YAMLs in cluster_configs/ are valid for Ray 2.60 and start the spot watcher.

Offline only: Ray's own JSON schema (``ray/autoscaler/ray-schema.json``) on the raw file, then
the same ``prepare_config`` + ``validate_config`` that ``ray up`` runs before it talks to a
cloud. Every worker type on spot capacity must start ``raytrain_sys.control.spot_watcher``
(backgrounded, after ``ray start``, with flags the watcher actually accepts).
"""

from __future__ import annotations

import copy
import json
import os
import shlex
from pathlib import Path

import jsonschema
import pytest
import yaml

import ray.autoscaler
from ray.autoscaler._private.util import prepare_config, validate_config

from raytrain_sys.control import node_roles as roles
from raytrain_sys.control import spot_watcher

CONFIG_DIR = Path(__file__).resolve().parents[1] / "cluster_configs"
CONFIGS = sorted(CONFIG_DIR.glob("*.yaml"))
SCHEMA = json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())
WATCHER_MODULE = "raytrain_sys.control.spot_watcher"


def load(path: Path) -> dict:
    with open(path) as f:
        return yaml.safe_load(f)


def is_spot(node_type: dict) -> bool:
    market = node_type.get("node_config", {}).get("InstanceMarketOptions", {}) or {}
    return str(market.get("MarketType", "")).lower() == "spot"


def watcher_args(cmd: str) -> list[str] | None:
    """The watcher's CLI arguments in a shell command, or None if it does not start it."""
    tokens = shlex.split(cmd, posix=True)
    for i in range(len(tokens) - 1):
        if tokens[i] == "-m" and tokens[i + 1] == WATCHER_MODULE:
            args = []
            for tok in tokens[i + 2:]:
                if tok in ("&", ">", ">>", "2>&1", "<", ";", "&&", "|") or tok.startswith(">"):
                    break
                args.append(tok)
            return args
    return None


def test_expected_configs_exist():
    names = {p.name for p in CONFIGS}
    assert {"aws-spot-gpu.yaml", "aws-cpu-small.yaml", "local.yaml"} <= names
    assert (CONFIG_DIR / "README.md").exists()


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_valid_against_rays_schema(path):
    config = load(path)
    jsonschema.validate(config, SCHEMA)  # the raw file
    prepared = prepare_config(copy.deepcopy(config))  # what `ray up` does before any cloud call
    validate_config(prepared)
    assert prepared["head_node_type"] in prepared["available_node_types"]


def test_schema_check_is_live():
    config = load(CONFIG_DIR / "aws-spot-gpu.yaml")
    config["idle_timeout_minute"] = 5  # a typo must be caught
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(config, SCHEMA)
    config = load(CONFIG_DIR / "aws-spot-gpu.yaml")
    del config["available_node_types"]["gpu_spot_1x"]["resources"]  # required per node type
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(config, SCHEMA)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_spot_workers_start_the_watcher(path):
    config = load(path)
    types = config.get("available_node_types", {})
    head = config.get("head_node_type")
    if head in types:
        assert not is_spot(types[head]), "the head must be on-demand: it holds the GCS and driver"
    global_start = config.get("worker_start_ray_commands", [])
    for name, node_type in types.items():
        if name == head or not is_spot(node_type):
            continue
        # worker_start_ray_commands run on every worker type; a type's own
        # worker_setup_commands run (before ray start) on that type only.
        commands = list(global_start) + list(node_type.get("worker_setup_commands", []))
        starting = [(i, c) for i, c in enumerate(commands) if watcher_args(c) is not None]
        assert starting, f"{path.name}: spot worker type {name!r} never starts {WATCHER_MODULE}"
        for i, cmd in starting:
            assert cmd.rstrip().endswith("&"), f"the watcher must run in the background: {cmd}"
            assert "nohup" in cmd or "setsid" in cmd, f"the watcher must outlive SSH: {cmd}"
            if i < len(global_start):
                ray_start = [j for j, c in enumerate(global_start) if "ray start" in c]
                assert ray_start and ray_start[0] < i, "start the watcher after `ray start`"
            args = watcher_args(cmd)
            parsed = spot_watcher.build_parser().parse_args(
                [a.replace("$RAY_HEAD_IP", "10.0.0.1") for a in args])
            assert parsed.gcs_address and parsed.gcs_address.endswith(":6379")
            assert parsed.lock_file, "a lock file keeps re-run start commands from stacking"
            assert parsed.imds_url == os.environ.get(spot_watcher.IMDS_URL_ENV,
                                                     spot_watcher.DEFAULT_IMDS_URL)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_setup_installs_pinned_torch_then_the_project(path):
    setup = "\n".join(load(path).get("setup_commands", []))
    assert '"torch==2.13.0"' in setup and "--index-url" in setup
    assert setup.index("torch==2.13.0") < setup.index("~/raytrain-sys")


def test_aws_spot_gpu_shape():
    config = load(CONFIG_DIR / "aws-spot-gpu.yaml")
    assert config["provider"]["type"] == "aws"
    assert config["provider"]["cache_stopped_nodes"] is False
    assert isinstance(config["idle_timeout_minutes"], int)
    spot_gpu = [n for n, t in config["available_node_types"].items()
                if is_spot(t) and t["node_config"]["InstanceType"].startswith(("g", "p"))]
    assert spot_gpu
    assert "download.pytorch.org/whl/cu" in "\n".join(config["setup_commands"])  # CUDA torch


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_node_exports_metrics_on_a_fixed_port(path):
    """Ray picks a random metrics port unless told (KubeRay sets 8080); Prometheus's scrape
    config and firewalls need a known one on every node."""
    config = load(path)
    starts = [c for key in ("head_start_ray_commands", "worker_start_ray_commands")
              for c in config.get(key, []) if "ray start" in c]
    assert len(starts) == 2, f"{path.name}: one head and one worker `ray start` expected"
    for cmd in starts:
        assert "--metrics-export-port=8080" in cmd, f"{path.name}: {cmd}"


@pytest.mark.parametrize("path", [p for p in CONFIGS if "available_node_types" in load(p)],
                         ids=lambda p: p.name)
def test_node_roles_and_flavors(path):
    """The names of raytrain_sys/control/node_roles.py, as the KubeRay manifests give them
    (tests/test_kubernetes_configs.py): the head is the safe node, every node type declares its
    flavor with Ray's labels, in agreement with its market."""
    config = load(path)
    types = config["available_node_types"]
    head = types[config["head_node_type"]]
    assert head["resources"].get(roles.CONTROL_RESOURCE) == roles.CONTROL_RESOURCE_PER_NODE
    assert roles.is_safe(head["resources"], head.get("labels", {}))
    builtin = {"CPU", "GPU", "memory", "object_store_memory"}
    for name, node_type in types.items():
        labels = node_type.get("labels", {})
        assert set(labels) <= {roles.MARKET_LABEL, roles.ACCELERATOR_LABEL}, (name, labels)
        assert set(node_type["resources"]) - builtin <= {roles.CONTROL_RESOURCE, roles.READ_RESOURCE}
        flavor = roles.flavor_of(labels)
        assert flavor is not None, f"{path.name}: {name} declares no {roles.MARKET_LABEL}"
        assert flavor.market == (roles.SPOT if is_spot(node_type) else roles.ON_DEMAND), name
        gpu = node_type["node_config"]["InstanceType"].startswith(("g", "p"))
        assert bool(flavor.accelerator) == gpu, (name, flavor)
        if is_spot(node_type):
            assert roles.CONTROL_RESOURCE not in node_type["resources"], f"{name}: spot is never safe"
