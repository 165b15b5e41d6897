"""What the per-rank step breakdown costs: DDP forward+backward with the timing comm hook
(raytrain_sys.parallel.timing, what training runs) against DDP's built-in all-reduce, in one
invocation.

Two gloo ranks (processes on this machine) train the same GPT on the same rows; each round times
``--steps`` steps with the hook and as many without, in alternating order (so that the machine's
drift cancels out), on two identical models. Prints the median over rounds of the
ratio within a round (hook / built-in step time); 1.00 means no cost.

    .venv/bin/python benchmarks/step_breakdown.py
    .venv/bin/python benchmarks/step_breakdown.py --rounds 9 --steps 20 --n-embd 256

Results go to benchmarks/results/step_breakdown.json (``--out`` to write elsewhere).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import _common as common


def _rank(rank: int, world: int, port: int, args, out) -> None:
    from raytrain_sys.models import build_gpt
    from raytrain_sys.parallel.fsdp import apply_ddp
    from raytrain_sys.parallel.timing import StepClock
    from raytrain_sys.spec import ModelSpec

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    spec = ModelSpec(block_size=args.block, n_layer=args.n_layer, n_head=4, n_embd=args.n_embd)
    clock = StepClock()
    wraps = {}
    for name in ("hook", "builtin"):  # two copies of one model: a module is wrapped by one DDP
        torch.manual_seed(0)
        wraps[name] = apply_ddp(build_gpt(spec), mesh, "cpu", clock=clock if name == "hook" else None)
    rows = torch.randint(0, 256, (args.rows, args.block + 1))

    def steps(name: str) -> float:
        ddp = wraps[name]
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            clock.start()
            logits = ddp(rows[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), rows[:, 1:].flatten())
            loss.backward()
            clock.split()
            ddp.zero_grad(set_to_none=True)
        return (time.perf_counter() - t0) / args.steps

    steps("hook"), steps("builtin")  # warm-up: buckets built, allocator grown
    ratios = []
    for r in range(args.rounds):
        order = ("hook", "builtin") if r % 2 == 0 else ("builtin", "hook")
        t = {name: steps(name) for name in order}
        ratios.append(t["hook"] / t["builtin"])
    if rank == 0:
        out.put(ratios)
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--block", type=int, default=64)
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "step_breakdown.json"))
    args = p.parse_args()
    loadavg = os.getloadavg()
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, 2, port, args, out)) for r in range(2)]
    for proc in procs:
        proc.start()
    ratios = out.get()
    for proc in procs:
        proc.join()
    print(f"step time with the timing hook / DDP's built-in all-reduce, per round: "
          f"{' '.join(f'{r:.3f}' for r in ratios)}")
    print(f"median {statistics.median(ratios):.3f}x over {len(ratios)} rounds of {args.steps} steps")
    common.write_report(args.out, common.report_head("step_breakdown", False, loadavg) | {
        "args": {k: v for k, v in vars(args).items() if k != "out"}, "ratios": ratios,
        "median": statistics.median(ratios)})


if __name__ == "__main__":
    main()
