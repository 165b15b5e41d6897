"""The run directory contract: ``summary.json`` and friends, read by other tools and later runs.

summary.json keys (stable): status, reason, job, run_dir, committed_steps, samples_consumed,
data_cursor, losses (index i = step i+1; losses_partial: the steps whose loss counts only the
rows of the ranks that outlived the step's agreement, NaN with none), world_sizes (index i = step i+1), newest_checkpoint,
checkpoints (step, uri, stall_s: training's wait at the step boundary; a background save,
checkpoint.async_save, also durable_after_s, write_s and snapshot_bytes_per_rank), mlflow_run_id, tracking_uri, spec_hash, training_hash, git_commit, transitions, throughput,
failures, steps_redone, recoveries (one record per recovery from lost members: step, lost,
reason, from: survivors | peer copies | checkpoint, steps_redone; and hung: one record per member
found hung at the step's deadline, control/supervisor/liveness.hang_record: slot, rank, node, pid,
phase, step, deadline_s, reason, top_frame {file, line, function} of its training thread, threads
(every thread's frames) and stack, the whole as a traceback), read_hangs (one record per read
found hung, data.read_timeout_s: position, window, waited_s, node_id, pid, hang, top_frame,
stack, reason), peer_copies
(checkpoint.peer_copies: peers, each rank's, and bytes_per_copy_estimate; or off: why; empty
when the layout keeps none), steps_run_ahead, leases, agent_calls, evals (one record per evaluation: step and
metrics), best_checkpoint (checkpoint.keep_best), compile_s (train.compile), step_times
(seconds each committed step took, index i = step i+1, like losses: the throughput plot of
``monitor/plots.py``), cost
(resources.cost_per_worker_hour; empty without a price: usd, worker_hours, usd_per_million_tokens
over every token trained, goodput_usd_per_million_tokens over the committed steps' tokens only,
cost_per_worker_hour; paid time is every slot held from placement to teardown, idle rebuilds and
resizes included; see monitor/cost.py), start_phases (where the newest start's seconds went, each
phase from the end of the one before, in order: preflight, ray (connected), data (plane opened,
first reads submitted), placement (every slot's bundle placed), workers (every worker up: a
spare adopted or a process started, its model built), tracking (the MLflow run), group (the
process group formed), restore (a resume's checkpoint), first_batch (the first global batch
read), then total); start_beside (what ran in the background of that start, each its own
seconds, of which the start waited only for the part its phase above shows: tracking, the MLflow
run opened; first_read, the first global batch read); start_spans (when each of them began and
ended, [start_s, end_s] in seconds from the start's beginning, so that the overlap shows: every
phase of start_phases under its name, and beside them mlflow_run (the MLflow run's opening: a new
run opens in its tracker's writer, beside the workers' start and often the first steps, and is
recorded once it is open) and first_read).

Per rank (control/supervisor/stragglers.py): rank_times ({rank: {node, data_wait_s, compute_s,
collective_s, optimizer_s, step_s}}: per-rank means over the last train.log_every_steps steps,
refreshed at each of them), rank_times_history (list of {step, ranks: the same shape}, at most
500, thinned by dropping every other one when full), stragglers (one event per flagged rank:
step, rank, node, kind slow_rank | data_imbalance, ratio of its compute to its peers' median,
action none | rebalance | replace, and with rebalance the rows per data index dealt from then on; with
replace, top_frame and stack: where the rank was in its step at the verdict).
"""

from __future__ import annotations

import json
import operator
import os
import subprocess
import time
from dataclasses import dataclass, field
from typing import Any

SUMMARY_FILE = "summary.json"
SAMPLE_LOG_FILE = "sample_ids.jsonl"
# summary.json's long lists (per step, and rank_times_history's N ranks an entry) are encoded by
# blocks of this many items, each block's text kept while it holds the same objects (see
# ``_ListText``).
TEXT_BLOCK = 16


def git_commit(cwd: str | None = None) -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True,
                             timeout=5)
        commit = out.stdout.strip()
        if out.returncode != 0 or not commit:
            return "unknown"
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=cwd,
                               capture_output=True, text=True, timeout=5).stdout.strip()
        return commit + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


