"""The KubeRay manifests in cluster_configs/kubernetes/ are what a Kubernetes API server accepts,
and agree with the project.

Offline, no cluster:

* RayCluster and RayJob against KubeRay's CRDs (``tests/fixtures/kuberay-crds/``, the served
  storage version's ``openAPIV3Schema``) with jsonschema, PLUS a walk that finds every key the
  schema does not name: the API server drops unknown fields of a custom resource silently, so
  a misspelt ``terminationGracePeriodSecond`` would otherwise pass and do nothing.
* Core kinds (Service, PodDisruptionBudget, ConfigMap, Job, Deployment, PVC) with the
  ``kubernetes-validate`` package in strict mode (unknown keys are errors there). The
  Prometheus scrape config is a plain ConfigMap (the Prometheus operator's ServiceMonitor and
  PodMonitor are CRDs we cannot validate offline), checked with ``promtool check config``.
* Against the project: Ray version and image tags equal pyproject's pin; ports equal the
  code's defaults; every ``raytrain-sys`` command parses with our CLI's argparse and every job
  spec it names loads with its overrides; a preStop drain's deadline plus Ray's SIGTERM drain
  stay under the pod's terminationGracePeriodSeconds; node names are node_roles.py's.
"""

from __future__ import annotations

import functools
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from raytrain_sys.cli.main import build_parser
from raytrain_sys.control import node_roles as roles
from raytrain_sys.spec import load_spec

ROOT = Path(__file__).resolve().parents[1]
K8S_DIR = ROOT / "cluster_configs" / "kubernetes"
# KubeRay's CRDs: the project's own copy (tests/fixtures/kuberay-crds/README.md says where they
# come from), so a clean clone validates with nothing beside it.
CRD_DIR = ROOT / "tests" / "fixtures" / "kuberay-crds"
MANIFESTS = sorted(K8S_DIR.glob("*.yaml"))
# The oldest Kubernetes these manifests are written for (policy/v1 PDBs, batch/v1 Jobs).
K8S_VERSION = "1.30"
CRDS = {"RayCluster": "ray.io_rayclusters.yaml", "RayJob": "ray.io_rayjobs.yaml"}
OBJECT_META_KEYS = {"name", "namespace", "labels", "annotations"}
# Margin between the preStop's deadline plus Ray's SIGTERM drain and the pod's grace period:
# the hook's own start (Python, Ray's imports) and the kubelet's signal delivery.
GRACE_MARGIN_S = 5
K8S_DEFAULT_GRACE_S = 30
RAY_DEFAULT_SIGTERM_DRAIN_S = 30  # RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S's default in Ray 2.60


def ray_pin() -> str:
    text = (ROOT / "pyproject.toml").read_text()
    return re.search(r'"ray\[[^\]]*\]==([0-9.]+)"', text).group(1)


def project_version() -> str:
    return re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M).group(1)


def documents() -> list[tuple[str, dict]]:
    out = []
    for path in MANIFESTS:
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                out.append((path.name, doc))
    return out


DOCS = documents()


def doc_id(item) -> str:
    name, doc = item
    return f"{name}:{doc['kind']}/{doc['metadata']['name']}"


@functools.lru_cache(maxsize=None)
def crd_schema(kind: str) -> dict:
    assert (CRD_DIR / CRDS[kind]).exists(), f"KubeRay's CRDs not found: {CRD_DIR}"
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # 2 MB of YAML: libyaml's parser
    crd = yaml.load((CRD_DIR / CRDS[kind]).read_text(), Loader=loader)
    served = [v for v in crd["spec"]["versions"] if v.get("served") and v.get("storage")]
    assert len(served) == 1, f"{CRDS[kind]}: one served storage version expected"
    return served[0]["schema"]["openAPIV3Schema"]


def unknown_keys(value, schema: dict, path: str = "") -> list[str]:
    """Paths of keys the schema does not name (what the API server would prune)."""
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return []
    found = []
    if isinstance(value, dict):
        props = schema.get("properties")
        extra = schema.get("additionalProperties")
        for key, sub in value.items():
            where = f"{path}.{key}" if path else key
            if props is not None and key in props:
                found += unknown_keys(sub, props[key], where)
            elif isinstance(extra, dict):
                found += unknown_keys(sub, extra, where)
            elif extra is True:
                continue
            elif props is not None or extra is False:
                found.append(where)
            # neither: a free-form object (metadata at the top, checked on its own)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            found += unknown_keys(item, schema["items"], f"{path}[{i}]")
    return found


