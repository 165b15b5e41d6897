"""One sitting: every benchmark's standard form in turn on this machine (issue 58).

Each figure is printed beside its goal and beside the last figure committed in
``benchmarks/results/``, and marked ``worse`` where it is worse than that last figure by more than
its noise band (how far two runs of the same form moved apart; ``_sitting_forms.py`` holds the
forms, the figures, their goals and bands, each band with the data it came from). A benchmark that
fails or outlives its timeout is a row that says so; the sitting goes on to the next.

    .venv/bin/python benchmarks/sitting.py                        # every form, ~45 min on a quiet 2-core machine
    .venv/bin/python benchmarks/sitting.py --only scheduler,recovery
    .venv/bin/python benchmarks/sitting.py --list                 # forms, figures, goals, bands, expected minutes
    .venv/bin/python benchmarks/sitting.py --from-results benchmarks/results/sitting_20261207-0300.json
    .venv/bin/python benchmarks/sitting.py --readme --from-results FILE   # the README's table, FILE's figures newest
    .venv/bin/python benchmarks/sitting.py --history --only scheduler   # the committed figures the bands come from

The sitting writes one JSON, ``benchmarks/results/sitting_<UTC time>.json`` (each benchmark's
command, exit status, minutes, figures and where its raw JSON and log were kept), and prints one
table. The last committed figure is the newest figure of the same form in a file git tracks under
``benchmarks/results/`` (a benchmark's own result, or an earlier sitting's), dated by the time
inside the file or else by its last commit, so a clean clone compares the same way. The README's
benchmark table (between its two markers) is the newest committed figure of each, written by
``--readme``; tests/test_sitting.py checks that it matches.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
RESULTS = HERE / "results"
README = REPO / "README.md"
sys.path.insert(0, str(HERE))

import _common as common  # noqa: E402
from _sitting_forms import BENCHMARKS, Benchmark, Figure, Point  # noqa: E402

README_BEGIN = ("<!-- the table below is written by `python benchmarks/sitting.py --readme`: "
                "edit the registry, not the table -->")
README_END = "<!-- end of the table written by benchmarks/sitting.py -->"


# ----------------------------------------------------------------------------- verdicts (pure)

@dataclass(frozen=True)
class Dated(Point):
    """A figure as one committed run measured it, with when (UTC, ISO 8601) and in which file."""

    when: str = ""
    source: str = ""


@dataclass(frozen=True)
class Row:
    """A line of the table: one figure of one benchmark, now and as last committed."""

    benchmark: Benchmark
    figure: Figure
    now: Point | None
    last: Dated | None
    status: str  # "ok", or why there is no figure now: "failed (exit 2)", "timed out after 20 min", ...


def goal_verdict(figure: Figure, point: Point | None) -> str:
    """``met``, ``not met``, ``no goal``, or ``-`` (no figure, or a goal whose run set no limit)."""
    if point is None:
        return "-"
    if figure.goal is None:
        return "no goal"
    met = figure.goal.met(point.value, point.limit)
    return "-" if met is None else "met" if met else "not met"


def change_verdict(figure: Figure, now: Point | None, last: Dated | None) -> str:
    """Against the last committed figure: ``worse`` or ``better`` by more than the noise band,
    else ``same``; ``new`` when nothing of the form was committed, ``-`` when there is no figure now."""
    if now is None:
        return "-"
    if last is None:
        return "new"
    worse_by = now.value - last.value
    if figure.better == "higher":
        worse_by = -worse_by
    band = figure.noise.width(last.value)
    return "worse" if worse_by > band else "better" if worse_by < -band else "same"


def newest(points: list[Dated], before: str | None = None, exclude: str | None = None) -> Dated | None:
    """The newest of ``points`` dated before ``before`` (ISO strings compare in time order), not
    from the file ``exclude``: a sitting is compared with what was committed before it."""
    kept = [p for p in points if p.source != exclude and (before is None or p.when < before)]
    return max(kept, key=lambda p: (p.when, p.source), default=None)


def make_rows(benchmarks, now: dict[str, dict[str, Point]], status: dict[str, str],
              history: dict[tuple[str, str], list[Dated]], before: str | None = None,
              exclude: str | None = None) -> list[Row]:
    """One row a figure of each benchmark, in the registry's order: its figure now (``now[name][key]``),
    the run's status, and the last committed figure of the same form before ``before``."""
    return [Row(b, f, now.get(b.name, {}).get(f.key), newest(history.get((b.name, f.key), []), before, exclude),
                status.get(b.name, "not run"))
            for b in benchmarks for f in b.figures]


