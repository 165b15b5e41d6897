"""Progress display: a live bar on a terminal, plain log lines otherwise."""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from raytrain_sys.control.supervisor import StepReport


def _fmt_eta(seconds: float) -> str:
    if seconds != seconds or seconds == float("inf"):  # unknown (no step time yet)
        return "?"
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


class Progress:
    def __init__(self, log_every_steps: int, stream=sys.stderr):
        self.stream = stream
        self.tty = stream.isatty()
        self.log_every = log_every_steps
        self.last_draw = 0.0

    def __call__(self, r: StepReport) -> None:
        line = (f"step {r.step}/{r.max_steps}  loss {r.loss:.4f}  lr {r.lr:.2e}  "
                f"{r.tokens_per_s:,.0f} tok/s  {r.step_time_s * 1000:.0f} ms/step  "
                f"world {r.world_size}  eta {_fmt_eta(r.eta_s)}")
        if self.tty:
            now = time.monotonic()
            if now - self.last_draw < 0.1 and r.step != r.max_steps:
                return
            self.last_draw = now
            width = 24
            done = int(width * r.step / r.max_steps)
            bar = "#" * done + "-" * (width - done)
            self.stream.write(f"\r[{bar}] {line}\x1b[K")
            if r.step == r.max_steps:
                self.stream.write("\n")
            self.stream.flush()
        elif r.step % self.log_every == 0 or r.step == r.max_steps:
            print(line, file=self.stream, flush=True)