@dataclass
class RunSummary:
    job: str
    run_dir: str
    status: str = "starting"
    reason: str = ""
    committed_steps: int = 0
    samples_consumed: int = 0
    data_cursor: int = 0
    losses: list[float | None] = field(default_factory=list)  # None: step ran before this record
    world_sizes: list[int | None] = field(default_factory=list)
    step_times: list[float | None] = field(default_factory=list)  # seconds; None: before this record
    newest_checkpoint: str = ""
    checkpoints: list[dict] = field(default_factory=list)
    mlflow_run_id: str = ""
    tracking_uri: str = ""
    spec_hash: str = ""
    training_hash: str = ""
    git_commit: str = ""
    transitions: list[dict] = field(default_factory=list)
    throughput: dict[str, float] = field(default_factory=dict)
    resumed_from: list[str] = field(default_factory=list)
    failures: int = 0  # membership failures survived
    steps_redone: int = 0  # committed steps lost to a restore from a durable checkpoint
    # steps whose loss counts only some ranks' rows (theirs lost with them in the step's agreement)
    losses_partial: list[int] = field(default_factory=list)
    # one record a recovery from lost members: {"step", "lost", "reason", "from": survivors |
    # peer copies | checkpoint, "steps_redone"} and "hung": the members found hung, with their stacks
    recoveries: list[dict] = field(default_factory=list)
    # one record a read found hung (data.read_timeout_s; data/plane.py): {"position", "window",
    # "waited_s", "node_id", "pid", "hang" (1, or 2: the run stopped), "top_frame", "stack", "reason"}
    read_hangs: list[dict] = field(default_factory=list)
    # checkpoint.peer_copies at the start: {"peers": each rank's peer, "bytes_per_copy_estimate"}
    peer_copies: dict = field(default_factory=dict)
    steps_run_ahead: int = 0  # committed steps sent while the step before them ran (train.run_ahead)
    leases: int = 0  # calls to the members with steps committed (train.steps_per_call); a failed one counts
    agent_calls: int = 0  # lease calls sent to node agents (each for its node's ranks; control/node_agent.py)
    evals: list[dict] = field(default_factory=list)  # {"step": s, "loss": ..., ...} per evaluation
    best_checkpoint: dict = field(default_factory=dict)  # {"step", "uri", metric}: checkpoint.keep_best
    compile_s: float = 0.0  # train.compile: first step's compute time beyond a later step's
    rank_times: dict[str, dict] = field(default_factory=dict)  # see the module docstring
    rank_times_history: list[dict] = field(default_factory=list)
    stragglers: list[dict] = field(default_factory=list)
    cost: dict = field(default_factory=dict)  # resources.cost_per_worker_hour: see the module docstring
    start_phases: dict = field(default_factory=dict)  # the newest start's phases, s each: see the module docstring
    start_beside: dict = field(default_factory=dict)  # what ran beside the newest start, s each: see the module docstring
    start_spans: dict = field(default_factory=dict)  # the newest start's phases and what ran beside, [start_s, end_s]
    started_at: float = field(default_factory=time.time)
    finished_at: float = 0.0

    @property
    def path(self) -> str:
        return os.path.join(self.run_dir, SUMMARY_FILE)

    def snapshot(self) -> dict:
        """A copy as plain data for a reader on another thread (the plots): each list and dict
        copied one level deep, which is enough (records are appended or replaced whole, never
        changed in place) and costs milliseconds where ``asdict``'s deep copy of a 100k-step
        run takes about a second of the step loop."""
        return {name: list(value) if isinstance(value, list) else dict(value) if isinstance(value, dict) else value
                for name, value in vars(self).items() if name in self.__dataclass_fields__}

    def write(self) -> None:
        """The record, replaced whole. Encoded by json's C encoder (one string, no indent: an
        indented ``json.dump`` runs the pure-Python encoder) straight from the fields (no
        ``asdict`` deep copy). The long lists (a value a step; rank_times_history, up to 500 x N
        ranks' records: 7 MB at 64 ranks, 52 MB at 512) are encoded by blocks whose text is kept
        (``_ListText``): a write encodes only what changed since the one before, where encoding
        all of it cost the step loop 0.12 s at 64 ranks and 0.8 s at 512."""
        tmp = self.path + ".tmp"
        texts = self.__dict__.setdefault("_texts", {})
        long, rest = [], {}
        for name in self.__dataclass_fields__:
            value = getattr(self, name)
            if isinstance(value, list) and len(value) > TEXT_BLOCK:
                long.append((name, texts.setdefault(name, _ListText()).encode(value)))
            else:
                texts.pop(name, None)
                rest[name] = value
        text = json.dumps(rest)
        with open(tmp, "w") as f:  # the blocks' texts written one by one: no copy of the whole
            f.write(text[:-1] if long else text)
            for k, (name, parts) in enumerate(long):
                f.write(f"{', ' if rest or k else ''}{json.dumps(name)}: [")
                for i, part in enumerate(parts):
                    f.write(", " + part if i else part)
                f.write("]")
            if long:
                f.write("}")
        os.replace(tmp, self.path)

    @classmethod
    def read(cls, run_dir: str) -> "RunSummary | None":
        path = os.path.join(run_dir, SUMMARY_FILE)
        if not os.path.exists(path):
            return None
        with open(path) as f:
            data: dict[str, Any] = json.load(f)
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        return cls(**known)

    def resumed_at(self, step: int, seen: int = 0) -> tuple[int, int] | None:
        """The run resumes from its checkpoint of ``step`` after its driver was lost: the steps
        the lost driver committed past it (as far as its last record says, or ``seen``, the step
        whoever watched it saw it commit last, the job service: lower bounds both) will be
        trained again, and are counted (``steps_redone``, and a recovery from the checkpoint in
        ``recoveries``) before the per-step records after ``step`` are dropped. Returns the
        range of steps trained again (first, last; 1-based), or None when there are none."""
        lost_run = max(self.committed_steps, seen)
        self.truncate_to(step)
        if lost_run <= step:
            return None
        self.steps_redone += lost_run - step
        self.recoveries.append({"step": lost_run, "lost": [], "from": "checkpoint", "steps_redone": lost_run - step,
                                "reason": f"the run's driver was lost at step {lost_run} (or later); resumed from "
                                          f"its checkpoint of step {step}"})
        return step + 1, lost_run

    def truncate_to(self, step: int) -> None:
        """Forget per-step records after ``step`` (a resume from an older checkpoint)."""
        self.losses = self.losses[:step]
        self.losses_partial = [s for s in self.losses_partial if s <= step]
        self.world_sizes = self.world_sizes[:step]
        self.step_times = self.step_times[:step]
        self.checkpoints = [c for c in self.checkpoints if c["step"] <= step]
        self.evals = [e for e in self.evals if e["step"] <= step]
        self.rank_times_history = [h for h in self.rank_times_history if h["step"] <= step]
        self.stragglers = [e for e in self.stragglers if e["step"] <= step]
        if self.best_checkpoint.get("step", 0) > step:
            self.best_checkpoint = {}


class _ListText:
    """A list's JSON text, by blocks of TEXT_BLOCK items: a block whose items are the same
    objects as when it was encoded keeps its text. The records' items are appended or replaced
    whole, never changed in place (``RunSummary.snapshot``), so the same objects encode to the
    same text; a list truncated, thinned or rebuilt has its changed blocks encoded again."""

    def __init__(self) -> None:
        self._blocks: list[tuple[list, str]] = []

    def encode(self, items: list) -> list[str]:
        """The items' JSON text, in parts: joined by ", " and bracketed, the list's."""
        blocks = []
        for k, i in enumerate(range(0, len(items), TEXT_BLOCK)):
            block = items[i:i + TEXT_BLOCK]
            kept = self._blocks[k] if k < len(self._blocks) else ([], "")
            same = len(kept[0]) == len(block) and all(map(operator.is_, kept[0], block))
            blocks.append(kept if same else (block, json.dumps(block)[1:-1]))
        self._blocks = blocks
        return [text for _, text in blocks]
