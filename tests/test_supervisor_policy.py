"""The Supervisor's pure parts: its decisions (``policy``) and its state table (``journal``).
No Ray: each decision is a function of the numbers it is given."""

from __future__ import annotations

import pytest

from raytrain_sys.control.supervisor import policy
from raytrain_sys.control.supervisor.journal import State, TransitionNotAllowed, transition_record
from raytrain_sys.control.supervisor.requests import StopRequest
from raytrain_sys.errors import TrainingFailed
from raytrain_sys.spec import ElasticSpec, ParallelSpec, from_dict


def job(**sections):
    raw = {"name": "t", "model": {"name": "gpt"}, "data": {"path": "/nowhere"}}
    for section, fields in sections.items():
        raw.setdefault(section, {}).update(fields)
    return from_dict(raw)


class Member:
    def __init__(self, slot):
        self.slot = slot

    def __repr__(self):
        return f"Member({self.slot})"


# ------------------------------------------------------------------ step deadline
REGULAR_3MS = [0.003] * 20


@pytest.mark.parametrize("times, new_group, floor, expected", [
    ([], False, 5.0, 600.0),
    ([0.5, 0.5], False, 5.0, 600.0),
    (REGULAR_3MS, False, 5.0, 5.0),
    ([4.0] * 10, False, 5.0, 8.0),
    ([2.0, 3.0, 4.0, 5.0, 6.0], False, 5.0, 4.0 + 10 * 1.4826),
    ([4.0, 4.0, 4.0, 4.0, 100.0], False, 5.0, 8.0),
    ([400.0] * 5, False, 5.0, 600.0),
    (REGULAR_3MS, True, 5.0, 15.0),
    ([4.0] * 10, True, 5.0, 24.0),
    ([0.5] * 10, False, 120.0, 120.0),
], ids=[
    "no steady step yet: the warm-up's train.step_timeout_s",
    "fewer steady steps than DEADLINE_SAMPLES: still train.step_timeout_s",
    "steps of 3 ms as regular as a clock: the elastic.hang_floor_s floor",
    "regular steps of 4 s: the median plus ten spreads of a tenth of it, twice the median",
    "noisy steps of 2-6 s: the median plus ten robust spreads (1.4826 median absolute deviations)",
    "one outlier of 100 s among steps of 4 s moves neither the median nor the spread",
    "very slow steps: capped by train.step_timeout_s",
    "a process group's first steps: three times the floor",
    "a process group's first steps of 4 s: three times the learned deadline",
    "a user's floor for jobs that stall for long legitimately wins over fast steps",
])
def test_step_deadline(times, new_group, floor, expected):
    spec = job(train={"step_timeout_s": 600.0}, elastic={"hang_floor_s": floor, "hang_factor": 10.0})
    assert policy.step_deadline_s(times, spec, new_group=new_group) == pytest.approx(expected)


@pytest.mark.parametrize("group_steps, after_pause, steady", [
    (1, False, False),
    (2, False, False),
    (3, False, True),
    (40, True, False),
    (40, False, True),
], ids=[
    "a process group's first step (DDP builds its buckets after it): not a sample",
    "its second step: not a sample either",
    "its third step: a sample",
    "the lease after a checkpoint or an evaluation: not a sample",
    "a step in the middle of a run: a sample",
])
def test_steady_steps_teach_the_deadline(group_steps, after_pause, steady):
    assert policy.steady_step(group_steps, after_pause) is steady


def test_collective_timeout_is_just_past_the_liveness_verdict():
    assert policy.collective_timeout_s(30.0) == 30.0 + policy.LIVENESS_EVERY_S + policy.PING_TIMEOUT_S


# ------------------------------------------------------------------ summary.json's refresh
@pytest.mark.parametrize("now, last_end, cost, due", [
    (100.0, 0.0, 0.0, True),
    (100.0, 97.5, 0.002, True),
    (100.0, 99.5, 0.002, False),
    (100.0, 95.0, 0.02, False),
    (100.0, 80.0, 0.02, True),
], ids=[
    "never written in this loop: written",
    "a small record (2 ms) 2.5 s ago: written again at the log step",
    "the same half a second ago: skipped, it would be 0.4% of the loop",
    "a write of 20 ms (many ranks' history) 5 s ago: skipped, it would be 0.4% of the loop",
    "the same 20 s ago: written, 0.1% of the loop",
])
def test_summary_due(now, last_end, cost, due):
    assert policy.summary_due(now, last_end, cost) is due


