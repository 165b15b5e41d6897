"""The plots people look at after (or during) a run, drawn from its ``summary.json`` as PNGs.

Owns: which figures a run gets and how each is drawn. Each is a function of the summary's plain
dict (``RunSummary`` as written to disk), so the same code serves ``raytrain-sys report`` on a
finished run dir, the Tracker's background writes (at the first checkpoint, then at most every
30 s, and at the end), and a notebook. A figure whose records are absent (a run from before
``step_times``, a branch without per-rank timings) is left out rather than drawn empty:

* ``loss.png``: training loss per committed step, evaluations as points.
* ``throughput.png``: tokens/s per step (from ``step_times``; the tokens of a step are
  ``throughput.tokens_per_s * throughput.step_time_s``) with a rolling mean.
* ``world_size.png``: workers per step, with failures and resizes marked at their steps.
* ``rank_breakdown.png``: each rank's mean step split into data wait, compute, collective wait
  and optimizer (``rank_times``), and a heat map of each rank's step time over the run
  (``rank_times_history``): a slow rank is a bright row.

A sweep's parent run gets one more, from its trials' table rather than a summary:
``sweep_curves.png`` (``sweep_curves_figure``), every trial's curve of the sweep's metric.

Drawn with matplotlib's object API (``Figure``, no pyplot: no global figure state, and a PNG is
rendered by Agg whatever backend a notebook chose). While a run trains they are drawn in a child
process (``write_plots_apart``; one a process, kept between redraws): drawn on a thread of the
driver, they would hold its GIL for a second or more a redraw and slow its step loop meanwhile by
about half (``benchmarks/plots_overhead.py``).
"""

from __future__ import annotations

import contextlib
import math
import os
import pickle
import select
import struct
import subprocess
import sys
import threading
import time
from typing import Any, Callable

PARTS = ("data_wait_s", "compute_s", "collective_s", "optimizer_s")  # one step on one rank, in order
PART_LABELS = {"data_wait_s": "data wait", "compute_s": "compute", "collective_s": "collective wait",
               "optimizer_s": "optimizer"}
# States a run enters because something happened to its workers: marked on the world-size plot.
MARKED_STATES = {"rebuilding": "tab:red", "restoring": "tab:red", "resizing": "tab:green",
                 "draining": "tab:orange", "waiting": "tab:gray"}
MAX_POINTS = 2000  # a line gets at most this many points (bucket means): 100k raw points take seconds to draw
DRAW_TIMEOUT_S = 300.0  # a child drawing 100k-step plots takes about 2 s; one stuck is ended
SIZE_IN = (7.0, 3.2)  # a figure's size in inches at DPI: 700x320 pixels, readable in a notebook cell
DPI = 100


def _figure(height_in: float = SIZE_IN[1]):
    from matplotlib.figure import Figure

    return Figure(figsize=(SIZE_IN[0], height_in), dpi=DPI, layout="constrained")


def _known(values: list) -> tuple[list[int], list[float]]:
    """(steps, values) of the entries recorded (not None, not NaN); step = index + 1."""
    steps, ys = [], []
    for i, v in enumerate(values or []):
        if v is not None and not (isinstance(v, float) and math.isnan(v)):
            steps.append(i + 1)
            ys.append(float(v))
    return steps, ys


