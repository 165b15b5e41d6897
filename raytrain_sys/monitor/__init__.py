"""Watching a run: a live view for notebooks (the CLI's terminal bar lives in raytrain_sys.cli),
Prometheus metrics through Ray (``metrics``) and what a run costs (``cost``)."""

from raytrain_sys.monitor.live import LiveView

__all__ = ["LiveView"]
