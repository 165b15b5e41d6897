"""`raytrain-sys jobs|teams|flavors` (and `service init-admin|serve`): the job service from a shell.

``jobs``, ``teams`` and ``flavors`` talk to a running service through ``raytrain_sys.service.client`` (URL and
token from ``--url``/``--token`` or ``RAYTRAIN_SYS_SERVICE_URL``/``RAYTRAIN_SYS_TOKEN``);
``service init-admin`` and ``service serve`` open the store directly (``--db`` or
``RAYTRAIN_SYS_SERVICE_DB``). Errors are the CLI's: one line, exit 2. A token is printed only
by the two commands that make one (``teams token``, ``service init-admin``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any, Optional

DB_ENV = "RAYTRAIN_SYS_SERVICE_DB"
STATES = ("queued", "starting", "running", "pausing", "paused", "resuming", "cancelling", "finished", "failed",
          "cancelled")
# `jobs list` cuts a job's reason to what the terminal leaves it, but to no fewer than this
# (a piped listing: to what 120 columns leave, shutil's fallback).
MIN_REASON_WIDTH = 40


def connection_parsers() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """(an action's, its group's) parents holding --url and --token. They go before or after the
    action (`teams --url U` alone lists): the group's parser holds the defaults, and an action's
    copy only sets them when given (SUPPRESS)."""
    conn, group_conn = (argparse.ArgumentParser(add_help=False) for _ in range(2))
    for parser, default in ((conn, argparse.SUPPRESS), (group_conn, None)):
        parser.add_argument("--url", default=default, help="the job service, default $RAYTRAIN_SYS_SERVICE_URL")
        parser.add_argument("--token", default=default, help="a bearer token, default $RAYTRAIN_SYS_TOKEN")
    return conn, group_conn


def add_parsers(sub: argparse._SubParsersAction) -> None:
    """Add the ``jobs`` and ``teams`` commands to the CLI's subparsers."""
    conn, group_conn = connection_parsers()

    jobs = sub.add_parser("jobs", parents=[group_conn],
                          help="submit, list, follow, pause, resume and cancel service jobs")
    js = jobs.add_subparsers(dest="jobs_command", required=True)
    s = js.add_parser("submit", parents=[conn], help="queue a job spec (YAML) with the service")
    s.add_argument("spec")
    s.add_argument("--team", default=None, help="default: the token's team (required with an admin token)")
    s.add_argument("--priority", type=int, default=None, help="higher is more important (default 0)")
    s.add_argument("--name", default=None, help="default: the spec's name")
    s.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a spec field")
    s.add_argument("--working-dir", default=None, metavar="DIR",
                   help="send this directory's files with the job: its working directory and first sys.path "
                        "entry on every node (your model.factory, train.task and data.transform modules)")
    s.add_argument("--exclude", action="append", default=[], metavar="PATTERN",
                   help="with --working-dir: leave out files or directories matching this glob (repeatable; "
                        ".git, __pycache__ and virtual environments are always left out)")
    s.set_defaults(func=_submit)
    ls = js.add_parser("list", parents=[conn], help="jobs of your team (admin: every team)")
    ls.add_argument("--state", action="append", choices=STATES, default=None, help="repeatable")
    ls.add_argument("--team", default=None)
    ls.set_defaults(func=_list)
    st = js.add_parser("status", parents=[conn], help="one job and its transitions")
    st.add_argument("job_id", type=int)
    st.set_defaults(func=_status)
    lg = js.add_parser("logs", parents=[conn], help="a job's log")
    lg.add_argument("job_id", type=int)
    lg.add_argument("--follow", "-f", action="store_true", help="print new lines until the job ends")
    lg.set_defaults(func=_logs)
    for action, text in (("pause", "pause a job and hold it (running: checkpoint and release; "
                                    "queued, paused or starting: held, paused once it runs)"),
                         ("resume", "release a job its team paused: it waits for admission again"),
                         ("cancel", "cancel a job")):
        a = js.add_parser(action, parents=[conn], help=text)
        a.add_argument("job_id", type=int)
        a.add_argument("--reason", default=None)
        if action == "cancel":
            a.add_argument("--delete-checkpoints", action="store_true",
                           help="delete its checkpoints once it has ended")
        a.set_defaults(func=_request, action=action)

    teams = sub.add_parser("teams", parents=[group_conn],
                           help="list teams; add or change one; issue or revoke its tokens (admin)")
    ts = teams.add_subparsers(dest="teams_command")
    teams.set_defaults(func=_teams_list)
    ts.add_parser("list", parents=[conn], help="every team's quota").set_defaults(func=_teams_list)
    for verb in ("add", "update"):
        t = ts.add_parser(verb, parents=[conn], help=f"{verb} a team's quota")
        t.add_argument("name")
        t.add_argument("--nominal", type=int, required=verb == "add", default=None, help="guaranteed workers")
        t.add_argument("--cohort", default=None, help="teams of a cohort lend each other unused quota")
        t.add_argument("--borrowing-limit", type=_limit_arg, default=None, metavar="N|none",
                       help="workers beyond nominal it may borrow; none: no limit (as much as the cohort lends)")
        t.add_argument("--lending-limit", type=_limit_arg, default=None, metavar="N|none",
                       help="of its nominal, the most it lends; none: no limit (lends all of it)")
        t.add_argument("--weight", type=float, default=None, help="fair-share weight (default 1)")
        t.set_defaults(func=_teams_add if verb == "add" else _teams_update)
    tk = ts.add_parser("token", parents=[conn], help="issue a token for a team (printed once)")
    tk.add_argument("name")
    tk.set_defaults(func=_teams_token)
    rv = ts.add_parser("revoke", parents=[conn], help="revoke every token of a team")
    rv.add_argument("name")
    rv.set_defaults(func=_teams_revoke)
    qt = ts.add_parser("quota", parents=[conn], help="set a team's quotas on one flavor (admin)")
    qt.add_argument("name")
    qt.add_argument("flavor")
    qt.add_argument("quotas", nargs="*", metavar="RESOURCE=NOMINAL[/BORROW[/LEND]]",
                    help="e.g. cpu=32 gpu=4/2/0: nominal 4 GPUs, borrowing at most 2, lending none ('-': no "
                         "limit); none given: clear the team's quotas on the flavor")
    qt.set_defaults(func=_teams_quota)

    flavors = sub.add_parser("flavors", parents=[group_conn],
                             help="the service's flavor table (kinds of node, their prices and ceilings)")
    fs = flavors.add_subparsers(dest="flavors_command")
    flavors.set_defaults(func=_flavors_list)
    fs.add_parser("list", parents=[conn], help="every flavor, its prices and capacity").set_defaults(
        func=_flavors_list)
    fset = fs.add_parser("set", parents=[conn], help="replace the flavor table from a YAML file (admin)")
    fset.add_argument("file", help="a YAML list of flavors, or {flavors: [...]} (docs/SERVICE.md)")
    fset.set_defaults(func=_flavors_set)



