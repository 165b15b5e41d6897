"""summary.json as written: what a reader parses is the record, whatever happened to its long
lists between writes (they are written from kept block texts, ``run_record._ListText``)."""

from __future__ import annotations

import dataclasses
import json

from raytrain_sys.control.run_record import TEXT_BLOCK, RunSummary


def _parsed(summary: RunSummary) -> dict:
    summary.write()
    with open(summary.path) as f:
        return json.load(f)


def _entry(step: int, ranks: int = 3) -> dict:
    return {"step": step, "ranks": {str(r): {"node": f"10.0.0.{r}", "compute_s": step * 1e-3 + r} for r in range(ranks)}}


def test_summary_json_is_the_record_after_appends_truncation_thinning_and_replacement(tmp_path):
    s = RunSummary(job="t", run_dir=str(tmp_path))
    fields = [f.name for f in dataclasses.fields(RunSummary)]
    steps = 5 * TEXT_BLOCK + 3
    for i in range(steps):
        s.losses.append(1.0 / (i + 1))
        s.world_sizes.append(2)
        s.step_times.append(0.01 * (i % 7))
    s.rank_times_history = [_entry(10 * i) for i in range(3 * TEXT_BLOCK)]
    assert _parsed(s) == {name: getattr(s, name) for name in fields}

    s.losses.append(float("nan"))  # json writes NaN, as json.dumps of the whole record did
    s.losses.append(0.5)
    s.world_sizes += [1, 1]
    s.step_times += [None, 0.2]
    back = _parsed(s)
    assert back["losses"][:-2] == s.losses[:-2] and back["losses"][-1] == 0.5 and back["losses"][-2] != back["losses"][-2]
    assert {k: v for k, v in back.items() if k != "losses"} == {n: getattr(s, n) for n in fields if n != "losses"}
    s.losses[-2] = 0.75

    # The history thinned when full, then appended to: blocks as long as before, other records.
    del s.rank_times_history[1::2]
    s.rank_times_history += [_entry(1000 + i, ranks=5) for i in range(TEXT_BLOCK // 2)]
    assert _parsed(s) == {name: getattr(s, name) for name in fields}
    s.rank_times_history[1] = _entry(-1)  # a record replaced whole
    assert _parsed(s) == {name: getattr(s, name) for name in fields}

    s.truncate_to(2 * TEXT_BLOCK + 1)  # a resume from an older checkpoint
    s.losses += [None] * 3 + [0.25]  # steps before the record, then new ones
    s.world_sizes += [None] * 3 + [4]
    s.step_times += [None] * 4
    assert _parsed(s) == {name: getattr(s, name) for name in fields}

    s.step_times = [0.1] * 3  # short again: written whole
    s.transitions.append({"state": "running", "why": "x"})
    assert _parsed(s) == {name: getattr(s, name) for name in fields}
    assert set(s.snapshot()) == set(fields)  # the kept texts are not part of the record


def test_a_resume_from_the_checkpoint_counts_the_steps_the_lost_driver_had_committed(tmp_path):
    """A driver lost at step 79 with its newest checkpoint at 50: the resumed run trains 51..79
    again, and its record says so (the lost run's own record counted none of them)."""
    lost = RunSummary(job="j", run_dir=str(tmp_path), committed_steps=79, losses=[1.0] * 79,
                      world_sizes=[2] * 79, steps_redone=3)
    assert lost.resumed_at(50) == (51, 79)
    assert lost.steps_redone == 3 + 29 and len(lost.losses) == 50
    assert lost.recoveries[-1]["from"] == "checkpoint" and lost.recoveries[-1]["steps_redone"] == 29
    caught_up = RunSummary(job="j", run_dir=str(tmp_path), committed_steps=50, losses=[1.0] * 50)
    assert caught_up.resumed_at(50) is None and caught_up.steps_redone == 0 and not caught_up.recoveries


def test_a_resume_counts_the_steps_its_watcher_saw_committed_past_the_lost_runs_last_record(tmp_path):
    """The lost run's summary.json was last written at step 60 (its writes are seconds apart),
    the job service saw its runner commit step 79: 29 steps are trained again, not 10; a watcher
    that saw less than the record (or nothing: 0) leaves the record's count."""
    lagging = RunSummary(job="j", run_dir=str(tmp_path), committed_steps=60, losses=[1.0] * 60)
    assert lagging.resumed_at(50, seen=79) == (51, 79) and lagging.steps_redone == 29
    for seen in (0, 55):
        behind = RunSummary(job="j", run_dir=str(tmp_path), committed_steps=60, losses=[1.0] * 60)
        assert behind.resumed_at(50, seen=seen) == (51, 60) and behind.steps_redone == 10
