"""`raytrain-sys service start|stop|status`: the job service's actor on a running Ray cluster.

The service runs in the cluster (a detached actor), not in this process: `start` returns once it
runs, and the jobs go on when the shell closes. The cluster is the one RAY_ADDRESS names, or
the one running on this machine (`ray start --head`). Ray is imported only when a command runs.

`start` and `status` say what really serves: the actor answers, and its HTTP API answers
`GET /healthz`; exit 0 only then, 1 when something does not serve, 2 for a start refused
(the port taken, the store unusable: one line saying what to do, and no actor left behind).
"""

from __future__ import annotations

import argparse
import json
import os

from raytrain_sys.errors import UserError

ANSWER_TIMEOUT_S = 30.0  # the actor answers info in milliseconds; a loaded node may take seconds


def add_parser(sub) -> None:
    from raytrain_sys.cli.jobs import DB_ENV, add_admin_commands

    svc = sub.add_parser("service", help="the job service: start, stop, status; init-admin, serve")
    cmds = svc.add_subparsers(dest="service_command", required=True)
    start = cmds.add_parser("start", help="start the service actor on the Ray cluster (or show the running one)")
    start.add_argument("--db", default=None,
                       help=f"SQLite file (relative to here) or postgresql+psycopg://user:pass@host/db; "
                            f"default ${DB_ENV} or sqlite:///raytrain-service.db")
    start.add_argument("--host", default="127.0.0.1", help="the HTTP API's address")
    start.add_argument("--port", type=int, default=8470)
    start.add_argument("--cluster-workers", type=int, default=None,
                       help="worker slots the scheduler may give out; default: the cluster's CPUs / "
                            "--cpus-per-worker (or GPUs / --gpus-per-worker)")
    start.add_argument("--cpus-per-worker", type=float, default=1.0)
    start.add_argument("--gpus-per-worker", type=float, default=0.0)
    start.add_argument("--log-dir", default="",
                       help="the service's and its jobs' logs, recorded in the store for every later part; "
                            "default: the store's, first raytrain-sys-logs beside the SQLite file")
    start.add_argument("--max-restarts", type=int, default=3, help="runner losses a job survives")
    start.add_argument("--warm-workers", type=int, default=None,
                       help="idle worker processes (torch imported) kept on each node for the jobs' "
                            "first gangs; 0: none (default 2, about 0.26 GB each, PSS)")
    start.add_argument("--package-retention-days", type=float, default=7.0,
                       help="delete a code package (jobs submit --working-dir) no waiting or running job uses and "
                            "none submitted within this many days used; 0: keep every package")
    start.add_argument("--start-stall-s", type=float, default=None,
                       help="a start that stays this long in one step (its runner not answering, its workers not "
                            "placed or not starting) goes back to the queue, saying why (default 600)")
    start.add_argument("--max-start-returns", type=int, default=None,
                       help="starts given up in a row before the job fails with the reason (default 3)")
    start.add_argument("--flavors", default=None, metavar="FILE",
                       help="the flavor table (kinds of node, their prices and ceilings: a YAML list, docs/SERVICE.md), "
                            "replacing the store's; default: the store's (`raytrain-sys flavors set` changes it)")
    start.add_argument("--autoscaling", action="store_true",
                       help="admit against what the worker groups can reach (a flavor's max_*, --max-cluster-workers, "
                            "else Ray's cluster config) and ask Ray's autoscaler for what the queue needs")
    start.add_argument("--max-cluster-workers", type=int, default=None,
                       help="with --autoscaling and no flavor table: the worker slots the cluster can reach")
    start.add_argument("--provisioning-timeout-min", type=float, default=None,
                       help="with --autoscaling: how long a job admitted against capacity being provisioned waits "
                            "for its nodes before it goes back to the queue (default 10)")
    start.set_defaults(func=_cmd_start)
    stop = cmds.add_parser("stop", help="stop the service (running jobs train on; the next start re-attaches)")
    stop.set_defaults(func=_cmd_stop)
    status = cmds.add_parser("status", help="whether the service serves (its actor alive, its API answering), "
                                            "its store, log dir and job counts; exit 1 when it does not serve")
    status.set_defaults(func=_cmd_status)
    add_admin_commands(cmds)


