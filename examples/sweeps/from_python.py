"""A sweep from Python: read tinygpt_asha.yaml, change it in Python, submit it to the job service,
follow its trials, and print its best (docs/SWEEPS.md).

The service is the one the README's "The job service" starts (its URL and token in
RAYTRAIN_SYS_SERVICE_URL and RAYTRAIN_SYS_TOKEN):

    python examples/sweeps/from_python.py --team research              # the example as it is: 6 trials
    python examples/sweeps/from_python.py --team research --small      # 4 short trials of a smaller GPT

Relative paths in the base spec (data.path, output_dir) are the service's, from its directory.
"""

from __future__ import annotations

import argparse
import os
import time

import raytrain_sys as rts
from raytrain_sys.service.sweeps.spec import load_sweep_file

HERE = os.path.dirname(os.path.abspath(__file__))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--team", required=True)
    p.add_argument("--small", action="store_true", help="4 trials of 40 steps of a 2-layer GPT (a try-out)")
    args = p.parse_args()
    sweep = load_sweep_file(os.path.join(HERE, "tinygpt_asha.yaml"))  # a mapping: its base read from its file
    if args.small:
        sweep["base"]["model"].update(n_layer=2, n_embd=64)
        sweep["base"]["train"].update(max_steps=40, global_batch_size=8)
        sweep["base"]["eval"].update(every_steps=10, max_rows=64)
        sweep["base"]["checkpoint"]["every_steps"] = 10
        sweep["base"]["optim"]["warmup_steps"] = 5
        sweep["scheduler"]["grace_period_steps"] = 10
        sweep["num_samples"] = 2  # times the 2 weight decays: 4 trials
    client = rts.Client.from_env()
    record = client.submit_sweep(sweep, team=args.team)  # refused here (a ServiceRequestInvalid) if wrong
    print(f"sweep {record['id']}: {record['name']}, state {record['state']}")
    while record["state"] not in ("finished", "failed", "cancelled"):
        time.sleep(5)
        record = client.sweep(record["id"])
        trials = record["trials"] or []
        print(f"  {record['state']}: " + ", ".join(f"{t['trial_id']} {t['state']} rung {t['rung']}" for t in trials))
    print(f"sweep {record['id']} {record['state']}: best trial {record['best_trial']}, "
          f"{record['spec']['metric']} {record['best_value']}")
    return 0 if record["state"] == "finished" else 1


if __name__ == "__main__":
    raise SystemExit(main())