def add_admin_commands(cmds) -> None:
    """``service init-admin`` and ``service serve`` (the store opened here, no Ray), added to the
    ``service`` command's subparsers (``cli/service.py`` owns that command)."""
    db = argparse.ArgumentParser(add_help=False)
    db.add_argument("--db", default=None, help=f"the store's SQLAlchemy URL, default ${DB_ENV} "
                                               "or sqlite:///raytrain-service.db")
    db.add_argument("--create", action="store_true",
                    help="make a new, empty store when there is none at --db (else: refused, exit 2)")
    ia = cmds.add_parser("init-admin", parents=[db], help="issue an admin token and print it once")
    ia.add_argument("--rotate", action="store_true", help="revoke every earlier admin token first")
    ia.set_defaults(func=_init_admin)
    sv = cmds.add_parser("serve", parents=[db], help="serve the HTTP API in the foreground (no scheduler)")
    sv.add_argument("--host", default="127.0.0.1")
    sv.add_argument("--port", type=int, default=8470)
    sv.add_argument("--log-dir", default=None,
                    help="where job-<id>.log files are read from; default: the store's (where its runners write)")
    sv.set_defaults(func=_serve)


def store_url(db: str | None) -> str:
    """The store a ``service`` command opens: ``--db``, else $RAYTRAIN_SYS_SERVICE_DB, else the
    SQLite file beside here."""
    from raytrain_sys.service.store import DEFAULT_URL

    return db or os.environ.get(DB_ENV) or DEFAULT_URL