@pytest.mark.parametrize("now, last_sent, metrics, due", [
    (100.0, float("-inf"), 2560, True),
    (100.0, 99.8, 10, True),
    (100.0, 90.0, 2560, False),
    (100.0, 74.0, 2560, True),
], ids=[
    "never sent: sent, however many",
    "two ranks' ten, 0.2 s ago (steps of 0.02 s): sent at every refresh",
    "512 ranks' 2,560, 10 s ago: held, it would be 256 a second",
    "the same 26 s ago: sent",
])
def test_rank_metrics_due(now, last_sent, metrics, due):
    assert policy.rank_metrics_due(now, last_sent, metrics) is due


@pytest.mark.parametrize("times, steps, expected", [
    ([], 4, 2400.0),
    ([0.5, 0.6, 0.7], 4, 4 * (0.6 + 10 * 1.4826 * 0.1)),
    ([0.1, 0.1, 0.1], 4, 5.0),
    ([5.0, 6.0, 7.0], 4, 4 * (6.0 + 10 * 1.4826)),
], ids=[
    "a lease before any step time: step_timeout_s for each of its steps",
    "a lease of steps of 0.6 s: the learned deadline for each of its steps",
    "a lease of fast steps: the elastic.hang_floor_s floor, once for the whole call",
    "a lease of slow noisy steps: the learned deadline for each of its steps",
])
def test_lease_deadline(times, steps, expected):
    spec = job(train={"step_timeout_s": 600.0}, elastic={"hang_floor_s": 5.0, "hang_factor": 10.0})
    assert policy.step_deadline_s(times, spec, steps) == pytest.approx(expected)


@pytest.mark.parametrize("mode, members, run, through", [
    ("auto", 4, 3, False),
    ("auto", policy.NODE_AGENTS_FROM, 7, True),
    ("auto", 512, 1, False),
    ("on", 3, 1, True),
    ("off", 512, 8, False),
], ids=[
    "auto, a small group: the driver's own calls (an agent's process would cost more than it saves)",
    "auto, a fleet's node of 8 GPUs: its other 7 ranks through the agent",
    "auto, a node with one rank in the run: the driver's one call, not an agent's",
    "on: every run through its agent, one rank or not (the tests' switch)",
    "off: never",
])
def test_node_agents_on(mode, members, run, through):
    assert policy.node_agents_on(mode, members, run) is through


def test_node_agents_mode_unknown_is_named():
    with pytest.raises(ValueError, match="RAYTRAIN_NODE_AGENTS='yes'"):
        policy.node_agents_on("yes", 64, 8)


# ------------------------------------------------------------------ leases
@pytest.mark.parametrize("train, every, step, last, times, expected", [
    ({}, 0, 0, 100, [], 1),
    ({}, 0, 2, 100, [0.01, 0.01], 1),
    ({}, 0, 5, 10**6, [0.01, 0.01, 0.01], policy.MAX_LEASE_STEPS),
    ({}, 0, 5, 10**6, [0.2, 0.2, 0.2], int(policy.LEASE_S / 0.2)),
    ({}, 0, 5, 100, [15.0, 16.0, 17.0], 1),
    ({}, 0, 5, 100, [0.01, 0.01, 0.01], 95),
    ({}, 10, 7, 100, [0.01, 0.01, 0.01], 3),
    ({}, 0, 97, 100, [0.01, 0.01, 0.01], 3),
    ({"steps_per_call": 4}, 0, 0, 100, [], 4),
    ({"steps_per_call": 4}, 10, 8, 100, [], 2),
    ({"steps_per_call": 16}, 0, 0, 100, [0.01, 0.01, 0.01], 16),
], ids=[
    "auto, no step time yet: one step a call",
    "auto, warm-up (fewer than three step times): one step a call",
    "auto, 10 ms steps: capped at MAX_LEASE_STEPS",
    "auto, 200 ms steps: as many as fit in LEASE_S",
    "auto, steps longer than LEASE_S: one step a call",
    "auto, short steps: to the last step (a boundary cuts a lease short, it need not be short)",
    "a lease ends where a checkpoint is due",
    "a lease ends at the last step",
    "steps_per_call set: that many from the first step",
    "steps_per_call set: still cut at a checkpoint",
    "steps_per_call set above the automatic cap: the user's number",
])
def test_lease_steps(train, every, step, last, times, expected):
    spec = job(train=train, checkpoint={"every_steps": every})
    assert policy.lease_steps(step, last, spec, times) == expected


