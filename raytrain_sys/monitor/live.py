"""A live view of a run for notebooks: pass it as ``on_step`` to ``run_job`` or ``resume_job``.

    from raytrain_sys.monitor import LiveView
    result = run_job(spec, on_step=LiveView())

In Jupyter it redraws one output area (a table of the newest step and a loss curve) at most
``min_interval_s`` apart; anywhere else it prints a line every ``log_every_steps`` steps. It only
reads the Supervisor's step reports, so it cannot slow or break training: a drawing error is
logged once and the view goes quiet.
"""

from __future__ import annotations

import html
import logging
import time

log = logging.getLogger(__name__)


def _in_notebook() -> bool:
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and shell.__class__.__name__ == "ZMQInteractiveShell"


def _fmt_eta(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


def loss_curve_svg(losses: list[float], width: int = 360, height: int = 90) -> str:
    """An inline SVG polyline of the losses (no plotting library needed in the kernel)."""
    points = [x for x in losses if x is not None]
    if len(points) < 2:
        return ""
    lo, hi = min(points), max(points)
    span = (hi - lo) or 1.0
    xs = [i * (width - 8) / (len(points) - 1) + 4 for i in range(len(points))]
    ys = [height - 4 - (v - lo) / span * (height - 8) for v in points]
    path = " ".join(f"{x:.1f},{y:.1f}" for x, y in zip(xs, ys))
    return (f'<svg width="{width}" height="{height}" style="border:1px solid #ddd">'
            f'<polyline fill="none" stroke="#1f77b4" stroke-width="1.5" points="{path}"/>'
            f'<text x="6" y="14" font-size="11">{hi:.3f}</text>'
            f'<text x="6" y="{height - 6}" font-size="11">{lo:.3f}</text></svg>')


class LiveView:
    """Callable ``on_step`` hook: keeps the step history and redraws it."""

    def __init__(self, log_every_steps: int = 10, min_interval_s: float = 0.5):
        self.log_every_steps = log_every_steps
        self.min_interval_s = min_interval_s  # redraws cost the kernel; twice a second is live enough
        self.losses: list[float] = []
        self.world_sizes: list[int] = []
        self._handle = None
        self._last_draw = 0.0
        self._broken = False
        self._notebook = _in_notebook()

    def __call__(self, report) -> None:
        self.losses.append(report.loss)
        self.world_sizes.append(report.world_size)
        if self._broken:
            return
        try:
            if self._notebook:
                self._draw(report)
            elif report.step % self.log_every_steps == 0 or report.step == report.max_steps:
                print(self.text(report), flush=True)
        except Exception as exc:  # a view must never stop a run
            self._broken = True
            log.warning("live view disabled: %s", exc)

    @staticmethod
    def text(r) -> str:
        return (f"step {r.step}/{r.max_steps}  loss {r.loss:.4f}  lr {r.lr:.2e}  "
                f"{r.tokens_per_s:,.0f} tok/s  {r.step_time_s * 1000:.0f} ms/step  "
                f"world {r.world_size}  eta {_fmt_eta(r.eta_s)}")

    def html(self, r) -> str:
        done = r.step / max(r.max_steps, 1)
        bar = (f'<div style="width:360px;background:#eee"><div style="width:{done * 100:.1f}%;'
               f'background:#4caf50;height:8px"></div></div>')
        return f"<div><code>{html.escape(self.text(r))}</code>{bar}{loss_curve_svg(self.losses)}</div>"

    def _draw(self, r) -> None:
        from IPython.display import HTML, display

        now = time.monotonic()
        if now - self._last_draw < self.min_interval_s and r.step != r.max_steps:
            return
        self._last_draw = now
        if self._handle is None:
            self._handle = display(HTML(self.html(r)), display_id=True)
        else:
            self._handle.update(HTML(self.html(r)))
