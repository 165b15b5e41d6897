"""The package's top is the public API: every name resolves, and importing the package imports
nothing heavy (a notebook or the CLI pays for torch, Ray and MLflow only when it uses them)."""

from __future__ import annotations

import subprocess
import sys

import raytrain_sys as rts


def test_import_is_cheap():
    code = ("import sys, raytrain_sys as rts; spec = rts.load_spec('jobs/tinygpt.yaml'); "
            "heavy = [m for m in ('torch', 'ray', 'mlflow') if m in sys.modules]; "
            "assert not heavy, heavy")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=rts.__path__[0] + "/..")


def test_every_public_name_resolves():
    for name in rts.__all__:
        assert getattr(rts, name) is not None, name
    assert rts.run.__module__ == "raytrain_sys.api" and rts.Client.__name__ == "Client"
    assert set(rts.__all__) <= set(dir(rts))