@pytest.mark.parametrize("train, ready, expected", [
    ({}, 7, 7), ({}, 0, 1), ({"steps_per_call": 20}, 7, 20),
], ids=[
    "auto: no more steps than the data plane has read, so that sending never waits on reads",
    "auto, nothing read ahead yet: one step",
    "steps_per_call set: the user's number, read or not",
])
def test_lease_steps_read_ahead(train, ready, expected):
    assert policy.lease_steps(5, 100, job(train=train), [0.01] * 3, ready_steps=ready) == expected


@pytest.mark.parametrize("train, group_steps, expected", [
    ({}, 0, 1), ({}, 2, 1), ({}, 3, 95), ({"steps_per_call": 4}, 0, 4),
], ids=[
    "auto, a group just formed (a rebuild, a resize): one step a call",
    "auto, two steps into a new group: still one",
    "auto, three steps into it: the full lease",
    "steps_per_call set: the user's number from a new group's first step",
])
def test_lease_steps_after_a_group_forms(train, group_steps, expected):
    assert policy.lease_steps(5, 100, job(train=train), [0.01] * 3, group_steps=group_steps) == expected


# ------------------------------------------------------------------ run-ahead
@pytest.mark.parametrize("train, checkpoint, step, last, world, target, held", [
    ({"run_ahead": True}, {"every_steps": 0}, 5, 20, 2, 2, False),
    ({"run_ahead": False}, {"every_steps": 0}, 5, 20, 2, 2, True),
    ({"run_ahead": True}, {"every_steps": 0}, 20, 20, 2, 2, True),
    ({"run_ahead": True}, {"every_steps": 5}, 10, 20, 2, 2, True),
    ({"run_ahead": True}, {"every_steps": 5}, 11, 20, 2, 2, False),
    ({"run_ahead": True}, {"every_steps": 0}, 5, 20, 1, 2, True),
], ids=[
    "nothing at the boundary: sent ahead",
    "train.run_ahead off: never sent ahead",
    "past the last step: nothing to send",
    "a checkpoint is due at the boundary: held",
    "the step after a checkpoint boundary: sent ahead",
    "below the target world: the boundary may take newcomers, held",
])
def test_run_ahead(train, checkpoint, step, last, world, target, held):
    spec = job(train=train, checkpoint=checkpoint)
    reason = policy.run_ahead_hold(step, last, spec, world, target)
    assert bool(reason) is held, reason


# ------------------------------------------------------------------ failure budget
@pytest.mark.parametrize("earlier, now, stops, kept", [
    ([], 1000.0, False, 1),
    ([990.0, 995.0], 1000.0, False, 3),
    ([980.0, 990.0, 995.0], 1000.0, True, 4),
    ([100.0, 200.0, 990.0], 1000.0, False, 2),
], ids=[
    "a first failure is within the budget",
    "the third failure in the window is still allowed (max_failures=3)",
    "a fourth failure within the window stops the run",
    "failures older than the window are forgotten",
])
def test_failure_budget(earlier, now, stops, kept):
    elastic = ElasticSpec(max_failures=3, failure_window_s=60.0)
    times, decision = policy.failure_budget(earlier, now, elastic, "worker 1 died")
    assert len(times) == kept and times[-1] == now
    assert isinstance(decision, policy.Stop if stops else policy.Continue)
    if stops:
        assert "elastic.max_failures=3" in decision.reason and decision.reason.endswith("last: worker 1 died")


def test_failure_budget_leaves_its_input_alone():
    earlier = [980.0, 990.0]
    policy.failure_budget(earlier, 1000.0, ElasticSpec(), "x")
    assert earlier == [980.0, 990.0]