def fmt(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    if unit in ("B", "MB", "steps", "tokens/s"):
        return f"{value:,.0f}" + ("" if unit == "tokens/s" else f" {unit}")
    if unit in ("x", "shards"):
        digits = 3 if abs(value) < 0.1 else 2
        return f"{value:.{digits}f}" + ("x" if unit == "x" else " shards")
    digits = 3 if abs(value) < 1 and unit in ("s", "ms") else 2 if abs(value) < 10 else 1
    return f"{value:.{digits}f} {unit}"


def goal_text(figure: Figure, point: Point | None) -> str:
    goal = figure.goal
    if goal is None:
        return "-"
    per_run = goal.threshold is None and point is not None and point.limit is not None
    here = f", {fmt(point.limit, figure.unit)} here" if per_run else ""
    return f"{'≤' if goal.op == '<=' else '≥'} {goal.text}{here} ({goal.source})"


def day(when: str) -> str:
    return when[:10] if when else "undated"


def table(rows: list[Row]) -> list[str]:
    """The sitting's table: a line a figure, grouped by benchmark."""
    head = ("figure", "now", "goal", "met", "last committed", "noise", "vs last")
    cells, shown = [], None
    for r in rows:
        if r.benchmark.name != shown:
            shown = r.benchmark.name
            cells.append((f"{r.benchmark.name}: {r.benchmark.shown()}"
                          + ("" if r.status == "ok" else f"  [{r.status}]"),))
        last = f"{fmt(r.last.value, r.figure.unit)} ({day(r.last.when)})" if r.last else "-"
        cells.append((f"  {r.figure.label}", fmt(r.now.value if r.now else None, r.figure.unit),
                      goal_text(r.figure, r.now), goal_verdict(r.figure, r.now), last, r.figure.noise.text(),
                      change_verdict(r.figure, r.now, r.last)))
    widths = [max(len(c[i]) for c in [head, *cells] if len(c) > 1) for i in range(len(head))]
    return [c[0] if len(c) == 1 else "  ".join(x.ljust(w) for x, w in zip(c, widths)).rstrip()
            for c in [head, *cells]]


def readme_table(rows: list[Row]) -> list[str]:
    """The README's table: for each figure its newest committed value (``Row.last``), its goal,
    and when and where it was measured."""
    lines = ["| benchmark (standard form) | figure | latest | goal | when, raw figures |", "|---|---|---|---|---|"]
    shown = None
    for r in rows:
        first = r.benchmark.name != shown
        shown = r.benchmark.name
        bench = f"`{r.benchmark.shown()}`: {r.benchmark.what}" if first else ""
        goal = "-" if r.figure.goal is None else f"{goal_text(r.figure, r.last)}: {goal_verdict(r.figure, r.last)}"
        value = f"**{fmt(r.last.value, r.figure.unit)}**" if r.last else "not measured yet"
        when = f"{day(r.last.when)}, `{r.last.source}`" if r.last else "-"
        lines.append(f"| {bench} | {r.figure.label} | {value} | {goal} | {when} |")
    return lines


def replace_table(text: str, lines: list[str]) -> str:
    """``text`` with what stands between the README's two markers replaced by ``lines``."""
    if text.count(README_BEGIN) != 1 or text.count(README_END) != 1:
        raise ValueError("the README must hold each of the sitting's two markers once")
    head, rest = text.split(README_BEGIN)
    _, tail = rest.split(README_END)
    return head + README_BEGIN + "\n" + "\n".join(lines) + "\n" + README_END + tail


def worse_or_missing(rows: list[Row]) -> list[Row]:
    """The rows a sitting should not pass over: a figure worse beyond noise, or a benchmark that
    gave no figures (failed, timed out)."""
    return [r for r in rows if change_verdict(r.figure, r.now, r.last) == "worse"
            or r.status not in ("ok", "not run")]


# ----------------------------------------------------------------------------- the committed figures

def utc(stamp: str) -> str:
    """A result's time (``2026-11-24 22:36:59``, ``2026-11-26T05:21:42+0000``, git's ISO) as UTC
    ISO 8601; a time without a zone is this project's machines' UTC."""
    t = datetime.fromisoformat(stamp)
    t = t if t.tzinfo else t.replace(tzinfo=timezone.utc)
    return t.astimezone(timezone.utc).replace(microsecond=0).isoformat()


def git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, check=True).stdout


