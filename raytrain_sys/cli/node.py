"""`raytrain-sys node drain`: the Ray node this runs on is going away (a pod's preStop hook).

See ``raytrain_sys/control/node_drain.py`` for what it does. Exit codes: 0 nothing of ours is
left on the node (or there was no node to drain); 1 the deadline came with training slots still
there; 2 the GCS could not be reached or refused the drain (one line on stderr).
"""

from __future__ import annotations

import argparse

from raytrain_sys.errors import UserError

# The preStop hook's default budget: under Kubernetes' default terminationGracePeriodSeconds
# (30 s) with room for Ray's own SIGTERM drain after it.
DEFAULT_DEADLINE_S = 20.0


def add_parser(sub) -> None:
    node = sub.add_parser("node", help="this Ray node: drain it before the machine goes away")
    cmds = node.add_subparsers(dest="node_command", required=True)
    d = cmds.add_parser("drain", help="drain this node (reason PREEMPTION) and wait until our training left it",
                        description="Drain this Ray node and, with --wait, return once no training slot of "
                                    "raytrain-sys is left on it, or at the deadline. A pod's preStop hook.")
    d.add_argument("--reason", choices=("preemption", "idle_termination"), default="preemption",
                   help="preemption (never refused) or idle_termination (refused on a busy node)")
    d.add_argument("--deadline-s", type=float, default=DEFAULT_DEADLINE_S,
                   help=f"seconds until the machine goes away: the drain's deadline and the wait's budget "
                        f"(default {DEFAULT_DEADLINE_S:g}); keep it under the pod's terminationGracePeriodSeconds")
    d.add_argument("--wait", action="store_true", help="return once our training slots left the node")
    d.add_argument("--node-id", default=None,
                   help="hex id of the node (default: the node of $RAY_CLOUD_INSTANCE_ID, KubeRay's pod "
                        "name, else the only node on this host's IP)")
    d.add_argument("--gcs-address", default=None, help="host:port of the GCS (default: $RAY_ADDRESS)")
    d.add_argument("--message", default="", help="recorded with the drain")
    d.add_argument("--poll-s", type=float, default=None, help="how often the wait looks (default 0.5 s)")
    d.set_defaults(func=_cmd_drain)


def _cmd_drain(args: argparse.Namespace) -> int:
    from raytrain_sys.control import drain, node_drain

    if args.deadline_s <= 0:
        raise UserError(f"--deadline-s must be more than 0 seconds, got {args.deadline_s:g}")
    try:
        outcome = node_drain.drain_this_node(
            args.deadline_s, reason=args.reason.upper(), wait=args.wait, node_id=args.node_id,
            gcs_address=args.gcs_address, message=args.message,
            poll_s=args.poll_s if args.poll_s is not None else node_drain.DEFAULT_POLL_S)
    except (drain.DrainError, LookupError) as e:
        raise UserError(f"node drain: {e}") from None
    print(outcome.summary(), flush=True)
    return 0 if outcome.ok or not args.wait else 1
