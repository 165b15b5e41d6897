"""Throughput and per-rank memory of every parallel strategy, in one run.

Each strategy trains the same GPT on the same random global batches for ``--steps`` steps on
its own group of gloo (CPU) or NCCL (CUDA) ranks, through ``raytrain_sys.parallel.parallelize``:
the path the worker takes. Reported per strategy:

  tokens/s       global_batch * block_size * measured steps / their summed wall time (the
                 Supervisor's formula); the first ``--skip-steps`` steps are left out.
  MiB/rank       the largest rank's parameter + gradient + optimizer-state bytes, measured on
                 the local shards after a step (raytrain_sys.parallel.memory).
  MFU            on CUDA only: tokens/s * training FLOPs per token / (world * peak FLOP/s);
                 FLOPs per token from raytrain_sys.models.model_flops_per_token (PaLM's 6N +
                 attention estimate, as nanoGPT's estimate_mfu); peak from --peak-tflops.

On a 2-core CPU the figures compare strategies' overheads (communication, recomputation,
pipeline bubbles) at equal world size, not hardware speed: every rank gets one thread.

    .venv/bin/python benchmarks/parallel.py --quick        # tiny model, 2 ranks, ~1-2 min
    .venv/bin/python benchmarks/parallel.py                # jobs/tinygpt.yaml's model
    .venv/bin/python benchmarks/parallel.py --world 4      # adds the 4-rank hybrids

Results go to benchmarks/results/parallel.json (``--out`` to change).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from raytrain_sys.spec import ModelSpec, OptimSpec, ParallelSpec  # noqa: E402

STRATEGIES_2 = {
    "ddp": dict(strategy="ddp"),
    "ddp+fp16": dict(strategy="ddp", comm_hook="fp16"),
    "ddp+powersgd": dict(strategy="ddp", comm_hook="powersgd", powersgd_start_iter=2),
    "fsdp": dict(strategy="fsdp"),
    "zero2": dict(strategy="fsdp", reshard_after_forward=False),
    "fsdp+ac": dict(strategy="fsdp", activation_checkpointing=True),
    "tp+sp": dict(tp=2),
    "pp-gpipe": dict(pp=2, pp_schedule="gpipe", microbatches=4),
    "pp-1f1b": dict(pp=2, pp_schedule="1f1b", microbatches=4),
    "pp-interleaved": dict(pp=2, pp_schedule="interleaved_1f1b", microbatches=4),
}
STRATEGIES_4 = {
    "hsdp 2x2": dict(strategy="hsdp", fsdp=2),
    "dp2 x tp2": dict(strategy="ddp", tp=2),
    "pp2 x fsdp2": dict(strategy="fsdp", pp=2, microbatches=4),
}


def _rank(rank: int, world: int, store_path: str, par: dict, model: dict, args: dict, out) -> None:
    from raytrain_sys.models import build_model, model_flops_per_token
    from raytrain_sys.parallel.mesh import build_mesh
    from raytrain_sys.parallel.parallelize import parallelize
    from raytrain_sys.train.optim import build_optimizer, lr_at
    from raytrain_sys.train.tasks import NextToken

    torch.set_num_threads(1)
    cuda = torch.cuda.is_available()
    device = f"cuda:{rank % max(1, torch.cuda.device_count())}" if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", store=dist.FileStore(store_path, world),
                            rank=rank, world_size=world, timeout=timedelta(seconds=300))
    model_spec, optim_spec = ModelSpec(**model), OptimSpec(warmup_steps=2)
    par_spec = ParallelSpec(**par)
    mesh = build_mesh(par_spec, world, "cuda" if cuda else "cpu")
    torch.manual_seed(0)
    pm = parallelize(build_model(model_spec).to(device), mesh, par_spec, device, task=NextToken(),
                     precision="bf16" if cuda else "fp32")
    opt = build_optimizer(pm.optimizer_module(), optim_spec)
    rng = np.random.default_rng(0)
    gbs, steps = args["global_batch"], args["steps"]
    index, size = pm.data_shard()
    times, memory = [], None
    for step in range(steps):
        batch = rng.integers(0, model_spec.vocab_size, size=(gbs, model_spec.block_size + 1))
        rows = torch.tensor(np.array_split(batch, size)[index], device=device)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, optim_spec, steps)
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        pm.forward_backward({"tokens": rows}, batch.shape[0] * (batch.shape[1] - 1))
        pm.clip_grad_norm_(optim_spec.grad_clip)
        opt.step()
        if memory is None:
            memory = pm.memory(opt)
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()
        times.append(time.perf_counter() - t0)
    measured = times[args["skip_steps"]:]
    tokens_per_s = gbs * model_spec.block_size * len(measured) / sum(measured)
    result = {"tokens_per_s": tokens_per_s, "memory": memory,
              "step_s": sum(measured) / len(measured)}
    if cuda:
        flops = model_flops_per_token(model_spec) * tokens_per_s
        result["mfu"] = flops / (world * args["peak_tflops"] * 1e12)
    out.put((rank, result))
    dist.destroy_process_group()


def run_strategy(world: int, par: dict, model: dict, args: dict) -> dict:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="rts-bench-") as tmp:
        procs = [ctx.Process(target=_rank, args=(r, world, os.path.join(tmp, "store"), par, model, args, out))
                 for r in range(world)]
        for p in procs:
            p.start()
        results = dict(out.get(timeout=900) for _ in procs)
        for p in procs:
            p.join()
    per_rank = [results[r] for r in range(world)]
    return {"world": world, "parallel": par,
            "tokens_per_s": min(r["tokens_per_s"] for r in per_rank),
            "step_s": max(r["step_s"] for r in per_rank),
            "bytes_per_rank": max(r["memory"]["total_bytes"] for r in per_rank),
            "memory_per_rank": [r["memory"] for r in per_rank],
            "mfu": per_rank[0].get("mfu")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny model and few steps: a smoke test")
    ap.add_argument("--world", type=int, default=2, choices=(2, 4), help="4 adds the hybrids")
    ap.add_argument("--steps", type=int, default=0, help="steps per strategy (default 20, quick 8)")
    ap.add_argument("--skip-steps", type=int, default=3, help="warm-up steps left out")
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--peak-tflops", type=float, default=989.0,
                    help="per-GPU peak for MFU (H100 SXM dense bf16: 989)")
    ap.add_argument("--only", default="", help="comma-separated strategy names")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "parallel.json"))
    a = ap.parse_args()
    model = (dataclasses.asdict(ModelSpec(block_size=32, n_layer=4, n_head=4, n_embd=64)) if a.quick
             else dataclasses.asdict(ModelSpec(block_size=128, n_layer=4, n_head=4, n_embd=128)))
    args = {"steps": a.steps or (8 if a.quick else 20), "skip_steps": a.skip_steps,
            "global_batch": a.global_batch, "peak_tflops": a.peak_tflops}
    plan = [(2, n, p) for n, p in STRATEGIES_2.items()]
    if a.world == 4:
        plan += [(4, n, p) for n, p in STRATEGIES_4.items()]
    if a.only:
        wanted = set(a.only.split(","))
        plan = [x for x in plan if x[1] in wanted]
    rows = {}
    print(f"{'strategy':<16}{'world':>6}{'tokens/s':>11}{'MiB/rank':>10}{'MFU':>8}", flush=True)
    for world, name, par in plan:
        r = run_strategy(world, par, model, args)
        rows[name] = r
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "n/a"
        print(f"{name:<16}{world:>6}{r['tokens_per_s']:>11.0f}{r['bytes_per_rank'] / 2**20:>10.2f}"
              f"{mfu:>8}", flush=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"quick": a.quick, "model": model, "args": args,
                   "device": "cuda" if torch.cuda.is_available() else "cpu",
                   "strategies": rows}, f, indent=2)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
