"""train.compile: torch.compile of the model's blocks gives the eager run's numbers (to float
tolerance: the compiled kernels sum in another order) and reports its compile time."""

from __future__ import annotations

import pytest
import torch

from raytrain_sys.control.supervisor import run_job
from tests.helpers import final_params, read_summary, tiny_spec

pytestmark = pytest.mark.warm_workers  # passes on warm spares too: RTS_TESTS_WARM_WORKERS=1 (conftest.py)


def test_compiled_run_equals_eager(ray_cluster, tiny_dataset, tmp_path):
    def spec(compile_model: bool):
        return tiny_spec(tmp_path / str(compile_model), tiny_dataset,
                         train={"max_steps": 6, "compile": compile_model},
                         resources={"num_workers": 2}, tracking={"enabled": False})

    eager, compiled = run_job(spec(False)), run_job(spec(True))
    assert eager.status == compiled.status == "finished"
    torch.testing.assert_close(torch.tensor(compiled.losses), torch.tensor(eager.losses), rtol=1e-4, atol=1e-5)
    a, b = final_params(eager.newest_checkpoint), final_params(compiled.newest_checkpoint)
    assert a.keys() == b.keys()  # Module.compile keeps the parameter names: checkpoints unchanged
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-3, atol=1e-5)
    summary = read_summary(compiled.run_dir)
    assert summary["compile_s"] > 0.5, summary["compile_s"]  # inductor needs seconds, eager none
