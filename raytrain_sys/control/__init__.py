"""Membership, drains and the worker processes of a run (see docs/ARCHITECTURE.md)."""

# The prefix of every actor and placement group name of a run (launches.run_name_prefix):
# here, and not in worker_group, so that a node's preStop hook can recognise a run's slots
# without importing torch.
NAME_PREFIX = "raytrain-sys"

GB = 1024 ** 3  # resources.memory_per_worker_gb: Ray's memory resource counts bytes


def slot_bundle(cpus: float, gpus: float = 0.0, memory_gb: float = 0.0) -> dict[str, float]:
    """One worker slot's placement bundle (CPU, and GPU and memory when asked): the worker group
    places it, and the job service asks Ray's autoscaler for the same (service/autoscale.py).
    Here, beside NAME_PREFIX, so that neither imports torch for it."""
    bundle = {"CPU": cpus}
    if gpus:
        bundle["GPU"] = gpus
    if memory_gb:
        bundle["memory"] = memory_gb * GB
    return bundle