# ------------------------------------------------------------------ fit to layout
@pytest.mark.parametrize("tp, members, held, standby", [
    (1, [1, 2, 3], {1: 5, 2: 5, 3: 5}, []),
    (2, [1, 2, 3, 4], {1: 5, 2: 5, 3: 5, 4: 5}, []),
    (2, [1, 2, 3], {1: 5, 2: 5, 3: 5}, [3]),
    (2, [1, 2, 3], {1: 0, 2: 5, 3: 5}, [1]),
], ids=[
    "plain DDP uses every member",
    "tp=2 with four members: a world of four",
    "tp=2 with three members: the last one waits on standby",
    "tp=2 with three members: a member without the committed step waits, holders first",
])
def test_standby_for_layout(tp, members, held, standby):
    parallel = ParallelSpec(tp=tp)
    ms = [Member(s) for s in members]
    assert [m.slot for m in policy.standby_for_layout(ms, held, 5, parallel)] == standby


def test_no_usable_world_is_an_error_that_names_the_field():
    with pytest.raises(TrainingFailed, match="elastic.min_workers"):
        policy.standby_for_layout([Member(1)], {1: 5}, 5, ParallelSpec(tp=2))


@pytest.mark.parametrize("tp, members, ready, grows", [
    (1, 2, 1, True),
    (2, 2, 1, False),
    (2, 2, 2, True),
    (1, 2, 0, False),
], ids=[
    "one newcomer grows a DDP world",
    "tp=2: one newcomer is not enough for the next world, it waits",
    "tp=2: two newcomers make the next world",
    "no newcomer: no growth",
])
def test_grows(tp, members, ready, grows):
    assert policy.grows(ParallelSpec(tp=tp), members, ready) is grows


# ------------------------------------------------------------------ drains
@pytest.mark.parametrize("staying, ready, pending, need, deadline, plan", [
    (2, 0, 0, 1, 1100.0, policy.Leave()),
    (0, 1, 0, 1, 1100.0, policy.HandOver()),
    (0, 0, 0, 1, 1100.0, policy.TrainOn(request=1)),
    (0, 0, 1, 1, None, policy.TrainOn(request=0)),
    (1, 0, 0, 3, 1100.0, policy.TrainOn(request=2)),
    (0, 0, 1, 1, 1010.0, policy.SaveThenLeave()),
], ids=[
    "enough members stay: the draining ones leave now",
    "too few stay but a newcomer is ready: it takes the state over",
    "nobody ready and time left: train on, one replacement requested",
    "no deadline and a replacement already starting: train on, nothing more requested",
    "min_workers=3 with one staying: two replacements requested",
    "nobody ready and the deadline within the handover margin: save, then leave",
])
def test_drain_plan(staying, ready, pending, need, deadline, plan):
    assert policy.drain_plan(staying, ready, pending, need, deadline, now_unix_s=1000.0) == plan


@pytest.mark.parametrize("elastic, ceiling, expected", [
    ({"max_workers": 4}, None, 4),
    ({"max_workers": 4}, 2, 2),
    ({"max_workers": 4}, 8, 4),
    ({"max_workers": 4, "min_workers": 2}, 1, 2),
], ids=[
    "no ceiling asked for: the spec's max_workers",
    "a ceiling below it: the ceiling",
    "a ceiling above it: still the spec's",
    "a ceiling below elastic.min_workers: the minimum world",
])
def test_target_size_under_a_requested_ceiling(elastic, ceiling, expected):
    assert policy.target_size(job(elastic=elastic, resources={"num_workers": 4}), ceiling) == expected


def test_shrink_leavers_are_the_highest_ranks():
    members = [Member(s) for s in (7, 3, 9, 4)]
    assert policy.shrink_leavers(members, 2) == members[2:]
    assert policy.shrink_leavers(members, 4) == [] and policy.shrink_leavers(members, 5) == []


def test_drain_floor_is_one_member_at_least():
    assert policy.drain_floor(ElasticSpec(min_workers=0)) == 1
    assert policy.drain_floor(ElasticSpec(min_workers=3)) == 3