# ----------------------------------------------------------------------------- jobs


def _client(args: argparse.Namespace):
    from raytrain_sys.service.client import Client

    return Client.from_env(args.url, args.token)


def _submit(args: argparse.Namespace) -> int:
    job = _client(args).submit(Path(args.spec), team=args.team, priority=args.priority, overrides=args.set,
                               name=args.name, working_dir=args.working_dir, excludes=args.exclude)
    code = f", code package {job['package'][:12]}" if job.get("package") else ""
    print(f"job {job['id']} queued: {job['name']} for team {job['team']}, {_workers(job)} workers, "
          f"priority {job['priority']}{code}")
    return 0


def _list(args: argparse.Namespace) -> int:
    jobs = _client(args).jobs(states=args.state, team=args.team)
    header = ("ID", "TEAM", "NAME", "STATE", "PRI", "WORKERS", "AGE", "REASON")
    rows = [(j["id"], j["team"], j["name"], j["state"] + (" (held)" if j["held"] else ""), j["priority"],
             f"{j['workers']}/{_workers(j)}", _age(j["submitted_at_s"]), _reason(j)) for j in jobs]
    used = sum(max(len(str(r[i])) for r in [header, *rows]) + 2 for i in range(len(header) - 1))
    width = max(MIN_REASON_WIDTH, shutil.get_terminal_size((120, 24)).columns - used)
    _table(header, [(*r[:-1], _cut(r[-1], width)) for r in rows])
    return 0


def _reason(job: dict) -> str:
    """Why the job is where it is: a job not running yet, why it waits (its wait reason, once the
    service has looked at it); any other, its last transition's reason."""
    return job.get("wait_reason") or job["message"]


def _status(args: argparse.Namespace) -> int:
    client = _client(args)
    job = client.job(args.job_id)
    fields = [("job", job["id"]), ("name", job["name"]), ("team", job["team"]),
              ("state", job["state"] + (" (held by its team)" if job["held"] else "")),
              ("priority", job["priority"]), ("workers", f"{job['workers']} (target {job['target_workers']}, "
                                                         f"range {_workers(job)})"),
              ("worker", _shape(job) + (f", on flavor {job['flavor']}" if job.get("flavor") else "")),
              ("restarts", job["restarts"] if not job.get("steps_redone") else
               f"{job['restarts']} ({job['steps_redone']} steps trained again)"), ("checkpoint", "none" if job["last_checkpoint_step"] is None
                                              else f"step {job['last_checkpoint_step']}"),
              ("mlflow run", job["mlflow_run_id"] or "-"), ("message", job["message"])]
    if job.get("wait_cause"):
        fields[4:4] = [("reason", job["wait_reason"]),
                       ("waits on", f"{job['wait_cause']} since {_when(job['wait_cause_since_s'])} "
                                    f"({_age(job['wait_cause_since_s'])} ago)")]
    if job.get("sweep_id") is not None:
        segment = f", segment {job['segment']}" if job.get("segment") else ""
        fields.insert(3, ("trial", f"{job['trial_id']} of sweep {job['sweep_id']}, rung {job['rung']}{segment} "
                                   f"(raytrain-sys sweeps status {job['sweep_id']})"))
    if job.get("start_returns"):
        fields.append(("starts given up", f"{job['start_returns']} in a row (the transitions say why)"))
    if job.get("package"):
        fields.append(("code", f"package {job['package']} (its working directory)"))
    if job["delete_checkpoints"]:
        fields.append(("on end", "delete checkpoints"))
    fields += [("stack", f"step {s['step']}: " + ("a read (data.transform, a shard) hung" if s["kind"] == "read" else
                                                  f"rank {s['rank']} {s['kind']}") + f" at {s['top']}")
               for s in _stacks(client, job)]
    width = max(len(k) for k, _ in fields)
    for key, value in fields:
        print(f"{key:<{width}}  {value}")
    print()
    _table(("WHEN", "FROM", "TO", "BY", "REASON"),
           [(_when(t["at_s"]), t["from_state"] or "-", t["to_state"], t["actor"], t["reason"])
            for t in client.transitions(args.job_id)])
    return 0


