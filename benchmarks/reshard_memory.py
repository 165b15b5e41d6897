"""Peak resident memory per rank while an FSDP job resizes, against the rank's steady state (issue 17).

One invocation runs one job on a private local Ray cluster (4 CPUs): a GPT with about 200 MB of
training state (fp32 parameters and AdamW's two moments) under FSDP, started on 2 workers
(the run's ceiling at 2, as the job service sets it), grown to 4 at a step boundary (2 newcomers
take their blocks from the members) and shrunk back to 2 later (the 2 leavers hand their shards
over through the object store). A thread in the driver samples every worker process's memory every 10 ms
from /proc: RSS, and RssAnon (its private memory, without the pages of Ray's shared object
store it maps). The workers run with glibc's mmap threshold fixed at 64 KB
(MALLOC_MMAP_THRESHOLD_): every tensor of any size is then mapped on its own and returned on
free, so RSS follows the memory in use instead of keeping the high-water mark of a resize.

Per rank and resize:
  steady    the most it used while training at the world before, and at the world after, the
            first step after each change left out;
  peak      the most it used from the last step at the old world to the first at the new one;
  ratio     peak / the larger of the two steadies: the memory a rank must have to survive the
            resize, against what it needs to train anyway. Goal (issue 17): at most 1.5x.
  state ratio  the same above the process's base (its least, before its model was built:
            Python, torch, Ray; about 400 MB of RSS here): what the state and its moving cost,
            which the base hides in the ratio of a model this small. The headline is RssAnon's:
            RSS also counts the object store's shared pages a worker has touched (batches and
            moving pieces, node memory counted once, not the rank's), and those stay mapped, so
            RSS creeps up across the run in every variant.

With ``--before REV`` the same job also runs on the code of commit REV (``git archive`` of
``raytrain_sys`` into a temp dir, its own Ray cluster): the path that assembled the full state
on every rank, for comparison in the same invocation. That code only grows: its shrink killed
the leavers before their pieces were stored, and the rebuild failed (fixed with this change).

    .venv/bin/python benchmarks/reshard_memory.py                 # ~2 min on 2 cores
    .venv/bin/python benchmarks/reshard_memory.py --before e8188ef  # and today's-path figures, ~4 min

Results go to benchmarks/results/reshard_memory.json (``--out`` to write elsewhere).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
MB = 2**20
SAMPLE_S = 0.01
# ~17 M parameters: 200 MB of fp32 parameters and AdamW moments, 50 MB a rank at world 4.
MODEL = {"n_layer": 5, "n_head": 8, "n_embd": 512, "block_size": 32}
STEPS = 13
GROW_AT, SHRINK_AT = 3, 8  # steps committed when the ceiling goes to 4, then back to 2

log = logging.getLogger("reshard_memory")


def _status_kb(pid: int) -> dict[str, int]:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon"):
                out[key] = int(value.split()[0]) * 1024
    return out


class Sampler(threading.Thread):
    """Memory of the job's worker processes over time: (t, pid, rss, anon) every SAMPLE_S."""

    def __init__(self, sup):
        super().__init__(daemon=True)
        self.sup, self.samples, self.stopped = sup, [], threading.Event()

    def run(self) -> None:
        while not self.stopped.is_set():
            t = time.monotonic()
            group = getattr(self.sup, "group", None)
            workers = list(group.workers) + list(group.pending) + list(group.standby) if group else []
            for w in workers:
                pid = (w.info or {}).get("pid")
                if pid is None:
                    continue
                try:
                    kb = _status_kb(pid)
                except (FileNotFoundError, ProcessLookupError):
                    continue
                if "VmRSS" not in kb:  # a process exiting: its memory is gone
                    continue
                self.samples.append((t, pid, kb["VmRSS"], kb.get("RssAnon", 0)))
            time.sleep(SAMPLE_S)


