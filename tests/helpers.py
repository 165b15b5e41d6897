"""Small helpers shared by the end-to-end tests."""

from __future__ import annotations

import json
import os

import torch

from raytrain_sys.checkpoint.export import load_model
from raytrain_sys.spec import JobSpec, from_dict


def tiny_spec(tmp_path, dataset: str, **sections) -> JobSpec:
    """A job small enough for CI: a 1-layer GPT on 33-token rows, global batch 8."""
    raw = {
        "name": "t",
        "output_dir": str(tmp_path / "runs"),
        "model": {"block_size": 32, "n_layer": 1, "n_head": 2, "n_embd": 32},
        "data": {"path": dataset, "shuffle_window": 256},
        "train": {"max_steps": 8, "global_batch_size": 8, "log_every_steps": 4},
        "optim": {"lr": 1e-2, "warmup_steps": 2},
        "checkpoint": {"every_steps": 0, "keep_last": 3},
        "resources": {"num_workers": 2, "cpus_per_worker": 1, "start_timeout_s": 60},
        "tracking": {"experiment": "tests"},
    }
    for section, fields in sections.items():
        if isinstance(fields, dict):
            raw.setdefault(section, {}).update(fields)
        else:
            raw[section] = fields
    return from_dict(raw)


def final_params(checkpoint_uri: str, s3_endpoint_url: str = "") -> dict[str, torch.Tensor]:
    model, _, _ = load_model(checkpoint_uri, s3_endpoint_url)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def read_summary(run_dir: str) -> dict:
    with open(os.path.join(run_dir, "summary.json")) as f:
        return json.load(f)


def assert_params_close(a: dict, b: dict, rtol: float, atol: float = 1e-7) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=rtol, atol=atol, msg=lambda m: f"{k}: {m}")


def assert_params_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs: max abs diff {(a[k] - b[k]).abs().max()}"


def live_actors_and_groups() -> tuple[list, list]:
    """Actors not dead and placement groups not removed, from the GCS tables.

    Ray Data starts detached, cluster-wide singletons (its stats and autoscaling actors) the first
    time any dataset runs; they are Ray's, shared by every job, and left out. Ours are never
    detached."""
    from ray._private.state import state

    actors = [a for a in state.actor_table(None).values()
              if a["State"] != "DEAD" and not a["IsDetached"]]
    groups = [g for g in state.placement_group_table().values() if g["state"] != "REMOVED"]
    return actors, groups


def exported_series(name: str, *selectors: str) -> list[str]:
    """Lines of ``ray_<name>`` (a ``raytrain_*`` metric) containing every one of ``selectors``,
    read from the session cluster's metrics agents as Prometheus would scrape them."""
    import urllib.request

    import ray

    lines = []
    for node in ray.nodes():
        port = node.get("MetricsExportPort")
        if not node["Alive"] or not port:
            continue
        try:
            with urllib.request.urlopen(f"http://{node['NodeManagerAddress']}:{port}/metrics", timeout=5) as r:
                text = r.read().decode()
        except OSError:
            continue
        lines += [line for line in text.splitlines()
                  if line.startswith(f"ray_{name}{{") and all(s in line for s in selectors)]
    return lines