# ------------------------------------------------------------------ the state table
@pytest.mark.parametrize("start, to, allowed", [
    (State.STARTING, State.DRAINING, False),
    (State.RESTORING, State.DRAINING, False),
    (State.FINISHED, State.RUNNING, False),
    (State.FAILED, State.FAILED, False),
    (State.STOPPED, State.RUNNING, False),
    (State.CANCELLED, State.RUNNING, False),
    (State.REBUILDING, State.CANCELLED, False),
    (State.RUNNING, State.CANCELLED, True),
    (State.REBUILDING, State.FINISHED, False),
    (State.STARTING, State.RESTORING, True),
    (State.RUNNING, State.CHECKPOINTING, True),
    (State.CHECKPOINTING, State.REBUILDING, True),
    (State.REBUILDING, State.WAITING, True),
    (State.WAITING, State.RESTORING, True),
    (State.DRAINING, State.RUNNING, True),
    (State.RUNNING, State.RUNNING, True),
    (State.RESIZING, State.FAILED, True),
    (State.RUNNING, State.STOPPED, True),
], ids=[
    "a run that has not started has nothing to drain",
    "a restore is not left for a drain",
    "a finished run stays finished",
    "a failed run is not failed twice",
    "a stopped run resumes as a new launch, not by a move",
    "a cancelled run stays cancelled",
    "a cancel waits for the rebuild to end (at a step boundary)",
    "cancelled at a step boundary",
    "a run does not finish in the middle of a rebuild",
    "a resumed run loads its checkpoint first",
    "a periodic checkpoint",
    "a member lost while saving",
    "below elastic.min_workers after a loss",
    "the newest checkpoint once every worker is gone",
    "the group re-formed after members left a draining node",
    "a note in the same state (a skipped bad shard)",
    "any live state may fail",
    "paused at train.stop_at_step",
])
def test_state_moves(start, to, allowed):
    """A move the table does not list raises, naming both states."""
    if allowed:
        start.check_move(to)
    else:
        with pytest.raises(TransitionNotAllowed, match=f"{start.value} cannot move to {to.value}"):
            start.check_move(to)


def test_terminal_states():
    assert {s for s in State if s.terminal} == {State.FINISHED, State.STOPPED, State.CANCELLED, State.FAILED}
    assert all(not s.allowed for s in State if s.terminal)


def test_transition_record_keeps_when_the_failure_was_seen():
    assert transition_record(State.REBUILDING, "lost", 7, 100.0, 99.5) == {
        "time": 100.0, "state": "rebuilding", "reason": "lost", "step": 7, "detected_at": 99.5}
    assert "detected_at" not in transition_record(State.RUNNING, "ok", 7, 100.0)


# ------------------------------------------------------------------ the step boundary's plan
def facts(step=6, last=20, world=2, target=2, **kw):
    """A boundary right after a commit: ``world`` members on nodes n0, n1, ..."""
    members = kw.pop("members", tuple(policy.Member(s, f"n{s}") for s in range(world)))
    return policy.Facts(step, last, members=members, target=target, just_committed=kw.pop("just_committed", True),
                        now_unix_s=1000.0, **kw)


def kinds(items):
    return [policy.kind(i) for i in items]


PAUSE = StopRequest("pause", "make room", "scheduler")