def run_child(out_path: str, workdir: str, shrink: bool) -> None:
    """One job on a private cluster; writes the raw samples and step times to ``out_path``."""
    import ray

    from raytrain_sys.control.supervisor import Supervisor
    from raytrain_sys.data.prepare import prepare_text_dataset
    from raytrain_sys.spec import from_dict

    data = os.path.join(workdir, "data")
    prepare_text_dataset(data, row_len=MODEL["block_size"] + 1, rows_per_shard=512, max_bytes=400_000)
    spec = from_dict({
        "name": "reshard-memory", "output_dir": os.path.join(workdir, "runs"),
        "model": MODEL, "data": {"path": data, "shuffle_window": 256},
        "train": {"max_steps": STEPS if shrink else SHRINK_AT, "global_batch_size": 8,
                  "log_every_steps": 100, "steps_per_call": 1},
        "optim": {"lr": 1e-3, "warmup_steps": 2},
        "parallel": {"strategy": "fsdp"},
        "checkpoint": {"every_steps": 0, "keep_last": 1},
        "resources": {"num_workers": 2, "cpus_per_worker": 1, "start_timeout_s": 120},
        "elastic": {"min_workers": 2, "max_workers": 4},
        "tracking": {"experiment": "reshard-memory"},
    })
    ray.init(num_cpus=4, include_dashboard=False, _temp_dir=os.path.join(workdir, "ray"),
             logging_level=logging.WARNING)
    steps: list[tuple[float, int, int]] = []  # (time, step, world)
    newcomers: set[int] = set()
    leavers: set[int] = set()
    first: set[int] = set()

    def on_step(report) -> None:
        steps.append((time.monotonic(), report.step, report.world_size))
        members = [w.info["pid"] for w in sup.group.workers]
        (newcomers if report.step > GROW_AT else first).update(set(members) - first)
        if report.step == GROW_AT:
            sup.requests.resize(4, "benchmark grow")
        elif report.step == SHRINK_AT and shrink:
            leavers.update(members[2:])
            sup.requests.resize(2, "benchmark shrink")
        elif GROW_AT < report.step < SHRINK_AT and report.world_size == 2 and sup.group.pending:
            # Hold the loop until both newcomers are up: one resize 2 -> 4, not 2 -> 3 -> 4.
            ray.wait([w.ready_ref for w in sup.group.pending], num_returns=len(sup.group.pending),
                     timeout=120)

    sup = Supervisor(spec, on_step=on_step)
    sup.requests.resize(2, "benchmark start")  # no growing before GROW_AT
    sampler = Sampler(sup)
    sampler.start()
    try:
        result = sup.run()
    finally:
        sampler.stopped.set()
        sampler.join()
        ray.shutdown()
    with open(out_path, "w") as f:
        json.dump({"status": result.status, "steps": steps, "samples": sampler.samples,
                   "newcomers": sorted(newcomers), "leavers": sorted(leavers)}, f)


def analyse(raw: dict) -> list[dict]:
    """Per rank and resize: steady before and after, peak during, the ratio (see the docstring)."""
    steps = raw["steps"]
    changes = [i for i in range(1, len(steps)) if steps[i][2] != steps[i - 1][2]]
    rows = []
    for n, i in enumerate(changes):
        old, new = steps[i - 1][2], steps[i][2]
        before_lo = steps[changes[n - 1] + 1][0] if n else steps[1][0]  # first step left out
        before = (before_lo, steps[i - 1][0])
        during = (steps[i - 1][0], steps[i][0])
        after_end = steps[changes[n + 1] - 1][0] if n + 1 < len(changes) else steps[-1][0]
        after = (steps[min(i + 1, len(steps) - 1)][0], after_end)
        for pid in sorted({s[1] for s in raw["samples"]}):
            role = ("newcomer" if new > old and pid in raw["newcomers"] else
                    "leaver" if new < old and pid in raw["leavers"] else "member")

            def most(window, col):
                vals = [s[col] for s in raw["samples"] if s[1] == pid and window[0] <= s[0] <= window[1]]
                return max(vals) if vals else 0

            if not most(during, 2):
                continue
            row = {"resize": f"{old}->{new}", "pid": pid, "role": role}
            for col, name in ((2, "rss"), (3, "anon")):
                b, a, p = most(before, col), most(after, col), most(during, col)
                row.update({f"{name}_steady_before_mb": b / MB, f"{name}_steady_after_mb": a / MB,
                            f"{name}_peak_mb": p / MB,
                            f"{name}_ratio": p / max(b, a) if max(b, a) else None})
            for col, name in ((2, "rss"), (3, "anon")):
                base = min(s[col] for s in raw["samples"] if s[1] == pid) / MB
                steady = max(row[f"{name}_steady_before_mb"], row[f"{name}_steady_after_mb"])
                row[f"{name}_base_mb"] = base
                row[f"{name}_state_ratio"] = ((row[f"{name}_peak_mb"] - base) / (steady - base)
                                              if steady > base else None)
            rows.append(row)
    return rows


