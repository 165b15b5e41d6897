"""Evaluation during training: the evaluation set, the members' calls, the metrics and what they
decide (the best checkpoint, an early stop).

Owns: the evaluation set's references (read once, ``data/evalset.py``), the evaluation records
of summary.json (``evals``, ``best_checkpoint``) and the ``eval_*`` metrics sent to MLflow. The
batches are dealt whole to data-parallel indices (``train/evaluate.assign``) and summed in batch
order, so the metrics are the same at any world size. A member lost during an evaluation is the
Supervisor's to handle (it rebuilds and asks again): ``run`` returns the outcome and never
rebuilds. Calls no other part of the Supervisor.
"""

from __future__ import annotations

import logging

import raytrain_sys.control.supervisor.policy as policy
from raytrain_sys.control.run_record import RunSummary
from raytrain_sys.control.supervisor.liveness import StepOutcome, collect
from raytrain_sys.control.worker_group import WorkerGroup
from raytrain_sys.parallel.mesh import rank_coordinates
from raytrain_sys.spec import JobSpec
from raytrain_sys.train.evaluate import assign, summarize

log = logging.getLogger(__name__)


class Evaluation:
    def __init__(self, spec: JobSpec, task, summary: RunSummary, tracker, eval_set):
        self.spec, self.task, self.summary, self.tracker = spec, task, summary, tracker
        self.uri, self.manifest = eval_set
        self.refs: list | None = None
        self.higher_is_better = spec.eval.metric == "accuracy"

    def start_reading(self) -> None:
        from raytrain_sys.data.evalset import eval_batch_refs

        self.refs = eval_batch_refs(self.spec, self.uri, self.manifest)

    def call(self, group: WorkerGroup, step: int, deadline_s: float) -> StepOutcome:
        """Every member evaluates its batches; the outcome of the calls, as for a step."""
        if self.refs is None:
            self.start_reading()
        members = list(group.workers)
        degrees = self.spec.parallel.degrees(len(members))
        data_size = degrees["dp"] * degrees["fsdp"]
        refs = []
        for rank, w in enumerate(members):
            c = rank_coordinates(degrees, rank)
            which = assign(len(self.refs), c["dp"] * degrees["fsdp"] + c["fsdp"], data_size)
            refs.append(w.actor.evaluate.remote(self.refs, which))
        return collect(group, members, refs, step, deadline_s)

    def record(self, step: int, outcome: StepOutcome, seconds: float) -> dict[str, float]:
        """The metrics of a finished evaluation, recorded (summary.json, MLflow)."""
        per_batch: dict[int, dict] = {}
        for result in outcome.results.values():
            per_batch.update(result)
        missing = sorted(set(range(len(self.refs))) - set(per_batch))
        assert not missing, f"evaluation batches {missing[:5]} came back from no data leader"
        metrics = summarize(self.task, [per_batch[i] for i in range(len(self.refs))])
        self.summary.evals = [e for e in self.summary.evals if e["step"] != step]
        self.summary.evals.append({"step": step, **metrics, "seconds": seconds})
        self.summary.write()
        if self.tracker is not None:
            self.tracker.log_metrics(step, {f"eval_{k}": v for k, v in metrics.items()})
        log.info("evaluation at step %d (%.2f s): %s", step, seconds,
                 ", ".join(f"{k} {v:.6g}" for k, v in metrics.items()))
        return metrics

    def metric_history(self) -> list[float]:
        return [e[self.spec.eval.metric] for e in self.summary.evals]

    def improves(self, metrics: dict[str, float]) -> bool:
        """Whether this evaluation is the best so far (checkpoint.keep_best keeps its checkpoint)."""
        best = self.summary.best_checkpoint.get(self.spec.eval.metric)
        return policy.is_better(metrics[self.spec.eval.metric], best, self.higher_is_better)

    def mark_best(self, step: int, uri: str, metrics: dict[str, float]) -> None:
        self.summary.best_checkpoint = {"step": step, "uri": uri, self.spec.eval.metric:
                                        metrics[self.spec.eval.metric]}
        self.summary.write()
        if self.tracker is not None:
            try:
                self.tracker.set_tags({"raytrain_sys.best_checkpoint": uri})
            except Exception as exc:
                log.warning("best checkpoint not tagged in MLflow: %s", exc)

    def early_stop(self) -> "policy.EarlyStop | None":
        es = self.spec.train.early_stop
        return policy.early_stop(self.metric_history(), self.higher_is_better, es.patience, es.min_delta)