@pytest.mark.parametrize("f, sections, expected", [
    (facts(), {}, []),
    (facts(step=10), {"checkpoint": {"every_steps": 5}}, ["Checkpoint"]),
    (facts(step=10, saved=True), {"checkpoint": {"every_steps": 5}}, []),
    (facts(step=10, tried=frozenset({"Checkpoint"})), {"checkpoint": {"every_steps": 5}}, []),
    (facts(step=10, just_committed=False), {"checkpoint": {"every_steps": 5}}, []),
    (facts(step=20), {"checkpoint": {"every_steps": 5}}, ["StopTraining"]),
    (facts(step=10, evaluates=True), {"checkpoint": {"every_steps": 5}, "eval": {"every_steps": 10}},
     ["Checkpoint", "Evaluate"]),
    (facts(step=20, evaluates=True), {"eval": {"every_steps": 7}, "train": {"max_steps": 20}},
     ["Evaluate", "StopTraining"]),
    (facts(stop=PAUSE, draining=(("n1", 1100.0),)), {}, ["StopTraining"]),
    (facts(early_stop="early stop: no better"), {}, ["StopTraining"]),
    (facts(straggler=(1, "rank 1 computes 2.00x its peers' median")), {}, ["ReplaceStraggler"]),
    (facts(draining=(("n1", 1100.0),)), {}, ["LeaveDraining"]),
    (facts(world=1, target=1, draining=(("n0", 1100.0),), ready=(policy.Member(7, "n5"),)), {}, ["LeaveDraining"]),
    (facts(draining=(("n1", 1100.0),), pending=(policy.Member(8, "n1"),)), {}, ["Release", "LeaveDraining"]),
    (facts(world=1, target=1, draining=(("n0", 1100.0),)), {}, ["TrainOnDraining"]),
    (facts(world=1, target=1, draining=(("n0", 1100.0),), tried=frozenset({"TrainOnDraining"})), {}, []),
    (facts(world=1, target=1, draining=(("n0", 1100.0),), pending=(policy.Member(9),),
           tried=frozenset({"TrainOnDraining"})), {}, []),
    (facts(world=1, target=1, draining=(("n0", 1010.0),)), {}, ["LeaveDraining"]),
    (facts(world=3, target=1, ceiling_reason="team b is owed its quota"), {}, ["Shrink"]),
    (facts(pending=(policy.Member(9),)), {}, ["Release"]),
    (facts(world=1), {}, ["RequestWorkers"]),
    (facts(world=1, ready=(policy.Member(9, "n9"),)), {}, ["RequestWorkers", "Grow"]),
    (facts(world=2, target=4, ready=(policy.Member(9, "n9"),)), {"parallel": {"tp": 2}}, ["RequestWorkers", "Bench"]),
    (facts(world=1, ready=(policy.Member(9, "n9"),), tried=frozenset({"RequestWorkers", "Grow"})), {}, []),
], ids=[
    "a step just committed with nothing due: an empty plan (the next lease may be sent ahead)",
    "a checkpoint due at the step just committed",
    "a checkpoint due but saved already (a drain saved first): not saved again",
    "a checkpoint tried at this boundary (its save failed): not again before the next interval",
    "a start or a restore at a multiple of every_steps: nothing committed, no checkpoint",
    "the last step: the step loop ends (the ending saves, not the plan)",
    "a checkpoint and an evaluation at the same step: the checkpoint first",
    "an evaluation at train.max_steps, then the end of the step loop",
    "a pause asked for: the step loop ends, nothing else is planned (not even a drain)",
    "an early stop: the step loop ends",
    "a straggler to replace",
    "a member on a draining node with enough staying: it leaves now",
    "the only member draining with a newcomer ready elsewhere: it hands the state over",
    "a newcomer starting on a draining node is let go before the members leave",
    "the only member draining, nobody ready and time left: it trains on",
    "training on asked at this boundary already: nothing more",
    "training on with its replacement starting: the replacement is kept (not a surplus newcomer)",
    "the only member draining and the deadline within the margin: save, then leave",
    "a ceiling below the world: the members above it leave",
    "at the target with a newcomer still starting (asked before a shrink): it is let go",
    "below the target with nobody ready: replacements are asked for",
    "below the target with a newcomer ready: the world grows",
    "tp=2 with one newcomer ready: too few for the next world, it waits on standby",
    "requested and grown at this boundary already: nothing more",
])
def test_boundary_plan(f, sections, expected):
    assert kinds(policy.plan(f, job(**sections))) == expected


def test_the_plan_names_who_leaves_and_why():
    f = facts(world=3, target=1, ceiling_reason="team b is owed its quota")
    [shrink] = policy.plan(f, job())
    assert shrink.slots == (1, 2) and shrink.reason == "shrinking to 1 worker(s) at step 6: team b is owed its quota"
    [leave] = policy.plan(facts(draining=(("n1", 1015.0),)), job())
    assert leave.slots == (1,) and leave.how == policy.Leave()
    assert leave.reason == "1 worker(s) on draining node(s) (deadline in 15 s): leaving at step 6"
    release, handover = policy.plan(facts(world=1, target=1, draining=(("n0", 1100.0),),
                                          ready=(policy.Member(7, "n0"), policy.Member(8, "n5"))), job())
    assert release.slots == (7,)  # up on the draining node itself: let go, not a successor
    assert handover.how == policy.HandOver() and "1 newcomer(s) take the state over" in handover.reason
    [train_on] = policy.plan(facts(world=1, target=1, draining=(("n0", None),)), job())
    assert train_on.nodes == ("n0",) and train_on.request == 1 and "no deadline" in train_on.reason


def test_the_plan_leaves_its_facts_alone():
    f = facts(world=1, ready=(policy.Member(9, "n9"),), draining=(("n0", 1100.0),))
    before = repr(f)
    policy.plan(f, job())
    assert repr(f) == before


