"""A run's report: the summary table ``raytrain-sys report`` prints, and its plots.

Owns: finding a run's ``summary.json`` (a run dir, or an MLflow run id whose record names its run
dir) and the rows of the table. Reads only; the plots are ``monitor/plots.py``'s. Fields other
parts of the system add later (``cost``, ``stragglers``) are shown when present and skipped
when not, so a report reads any run's summary.
"""

from __future__ import annotations

import json
import math
import os
from collections import Counter

from raytrain_sys.control.run_record import SUMMARY_FILE
from raytrain_sys.errors import UserError
from raytrain_sys.monitor.plots import write_plots

# States a run enters after losing a member: each entry is one recovery.
RECOVERY_STATES = ("rebuilding", "restoring")


def find_summary(run: str, tracking_uri: str = "") -> tuple[dict, str]:
    """The summary of ``run`` and its run dir: ``run`` is a run dir holding summary.json, or an
    MLflow run id (its ``raytrain.run_dir`` tag names the dir) in the store at ``tracking_uri``."""
    if os.path.isdir(run):
        run_dir = run
        if not os.path.exists(os.path.join(run, SUMMARY_FILE)):
            raise UserError(f"{run} holds no {SUMMARY_FILE}: give a run dir (runs/<job>-<time>) or an "
                            f"MLflow run id with --tracking-uri")
    else:
        if not tracking_uri:
            raise UserError(f"{run!r} is not a directory; for an MLflow run id give --tracking-uri "
                            f"(e.g. sqlite:///runs/mlflow.db)")
        from raytrain_sys.tracking.mlflow_tracker import Tracker

        record = Tracker.lookup(tracking_uri, run)
        if not record.run_dir or not os.path.exists(os.path.join(record.run_dir, SUMMARY_FILE)):
            raise UserError(f"MLflow run {run} names run dir {record.run_dir or '(none)'}, which holds no "
                            f"{SUMMARY_FILE} on this machine: pass the run dir itself")
        run_dir = record.run_dir
    with open(os.path.join(run_dir, SUMMARY_FILE)) as f:
        return json.load(f), run_dir