def _binned(steps: list[int], ys: list[float], max_points: int = MAX_POINTS) -> tuple[list[float], list[float]]:
    """At most ``max_points`` (step, value) pairs: the mean of each run of consecutive points
    (the figure is 700 pixels wide; more points only cost drawing time)."""
    every = -(-len(steps) // max_points)
    if every <= 1:
        return steps, ys
    xs, means = [], []
    for i in range(0, len(steps), every):
        chunk = ys[i:i + every]
        xs.append(sum(steps[i:i + every]) / len(chunk))
        means.append(sum(chunk) / len(chunk))
    return xs, means


def _changes(steps: list[int], ys: list[float]) -> tuple[list[int], list[float]]:
    """The points where the value changes (and the last): the same step plot, drawn exactly."""
    keep = [i for i in range(len(ys)) if i == 0 or i == len(ys) - 1 or ys[i] != ys[i - 1]]
    return [steps[i] for i in keep], [ys[i] for i in keep]


def _rolling_mean(ys: list[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, y in enumerate(ys):
        total += y
        if i >= window:
            total -= ys[i - window]
        out.append(total / min(i + 1, window))
    return out


def loss_figure(summary: dict):
    steps, losses = _known(summary.get("losses"))
    if not steps:
        return None
    fig = _figure()
    ax = fig.add_subplot()
    ax.plot(*_binned(steps, losses), color="tab:blue", linewidth=1.2, label="train")
    evals = [(e["step"], e["loss"]) for e in summary.get("evals") or [] if "loss" in e]
    if evals:
        ax.plot(*zip(*evals), "o", color="tab:orange", label="eval")
        ax.legend(loc="upper right")
    ax.set(xlabel="step", ylabel="loss", title=f"{summary.get('job', '')}: loss")
    ax.grid(alpha=0.3)
    return fig


def tokens_per_step(summary: dict) -> float:
    """Tokens a step trains, from the throughput record (0 when not yet written)."""
    tp = summary.get("throughput") or {}
    return float(tp.get("tokens_per_s", 0.0)) * float(tp.get("step_time_s", 0.0))


def throughput_figure(summary: dict):
    steps, dts = _known(summary.get("step_times"))
    tokens = tokens_per_step(summary)
    if not steps or not tokens:
        return None
    rates = [tokens / dt if dt > 0 else 0.0 for dt in dts]
    fig = _figure()
    ax = fig.add_subplot()
    ax.plot(*_binned(steps, rates), color="tab:green", alpha=0.35, linewidth=1, label="per step")
    ax.plot(*_binned(steps, _rolling_mean(rates, 10)), color="tab:green", linewidth=1.8, label="mean of 10")
    ax.set(xlabel="step", ylabel="tokens/s", title=f"throughput ({tokens:,.0f} tokens a step)")
    ax.set_ylim(bottom=0)
    ax.legend(loc="lower right")
    ax.grid(alpha=0.3)
    return fig


def world_size_figure(summary: dict):
    steps, sizes = _known(summary.get("world_sizes"))
    if not steps:
        return None
    fig = _figure(2.6)
    ax = fig.add_subplot()
    ax.step(*_changes(steps, sizes), where="post", color="tab:purple", linewidth=1.8)
    seen = set()
    for t in summary.get("transitions") or []:
        color = MARKED_STATES.get(t.get("state"))
        if color is None or not t.get("step"):
            continue
        label = t["state"] if t["state"] not in seen else None
        seen.add(t["state"])
        ax.axvline(t["step"], color=color, linestyle="--", linewidth=1, label=label)
    if seen:
        ax.legend(loc="lower right", fontsize=8)
    ax.set(xlabel="step", ylabel="workers", title="world size")
    ax.set_ylim(0, max(sizes) + 1)
    ax.yaxis.get_major_locator().set_params(integer=True)
    ax.grid(alpha=0.3)
    return fig


def _ranks(table: dict) -> list[str]:
    return sorted(table, key=lambda r: int(r) if str(r).isdigit() else r)


def rank_breakdown_figure(summary: dict):
    rank_times = summary.get("rank_times") or {}
    history = [h for h in summary.get("rank_times_history") or [] if h.get("ranks")]
    if not rank_times and not history:
        return None
    panels = int(bool(rank_times)) + int(bool(history))
    fig = _figure(2.4 + 1.6 * panels)
    axes = fig.subplots(panels, 1, squeeze=False)[:, 0]
    if rank_times:
        ax = axes[0]
        ranks = _ranks(rank_times)
        left = [0.0] * len(ranks)
        for part, color in zip(PARTS, ("tab:gray", "tab:blue", "tab:red", "tab:olive")):
            widths = [float(rank_times[r].get(part) or 0.0) * 1000 for r in ranks]
            ax.barh(ranks, widths, left=left, color=color, label=PART_LABELS[part])
            left = [a + b for a, b in zip(left, widths)]
        ax.set(xlabel="ms per step (recent mean)", ylabel="rank", title="step breakdown per rank")
        ax.invert_yaxis()
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    if history:
        ax = axes[-1]
        ranks = _ranks({r: None for h in history for r in h["ranks"]})
        grid = [[float((h["ranks"].get(r) or {}).get("step_s") or math.nan) * 1000 for h in history]
                for r in ranks]
        steps = [h["step"] for h in history]
        image = ax.imshow(grid, aspect="auto", cmap="magma", interpolation="nearest",
                          extent=(steps[0] - 0.5, steps[-1] + 0.5, len(ranks) - 0.5, -0.5))
        ax.set_yticks(range(len(ranks)), ranks)
        ax.set(xlabel="step", ylabel="rank", title="step time per rank (ms)")
        fig.colorbar(image, ax=ax)
    return fig


LEGEND_TRIALS = 12  # a sweep's figure names its trials in a legend up to this many; past it, only the best


def sweep_curves_figure(table: list[dict], metric: str, best_trial: str | None = None):
    """A sweep's trials on one figure: each trial's curve of ``metric`` as its job logged it
    (``sweeps.outcome.trial_table`` rows: ``trial``, ``state``, ``curve`` as (step, value)
    pairs), the best trial drawn bold, trials that did not finish dashed (stopped early by
    the scheduler, cancelled, failed). None when no trial logged a value."""
    rows = [r for r in table if r.get("curve")]
    if not rows:
        return None
    fig = _figure()
    ax = fig.add_subplot()
    for row in rows:
        steps, values = zip(*row["curve"])
        best = row["trial"] == best_trial
        label = (f"{row['trial']} (best)" if best else str(row["trial"])) if (
            best or len(rows) <= LEGEND_TRIALS) else None
        ax.plot(steps, values, marker="o", markersize=3, label=label,
                linewidth=2.4 if best else 1.0, alpha=1.0 if best else 0.7,
                linestyle="-" if row.get("state") == "finished" else "--", zorder=3 if best else 2)
    ax.set(xlabel="step", ylabel=metric, title=f"{metric} per trial ({len(rows)} trials; dashed: ended early)")
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize="small")
    return fig


FIGURES: dict[str, Callable[[dict], Any]] = {
    "loss.png": loss_figure,
    "throughput.png": throughput_figure,
    "world_size.png": world_size_figure,
    "rank_breakdown.png": rank_breakdown_figure,
}


def write_plots(summary: dict, out_dir: str) -> list[str]:
    """Draw every figure the summary has records for into ``out_dir``; the paths written."""
    os.makedirs(out_dir, exist_ok=True)
    written = []
    for name, draw in FIGURES.items():
        fig = draw(summary)
        if fig is None:
            continue
        path = os.path.join(out_dir, name)
        fig.savefig(path)
        written.append(path)
    return written


class _Drawer:
    """The child Python process that draws this process's redraws (``write_plots_apart``), one at
    a time: started at the first, kept for the next, so that its imports (matplotlib: about half
    of a redraw's second) are paid once a process and not once a redraw; started again when it
    died, and ended when a redraw outlives its timeout. It reads requests on its stdin and ends
    when that closes (this process ended, however it ended)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._pid = os.getpid()  # a forked copy of this process starts a child of its own

    def draw(self, summary: dict, out_dir: str, timeout_s: float) -> list[str]:
        request = pickle.dumps((summary, out_dir), protocol=pickle.HIGHEST_PROTOCOL)
        with self._lock:
            proc = self._running()
            deadline = time.monotonic() + timeout_s
            try:
                proc.stdin.write(struct.pack("<Q", len(request)) + request)
                proc.stdin.flush()
                reply = _read_message(proc.stdout.fileno(), deadline)
            except (OSError, ValueError):  # a broken pipe: the child died before the request
                reply = b""
            if not reply:
                self._end()
                why = (f"no plots within {timeout_s:g} s" if reply is None else
                       f"the drawing process ended (exit status {proc.returncode})")
                raise RuntimeError(f"drawing the plots failed: {why}")
        ok, payload = pickle.loads(reply)
        if not ok:
            raise RuntimeError(f"drawing the plots failed: {payload}")
        return payload

    def _running(self) -> subprocess.Popen:
        if self._pid != os.getpid():
            self._proc, self._pid = None, os.getpid()
        if self._proc is None or self._proc.poll() is not None:
            package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
            env = os.environ | {"PYTHONPATH": os.pathsep.join(
                filter(None, [package_root, os.environ.get("PYTHONPATH")]))}
            self._proc = subprocess.Popen([sys.executable, "-m", "raytrain_sys.monitor.plots", "--serve"],
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                          stderr=subprocess.DEVNULL, env=env, close_fds=True)
        return self._proc

    def _end(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            for pipe in (self._proc.stdin, self._proc.stdout):
                with contextlib.suppress(OSError):
                    pipe.close()
            self._proc = None


def _read_message(fd: int, deadline: float | None) -> bytes | None:
    """One length-prefixed message from ``fd``; b"" at end of file, None past ``deadline``."""
    header = _read_exact(fd, 8, deadline)
    if not header:
        return header
    return _read_exact(fd, struct.unpack("<Q", header)[0], deadline)


def _read_exact(fd: int, n: int, deadline: float | None) -> bytes | None:
    chunks, got = [], 0
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
        chunk = os.read(fd, n - got)
        if not chunk:
            return b""
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


_DRAWER = _Drawer()


def write_plots_apart(summary: dict, out_dir: str, timeout_s: float = DRAW_TIMEOUT_S) -> list[str]:
    """``write_plots`` in this process's drawing child (``python -m raytrain_sys.monitor.plots
    --serve``, kept between redraws): the caller only pickles the summary and waits with its GIL
    released. Raises RuntimeError with the child's error when it fails."""
    os.makedirs(out_dir, exist_ok=True)
    return _DRAWER.draw(summary, out_dir, timeout_s)


def _serve() -> None:
    """The drawing child: a (summary, out_dir) request on stdin at a time, (ok, paths or the
    error's last line) on stdout; ends when stdin closes."""
    stdin = sys.stdin.buffer.fileno()
    stdout = os.fdopen(os.dup(sys.stdout.fileno()), "wb")  # the replies' own; print() goes to stderr
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    while True:
        request = _read_message(stdin, None)
        if not request:
            return
        try:
            summary, out_dir = pickle.loads(request)
            reply = (True, write_plots(summary, out_dir))
        except Exception as exc:  # noqa: BLE001: the caller raises it
            reply = (False, f"{type(exc).__name__}: {exc}".splitlines()[0])
        data = pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL)
        stdout.write(struct.pack("<Q", len(data)) + data)
        stdout.flush()


if __name__ == "__main__":  # write_plots_apart's child: python -m raytrain_sys.monitor.plots --serve
    _serve()