def run_variant(label: str, code_dir: Path, shrink: bool = True) -> dict:
    workdir = tempfile.mkdtemp(prefix="rts-rm-", dir="/tmp")
    out = os.path.join(workdir, "raw.json")
    env = {**os.environ, "PYTHONPATH": str(code_dir), "MALLOC_MMAP_THRESHOLD_": "65536"}
    t0 = time.monotonic()
    try:
        subprocess.run([sys.executable, __file__, "--child", out, "--workdir", workdir]
                       + ([] if shrink else ["--no-shrink"]), env=env, check=True, cwd=code_dir)
        with open(out) as f:
            raw = json.load(f)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    rows = analyse(raw)
    return {"variant": label, "status": raw["status"], "wall_s": time.monotonic() - t0,
            "world_sizes": [s[2] for s in raw["steps"]], "ranks": rows}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--before", default="", help="also run the code of this commit (today's path)")
    p.add_argument("--out", default=str(HERE / "results" / "reshard_memory.json"))
    p.add_argument("--child", default="", help=argparse.SUPPRESS)
    p.add_argument("--workdir", default="", help=argparse.SUPPRESS)
    p.add_argument("--no-shrink", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return run_child(args.child, args.workdir, shrink=not args.no_shrink)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    variants = []
    if args.before:
        old = Path(tempfile.mkdtemp(prefix="rts-rm-code-", dir="/tmp"))
        try:
            archive = subprocess.run(["git", "-C", str(REPO), "archive", args.before, "raytrain_sys"],
                                     check=True, capture_output=True).stdout
            subprocess.run(["tar", "-x", "-C", str(old)], input=archive, check=True)
            variants.append(run_variant(f"before ({args.before})", old, shrink=False))
        finally:
            shutil.rmtree(old, ignore_errors=True)
    variants.append(run_variant("by blocks", REPO))

    print(f"\n{'variant':<20} {'resize':<7} {'role':<9} {'RssAnon MB: base':>16} {'steady before/after':>20} "
          f"{'peak':>6} | {'ratio':>5} {'state ratio':>11} | {'RSS ratio':>9} {'RSS state':>9}")
    for v in variants:
        for r in v["ranks"]:
            print(f"{v['variant']:<20} {r['resize']:<7} {r['role']:<9} {r['anon_base_mb']:>16.0f} "
                  f"{r['anon_steady_before_mb']:>10.0f} /{r['anon_steady_after_mb']:>8.0f} "
                  f"{r['anon_peak_mb']:>6.0f} | {r['anon_ratio']:>5.2f} {r['anon_state_ratio']:>11.2f} | "
                  f"{r['rss_ratio']:>9.2f} {r['rss_state_ratio']:>9.2f}")
        for key in ("rss_ratio", "rss_state_ratio", "anon_ratio", "anon_state_ratio"):
            v[f"worst_{key}"] = max((r[key] for r in v["ranks"] if r[key] is not None), default=None)
        print(f"{v['variant']}: worst peak/steady {v['worst_anon_ratio']:.2f}, above the base "
              f"{v['worst_anon_state_ratio']:.2f} (RssAnon; RSS: {v['worst_rss_ratio']:.2f}, "
              f"{v['worst_rss_state_ratio']:.2f}); goal <= 1.5; world sizes {v['world_sizes']}; "
              f"{v['wall_s']:.0f} s\n")
    results = Path(args.out)
    results.write_text(json.dumps({"model": MODEL, "steps": STEPS, "variants": variants}, indent=1) + "\n")
    print(f"wrote {results}")


if __name__ == "__main__":
    main()
