"""`raytrain-sys`: run, resume, report, prepare-data, sample, export, the job service's jobs, teams, service, and node drain.

Exit codes: 0 done; 2 bad input or environment (one line on stderr says what and what to do);
3 training failed (workers lost, step timeout); 130 interrupted.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from raytrain_sys.version import __version__
from raytrain_sys.errors import UserError


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("raytrain_sys").setLevel(logging.INFO)
    # Ray Data and MLflow are chatty at INFO; their warnings still show.
    for name in ("ray", "ray.data", "mlflow", "alembic"):
        logging.getLogger(name).setLevel(logging.WARNING)
    os.environ.setdefault("RAY_DATA_DISABLE_PROGRESS_BARS", "1")


def _cmd_run(args: argparse.Namespace) -> int:
    from raytrain_sys.spec import load_spec

    # The spec is checked before torch, Ray and MLflow are imported: a typo costs no seconds.
    spec = load_spec(args.spec, args.set)
    from raytrain_sys.cli.progress import Progress
    from raytrain_sys.control.supervisor import run_job

    result = run_job(spec, on_step=Progress(spec.train.log_every_steps))
    _print_result(result)
    return 0


def _cmd_resume(args: argparse.Namespace) -> int:
    from raytrain_sys.cli.progress import Progress
    from raytrain_sys.control.supervisor import resume_job

    result = resume_job(args.mlflow_run, tracking_uri=args.tracking_uri, overrides=args.set,
                        output_dir=args.output_dir, on_step=Progress(10))
    _print_result(result)
    return 0


def _print_result(result) -> None:
    final = f"{result.losses[-1]:.4f}" if result.losses else "n/a"
    print(f"{result.status}: {result.committed_steps} steps, final loss {final}")
    print(f"  run dir:     {result.run_dir}")
    print(f"  checkpoint:  {result.newest_checkpoint or 'none'}")
    print(f"  mlflow run:  {result.mlflow_run_id or 'tracking disabled'}")


def _cmd_report(args: argparse.Namespace) -> int:
    from raytrain_sys.monitor.report import report

    table, plots = report(args.run, out_dir=args.out, tracking_uri=args.tracking_uri)
    print(table)
    print(f"plots: {', '.join(plots) or 'none (no per-step records yet)'}")
    return 0


def _cmd_prepare(args: argparse.Namespace) -> int:
    from raytrain_sys.data.prepare import prepare_digits_dataset, prepare_text_dataset

    if args.index:
        from raytrain_sys.data.table import index_parquet

        manifest = index_parquet(args.index, args.s3_endpoint_url, overwrite=args.overwrite)
        print(f"indexed {len(manifest.shards)} Parquet files, {manifest.num_rows} rows in {args.index} "
              f"(columns {', '.join(manifest.extra['schema'])}; content hash {manifest.content_hash}); "
              f"files unchanged, {args.index.rstrip('/')}/manifest.json written")
        return 0

    if args.format == "webdataset":
        if args.source not in ([], ["digits"]):
            raise UserError(f"--format webdataset prepares --source digits (scikit-learn's bundled "
                            f"8x8 digits); got {args.source}")
        out = args.out if args.out != "data/stdlib" else "data/digits"
        manifest = prepare_digits_dataset(out, overwrite=args.overwrite)
        print(f"wrote {len(manifest.shards)} WebDataset shards, {manifest.num_rows} samples to {out} "
              f"(+ {manifest.extra.get('val_num_rows', 0)} in {out}/val; content hash "
              f"{manifest.content_hash})")
        return 0
    if args.format == "documents":
        from raytrain_sys.data.prepare import prepare_documents_dataset

        out = args.out if args.out != "data/stdlib" else "data/stdlib-docs"
        manifest = prepare_documents_dataset(out, sources=args.source or None,
                                             max_bytes=args.max_bytes, overwrite=args.overwrite)
        print(f"wrote {len(manifest.shards)} shards, {manifest.num_rows} documents "
              f"({manifest.extra['num_tokens']} tokens) to {out} (content hash "
              f"{manifest.content_hash}); train with data.sequences: pack, pack_masked or bucket")
        return 0
    manifest = prepare_text_dataset(args.out, sources=args.source or None, row_len=args.row_len,
                                    rows_per_shard=args.rows_per_shard, max_bytes=args.max_bytes,
                                    overwrite=args.overwrite)
    print(f"wrote {len(manifest.shards)} shards, {manifest.num_rows} rows of {manifest.row_len} "
          f"tokens to {args.out} (content hash {manifest.content_hash})")
    return 0


def _cmd_sample(args: argparse.Namespace) -> int:
    import torch

    from raytrain_sys.checkpoint.export import load_model
    from raytrain_sys.models.gpt import generate

    model, spec, info = load_model(args.checkpoint, args.s3_endpoint_url)
    gen = torch.Generator().manual_seed(args.seed)
    prompt = args.prompt.encode().decode("unicode_escape").encode("utf-8", "surrogateescape") \
        if args.escapes else args.prompt.encode()
    idx = torch.tensor([list(prompt) or [10]], dtype=torch.long)
    out = generate(model, idx, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                   generator=gen)
    text = bytes(out[0].tolist()).decode("utf-8", errors="replace")
    print(f"# checkpoint {info.uri} (step {info.step})", file=sys.stderr)
    print(text)
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    from raytrain_sys.checkpoint.export import export_state_dict

    info = export_state_dict(args.checkpoint, args.out, args.s3_endpoint_url)
    print(f"exported step {info.step} of {info.uri} to {args.out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="raytrain-sys", description=__doc__.splitlines()[0])
    p.add_argument("--version", action="version", version=__version__)
    p.add_argument("-v", "--verbose", action="store_true", help="log at INFO from every library")
    sub = p.add_subparsers(dest="command", required=True)

    r = sub.add_parser("run", help="run a job spec (YAML)")
    r.add_argument("spec")
    r.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a spec field, e.g. --set train.max_steps=50 (repeatable)")
    r.set_defaults(func=_cmd_run)

    rs = sub.add_parser("resume", help="continue an MLflow run from its newest committed checkpoint",
                        description="Continue an MLflow run from its newest committed checkpoint, "
                                    "in the same run. Workers and placement groups a lost driver "
                                    "left on the cluster are removed first; while that driver "
                                    "still runs, resume refuses (exit 2).")
    rs.add_argument("--mlflow-run", required=True, metavar="RUN_ID")
    rs.add_argument("--tracking-uri", default="", help="default: sqlite:///<output-dir>/mlflow.db")
    rs.add_argument("--output-dir", default="runs")
    rs.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    rs.set_defaults(func=_cmd_resume)

    rp = sub.add_parser("report", help="a run's summary table, and its plots as PNGs",
                        description="Print a run's summary (status, steps, loss, tokens/s, world sizes, "
                                    "failures, recoveries, cost and stragglers when recorded) and write "
                                    "its plots (loss, throughput, world size, per-rank step breakdown).")
    rp.add_argument("run", metavar="RUN", help="run dir (holds summary.json), or an MLflow run id with --tracking-uri")
    rp.add_argument("--tracking-uri", default="", help="where the MLflow run id is recorded")
    rp.add_argument("--out", default="", help="where the PNGs go (default: <run dir>/plots)")
    rp.set_defaults(func=_cmd_report)

    pd = sub.add_parser("prepare-data", help="text files -> sharded Parquet token rows + manifest")
    pd.add_argument("--out", default="data/stdlib")
    pd.add_argument("--source", action="append", default=[],
                    help="file or directory (repeatable); default: this Python's standard library source")
    pd.add_argument("--row-len", type=int, default=129, help="tokens per row = model block_size + 1")
    pd.add_argument("--rows-per-shard", type=int, default=8192)
    pd.add_argument("--max-bytes", type=int, default=24_000_000, help="corpus cap; 0 = no cap")
    pd.add_argument("--overwrite", action="store_true")
    pd.add_argument("--index", default="", metavar="DIR_OR_S3",
                    help="write only a manifest for the existing *.parquet files there (not rewritten)")
    pd.add_argument("--s3-endpoint-url", default="", help="for --index s3://...")
    pd.add_argument("--format", choices=("parquet", "documents", "webdataset"), default="parquet",
                    help="parquet: token rows from text; documents: one variable-length token row "
                         "per file, for data.sequences pack/pack_masked/bucket (written to "
                         "data/stdlib-docs unless --out is given); webdataset: image+label tar "
                         "shards (--source digits, written to data/digits unless --out is given)")
    pd.set_defaults(func=_cmd_prepare)

    sp = sub.add_parser("sample", help="generate text from a checkpoint")
    sp.add_argument("checkpoint", help="checkpoint dir, checkpoint root or run dir (newest is used)")
    sp.add_argument("--prompt", default="def ")
    sp.add_argument("--escapes", action="store_true", help="interpret \\n etc. in the prompt")
    sp.add_argument("--max-new-tokens", type=int, default=300)
    sp.add_argument("--temperature", type=float, default=0.8)
    sp.add_argument("--top-k", type=int, default=40)
    sp.add_argument("--seed", type=int, default=0)
    sp.add_argument("--s3-endpoint-url", default="")
    sp.set_defaults(func=_cmd_sample)

    ex = sub.add_parser("export", help="one consolidated state_dict (torch.load(weights_only=True))")
    ex.add_argument("checkpoint")
    ex.add_argument("--out", required=True)
    ex.add_argument("--s3-endpoint-url", default="")
    ex.set_defaults(func=_cmd_export)

    from raytrain_sys.cli import jobs, node, sweeps
    from raytrain_sys.cli import service as service_cli

    jobs.add_parsers(sub)
    sweeps.add_parsers(sub)
    service_cli.add_parser(sub)
    node.add_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _setup_logging(args.verbose)
    connected_before = _ray_connected()
    try:
        return args.func(args)
    except UserError as exc:
        print(f"raytrain-sys: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("raytrain-sys: interrupted", file=sys.stderr)
        return 130
    finally:
        if not connected_before:
            _release_ray()


def _ray_connected() -> bool:
    return "ray" in sys.modules and sys.modules["ray"].is_initialized()


def _release_ray() -> None:
    """Disconnect from Ray (if this command connected) once this process's Ray objects are
    freed: an object reference finalized after Ray's own exit-time shutdown makes Ray end the
    process with status 1, whatever exit code the command returned (seen once in CI: a run
    refused with exit 2 ended with 1)."""
    if not _ray_connected():
        return
    import gc

    import ray

    gc.collect()
    ray.shutdown()


if __name__ == "__main__":
    sys.exit(main())
