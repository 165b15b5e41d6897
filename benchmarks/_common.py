"""What the benchmark scripts share around their measurements: argument checks and set-up."""

from __future__ import annotations

import argparse
import logging
import tempfile


def pick(p: argparse.ArgumentParser, value: str, allowed, flag: str) -> list[str]:
    """A comma list of names, each one of ``allowed``; an unknown one is a usage error."""
    names = [v.strip() for v in value.split(",") if v.strip()]
    unknown = set(names) - set(allowed)
    if unknown:
        p.error(f"unknown {flag} {', '.join(sorted(unknown))}; allowed: {', '.join(allowed)}")
    return names


def start(verbose: bool, log: logging.Logger, prefix: str) -> str:
    """Logging as asked, and a private work dir for the run."""
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(asctime)s %(name)s: %(message)s")
    log.setLevel(logging.INFO)
    # Short and under /tmp: Ray's unix socket paths must stay under 107 characters.
    return tempfile.mkdtemp(prefix=prefix, dir="/tmp")
