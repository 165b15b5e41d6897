"""`raytrain-sys sweeps submit|list|status|pause|resume|cancel` (a service's sweeps, through
``service.client``) and `raytrain-sys sweep SWEEP.yaml` (one sweep on a Ray cluster of your own,
through the same service code: a service started here on a store of its own, the sweep submitted
to it, its end awaited and printed). Errors are the CLI's: one line, exit 2.
"""

from __future__ import annotations

import argparse
import os
import time

from raytrain_sys.cli.jobs import _age, _client, _table, connection_parsers

LOCAL_TEAM = "local"  # the one team of a local sweep's service
LOCAL_POLL_S = 2.0


def add_parsers(sub: argparse._SubParsersAction) -> None:
    conn, group_conn = connection_parsers()
    sweeps = sub.add_parser("sweeps", parents=[group_conn], help="submit, list, pause, resume and cancel sweeps "
                                                                 "on the job service")
    ss = sweeps.add_subparsers(dest="sweeps_command", required=True)
    s = ss.add_parser("submit", parents=[conn], help="queue a sweep (YAML: base, space, metric, ...)")
    s.add_argument("sweep")
    s.add_argument("--team", default=None, help="default: the token's team (required with an admin token)")
    s.add_argument("--priority", type=int, default=None, help="every trial's priority (default 0)")
    s.set_defaults(func=_submit)
    ls = ss.add_parser("list", parents=[conn], help="sweeps of your team (admin: every team)")
    ls.add_argument("--team", default=None)
    ls.set_defaults(func=_list)
    st = ss.add_parser("status", parents=[conn], help="one sweep and its trials")
    st.add_argument("sweep_id", type=int)
    st.set_defaults(func=_status)
    for action, text in (("pause", "hold every trial of a sweep"), ("resume", "release a paused sweep's trials"),
                         ("cancel", "end a sweep and cancel its trials")):
        a = ss.add_parser(action, parents=[conn], help=text)
        a.add_argument("sweep_id", type=int)
        a.add_argument("--reason", default=None)
        a.set_defaults(func=_request, action=action)

    local = sub.add_parser("sweep", help="run a sweep on a Ray cluster of your own (RAY_ADDRESS, or a local one)")
    local.add_argument("sweep")
    local.add_argument("--db", default="", help="the sweep's store (default: sweeps.db in the base spec's "
                                                 "output_dir)")
    local.set_defaults(func=_local)


def _submit(args: argparse.Namespace) -> int:
    sweep = _client(args).submit_sweep(args.sweep, team=args.team, priority=args.priority)
    print(f"sweep {sweep['id']} queued: {sweep['name']} for team {sweep['team']}, priority {sweep['priority']}")
    return 0


def _list(args: argparse.Namespace) -> int:
    rows = [(s["id"], s["team"], s["name"], s["state"], s["priority"], s["best_trial"] or "-",
             "-" if s["best_value"] is None else f"{s['best_value']:.6g}", _age(s["submitted_at_s"]))
            for s in _client(args).sweeps(team=args.team)]
    _table(("ID", "TEAM", "NAME", "STATE", "PRI", "BEST", "VALUE", "AGE"), rows)
    return 0


def _status(args: argparse.Namespace) -> int:
    _print_sweep(_client(args).sweep(args.sweep_id))
    return 0


def _print_sweep(sweep: dict) -> None:
    spec = sweep["spec"]
    fields = [("sweep", sweep["id"]), ("name", sweep["name"]), ("team", sweep["team"]), ("state", sweep["state"]),
              ("metric", f"{spec['metric']} ({spec['mode']})"), ("scheduler", spec["scheduler"]["type"]),
              ("best", f"{sweep['best_trial']} ({sweep['best_value']})" if sweep["best_trial"] else "-"),
              ("runner restarts", sweep["runner_restarts"]), ("message", sweep["message"])]
    width = max(len(k) for k, _ in fields)
    for key, value in fields:
        print(f"{key:<{width}}  {value}")
    print()
    _table(("TRIAL", "SEGMENT", "JOB", "STATE", "WORKERS", "RUNG", "CHECKPOINT"),
           [(t["trial_id"], t.get("segment", 0), t["job_id"], t["state"], t["workers"], t["rung"],
             "-" if t["last_checkpoint_step"] is None else t["last_checkpoint_step"]) for t in sweep["trials"] or []])


def _request(args: argparse.Namespace) -> int:
    sweep = getattr(_client(args), f"{args.action}_sweep")(args.sweep_id, args.reason)
    print(f"sweep {sweep['id']}: {sweep['state']}")
    return 0


def _local(args: argparse.Namespace) -> int:
    """One sweep through the service's own code on this cluster: a service on a store of its
    own (one team, as large as the cluster), the sweep submitted, its end awaited."""
    import ray

    from raytrain_sys.cli.service import _connect
    from raytrain_sys.service import requests as job_requests
    from raytrain_sys.service.service import cluster_capacity_workers, start_service, stop_service
    from raytrain_sys.service.store import Store
    from raytrain_sys.service.sweeps import requests as sweep_requests
    from raytrain_sys.service.sweeps.spec import load_sweep_file

    raw = load_sweep_file(args.sweep)
    spec = sweep_requests.parse(raw, os.getcwd())  # refused here, before anything starts
    db = args.db or os.path.join(spec.base["output_dir"], "sweeps.db")
    os.makedirs(os.path.dirname(os.path.abspath(db)), exist_ok=True)
    url = db if "://" in db else f"sqlite:///{os.path.abspath(db)}"
    _connect()
    store = Store.open(url)
    try:
        from raytrain_sys.service.teams import Team

        workers = max(1, cluster_capacity_workers(job_requests.shape_of(_job_spec(spec)).cpu))
        if LOCAL_TEAM not in {t.name for t in store.teams()}:
            store.add_team(Team(LOCAL_TEAM, workers))
        svc = start_service(url, serve_api=False, warm_workers_per_node=0)
        try:
            sweep = ray.get(svc.submit_sweep.remote(LOCAL_TEAM, raw))
            print(f"sweep {sweep['id']}: {spec.trial_count} trials of {spec.name}, {spec.scheduler.type}, "
                  f"store {url}")
            while not store.sweep(sweep["id"]).state.terminal:
                time.sleep(LOCAL_POLL_S)
            _print_sweep(sweep_requests.sweep_dict(store.sweep(sweep["id"]), store.trials(sweep["id"])))
            return 0 if store.sweep(sweep["id"]).state.value == "finished" else 1
        finally:
            stop_service()
    finally:
        store.close()


def _job_spec(spec):
    from raytrain_sys.spec import from_dict

    return from_dict(spec.base)
