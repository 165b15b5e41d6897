"""Expected data-parallel scaling of GPT models at 8, 64 and 512 H100s: a calculator, no Ray.

Per model shape and GPU count p, one optimizer step of data parallelism (DDP: every GPU holds the
whole model, gradients all-reduced in buckets):

  compute     tokens per GPU x FLOPs per token / (MFU x peak). FLOPs per token from the repo's
              own ``raytrain_sys.models.gpt.flops_per_token``: 6N + 12 L H Q T (PaLM, Chowdhery et
              al. 2022, appendix B; nanoGPT's estimate_mfu), N the non-embedding parameters.
  all-reduce  gradient bytes (every parameter, embeddings included, ``--grad-bytes`` each) in
              buckets of ``--bucket-mib`` (DDP's default 25 MiB), three algorithms:
                ring  flat ring over all p GPUs:
                      2(p-1)/p x bytes / busbw + 2(p-1) x latency per bucket;
                      busbw = NVLink's within a node, one GPU's NIC share across nodes (the slowest
                      link of the ring), latency the per-hop latency of that link.
                hier  within each node a ring reduce-scatter over NVLink, then a ring all-reduce
                      across the n nodes of each GPU's 1/g shard on its own NIC, then a ring
                      all-gather over NVLink (a hierarchical all-reduce).
                tree  as hier, the inter-node part a double binary tree (NCCL's tree): the same
                      bandwidth term, latency 2 log2(n) hops instead of 2(n-1).
              The expected figure uses the fastest of the three.
  overlap     no-overlap: step = compute + all-reduce. overlap: DDP starts each bucket's
              all-reduce as soon as its gradients are ready during backward (2/3 of compute:
              4N of 6N); all of it can hide behind backward except the last bucket:
              step = compute + max(0, all-reduce - backward) + one bucket's all-reduce.
  control     the Supervisor's own CPU per step at p workers, from
              benchmarks/results/control_plane.json (measured on this machine with stand-in
              ranks, N = 8..512): a part per call to every member, a + b p, shared by the steps of
              a lease, and a part per step, c + d p (its plans, its report, its commit), so
              control per step = (a + b p) / lease + c + d p, with the automatic lease of
              train.steps_per_call = 0: min(MAX_LEASE_STEPS, LEASE_S / step) steps
              (control/supervisor/policy.py). An older result without the split: its
              one-step-a-call line over the lease, as before.
              With run-ahead it is off the critical path while it is shorter than a step; the
              goal is that it stays under 2% of one.
  efficiency  compute / step: throughput per GPU against one GPU with no communication
              (weak scaling, the same tokens per GPU at every p).

And the data path: bytes per step through the driver, relayed rows (before issue 12) against
object references (after), and the rows moved node to node instead.

Every constant below is a published figure or a stated assumption (see docs/SCALING.md).
Results of a run that measured something here are read from benchmarks/results/.

    .venv/bin/python benchmarks/scaling_model.py                 # the tables in docs/SCALING.md
    .venv/bin/python benchmarks/scaling_model.py --mfu 0.3 --grad-bytes 2 --json out.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))

from raytrain_sys.control.supervisor.policy import LEASE_S, MAX_LEASE_STEPS, lease_steps  # noqa: E402
from raytrain_sys.models.gpt import GPTConfig, flops_per_token, num_params  # noqa: E402
from raytrain_sys.spec import from_dict  # noqa: E402

# --------------------------------------------------------------------------- hardware (published)
H100_BF16_DENSE_TFLOPS = 989.0  # NVIDIA H100 SXM5 datasheet: 989 TFLOP/s bf16 dense (1979 with sparsity)
NVLINK_GBPS_PER_DIR = 450.0  # H100 SXM NVLink 4: 900 GB/s bidirectional per GPU (18 links x 50 GB/s)
GPUS_PER_NODE = 8  # DGX/HGX H100: 8 GPUs on an NVSwitch fabric
IB_GBPS_PER_GPU = 50.0  # DGX H100: 8 x ConnectX-7 400 Gb/s NDR InfiniBand per node, one per GPU
# Per-hop latencies: assumptions of the usual order for NCCL (LL protocol over NVLink a few
# microseconds; over InfiniBand the wire's ~1-2 us plus NCCL's proxy and protocol overhead).
NVLINK_HOP_LATENCY_US = 3.0
IB_HOP_LATENCY_US = 10.0
# Fraction of a link's peak that an all-reduce reaches (NCCL's bus bandwidth): assumed; nccl-tests
# on such systems usually report a large fraction, not all, of the link rate.
LINK_EFFICIENCY = 0.8
MFU = 0.40  # assumed; torchtitan reports 33-42% on H100 for Llama 3 8B (docs/SCALING.md)

# --------------------------------------------------------------------------- model shapes
# raytrain_sys/models/ has one GPT (gpt.py) and no named presets: the shapes below are the repo's
# own default job (jobs/tinygpt.yaml, byte-level) and the GPT-2 family (Radford et al. 2019,
# table 2: layers, width; heads as in the released checkpoints; vocabulary 50257, context
# 1024), built with the repo's GPTConfig (no biases, tied embedding).
SHAPES = {
    "tinygpt (jobs/tinygpt.yaml)": GPTConfig(vocab_size=256, block_size=128, n_layer=4, n_head=4, n_embd=128),
    "gpt2-small": GPTConfig(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768),
    "gpt2-medium": GPTConfig(vocab_size=50257, block_size=1024, n_layer=24, n_head=16, n_embd=1024),
    "gpt2-large": GPTConfig(vocab_size=50257, block_size=1024, n_layer=36, n_head=20, n_embd=1280),
    "gpt2-xl": GPTConfig(vocab_size=50257, block_size=1024, n_layer=48, n_head=25, n_embd=1600),
}
GPU_COUNTS = (8, 64, 512)
GOALS = {8: 0.95, 64: 0.85, 512: 0.75}  # issue 12's production goal
CONTROL_GOAL = 0.02  # the control plane under 2% of a step


@dataclass
class Net:
    nvlink_Bps: float
    ib_Bps: float
    nvlink_lat_s: float
    ib_lat_s: float
    gpus_per_node: int


def ring_time(nbytes: float, p: int, bw: float, lat: float) -> float:
    """Ring all-reduce of ``nbytes`` over ``p`` ranks: reduce-scatter + all-gather."""
    if p <= 1:
        return 0.0
    return 2 * (p - 1) / p * nbytes / bw + 2 * (p - 1) * lat


def allreduce_times(nbytes: float, p: int, net: Net, bucket: float) -> dict[str, float]:
    """Seconds to all-reduce ``nbytes`` of gradients in buckets of ``bucket`` bytes, by algorithm."""
    buckets = max(1, math.ceil(nbytes / bucket))
    per = nbytes / buckets
    g = min(p, net.gpus_per_node)
    n = max(1, p // net.gpus_per_node)
    if n == 1:  # one node: every algorithm is an NVLink ring (NCCL's tree needs nodes)
        t = buckets * ring_time(per, p, net.nvlink_Bps, net.nvlink_lat_s)
        return {"ring": t, "hier": t, "tree": t}
    flat = buckets * ring_time(per, p, net.ib_Bps, net.ib_lat_s)  # the ring's slowest link is a NIC
    intra = 2 * (g - 1) / g * per / net.nvlink_Bps + 2 * (g - 1) * net.nvlink_lat_s  # RS + AG in a node
    inter_bw = 2 * (n - 1) / n * (per / g) / net.ib_Bps
    hier = buckets * (intra + inter_bw + 2 * (n - 1) * net.ib_lat_s)
    tree = buckets * (intra + inter_bw + 2 * math.ceil(math.log2(n)) * net.ib_lat_s)
    return {"ring": flat, "hier": hier, "tree": tree}


def control_fit(path: Path) -> dict | None:
    if not path.exists():
        return None
    with open(path) as f:
        res = json.load(f)
    runs = res.get("runs_by_steps_per_call", {}).get("1", res["runs"])
    split = res.get("split")
    if split:  # a part per call (a lease shares it out) and a part per step
        call, step = split["per_call"], split["per_step"]
    else:  # the one-step-a-call line, all of it per call
        call = res.get("fits_by_steps_per_call", {}).get("1", res["fit"])["driver_cpu"]
        step = {"a_ms": 0.0, "b_ms_per_worker": 0.0}
    return {"a_s": call["a_ms"] / 1e3, "b_s": call["b_ms_per_worker"] / 1e3,
            "c_s": step["a_ms"] / 1e3, "d_s": step["b_ms_per_worker"] / 1e3, "split": bool(split),
            "quick": res.get("quick", False), "measured_n": [r["workers"] for r in runs],
            "measured_ms": [r.get("driver_cpu_ms_per_step", r["driver_cpu_ms"]["median"]) for r in runs],
            "time": res.get("time")}


def control_s(cp: dict, p: int, lease: int) -> float:
    """The Supervisor's CPU per step at ``p`` workers in leases of ``lease`` steps; each line
    at least 0 (a line through 8..512 can have a negative intercept: below its measured range
    it says nothing)."""
    return max(0.0, cp["a_s"] + cp["b_s"] * p) / lease + max(0.0, cp["c_s"] + cp["d_s"] * p)


def auto_lease(step_s: float) -> int:
    """Steps per call of the automatic lease, once step times are known: ``policy.lease_steps``
    itself, away from checkpoints and the last step."""
    spec = from_dict({"name": "model", "model": {"name": "gpt"}, "data": {"path": "-"},
                      "checkpoint": {"every_steps": 0}})
    return lease_steps(0, 10**9, spec, [step_s] * 3)


def gloo_fit(path: Path) -> dict | None:
    if not path.exists():
        return None
    with open(path) as f:
        return json.load(f)


def model_rows(args: argparse.Namespace, net: Net, cp: dict | None) -> list[dict]:
    rows = []
    peak = args.peak_tflops * 1e12
    for name, cfg in SHAPES.items():
        n_non_emb = num_params(cfg)
        n_all = num_params(cfg, non_embedding=False)
        fpt = flops_per_token(cfg)
        tokens = args.seqs_per_gpu * cfg.block_size
        compute = tokens * fpt / (args.mfu * peak)
        backward = compute * 2 / 3
        grad = n_all * args.grad_bytes
        bucket = args.bucket_mib * 2**20
        for p in GPU_COUNTS:
            ar = allreduce_times(grad, p, net, bucket)
            best_alg = min(ar, key=ar.get)
            t_ar = ar[best_alg]
            last_bucket = allreduce_times(min(grad, bucket), p, net, bucket)[best_alg]
            exposed = max(0.0, t_ar - backward) + last_bucket
            step_no = compute + t_ar
            step_ov = compute + min(t_ar, exposed)
            lease = auto_lease(step_ov)
            t_cp = control_s(cp, p, lease) if cp else float("nan")
            rows.append({
                "model": name, "params": n_all, "params_non_embedding": n_non_emb, "flops_per_token": fpt,
                "gpus": p, "tokens_per_gpu": tokens, "compute_s": compute, "grad_bytes": grad,
                "allreduce_s": ar, "algorithm": best_alg, "allreduce_best_s": t_ar,
                "step_no_overlap_s": step_no, "step_overlap_s": step_ov,
                "eff_no_overlap": compute / step_no, "eff_overlap": compute / step_ov,
                "control_s": t_cp, "control_fraction": t_cp / step_ov, "lease_steps": lease,
                # Run-ahead hides the supervisor until it is slower than a step: then it sets the pace.
                "eff_overlap_with_control": compute / max(step_ov, t_cp),
                "goal": GOALS[p],
            })
    return rows


def data_rows(args: argparse.Namespace, cp: dict | None) -> list[dict]:
    """Driver bytes per step before (rows relayed) and after issue 12 (references), per p."""
    out = []
    for p in GPU_COUNTS:
        for kind, per_gpu_bytes_per_s, note in (
                ("gpt2 tokens", args.seqs_per_gpu * 1025 * 2 / args.ref_step_s,
                 f"{args.seqs_per_gpu} rows of 1025 uint16 tokens per GPU per {args.ref_step_s * 1e3:.0f} ms step"),
                ("images 150 KB", args.images_per_gpu_s * 150e3,
                 f"{args.images_per_gpu_s:g} images/s per GPU x 150 KB (issue 12's example)")):
            relay = per_gpu_bytes_per_s * p
            refs = args.ref_bytes_per_rank * p / args.ref_step_s
            out.append({"gpus": p, "rows": kind, "note": note, "relay_Bps": relay, "refs_Bps": refs,
                        "node_to_node_Bps_per_node": per_gpu_bytes_per_s * min(p, GPUS_PER_NODE),
                        "relay_over_capacity": relay / args.driver_Bps})
    return out


def fmt_bytes(b: float) -> str:
    for unit, k in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if b >= k:
            return f"{b / k:.1f} {unit}"
    return f"{b:.0f} B"


def print_tables(args, net, rows, drows, cp, gloo) -> None:
    print(f"assumptions: H100 SXM {args.peak_tflops:g} TFLOP/s bf16 dense x MFU {args.mfu:.0%}; "
          f"{args.seqs_per_gpu} sequences per GPU per step (weak scaling); gradients {args.grad_bytes} B/param "
          f"in {args.bucket_mib:g} MiB buckets; links at {args.link_efficiency:.0%} of peak: "
          f"NVLink {net.nvlink_Bps / 1e9:g} GB/s/dir/GPU, hop "
          f"{net.nvlink_lat_s * 1e6:g} us; IB {net.ib_Bps / 1e9:g} GB/s/GPU, hop {net.ib_lat_s * 1e6:g} us; "
          f"{net.gpus_per_node} GPUs per node")
    print()
    print(f"{'model':<28} {'params':>7} {'GFLOP/tok':>9} {'p':>4} {'compute ms':>10} {'grad MB':>8} "
          f"{'ring ms':>8} {'hier ms':>8} {'tree ms':>8} {'eff no-ovl':>10} {'eff ovl':>7} {'goal':>5} "
          f"{'ctrl ms':>8} {'ctrl %':>7} {'eff ovl+ctrl':>12}")
    for r in rows:
        ar = r["allreduce_s"]
        ok = "met" if r["eff_overlap_with_control"] >= r["goal"] and r["control_fraction"] <= CONTROL_GOAL else "NO"
        print(f"{r['model']:<28} {r['params'] / 1e6:>6.1f}M {r['flops_per_token'] / 1e9:>9.3f} {r['gpus']:>4} "
              f"{r['compute_s'] * 1e3:>10.2f} {r['grad_bytes'] / 1e6:>8.1f} {ar['ring'] * 1e3:>8.2f} "
              f"{ar['hier'] * 1e3:>8.2f} {ar['tree'] * 1e3:>8.2f} {r['eff_no_overlap']:>10.1%} "
              f"{r['eff_overlap']:>7.1%} {r['goal']:>5.0%} {r['control_s'] * 1e3:>8.1f} "
              f"{r['control_fraction']:>7.1%} {r['eff_overlap_with_control']:>9.1%} {ok}")
    print("(eff: compute / step; ovl: all-reduce overlapped with backward but the last bucket; ctrl: "
          "Supervisor CPU per step: the measured lines, per call over the automatic lease's steps plus per step; "
          "'met' needs eff ovl+ctrl >= goal and ctrl <= 2%)")
    if cp:
        print()
        print(f"control plane (measured here, N = {', '.join(map(str, cp['measured_n']))}"
              + (", quick run" if cp["quick"] else "") + f"): per call {cp['a_s'] * 1e3:.2f} ms + "
              f"{cp['b_s'] * 1e6:.1f} us x N, per step {cp['c_s'] * 1e3:.3f} ms + {cp['d_s'] * 1e6:.2f} us x N; "
              f"automatic lease: up to {LEASE_S:g} s of steps, at most {MAX_LEASE_STEPS}")
        for name, cfg in SHAPES.items():
            step = next(r["step_overlap_s"] for r in rows if r["model"] == name and r["gpus"] == 512)
            lease = auto_lease(step)
            # Largest N with the Supervisor under 2% of a step, and where it equals a step.
            slope = cp["b_s"] / lease + cp["d_s"]
            base = cp["a_s"] / lease + cp["c_s"]
            n2 = max(0.0, (CONTROL_GOAL * step - base) / slope)
            n1 = max(0.0, (step - base) / slope)
            reach = 2 * max(cp["measured_n"])  # the lines go no further than 2x past what was measured
            said = [f"{n:6.0f}" if n <= reach else f"> {reach} (past 2x the measured range: not claimed)"
                    for n in (n2, n1)]
            print(f"  {name:<28} step {step * 1e3:7.1f} ms, lease {lease}: control under 2% up to N = {said[0]}; "
                  f"the bottleneck (as long as a step) from N = {said[1]}")
    print()
    print(f"data path (driver capacity assumed {fmt_bytes(args.driver_Bps)}/s for one Python process "
          f"relaying rows; references {args.ref_bytes_per_rank:g} B per rank per step):")
    print(f"{'p':>4} {'rows':<14} {'relay through driver':>21} {'x capacity':>10} {'refs through driver':>20} "
          f"{'node to node per node':>22}")
    for d in drows:
        print(f"{d['gpus']:>4} {d['rows']:<14} {fmt_bytes(d['relay_Bps']) + '/s':>21} "
              f"{d['relay_over_capacity']:>10.2f} {fmt_bytes(d['refs_Bps']) + '/s':>20} "
              f"{fmt_bytes(d['node_to_node_Bps_per_node']) + '/s':>22}")
    if gloo:
        f = gloo["fit"]
        print()
        print(f"checked here: gloo all-reduce, {gloo['procs']} processes on this machine: fit latency "
              f"{f['latency_s'] * 1e6:.1f} us/hop, busbw {f['busbw_bytes_per_s'] / 1e9:.2f} GB/s; the ring "
              f"formula's measured/model ratio within {gloo['worst_ratio']:.2f}x over "
              f"{gloo['sizes'][0]['bytes']} B to {fmt_bytes(gloo['sizes'][-1]['bytes'])} "
              f"(benchmarks/results/allreduce_gloo.json)")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mfu", type=float, default=MFU)
    p.add_argument("--peak-tflops", type=float, default=H100_BF16_DENSE_TFLOPS)
    p.add_argument("--seqs-per-gpu", type=int, default=16,
                   help="sequences per GPU per optimizer step (micro-batches x accumulation)")
    p.add_argument("--grad-bytes", type=int, default=4, help="bytes per gradient element all-reduced "
                   "(4: fp32 gradients of fp32 master weights, DDP's default; 2: bf16 reduction)")
    p.add_argument("--bucket-mib", type=float, default=25.0, help="DDP's bucket_cap_mb default")
    p.add_argument("--nvlink-gbps", type=float, default=NVLINK_GBPS_PER_DIR)
    p.add_argument("--ib-gbps", type=float, default=IB_GBPS_PER_GPU)
    p.add_argument("--link-efficiency", type=float, default=LINK_EFFICIENCY,
                   help="achieved fraction of NVLink / IB peak in an all-reduce (assumed)")
    p.add_argument("--nvlink-latency-us", type=float, default=NVLINK_HOP_LATENCY_US)
    p.add_argument("--ib-latency-us", type=float, default=IB_HOP_LATENCY_US)
    p.add_argument("--driver-gbps", type=float, default=1.0,
                   help="bytes/s one driver process can relay (assumed, GB/s)")
    p.add_argument("--ref-bytes-per-rank", type=float, default=0,
                   help="bytes the driver sends a rank per step; 0 = the largest measured by "
                        "benchmarks/data_path.py (results/data_path.json), else issue 12's goal, 4 KiB")
    p.add_argument("--data-path", default=str(HERE / "results" / "data_path.json"))
    p.add_argument("--ref-step-s", type=float, default=0.1, help="step time used for data rates")
    p.add_argument("--images-per-gpu-s", type=float, default=2000.0,
                   help="images/s per GPU (issue 12: 64 GPUs at 2,000 images/s each, 150 KB: ~19 GB/s)")
    p.add_argument("--control", default=str(HERE / "results" / "control_plane.json"))
    p.add_argument("--gloo", default=str(HERE / "results" / "allreduce_gloo.json"))
    p.add_argument("--json", default="", help="also write the figures here")
    return p


def network(args: argparse.Namespace) -> Net:
    eff = args.link_efficiency
    return Net(args.nvlink_gbps * 1e9 * eff, args.ib_gbps * 1e9 * eff, args.nvlink_latency_us * 1e-6,
               args.ib_latency_us * 1e-6, GPUS_PER_NODE)


def step_time_s(model: str, gpus: int) -> float:
    """One step of ``model`` at ``gpus`` with overlap, under the default assumptions: the step
    benchmarks/control_plane.py judges the Supervisor's cost against."""
    args = parser().parse_args([])
    row = next(r for r in model_rows(args, network(args), None) if r["model"] == model and r["gpus"] == gpus)
    return row["step_overlap_s"]


def main() -> int:
    args = parser().parse_args()
    net = network(args)
    args.driver_Bps = args.driver_gbps * 1e9
    if not args.ref_bytes_per_rank:
        measured = Path(args.data_path)
        args.ref_bytes_per_rank = 4096.0
        if measured.exists():
            table = json.loads(measured.read_text()).get("table", [])
            if table:
                args.ref_bytes_per_rank = float(max(r["refs_bytes_per_rank_step"] for r in table))
    cp = control_fit(Path(args.control))
    gloo = gloo_fit(Path(args.gloo))
    rows = model_rows(args, net, cp)
    drows = data_rows(args, cp)
    print_tables(args, net, rows, drows, cp, gloo)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows, "data": drows, "control": cp}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