def committed_results() -> dict[str, tuple[dict, str]]:
    """Every JSON under benchmarks/results/ that git tracks: its content and when it was measured
    (the time inside it, or else its last commit's)."""
    names = [Path(p).name for p in git("ls-files", "--", "benchmarks/results/*.json").split()]
    committed_at: dict[str, str] = {}
    commit_time = ""
    for line in git("log", "--format=%x00%cI", "--name-only", "--", "benchmarks/results").splitlines():
        if line.startswith("\x00"):
            commit_time = line[1:]
        elif line.strip():
            committed_at.setdefault(Path(line).name, commit_time)  # the log runs newest first
    out = {}
    for name in names:
        data = json.loads((RESULTS / name).read_text())
        stamp = (data.get("time") if isinstance(data, dict) else None) or committed_at.get(name)
        out[name] = (data, utc(stamp) if stamp else "")
    return out


def history(results: dict[str, tuple[dict, str]], benchmarks=BENCHMARKS):
    """``{(benchmark, figure): [Dated]}`` over ``results``, and the extractor errors met
    (``file: benchmark.figure: error``): a sitting's own figures where its run was of today's
    form, and each benchmark's figures from its own results of that form."""
    found: dict[tuple[str, str], list[Dated]] = {}
    errors: list[str] = []
    for name, (data, when) in sorted(results.items()):
        if not isinstance(data, dict):
            continue
        if data.get("benchmark") == "sitting":
            for b in benchmarks:
                run = data.get("runs", {}).get(b.name)
                if run and run.get("form") == list(b.args):
                    for key, p in run.get("figures", {}).items():
                        found.setdefault((b.name, key), []).append(
                            Dated(p["value"], p.get("limit"), utc(run["started"]) if run.get("started") else when,
                                  name))
            continue
        for b in benchmarks:
            if not b.accepts(name, data):
                continue
            for f in b.figures:
                try:
                    point = figure_point(f, data)
                except Exception as e:  # an older layout the extractor does not know: said, not fatal
                    errors.append(f"{name}: {b.name}.{f.key}: {type(e).__name__}: {e}")
                    continue
                if point is not None:
                    found.setdefault((b.name, f.key), []).append(Dated(point.value, point.limit, when, name))
    return found, errors


def figure_point(figure: Figure, data: dict) -> Point | None:
    got = figure.extract(data)
    if got is None or isinstance(got, Point):
        return got
    return Point(float(got))


# ----------------------------------------------------------------------------- running one benchmark

def fill(args, work: Path) -> list[str]:
    return [a.replace("{work}", str(work)) for a in args]


def run_benchmark(b: Benchmark, work: Path, timeout_s: float) -> dict:
    """Run ``b``'s standard form (its setup first) with its raw JSON and log in ``work``: a record
    with its figures, or with why there are none. Never raises for the benchmark's sake."""
    raw, log = work / f"{b.name}.json", work / f"{b.name}.log"
    record = {"form": list(b.args), "command": b.command(),
              "started": datetime.now(timezone.utc).replace(microsecond=0).isoformat(),
              "raw": str(raw), "log": str(log), "loadavg_before": os.getloadavg(), "figures": {}}
    raw.unlink(missing_ok=True)
    t0 = time.monotonic()
    steps = ([[sys.executable, *fill(b.setup, work)]] if b.setup else []) + [
        [sys.executable, *fill(b.command(), work), "--out", str(raw)]]
    status = "ok"
    with open(log, "w") as out:
        for step in steps:
            left = timeout_s - (time.monotonic() - t0)
            code = run_until(step, out, left)
            record.setdefault("exit_codes", []).append(code)
            if code is None:
                status = f"timed out after {timeout_s / 60:.0f} min" if timeout_s >= 120 else \
                    f"timed out after {timeout_s:.0f} s"
                break
            if step is not steps[-1] and code != 0:
                status = f"setup failed (exit {code})"
                break
    record["wall_s"] = round(time.monotonic() - t0, 1)
    record["loadavg_after"] = os.getloadavg()
    if status == "ok":
        code = record["exit_codes"][-1]
        if not raw.exists():
            status = f"failed (exit {code}, no result JSON)"
        else:
            status = read_figures(b, raw, record)
    record["status"] = status
    return record