def pod_templates(doc: dict) -> list[tuple[str, dict, dict]]:
    """(group name, group spec, pod template) of a RayCluster's or a RayJob's cluster."""
    spec = doc["spec"] if doc["kind"] == "RayCluster" else doc["spec"]["rayClusterSpec"]
    groups = [("headgroup", spec["headGroupSpec"])]
    groups += [(g["groupName"], g) for g in spec.get("workerGroupSpecs", [])]
    return [(name, group, group["template"]) for name, group in groups]


def containers(doc: dict) -> list[dict]:
    if doc["kind"] in CRDS:
        return [c for _, _, t in pod_templates(doc) for c in t["spec"]["containers"]]
    template = doc.get("spec", {}).get("template", {})
    return list(template.get("spec", {}).get("containers", []))


def env_of(container: dict) -> dict:
    return {e["name"]: e.get("value") for e in container.get("env", [])}


# --------------------------------------------------------------------------- the files
def test_expected_manifests_exist():
    names = {p.name for p in MANIFESTS}
    assert {"raycluster.yaml", "state.yaml", "service-start.yaml", "rayjob.yaml",
            "rayjob-kueue.yaml"} <= names
    assert (K8S_DIR / "README.md").exists() and (K8S_DIR / "Dockerfile").exists()
    kinds = {doc["kind"] for _, doc in DOCS}
    assert {"RayCluster", "RayJob", "Service", "PodDisruptionBudget", "ConfigMap", "Job",
            "Deployment", "PersistentVolumeClaim"} <= kinds


@pytest.mark.parametrize("item", [d for d in DOCS if d[1]["kind"] in CRDS], ids=doc_id)
def test_custom_resources_valid_against_kuberay_crds(item):
    _, doc = item
    schema = crd_schema(doc["kind"])
    jsonschema.validate(doc, schema)
    assert unknown_keys(doc, schema) == []
    assert set(doc["metadata"]) <= OBJECT_META_KEYS, set(doc["metadata"]) - OBJECT_META_KEYS


@pytest.mark.parametrize("item", [d for d in DOCS if d[1]["kind"] not in CRDS], ids=doc_id)
def test_core_kinds_valid_in_strict_mode(item):
    _, doc = item
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_validation_is_live():
    """The checks above fail on what they are there to catch."""
    name, cluster = next(d for d in DOCS if d[1]["kind"] == "RayCluster")
    schema = crd_schema("RayCluster")
    typo = yaml.safe_load(yaml.safe_dump(cluster))
    group = typo["spec"]["workerGroupSpecs"][1]
    group["template"]["spec"]["terminationGracePeriodSecond"] = 120  # pruned silently by the API
    group["minReplica"] = 1
    jsonschema.validate(typo, schema)  # jsonschema alone lets both through
    assert unknown_keys(typo, schema) == [
        "spec.workerGroupSpecs[1].template.spec.terminationGracePeriodSecond",
        "spec.workerGroupSpecs[1].minReplica"]
    wrong_type = yaml.safe_load(yaml.safe_dump(cluster))
    wrong_type["spec"]["workerGroupSpecs"][1]["maxReplicas"] = "8"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(wrong_type, schema)
    _, service = next(d for d in DOCS if d[1]["kind"] == "Service")
    bad = yaml.safe_load(yaml.safe_dump(service))
    bad["spec"]["port"] = 8470
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)