def _stacks(client, job: dict) -> list[dict]:
    """The job's newest workers found hung or stragglers replaced, with their stacks' top frames
    (its run's progress: ``monitor.report.stack_tops``); none when its progress cannot be read."""
    try:
        found = [p for p in client.progress(job["team"]) if p["job"]["id"] == job["id"]]
    except Exception:  # noqa: BLE001: the status shows without them
        return []
    return (found[0].get("progress") or {}).get("stacks", []) if found else []


def _logs(args: argparse.Namespace) -> int:
    client = _client(args)
    if not args.follow:
        sys.stdout.write(client.logs(args.job_id))
        return 0
    for text in client.logs(args.job_id, follow=True):
        sys.stdout.write(text)
        sys.stdout.flush()
    return 0


def _request(args: argparse.Namespace) -> int:
    client = _client(args)
    if args.action == "cancel":
        job = client.cancel(args.job_id, args.reason, delete_checkpoints=args.delete_checkpoints)
    else:
        job = getattr(client, args.action)(args.job_id, args.reason)
    print(f"job {job['id']}: {job['state']}{' (held)' if job['held'] else ''}")
    return 0


# ----------------------------------------------------------------------------- teams


NO_LIMIT = "none"  # --borrowing-limit none: the limit cleared (the API's null)
_CLEARED = object()


def _limit_arg(text: str) -> Any:
    if text.strip().lower() == NO_LIMIT:
        return _CLEARED
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of workers, or {NO_LIMIT} for no limit; got {text!r}")