def _connect() -> None:
    import ray

    if ray.is_initialized():  # called from a notebook or a test already connected
        return
    from raytrain_sys.control.worker_group import check_ray_auth

    address = os.environ.get("RAY_ADDRESS", "auto")
    check_ray_auth(address)
    try:
        ray.init(address=address, log_to_driver=False, logging_level="WARNING")
    except ConnectionError as exc:
        raise UserError(f"no Ray cluster at {address} ({exc}); start one with `ray start --head` or set "
                        f"RAY_ADDRESS") from None


def _cmd_start(args: argparse.Namespace) -> int:
    _connect()
    from raytrain_sys.cli.jobs import store_url
    from raytrain_sys.service.service import absolute_db_url, get_service, start_service
    from raytrain_sys.service.store import Store, mask_url

    running = get_service()
    db_url = absolute_db_url(store_url(args.db), os.getcwd())
    new_store = running is None and db_url.startswith("sqlite:") and Store.missing(db_url) is not None
    handle = running or start_service(
        db_url, args.host, args.port, log_dir=args.log_dir, cluster_workers=args.cluster_workers,
        cpus_per_worker=args.cpus_per_worker, gpus_per_worker=args.gpus_per_worker,
        max_restarts=args.max_restarts, package_retention_s=args.package_retention_days * 86400.0,
        **{k: v for k, v in (("start_stall_s", args.start_stall_s), ("max_start_returns", args.max_start_returns))
           if v is not None},
        **({} if args.warm_workers is None else {"warm_workers_per_node": args.warm_workers}),
        **_flavor_config(args))
    info = _report(handle, "already running" if running else "started", new_store=new_store)
    if running and info is not None and (info["port"] != args.port or info["db"] != mask_url(db_url)):
        print(f"note: the running service keeps its own store and port; `raytrain-sys service stop` first "
              f"to start one on {mask_url(db_url)}, port {args.port}")
    return 0 if info is not None and not info["api_problem"] else 1


def _flavor_config(args: argparse.Namespace) -> dict:
    """The flavor table and autoscaling options ``service start`` passes on (only those given)."""
    from raytrain_sys.cli.jobs import read_flavor_file

    config = {"flavors": read_flavor_file(args.flavors)} if args.flavors else {}
    if args.autoscaling:
        config["autoscaling"] = True
    if args.max_cluster_workers is not None:
        config["max_cluster_workers"] = args.max_cluster_workers
    if args.provisioning_timeout_min is not None:
        config["provisioning_timeout_s"] = args.provisioning_timeout_min * 60.0
    return config


def _cmd_stop(args: argparse.Namespace) -> int:
    _connect()
    from raytrain_sys.service.service import stop_service

    print("stopped" if stop_service() else "no service was running")
    return 0


def _cmd_status(args: argparse.Namespace) -> int:
    _connect()
    from raytrain_sys.service.service import get_service

    handle = get_service()
    if handle is None:
        print("not running")
        return 1
    info = _report(handle, "running")
    return 0 if info is not None and not info["api_problem"] else 1


def _report(handle, verb: str, new_store: bool = False) -> dict | None:
    """Print what really serves: the actor (it answers), the API (it answers GET /healthz at its
    address, asked from the actor's node), the store and the log directory; then the details.
    Returns the actor's info, None when the actor does not answer."""
    import ray

    try:
        info = ray.get(handle.info.remote(), timeout=ANSWER_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:
        print(f"{verb}, but not serving: the service actor does not answer within {ANSWER_TIMEOUT_S:g} s "
              f"(a loaded node, or a stuck actor: see its service.log; `raytrain-sys service stop` and start "
              f"again)")
        return None
    except ray.exceptions.RayActorError as exc:
        print(f"not serving: the service actor is gone ({str(exc).splitlines()[0]}); `raytrain-sys service "
              f"start` starts it again")
        return None
    problem = info["api_problem"]
    print(f"{verb}: serving" if not problem else f"{verb}, but not serving: the HTTP API does not answer")
    rows = [("actor", f"alive, pid {info['pid']} on {info['node_ip']}"),
            ("api", f"answering at {info['url']} (GET /healthz)" if not problem else f"not answering: {problem}"),
            ("store", info["db"] + (" (new and empty: made by this start)" if new_store else "")),
            ("logs", info["log_dir"])]
    for key, value in rows:
        print(f"  {key + ':':<7}{value}")
    print("details: " + json.dumps(info, indent=1))
    return info