def test_prometheus_scrape_config_is_valid(tmp_path):
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (scripts/install.sh dev installs prometheus)")
    _, cm = next(d for d in DOCS if d[1]["kind"] == "ConfigMap" and "prometheus.yml" in d[1]["data"])
    config = yaml.safe_load(cm["data"]["prometheus.yml"])
    scrape = config["scrape_configs"][0]
    assert scrape.pop("kubernetes_sd_configs") == [{"role": "pod"}]
    # Debian's Prometheus is built without Kubernetes service discovery: promtool checks the
    # rest (relabelling, intervals) with the discovery swapped for a file.
    scrape["file_sd_configs"] = [{"files": [str(tmp_path / "targets.json")]}]
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    out = subprocess.run([promtool, "check", "config", str(path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert scrape["honor_labels"] is True  # our series carry their own `job` label
    keep = {tuple(r["source_labels"]): r["regex"] for r in scrape["relabel_configs"]
            if r.get("action") == "keep"}
    assert keep[("__meta_kubernetes_pod_container_port_name",)] == "metrics"


# --------------------------------------------------------------------------- the project
def test_ray_version_and_images_follow_pyproject():
    pin, version = ray_pin(), project_version()
    ours = f":{version}-ray{pin}"
    for name, doc in DOCS:
        if doc["kind"] in CRDS:
            spec = doc["spec"] if doc["kind"] == "RayCluster" else doc["spec"]["rayClusterSpec"]
            assert spec["rayVersion"] == pin, name
        for c in containers(doc):
            if "raytrain-sys" in c["image"]:
                assert c["image"].endswith(ours), f"{name}: {c['image']} (want ...{ours})"
    dockerfile = (K8S_DIR / "Dockerfile").read_text()
    assert re.search(rf"^FROM rayproject/ray:{re.escape(pin)}-py3\d+", dockerfile, re.M)
    assert '"torch==2.13.0"' in dockerfile and ours.lstrip(":") in dockerfile


def test_ports_equal_the_codes_defaults():
    from ray._private import ray_constants

    from raytrain_sys.service.service import DEFAULT_PORT

    _, cluster = next(d for d in DOCS if d[1]["kind"] == "RayCluster")
    head = cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in head["ports"]}
    assert ports["raytrain-api"] == DEFAULT_PORT
    assert ports["gcs-server"] == ray_constants.DEFAULT_PORT
    assert ports["dashboard"] == ray_constants.DEFAULT_DASHBOARD_PORT
    for c in containers(cluster):  # Prometheus scrapes every pod on one known port
        assert {p["name"]: p["containerPort"] for p in c["ports"]}["metrics"] == 8080
    for _, _, template in pod_templates(cluster):
        assert template["metadata"]["annotations"]["prometheus.io/port"] == "8080"
    _, api = next(d for d in DOCS if d[1]["kind"] == "Service" and d[1]["metadata"]["name"] == "raytrain-api")
    assert api["spec"]["ports"][0] == {"name": "http", "port": DEFAULT_PORT, "targetPort": "raytrain-api"}
    assert api["spec"]["selector"] == {"ray.io/cluster": cluster["metadata"]["name"], "ray.io/node-type": "head"}
    start = raytrain_sys_commands()["service-start.yaml"][0]
    args = build_parser().parse_args(start)
    assert args.port == DEFAULT_PORT and args.host == "0.0.0.0"
    assert args.log_dir.startswith("/mnt/shared/")  # where every pod mounts the shared volume
    for c in containers(cluster):
        assert {"name": "shared", "mountPath": "/mnt/shared"} in c["volumeMounts"]


# --------------------------------------------------------------------------- commands
def _command_strings(doc: dict) -> list[list[str]]:
    """Every command of a manifest, as argument lists: containers' command + args (a `bash -c`
    string split by shlex), preStop hooks, and a RayJob's entrypoint."""
    found = []
    for c in containers(doc):
        argv = list(c.get("command", [])) + list(c.get("args", []))
        if argv[:2] in (["/bin/bash", "-c"], ["/bin/sh", "-c"]):
            found += [shlex.split(a) for a in argv[2:] if a != "--"]
        elif argv:
            found.append(argv)
        hook = c.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command")
        if hook:
            found.append(list(hook))
    if doc["kind"] == "RayJob":
        found.append(shlex.split(doc["spec"]["entrypoint"]))
    return found


def raytrain_sys_commands() -> dict[str, list[list[str]]]:
    """{file: [argv after `raytrain-sys`, ...]}, shell separators cut off."""
    out: dict[str, list[list[str]]] = {}
    for name, doc in DOCS:
        for argv in _command_strings(doc):
            while "raytrain-sys" in argv:
                argv = argv[argv.index("raytrain-sys") + 1:]
                cut = next((i for i, a in enumerate(argv) if a in (";", "&&", "||", "|", "&")), len(argv))
                out.setdefault(name, []).append(argv[:cut])
                argv = argv[cut:]
    return out


def test_every_raytrain_sys_command_parses_with_our_cli():
    commands = raytrain_sys_commands()
    assert {"raycluster.yaml", "service-start.yaml", "rayjob.yaml", "rayjob-kueue.yaml"} <= set(commands)
    for name, argvs in commands.items():
        for argv in argvs:
            try:
                args = build_parser().parse_args(argv)
            except SystemExit:
                pytest.fail(f"{name}: `raytrain-sys {' '.join(argv)}` does not parse")
            if args.command == "run":  # the spec it names loads, with its overrides
                spec = load_spec(ROOT / args.spec, args.set)
                assert spec.checkpoint.uri.startswith("s3://"), f"{name}: checkpoints belong on S3"
                assert spec.tracking.uri.startswith("http://"), f"{name}: MLflow is a server"
    with pytest.raises(SystemExit):  # and a wrong one would not
        build_parser().parse_args(["node", "drain", "--grace-s", "90"])


def test_prestop_drain_fits_the_grace_period():
    """A pod with our preStop hook: its deadline, then Ray's SIGTERM drain, within the grace
    period; and every spot group has the hook (a reclaim must become a drain)."""
    hooked = 0
    for name, doc in DOCS:
        if doc["kind"] not in CRDS:
            continue
        for group, spec, template in pod_templates(doc):
            for c in template["spec"]["containers"]:
                hook = c.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command")
                if spec.get("labels", {}).get(roles.MARKET_LABEL) == roles.SPOT:
                    assert hook, f"{name}: spot group {group} has no preStop drain"
                if not hook:
                    continue
                hooked += 1
                args = build_parser().parse_args(hook[hook.index("raytrain-sys") + 1:])
                assert (args.command, args.node_command, args.reason, args.wait) == \
                    ("node", "drain", "preemption", True), hook
                grace = template["spec"].get("terminationGracePeriodSeconds", K8S_DEFAULT_GRACE_S)
                sigterm = float(env_of(c).get("RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S")
                                or RAY_DEFAULT_SIGTERM_DRAIN_S)
                assert args.deadline_s + sigterm + GRACE_MARGIN_S <= grace, \
                    f"{name}: {group}: {args.deadline_s:g} s hook + {sigterm:g} s SIGTERM drain > {grace} s grace"
    assert hooked >= 4


def test_ray_start_is_the_process_that_gets_sigterm(tmp_path):
    """RayCluster pods run KubeRay's generated `ray start --block` with exec (our own command,
    ray.io/overwrite-container-cmd): SIGTERM reaches Ray's drain whatever the shell does."""
    _, cluster = next(d for d in DOCS if d[1]["kind"] == "RayCluster")
    assert cluster["metadata"]["annotations"]["ray.io/overwrite-container-cmd"] == "true"
    scripts = {tuple(c["command"] + c["args"]) for c in containers(cluster)}
    assert len(scripts) == 1, scripts  # every group starts Ray the same way
    # Run it as the container would, with a stand-in `ray` that reports its pid and arguments,
    # and a command shaped like the one KubeRay generates (JSON in quotes, an env reference).
    stub = tmp_path / "ray"
    stub.write_text('#!/bin/sh\necho "pid $$"\nfor a in "$@"; do echo "arg $a"; done\n')
    stub.chmod(0o755)
    env = {"PATH": f"{tmp_path}:/usr/bin:/bin", "REDIS_PASSWORD": "pw",
           "KUBERAY_GEN_RAY_START_CMD": "ray start --block --num-cpus=0 "
                                        "--resources='{\"raytrain_control\":1000}' "
                                        "--redis-password=$REDIS_PASSWORD"}
    proc = subprocess.Popen(list(scripts.pop()), env=env, stdout=subprocess.PIPE, text=True)
    out, _ = proc.communicate(timeout=30)
    assert f"pid {proc.pid}" in out.splitlines()  # exec'ed: Ray's process is the one signalled
    assert 'arg --resources={"raytrain_control":1000}' in out.splitlines()
    assert "arg --redis-password=pw" in out.splitlines()


# --------------------------------------------------------------------------- node roles
def test_node_names_are_node_roles():
    """Safe nodes offer the control resource and are on-demand; spot nodes never offer it;
    every group declares its flavor with Ray's labels; no other custom resource or label."""
    allowed_resources = {roles.CONTROL_RESOURCE, roles.READ_RESOURCE}
    allowed_labels = {roles.MARKET_LABEL, roles.ACCELERATOR_LABEL}
    for name, doc in DOCS:
        if doc["kind"] not in CRDS:
            continue
        for group, spec, template in pod_templates(doc):
            resources = {k: float(v) for k, v in spec.get("resources", {}).items()}
            labels = spec.get("labels", {})
            assert set(resources) <= allowed_resources, f"{name}: {group}: {resources}"
            assert set(labels) <= allowed_labels, f"{name}: {group}: {labels}"
            flavor = roles.flavor_of(labels)
            assert flavor is not None, f"{name}: {group} declares no {roles.MARKET_LABEL}"
            capacity = template["spec"].get("nodeSelector", {}).get("karpenter.sh/capacity-type")
            assert capacity == flavor.market, f"{name}: {group}: label {flavor.market}, pool {capacity}"
            gpus = [c["resources"].get("limits", {}).get("nvidia.com/gpu") for c in template["spec"]["containers"]]
            assert bool(flavor.accelerator) == any(gpus), f"{name}: {group}: {flavor}"
            if roles.CONTROL_RESOURCE in resources:
                assert resources[roles.CONTROL_RESOURCE] == roles.CONTROL_RESOURCE_PER_NODE
                assert roles.is_safe(resources, labels), f"{name}: {group} is marked safe but is spot"
            if doc["kind"] == "RayCluster" and group in ("headgroup", "control"):
                assert roles.is_safe(resources, labels), f"{name}: {group} must be a safe node"


def test_spot_and_on_demand_gpu_groups_by_priority():
    _, cluster = next(d for d in DOCS if d[1]["kind"] == "RayCluster")
    spec = cluster["spec"]
    assert spec["enableInTreeAutoscaling"] is True and spec["autoscalerOptions"]["version"] == "v2"
    assert spec["authOptions"]["mode"] == "token"
    assert spec["gcsFaultToleranceOptions"]["redisAddress"]
    gpu = {g["groupName"]: g for g in spec["workerGroupSpecs"]
           if roles.ACCELERATOR_LABEL in g.get("labels", {})}
    by_market = {g["labels"][roles.MARKET_LABEL]: g["priority"] for g in gpu.values()}
    assert by_market[roles.SPOT] > by_market[roles.ON_DEMAND]
    readers = [g for g in spec["workerGroupSpecs"] if roles.READ_RESOURCE in g.get("resources", {})]
    assert readers and all("nvidia.com/gpu" not in c["resources"]["limits"]
                           for g in readers for c in g["template"]["spec"]["containers"])


def test_the_walk_through_commands_parse():
    """docs/KUBERNETES.md's raytrain-sys commands parse, its job's overrides name real spec
    fields, and the files it applies exist."""
    text = (ROOT / "docs" / "KUBERNETES.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text, re.S)
    lines = "\n".join(blocks).replace("\\\n", " ").splitlines()
    parsed = []
    for line in lines:
        line = line.split("#")[0]
        for applied in re.findall(r"kubectl apply -f (\S+)", line):
            assert (K8S_DIR / applied).exists(), applied
        for part in re.split(r"\$\(|\)|;|&&|\|\||&", line):
            if "raytrain-sys " not in part:
                continue
            argv = shlex.split(part)
            argv = argv[argv.index("raytrain-sys") + 1:]
            try:
                parsed.append(build_parser().parse_args(argv))
            except SystemExit:
                pytest.fail(f"docs/KUBERNETES.md: `raytrain-sys {' '.join(argv)}` does not parse")
    commands = {(a.command, getattr(a, "jobs_command", None) or getattr(a, "service_command", None)
                 or getattr(a, "teams_command", None))
                for a in parsed}
    assert {("service", "init-admin"), ("teams", "add"), ("jobs", "submit")} <= commands
    submit = next(a for a in parsed if a.command == "jobs" and a.jobs_command == "submit")
    spec = load_spec(ROOT / submit.spec, submit.set)
    assert spec.checkpoint.uri.startswith("s3://") and spec.tracking.uri == "http://raytrain-mlflow:5000"
    assert spec.data.path.startswith("/mnt/shared/") and spec.output_dir.startswith("/mnt/shared/")


def test_the_flavor_table_is_the_clusters_worker_groups():
    """service-start.yaml's flavor table loads as the service reads it, and names the
    RayCluster's training groups: each flavor a group of its market and accelerator, its ceilings
    the group's maxReplicas times what one pod gives Ray; service start takes it with
    --autoscaling."""
    from raytrain_sys.service.flavors import check_flavor_table, flavor_from_dict

    config = next(doc for name, doc in DOCS if doc["kind"] == "ConfigMap" and doc["metadata"]["name"] ==
                  "raytrain-flavors")
    table = check_flavor_table([flavor_from_dict(f) for f in yaml.safe_load(config["data"]["flavors.yaml"])["flavors"]])
    _, cluster = next(d for d in DOCS if d[1]["kind"] == "RayCluster")
    groups = {}
    for group in cluster["spec"]["workerGroupSpecs"]:
        flavor = roles.flavor_of(group.get("labels", {}))
        if roles.CONTROL_RESOURCE not in group.get("resources", {}):
            groups[(flavor.market, flavor.accelerator)] = group
    assert {(f.market, f.accelerator) for f in table} == set(groups)
    for f in table:
        group = groups[(f.market, f.accelerator)]
        limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
        assert f.max_cpu == group["maxReplicas"] * float(limits["cpu"]), f.name
        assert (f.max_gpu or 0) == group["maxReplicas"] * float(limits.get("nvidia.com/gpu", 0)), f.name
    start = raytrain_sys_commands()["service-start.yaml"][0]
    args = build_parser().parse_args(start)
    assert args.autoscaling and args.flavors == "flavors.yaml"
