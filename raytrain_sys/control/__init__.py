"""Membership, drains and the worker processes of a run (see docs/ARCHITECTURE.md)."""

# The prefix of every actor and placement group name of a run (worker_group.run_name_prefix):
# here, and not in worker_group, so that a node's preStop hook can recognise a run's slots
# without importing torch.
NAME_PREFIX = "raytrain-sys"