def test_run_ahead_hold_keeps_an_evaluation_boundary():
    spec = job(eval={"every_steps": 5})
    assert policy.run_ahead_hold(10, 20, spec, 2, 2) == "an evaluation is due at step 10"
    assert policy.run_ahead_hold(11, 20, spec, 2, 2) == ""


@pytest.mark.parametrize("f, train, held", [
    (facts(), {}, False),
    (facts(), {"run_ahead": False}, True),
    (facts(draining=(("n1", 1100.0),)), {}, True),
    (facts(stop=PAUSE), {}, True),
    (facts(straggler=(1, "slow")), {}, True),
], ids=[
    "nothing at the boundary: the next lease is sent ahead",
    "train.run_ahead off: never sent ahead",
    "a member on a draining node: the boundary is kept for its leaving",
    "a pause asked for: the boundary is kept for it",
    "a straggler to replace: the boundary is kept for it",
])
def test_run_ahead_is_the_plan_being_empty(f, train, held):
    spec = job(train=train)
    reason = policy.hold_reason(f, spec)
    assert bool(reason) is held, reason
    if train.get("run_ahead", True):
        assert bool(policy.plan(f, spec)) is held


@pytest.mark.parametrize("f, cut", [
    (facts(), False),
    (facts(world=1), False),
    (facts(world=1, ready=(policy.Member(9, "n9"),)), True),
    (facts(draining=(("n1", 1100.0),)), True),
    (facts(stop=PAUSE), True),
    (facts(pending=(policy.Member(9),)), False),
], ids=[
    "nothing to do: the lease runs on",
    "below the target, nobody ready: replacements asked for at once, the lease runs on",
    "a newcomer ready: the lease is cut short for it to join",
    "a member on a draining node: cut short, it leaves after the step in flight",
    "a pause asked for: cut short",
    "a newcomer not needed: let go at once, the lease runs on",
])
def test_a_running_lease_is_cut_only_for_what_needs_the_members(f, cut):
    assert bool(policy.boundary_due(f, job())) is cut


@pytest.mark.parametrize("step, last, every, due", [
    (10, 20, 5, True), (11, 20, 5, False), (20, 20, 5, False), (0, 20, 5, False), (10, 20, 0, False),
], ids=[
    "a multiple of checkpoint.every_steps", "between two", "the last step: the ending saves",
    "step 0: nothing to save", "checkpoint.every_steps=0: never",
])
def test_checkpoint_due(step, last, every, due):
    assert policy.checkpoint_due(step, last, job(checkpoint={"every_steps": every})) is due


@pytest.mark.parametrize("step, stop, early, save_on_exit, expected", [
    (20, None, "", True, (True, "finished", "reached train.max_steps=20")),
    (20, None, "", False, (False, "finished", "reached train.max_steps=20")),
    (12, PAUSE, "", False, (True, "stopped", "paused by scheduler: make room (at step 12)")),
    (12, StopRequest("cancel", "no longer needed", "team-a"), "", True,
     (False, "cancelled", "cancelled by team-a: no longer needed (at step 12)")),
    (12, None, "early stop: no better", True, (True, "finished", "early stop: no better")),
    (10, None, "", True, (True, "stopped", "paused at train.stop_at_step=10")),
    (20, PAUSE, "", True, (True, "finished", "reached train.max_steps=20")),
], ids=[
    "train.max_steps reached: finished, saved (checkpoint.save_on_exit)",
    "train.max_steps reached with save_on_exit off: finished, not saved",
    "a pause: stopped, saved so it can resume",
    "a cancel: cancelled, no checkpoint added",
    "an early stop: finished, with its reason",
    "train.stop_at_step: stopped, resumable",
    "a pause that came after the last step: finished",
])
def test_ending(step, stop, early, save_on_exit, expected):
    spec = job(train={"max_steps": 20, "stop_at_step": 10 if step == 10 else 0},
               checkpoint={"save_on_exit": save_on_exit})
    e = policy.ending(step, spec, stop, early)
    assert (e.save, e.state, e.reason) == expected