def _num(value, fmt: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return format(value, fmt)


def summary_rows(s: dict) -> list[tuple[str, str]]:
    """(label, value) rows describing the run, in reading order."""
    losses = [x for x in s.get("losses") or [] if x is not None and not math.isnan(x)]
    worlds = [w for w in s.get("world_sizes") or [] if w]
    tp = s.get("throughput") or {}
    started, finished = s.get("started_at") or 0.0, s.get("finished_at") or 0.0
    transitions = s.get("transitions") or []
    # One entry a recovery in summary.json's recoveries; a summary from before them: the states
    # entered after losing a member.
    recoveries = len(s.get("recoveries") or []) or sum(t.get("state") in RECOVERY_STATES for t in transitions)
    rows = [
        ("job", s.get("job", "")),
        ("status", s.get("status", "") + (f" ({s['reason']})" if s.get("reason") else "")),
        ("steps", str(s.get("committed_steps", 0))),
        ("loss", f"{_num(losses[0], '.4f')} -> {_num(losses[-1], '.4f')}" if losses else "n/a"),
        ("tokens/s", _num(tp.get("tokens_per_s"), ",.0f")),
        ("step time", f"{_num(tp['step_time_s'] * 1000, '.1f')} ms" if tp.get("step_time_s") else "n/a"),
        ("world sizes", f"{min(worlds)}..{max(worlds)}, last {worlds[-1]}" if worlds else "n/a"),
        ("failures", str(s.get("failures", 0))),
        ("recoveries", f"{recoveries} ({s.get('steps_redone', 0)} steps redone{_sources(s.get('recoveries'))})"),
        ("duration", f"{finished - started:.1f} s" if started and finished else "running"),
    ]
    cost = s.get("cost") or {}
    if cost:
        rows.append(("cost", f"${_num(cost.get('usd'), '.4f')} "
                             f"(${_num(cost.get('usd_per_million_tokens'), '.4f')} / M tokens, goodput "
                             f"${_num(cost.get('goodput_usd_per_million_tokens'), '.4f')} / M tokens)"))
    copies = s.get("peer_copies") or {}
    if copies:
        rows.append(("peer copies", copies["off"] if "off" in copies else
                     f"rank -> peer {', '.join(f'{r}->{p}' for r, p in enumerate(copies.get('peers', [])))}, "
                     f"about {_num((copies.get('bytes_per_copy_estimate') or 0) / 2**20, '.1f')} MB a copy"))
    stragglers = s.get("stragglers")
    if stragglers is not None:
        ranks = sorted({str(e.get("rank")) for e in stragglers})
        rows.append(("stragglers", f"{len(stragglers)} events" + (f" (ranks {', '.join(ranks)})" if ranks else "")))
    rows += [("checkpoint", s.get("newest_checkpoint") or "none"),
             ("mlflow run", s.get("mlflow_run_id") or "tracking disabled"),
             ("run dir", s.get("run_dir", ""))]
    return rows


def _sources(recoveries: list | None) -> str:
    """Where the recoveries' state came from (summary.json ``recoveries``), e.g. "; from peer
    copies 2, checkpoint 1"; "" for a summary without them."""
    if not recoveries:
        return ""
    counts = Counter(r.get("from", "?") for r in recoveries)
    return "; from " + ", ".join(f"{source} {n}" for source, n in counts.items())


def format_table(rows: list[tuple[str, str]]) -> str:
    width = max(len(label) for label, _ in rows)
    return "\n".join(f"{label:<{width}}  {value}" for label, value in rows)


def report(run: str, out_dir: str = "", tracking_uri: str = "") -> tuple[str, list[str]]:
    """The table's text and the plots written (to ``out_dir``, default ``<run dir>/plots``)."""
    summary, run_dir = find_summary(run, tracking_uri)
    out = out_dir or os.path.join(run_dir, "plots")
    return format_table(summary_rows(summary)), write_plots(summary, out)


PROGRESS_POINTS = 300  # loss points a live view gets: enough for a curve, small enough to poll
STACK_TOPS = 3  # the newest workers found hung (or stragglers replaced) a live view names


def stack_tops(recoveries: list, stragglers: list, read_hangs: list = (), newest: int = STACK_TOPS) -> list[dict]:
    """The newest workers found hung (summary.json's recoveries' ``hung``), stragglers replaced
    with their stacks (``stragglers``' ``top_frame``) and reads found hung (``read_hangs``: kind
    "read", no slot or rank), oldest first: step, slot, rank, kind, why and the top frame of the
    training (or reading) thread (``top``: "file:line in function")."""
    found = [{"step": h["step"], "slot": h["slot"], "rank": h["rank"], "kind": "hung", "reason": h["reason"],
              "top": _frame(h["top_frame"])} for r in recoveries for h in r.get("hung", [])]
    found += [{"step": e["step"], "slot": None, "rank": e["rank"], "kind": "straggler",
               "reason": f"straggler replaced: {e['ratio']}x its peers' compute", "top": _frame(e["top_frame"])}
              for e in stragglers if "top_frame" in e]
    found += [{"step": r.get("step", 0), "slot": None, "rank": None, "kind": "read", "reason": r["reason"],
               "top": _frame(r.get("top_frame"))} for r in read_hangs]
    return sorted(found, key=lambda f: f["step"])[-newest:]


def _frame(top: dict) -> str:
    return f"{top['file']}:{top['line']} in {top['function']}" if top else "(no stack)"


def _thinned(values: list, points: int) -> list[list]:
    """[[step, value], ...] of the recorded values, every k-th so at most about ``points`` remain,
    the newest always kept."""
    n = len(values)
    every = max(1, -(-n // points))
    picked = list(range(0, n, every))
    if n and picked[-1] != n - 1:
        picked.append(n - 1)
    return [[i + 1, values[i]] for i in picked
            if values[i] is not None and not (isinstance(values[i], float) and math.isnan(values[i]))]


def progress(summary, max_steps: int = 0) -> dict:
    """What a live page shows of a run, from its ``RunSummary`` (read in place: slices, no deep
    copy, so a runner answers it between steps for nothing) or its summary.json as a dict."""
    get = summary.get if isinstance(summary, dict) else (lambda key, default=None: getattr(summary, key, default))
    tp = get("throughput") or {}
    worlds = get("world_sizes") or []
    return {"status": get("status", ""), "step": int(get("committed_steps", 0) or 0), "max_steps": int(max_steps),
            "world_size": worlds[-1] if worlds else None, "losses": _thinned(get("losses") or [], PROGRESS_POINTS),
            "tokens_per_s": tp.get("tokens_per_s"), "step_time_s": tp.get("step_time_s"),
            "rank_times": dict(get("rank_times") or {}), "cost": dict(get("cost") or {}),
            "stragglers": len(get("stragglers") or []), "failures": int(get("failures", 0) or 0),
            "stacks": stack_tops(get("recoveries") or [], get("stragglers") or [], get("read_hangs") or []),
            "started_at": get("started_at"), "finished_at": get("finished_at") or None}