def _team_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The fields given, a cleared limit as None (sent as null: the API clears it)."""
    given = {"nominal_workers": args.nominal, "cohort": args.cohort, "borrowing_limit_workers": args.borrowing_limit,
             "lending_limit_workers": args.lending_limit, "weight": args.weight}
    return {k: None if v is _CLEARED else v for k, v in given.items() if v is not None}


def _teams_list(args: argparse.Namespace) -> int:
    teams = _client(args).teams()
    rows = [(t["name"], t["nominal_workers"], t["cohort"] or "-", _limit(t["borrowing_limit_workers"]),
             _limit(t["lending_limit_workers"]), f"{t['weight']:g}") for t in teams]
    if any(t.get("quotas") for t in teams):  # per flavor: FLAVOR RESOURCE NOMINAL/BORROW/LEND
        _table(("TEAM", "NOMINAL", "COHORT", "BORROW", "LEND", "WEIGHT", "QUOTAS"),
               [(*row, "; ".join(f"{q['flavor']} {_quota(q)}" for q in t["quotas"]) or "-")
                for row, t in zip(rows, teams)])
    else:
        _table(("TEAM", "NOMINAL", "COHORT", "BORROW", "LEND", "WEIGHT"), rows)
    return 0


def _teams_add(args: argparse.Namespace) -> int:
    fields = {k: v for k, v in _team_fields(args).items() if v is not None}  # a new team has no limit unless given
    team = _client(args).add_team(args.name, fields.pop("nominal_workers"), **fields)
    print(f"team {team['name']} added: nominal {team['nominal_workers']} workers")
    return 0


def _teams_update(args: argparse.Namespace) -> int:
    from raytrain_sys.errors import UserError

    fields = _team_fields(args)
    if not fields:
        raise UserError("teams update: give at least one of --nominal, --cohort, --borrowing-limit, "
                        "--lending-limit, --weight (a limit of none clears it)")
    team = _client(args).update_team(args.name, **fields)
    print(f"team {team['name']} updated: nominal {team['nominal_workers']}, cohort {team['cohort'] or '-'}, "
          f"borrowing limit {_limit(team['borrowing_limit_workers'])}, "
          f"lending limit {_limit(team['lending_limit_workers'])}, weight {team['weight']:g}")
    return 0


def _teams_quota(args: argparse.Namespace) -> int:
    quotas = {}
    for item in args.quotas:
        resource, nominal, borrow, lend = _quota_arg(item)
        quotas[resource] = {"nominal": nominal, "borrowing_limit": borrow, "lending_limit": lend}
    team = _client(args).set_quotas(args.name, args.flavor, quotas)
    mine = [q for q in team["quotas"] if q["flavor"] == args.flavor]
    print(f"team {team['name']} on {args.flavor}: " + (", ".join(_quota(q) for q in mine) or
                                                       "no quota (nominal 0, borrowing from its cohort)"))
    return 0


def _quota_arg(item: str) -> tuple[str, float, Optional[float], Optional[float]]:
    """RESOURCE=NOMINAL[/BORROW[/LEND]] ('-' for no limit)."""
    from raytrain_sys.errors import UserError

    resource, _, amounts = item.partition("=")
    parts = amounts.split("/")
    try:
        if not resource or not amounts or len(parts) > 3:
            raise ValueError
        values = [None if p.strip() in ("-", "") and i else float(p) for i, p in enumerate(parts)]
    except ValueError:
        raise UserError(f"teams quota: got {item!r}; each quota is RESOURCE=NOMINAL[/BORROW[/LEND]], e.g. cpu=32 "
                        f"or gpu=4/2/0 ('-': no limit)") from None
    values += [None] * (3 - len(values))
    return resource.strip(), values[0], values[1], values[2]


def _quota(q: dict) -> str:
    return f"{q['resource']} {q['nominal']:g}/{_limit(q['borrowing_limit'])}/{_limit(q['lending_limit'])}"


# ----------------------------------------------------------------------------- flavors


def _flavors_list(args: argparse.Namespace) -> int:
    flavors = _client(args).flavors()
    if not flavors:
        print("no flavor table: one implicit flavor counts workers of any shape on any node, with each team's "
              "nominal_workers as its quota")
        return 0
    _table(("FLAVOR", "MARKET", "ACCELERATOR", "COUNTS", "USD/H (CPU, GPU, GB)", "CEILING", "CAPACITY"),
           [(f["name"], f["market"], f["accelerator"] or "-", ",".join(f["resources"]),
             f"{f['usd_per_cpu_hour']:g}, {f['usd_per_gpu_hour']:g}, {f['usd_per_memory_gb_hour']:g}",
             _amounts({"cpu": f["max_cpu"], "gpu": f["max_gpu"], "memory_gb": f["max_memory_gb"]}),
             _amounts(f["capacity"] or {})) for f in flavors])
    return 0


def _flavors_set(args: argparse.Namespace) -> int:
    flavors = _client(args).set_flavors(read_flavor_file(args.file))
    print(f"flavor table set: {', '.join(f['name'] for f in flavors) or 'empty (the implicit flavor)'}")
    return 0


def read_flavor_file(path: str) -> list[dict]:
    """A flavor table from YAML: a list of flavors, or a mapping with the list under ``flavors``."""
    import yaml

    from raytrain_sys.errors import UserError

    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except (OSError, yaml.YAMLError) as exc:
        raise UserError(f"cannot read the flavor table {path}: {exc}") from None
    if isinstance(data, dict):
        data = data.get("flavors")
    if not isinstance(data, list) or not all(isinstance(f, dict) for f in data):
        raise UserError(f"{path}: a flavor table is a YAML list of flavors (name, market, accelerator, resources, "
                        f"usd_per_cpu_hour, ...), or a mapping with that list under 'flavors'")
    return data


def _amounts(values: dict) -> str:
    shown = [f"{k} {v:g}" for k, v in values.items() if v is not None]
    return ", ".join(shown) or "-"


def _teams_token(args: argparse.Namespace) -> int:
    token = _client(args).issue_token(args.name)
    print(f"# a token for team {args.name}, shown once; keep it secret (export {_token_env()}=...)",
          file=sys.stderr)
    print(token)
    return 0


def _teams_revoke(args: argparse.Namespace) -> int:
    n = _client(args).revoke_tokens(args.name)
    print(f"revoked {n} token(s) of team {args.name}")
    return 0


# ----------------------------------------------------------------------------- service


def _store(args: argparse.Namespace):
    """The store at --db, refused (exit 2) when there is none unless --create: a mistyped path
    must not become a new, empty store whose token no running service accepts."""
    from raytrain_sys.errors import UserError
    from raytrain_sys.service.store import Store, mask_url

    url = store_url(args.db)
    why = None if args.create else Store.missing(url)
    if why is not None:
        raise UserError(f"no job service store at {mask_url(url)} ({why}): check --db (or ${DB_ENV}), "
                        f"or give --create to make a new, empty one")
    return Store.open(url)


def _init_admin(args: argparse.Namespace) -> int:
    from raytrain_sys.service.auth import init_admin

    store = _store(args)
    try:
        token = init_admin(store, rotate=args.rotate)
    finally:
        store.close()
    print(f"# an admin token for {store.url}, shown once; keep it secret (export {_token_env()}=...)",
          file=sys.stderr)
    print(token)
    return 0


def _serve(args: argparse.Namespace) -> int:
    from raytrain_sys.service.api import serve

    store = _store(args)
    handle = serve(store, args.host, args.port, log_dir=args.log_dir)
    print(f"job service API at {handle.url} (store {store.url}, job logs in {store.log_dir()}); Ctrl-C stops it",
          file=sys.stderr)
    try:
        while True:
            time.sleep(3600)
    finally:
        handle.stop()
        store.close()


# ----------------------------------------------------------------------------- printing


def _token_env() -> str:
    from raytrain_sys.service.client import TOKEN_ENV

    return TOKEN_ENV


def _workers(job: dict) -> str:
    lo, hi = job["min_workers"], job["max_workers"]
    return str(lo) if lo == hi else f"{lo}..{hi}"


def _limit(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:g}"


def _shape(job: dict) -> str:
    """What one worker asks: CPUs, GPUs (their type), memory, market."""
    parts = [f"{job.get('cpus_per_worker', 1):g} CPU"]
    if job.get("gpus_per_worker"):
        parts.append(f"{job['gpus_per_worker']:g} {job.get('accelerator') or 'GPU'}")
    if job.get("memory_per_worker_gb"):
        parts.append(f"{job['memory_per_worker_gb']:g} GB")
    market = job.get("market") or "any"
    return " + ".join(parts) + ("" if market == "any" else f", {market}")


def _cut(text: str, width: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[:width - 3] + "..."


def _when(at_s: float) -> str:
    return datetime.fromtimestamp(at_s).strftime("%m-%d %H:%M:%S")


def _age(since_s: float) -> str:
    s = max(0, int(time.time() - since_s))
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= size:
            return f"{s // size}{unit}"
    return f"{s}s"


def _table(header: tuple, rows: list[tuple]) -> None:
    cells = [tuple(map(str, header))] + [tuple(map(str, r)) for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    for row in cells:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