def run_until(argv: list[str], out, left_s: float) -> int | None:
    """Run ``argv`` in its own session (so that a timeout ends it and every process it started);
    its exit code, or None when ``left_s`` ran out first."""
    if left_s <= 0:
        return None
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen(argv, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        return proc.wait(timeout=left_s)
    except subprocess.TimeoutExpired:
        end_group(proc)
        return None


def end_group(proc: subprocess.Popen, grace_s: float = 20) -> None:
    """SIGTERM to ``proc``'s whole process group (a benchmark's ``finally`` stops its cluster), and
    SIGKILL to whatever of it is left ``grace_s`` later."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=grace_s)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def read_figures(b: Benchmark, raw: Path, record: dict) -> str:
    try:
        data = json.loads(raw.read_text())
    except ValueError as e:
        return f"failed (unreadable result JSON: {e})"
    missing = []
    for f in b.figures:
        try:
            point = figure_point(f, data)
        except Exception as e:
            return f"extractor failed on {f.key}: {type(e).__name__}: {e}"
        if point is None:
            missing.append(f.key)
        else:
            record["figures"][f.key] = {"value": point.value, "limit": point.limit}
    return "ok" if not missing or record["figures"] else f"no figures in the result ({', '.join(missing)})"


# ----------------------------------------------------------------------------- the command

def select(p: argparse.ArgumentParser, only: str, skip: str) -> list[Benchmark]:
    names = [b.name for b in BENCHMARKS]
    keep = common.pick(p, only, names, "--only") if only else names
    drop = common.pick(p, skip, names, "--skip") if skip else []
    return [b for b in BENCHMARKS if b.name in keep and b.name not in drop]


def last_sitting_minutes(results: dict[str, tuple[dict, str]]) -> dict[str, str]:
    """Each form's minutes in the newest committed sitting that ran it, as ``"5.2 min on 2026-12-08"``:
    what the expected minutes are checked against."""
    minutes: dict[str, tuple[str, str]] = {}
    for name, (data, when) in results.items():
        if isinstance(data, dict) and data.get("benchmark") == "sitting":
            for form, run in data.get("runs", {}).items():
                if run.get("wall_s") and when > minutes.get(form, ("", ""))[0]:
                    minutes[form] = (when, f"{run['wall_s'] / 60:.1f} min on {day(when)}")
    return {form: text for form, (_, text) in minutes.items()}


def print_list(chosen: list[Benchmark], measured: dict[str, str]) -> None:
    for b in chosen:
        last = f"; {measured[b.name]}" if b.name in measured else ""
        print(f"{b.name}: {b.shown()}  (~{b.expected_min:g} min expected{last}; timeout {b.timeout_min:g} min)")
        for f in b.figures:
            print(f"    {f.key}: {f.label} [{f.unit}, {f.better} is better]; goal {goal_text(f, None)}; "
                  f"noise {f.noise.text()}")
    print(f"{len(chosen)} forms, ~{sum(b.expected_min for b in chosen):g} min expected")


def print_history(chosen: list[Benchmark], found: dict, errors: list[str]) -> None:
    for b in chosen:
        for f in b.figures:
            points = sorted(found.get((b.name, f.key), []), key=lambda p: p.when)
            print(f"{b.name}.{f.key} ({f.unit}; noise {f.noise.text()}):")
            for p in points:
                print(f"    {day(p.when)}  {fmt(p.value, f.unit):>14}  {p.source}")
    for e in errors:
        print(f"extractor error: {e}")


def load_sitting(path: str) -> dict:
    data = json.loads(Path(path).read_text())
    if data.get("benchmark") != "sitting":
        raise SystemExit(f"{path} is not a sitting's JSON (no \"benchmark\": \"sitting\")")
    return data


def sitting_rows(chosen, data: dict, found: dict, source: str) -> list[Row]:
    runs = data.get("runs", {})
    forms = {b.name: list(b.args) for b in chosen}
    now = {name: {k: Point(p["value"], p.get("limit")) for k, p in run.get("figures", {}).items()}
           for name, run in runs.items() if run.get("form") == forms.get(name)}
    status = {name: run.get("status", "?") if run.get("form") == forms.get(name) else
              f"ran another form: {' '.join(run.get('form', []))}" for name, run in runs.items()}
    return make_rows(chosen, now, status, found, before=utc(data["time"]), exclude=source)


def write_readme(chosen_all, found: dict) -> list[str]:
    lines = readme_table(make_rows(chosen_all, {}, {}, found))
    README.write_text(replace_table(README.read_text(), lines))
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    p.add_argument("--only", default="", help="comma list of the forms to run (--list names them)")
    p.add_argument("--skip", default="", help="comma list of the forms to leave out")
    p.add_argument("--list", action="store_true", help="the forms, their figures, goals and noise bands; run nothing")
    p.add_argument("--history", action="store_true",
                   help="every committed figure of the chosen forms, by date (what the noise bands come from)")
    p.add_argument("--from-results", default="", metavar="FILE",
                   help="the table of an existing sitting's JSON, against what was committed before it; run nothing")
    p.add_argument("--readme", action="store_true",
                   help="write the README's benchmark table from the newest committed figures "
                        "(with --from-results, that sitting's figures newest); run nothing")
    p.add_argument("--timeout-min", type=float, default=0, help="every form's timeout (default: each form's own)")
    p.add_argument("--work", default="", help="where the raw JSONs and logs go (default: a new dir under /tmp)")
    p.add_argument("--out", default="", help="the sitting's JSON (default benchmarks/results/sitting_<UTC time>.json)")
    args = p.parse_args(argv)
    chosen = select(p, args.only, args.skip)
    results = committed_results()
    if args.list:
        print_list(chosen, last_sitting_minutes(results))
        return 0
    found, errors = history(results)
    if args.history:
        print_history(chosen, found, errors)
        return 0
    if args.from_results:
        data = load_sitting(args.from_results)
        source = Path(args.from_results).name
        if args.readme:
            extra, _ = history({source: (data, utc(data["time"]))})
            for key, points in extra.items():
                found.setdefault(key, []).extend(points)
            print("\n".join(write_readme(BENCHMARKS, found)))
            print(f"wrote the table into {README}")
            return 0
        print("\n".join(table(sitting_rows(chosen, data, found, source))))
        return 0
    if args.readme:
        print("\n".join(write_readme(BENCHMARKS, found)))
        print(f"wrote the table into {README}")
        return 0
    return sit(chosen, args, found)


def sit(chosen: list[Benchmark], args, found: dict) -> int:
    started = datetime.now(timezone.utc).replace(microsecond=0)
    out = Path(args.out or RESULTS / f"sitting_{started.strftime('%Y%m%d-%H%M')}.json")
    work = Path(args.work or tempfile.mkdtemp(prefix="sitting-", dir="/tmp"))
    work.mkdir(parents=True, exist_ok=True)
    commit = git("rev-parse", "--short", "HEAD").strip()
    report = {"benchmark": "sitting", "time": started.isoformat(), "commit": commit,
              "dirty": bool(git("status", "--porcelain", "--untracked-files=no").strip()),
              "machine": {"cpu_count": os.cpu_count(), "loadavg_before": os.getloadavg()},
              "work": str(work), "runs": {}}
    print(f"sitting of {len(chosen)} forms at {commit}, ~{sum(b.expected_min for b in chosen):g} min expected; "
          f"raw results and logs in {work}", flush=True)
    for i, b in enumerate(chosen, 1):
        timeout_s = 60 * (args.timeout_min or b.timeout_min)
        print(f"[{i}/{len(chosen)}] {b.name}: {b.shown()}", flush=True)
        try:
            run = run_benchmark(b, work, timeout_s)
        except Exception as e:  # the sitting's own fault (a log it cannot write, a script it cannot start)
            run = {"form": list(b.args), "command": b.command(), "figures": {}, "wall_s": 0.0,
                   "status": f"not run: {type(e).__name__}: {e}"}
        report["runs"][b.name] = run
        print(f"    {run['status']} in {run['wall_s'] / 60:.1f} min", flush=True)
        common.write_report(str(out), report)  # kept after each form: a sitting cut short keeps what it ran
    rows = sitting_rows(chosen, report, found, out.name)
    lines = table(rows)
    report["machine"]["loadavg_at_end"] = os.getloadavg()
    report["table"] = lines
    common.write_report(str(out), report)
    print("\n".join(lines))
    flagged = worse_or_missing(rows)
    print(f"{len(flagged)} figures worse beyond noise or missing" if flagged else "no figure worse beyond noise")
    print(f"the README's table: .venv/bin/python benchmarks/sitting.py --readme --from-results {out}")
    return 1 if flagged else 0


if __name__ == "__main__":
    sys.exit(main())
