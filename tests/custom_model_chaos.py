"""Run from examples/custom_model's directory (a copy of it) by test_example_custom_model.py: the
example's job at one worker, then at two with a worker killed and the group shrunk and grown;
prints one JSON line with what the test checks. A driver of its own, so that its working directory
(the user's code) is on the workers' path, as for any user's driver."""

from __future__ import annotations

import json
import sys

import raytrain_sys as rts
from tests.ft_common import kill_soon, run_with_events, worker_pid
from tests.helpers import final_params, read_summary


def main(out: str) -> None:
    common = [f"output_dir={out}", "train.max_steps=14", "train.precision=fp64", "train.steps_per_call=1",
              "checkpoint.every_steps=5", "eval.every_steps=7", "elastic.hang_floor_s=4",
              "tracking.enabled=false"]
    reference = rts.run("job.yaml", common + ["resources.num_workers=1"])
    spec = rts.load_spec("job.yaml", common + ["resources.num_workers=2", "elastic.max_workers=3"])
    result, _, _ = run_with_events(spec, {
        3: lambda s: kill_soon(worker_pid(s, 1)),
        6: lambda s: s.requests.resize(1, "test shrink"),
        9: lambda s: s.requests.resize(3, "test grow"),
    })
    a, b = final_params(reference.newest_checkpoint), final_params(result.newest_checkpoint)
    diff = max(float(((a[k] - b[k]).abs() / a[k].abs().clamp_min(1e-12)).max()) for k in a)
    summary, ref_summary = read_summary(result.run_dir), read_summary(reference.run_dir)
    print(json.dumps({"statuses": [reference.status, result.status], "keys_equal": a.keys() == b.keys(),
                      "max_rel_diff": diff, "failures": summary["failures"],
                      "world_sizes": sorted({w for w in summary["world_sizes"] if w}),
                      "evals": [summary["evals"], ref_summary["evals"]]}))


if __name__ == "__main__":
    main(sys.argv[1])