# ------------------------------------------------------------------ a rank's kept step results
@pytest.mark.parametrize("kept, newest_from, first, keep, expected", [
    # The lease of steps 10..14 ran here, and the next one begins at 15: under run-ahead the
    # Supervisor may yet learn that 10..14 failed elsewhere (its reporter lost), and ask.
    ({10: "a", 11: "b", 14: "c"}, 10, 15, 0, [10, 11, 14]),
    # A lease older than the newest one before this goes, beyond the steps kept for an adoption.
    ({5: "old", 10: "a"}, 10, 15, 0, [10]),
    ({2: "older", 5: "old", 10: "a"}, 10, 15, 10, [5, 10]),
    # A restore rewound the run to step 8: the results of steps 8 on are of the old timeline.
    ({5: "a", 8: "b", 9: "c"}, 5, 8, 0, [5]),
    ({5: "a", 8: "b", 9: "c"}, 5, 8, 100, [5]),
])
def test_a_rank_keeps_the_results_of_the_lease_before_the_one_it_begins(kept, newest_from, first, keep, expected):
    from raytrain_sys.control.worker import results_kept

    assert sorted(results_kept(kept, newest_from, first, keep)) == expected


def test_a_kept_result_after_the_agreement_carries_every_ranks_loss():
    """A survivor alone can then commit the step with its whole loss, summed in rank order as
    ``report_results`` sums a lease's reports (the same float)."""
    import numpy as np

    from raytrain_sys.control.supervisor.steps import report_results
    from raytrain_sys.control.worker import AGREED, agreed_result

    ranks = np.zeros((3, len(AGREED)))
    ranks[:, AGREED.index("loss_sum")] = [0.1, 0.7, 0.2]
    agreed = {"step": 4, "lr": 1e-3, "grad_norm": 2.0, "ranks": ranks, "cut": False}
    mine = {"loss_sum": 0.7, "lr": 1e-3, "grad_norm": 2.0}
    kept = agreed_result(mine, agreed)
    assert kept["loss_sum"] == 0.7  # this rank's part, as before
    assert kept["loss_all"] == report_results([agreed])[0]["loss_sum"] == (0.1 + 0.7) + 0.2


class _SlotsOnly:
    """The part of a WorkerGroup that asking for replacements reads: who is in, starting, waiting."""

    def __init__(self, workers: int, pending: int, standby: int):
        self.workers, self.pending, self.standby = [object()] * workers, [object()] * pending, [object()] * standby
        self.asked = 0

    def drop_stale_pending(self, timeout_s: float) -> None:
        pass

    def request(self) -> None:
        self.asked += 1
        self.pending.append(object())


@pytest.mark.parametrize("workers, pending, standby, asked", [
    (2, 0, 0, 2),  # two lost of four: two asked for
    (2, 1, 1, 0),  # one up on standby (pp=2 needs two), one starting: none more (it asked for a third, never placed)
    (2, 0, 2, 0),
    (3, 0, 0, 1),
])
def test_replacements_count_the_newcomers_waiting_on_standby(workers, pending, standby, asked):
    from raytrain_sys.control.supervisor.membership import Membership

    spec = from_dict({"name": "t", "model": {"name": "gpt"}, "data": {"path": "/nowhere"},
                      "resources": {"num_workers": 4}, "parallel": {"pp": 2}})
    group = _SlotsOnly(workers, pending, standby)
    Membership(spec, group).request_replacements()
    assert group.asked == asked


@pytest.mark.parametrize("reported, cut, failed", [
    (3, False, False),  # every step reported: committed as it is
    (1, True, False),  # cut short: the rest is sent again, as planned
    (1, False, True),  # short, neither cut nor failed: rank 0's failure, never a step skipped
    (0, False, True),
])
def test_a_lease_short_of_its_steps_is_a_failure_not_a_skip(reported, cut, failed):
    from types import SimpleNamespace

    from raytrain_sys.control.supervisor.liveness import StepOutcome
    from raytrain_sys.control.supervisor.steps import _Dispatch
    from raytrain_sys.control.supervisor.supervisor import Supervisor

    lease = _Dispatch(step=6, members=[SimpleNamespace(slot=4), SimpleNamespace(slot=5)], refs=[], batches=[None] * 3,
                      shares=[], deadline_s=1.0, t0=0.0, data_wait=0.0, sent_ahead=False, lease=9)
    reports = [{"step": 6 + i, "cut": cut and i == reported - 1} for i in range(reported)]
    outcome = StepOutcome()
    Supervisor._check_reported(lease, outcome, reports)
    assert outcome.failed is failed
    if failed:
        assert "lease 9 (steps 7..9) ended after" in outcome.errored[4]
