"""benchmarks/sitting.py: every benchmark's standard form in one sitting, each figure beside its
goal and its last committed figure (issue 58). The verdicts and the tables are pure functions of
figures; the extractors are read against the committed results; the runner against tiny fake
benchmarks. No benchmark runs here."""

import json
import os
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import _sitting_forms as forms  # noqa: E402
import sitting  # noqa: E402
from _sitting_forms import Benchmark, Figure, Goal, Noise, Point  # noqa: E402

RESULTS = Path(__file__).resolve().parent.parent / "benchmarks" / "results"


def fig(better="lower", goal=None, noise=Noise(rel=0.25), unit="s") -> Figure:
    return Figure("f", "a figure", unit, better, lambda d: d.get("f"), noise, goal)


def dated(value, when="2026-12-01T00:00:00+00:00", source="a.json", limit=None) -> sitting.Dated:
    return sitting.Dated(value, limit, when, source)


@pytest.mark.parametrize("figure, point, verdict", [
    (fig(goal=Goal("<=", 2.0, "2 s", "issue 0")), Point(1.5), "met"),
    (fig(goal=Goal("<=", 2.0, "2 s", "issue 0")), Point(2.5), "not met"),
    (fig(goal=Goal("<=", 2.0, "2 s", "issue 0")), Point(2.0), "met"),
    (fig("higher", Goal(">=", 0.9, "0.9x", "issue 0")), Point(0.95), "met"),
    (fig("higher", Goal(">=", 0.9, "0.9x", "issue 0")), Point(0.85), "not met"),
    (fig(goal=Goal("<=", None, "2 step times + 2 s", "issue 0")), Point(2.0, limit=2.5), "met"),
    (fig(goal=Goal("<=", None, "2 step times + 2 s", "issue 0")), Point(3.0, limit=2.5), "not met"),
    (fig(goal=Goal("<=", None, "2 step times + 2 s", "issue 0")), Point(1.0), "-"),
    (fig(), Point(1.0), "no goal"),
    (fig(goal=Goal("<=", 2.0, "2 s", "issue 0")), None, "-"),
], ids=[
    "a figure under its ceiling meets it",
    "a figure over its ceiling does not meet it",
    "a figure exactly at its ceiling meets it",
    "a figure above its floor meets it",
    "a figure below its floor does not meet it",
    "a goal the run sets (2 step times + 2 s) is judged by that run's own limit",
    "over the run's own limit is not met",
    "a goal the run sets is not judged when the run gave no limit",
    "a figure without a goal says so",
    "no figure now is not judged",
])
def test_goal_verdict(figure, point, verdict):
    assert sitting.goal_verdict(figure, point) == verdict


@pytest.mark.parametrize("figure, now, last, verdict", [
    (fig(), Point(2.6), dated(2.0), "worse"),
    (fig(), Point(2.4), dated(2.0), "same"),
    (fig(), Point(2.5), dated(2.0), "same"),
    (fig(), Point(1.4), dated(2.0), "better"),
    (fig("higher"), Point(1.4), dated(2.0), "worse"),
    (fig("higher"), Point(2.6), dated(2.0), "better"),
    (fig(noise=Noise(abs=0.1)), Point(0.45), dated(0.3), "worse"),
    (fig(noise=Noise(rel=0.1, abs=0.25)), Point(1.2), dated(1.0), "same"),
    (fig(noise=Noise(abs=0), unit="steps"), Point(1.0), dated(0.0), "worse"),
    (fig(noise=Noise(abs=0), unit="steps"), Point(0.0), dated(0.0), "same"),
    (fig(), Point(2.0), None, "new"),
    (fig(), None, dated(2.0), "-"),
], ids=[
    "lower is better: a rise beyond the relative band is worse",
    "lower is better: a rise within the band is the same",
    "a change of exactly the band is the same",
    "lower is better: a fall beyond the band is better",
    "higher is better: a fall beyond the band is worse",
    "higher is better: a rise beyond the band is better",
    "an absolute band counts in the figure's unit",
    "the larger of the relative and the absolute band applies",
    "with no band, one step redone where none was is worse",
    "with no band, none redone again is the same",
    "nothing committed of the form makes the figure new",
    "no figure now is compared with nothing",
])
def test_change_verdict(figure, now, last, verdict):
    assert sitting.change_verdict(figure, now, last) == verdict


def test_todays_pause_is_worse_than_the_last_committed_beyond_its_noise():
    # issue 58: 8.0 s beyond the checkpoint today, 0.275 s in results/scheduler.json (2026-11-25)
    pause = next(f for f in forms.BY_NAME["scheduler"].figures if f.key == "pause_slack_s")
    assert sitting.change_verdict(pause, Point(8.0), dated(0.275)) == "worse"
    assert sitting.goal_verdict(pause, Point(8.0)) == "not met"
    assert sitting.change_verdict(pause, Point(0.35), dated(0.275)) == "same"


@pytest.mark.parametrize("points, before, exclude, newest", [
    ([dated(1, "2026-11-01T00:00:00+00:00", "old.json"), dated(2, "2026-12-01T00:00:00+00:00", "new.json")],
     None, None, "new.json"),
    ([dated(1, "2026-11-01T00:00:00+00:00", "old.json"), dated(2, "2026-12-01T00:00:00+00:00", "new.json")],
     "2026-11-15T00:00:00+00:00", None, "old.json"),
    ([dated(1, "2026-11-01T00:00:00+00:00", "old.json"), dated(2, "2026-11-02T00:00:00+00:00", "sitting_x.json")],
     None, "sitting_x.json", "old.json"),
    ([], None, None, None),
], ids=[
    "the newest committed figure is the last",
    "a figure dated after the sitting is not its last",
    "a sitting's own file is never its own last",
    "nothing committed, no last",
])
def test_newest(points, before, exclude, newest):
    got = sitting.newest(points, before, exclude)
    assert (got.source if got else None) == newest


BENCH = Benchmark("fake", "fake.py", ("--form",), "a fake", 1, 1,
                  (fig(goal=Goal("<=", 2.0, "2 s", "issue 0")),), lambda f, d: True)


def test_a_failed_benchmark_is_rows_that_say_so_with_the_last_figure_beside():
    rows = sitting.make_rows([BENCH], {}, {"fake": "timed out after 20 min"}, {("fake", "f"): [dated(1.5)]})
    [row] = rows
    assert row.now is None and row.last.value == 1.5 and row.status == "timed out after 20 min"
    lines = sitting.table(rows)
    assert "[timed out after 20 min]" in lines[1]
    assert lines[2].split()[-1] == "-" and sitting.worse_or_missing(rows) == rows


def test_the_table_marks_a_figure_worse_than_its_last():
    rows = sitting.make_rows([BENCH], {"fake": {"f": Point(3.0)}}, {"fake": "ok"}, {("fake", "f"): [dated(1.5)]})
    line = sitting.table(rows)[2]
    assert "3.00 s" in line and "not met" in line and "1.50 s (2026-12-01)" in line and line.endswith("worse")
    assert sitting.worse_or_missing(rows) == rows


def test_a_figure_as_good_as_its_last_is_not_flagged():
    rows = sitting.make_rows([BENCH], {"fake": {"f": Point(1.6)}}, {"fake": "ok"}, {("fake", "f"): [dated(1.5)]})
    assert sitting.table(rows)[2].endswith("same") and sitting.worse_or_missing(rows) == []


@pytest.mark.parametrize("text, ok", [
    (f"a\n{sitting.README_BEGIN}\nold\n{sitting.README_END}\nb\n", True),
    ("a\nno markers\n", False),
    (f"{sitting.README_BEGIN}\n{sitting.README_BEGIN}\n{sitting.README_END}\n", False),
], ids=[
    "the table between the markers is replaced and nothing else",
    "a README without the markers is refused",
    "a README with a marker twice is refused",
])
def test_replace_table(text, ok):
    if not ok:
        with pytest.raises(ValueError):
            sitting.replace_table(text, ["new"])
        return
    assert sitting.replace_table(text, ["| new |"]) == f"a\n{sitting.README_BEGIN}\n| new |\n{sitting.README_END}\nb\n"


# ----------------------------------------------------------------------------- the committed results

EXTRACTED = [  # (form, committed file, figure, its value there, the limit its run set)
    ("scheduler", "scheduler.json", "pause_slack_s", 0.275, None),
    ("scheduler", "scheduler_reclaim_dec06.json", "reclaim_s", 0.833, 1.2 * 0.308),
    ("scheduler", "scheduler_handover_nov26b.json", "handover_s", 0.986, 1.5 * 0.661),
    ("ddp_overhead", "ddp_overhead_dec05.json", "vs_torchrun", 0.9528, None),
    ("recovery", "recovery_reread.json", "worker_kill_s", 1.0642, 2.5179),
    ("recovery", "recovery_finished_reads.json", "drain_left_s", 0.2949, 1.1771),
    ("recovery", "recovery.json", "ray_train_kill_ratio", 11.924, None),
    ("recovery_hang", "recovery_hang.json", "hang_s", 6.4685, 7.9392),
    ("recovery_hang", "recovery_hang.json", "ray_train_hang_ratio", 11.1574, None),
    ("peer_copies", "peer_copies_steady_dec05.json", "large_step", 1.131, None),
    ("peer_copies", "peer_copies.json", "extra_shards", 3.016, None),
    ("peer_copies_kill", "peer_copies.json", "regain", 0.2893, None),
    ("data_path", "data_path.json", "driver_bytes", 250.31, None),
    ("data_throughput_warm", "data_throughput_40epochs.json", "rows", 1.1749, None),
    ("data_throughput_cold", "data_throughput.json", "rows", 0.4864, None),
    ("control_plane", "control_plane_gpt2_rows.json", "driver_cpu_64", 0.695, None),
    ("sweep", "sweep_dec06.json", "asha_time", 98.786 / 194.968, None),
    ("sweep", "sweep_dec06.json", "stop_to_step", 1.423 / 0.184, None),
    ("autoscale", "autoscale.json", "ours_over_warm", 8.1, None),
    ("checkpoint", "checkpoint.json", "stall_s3", 0.00503, None),
    ("reshard_memory", "reshard_memory.json", "shrink", 1.0802, None),
    ("idle_footprint", "idle_footprint.json", "pss_mb", 1720.9, None),
    ("allreduce_gloo", "allreduce_gloo.json", "latency_us", 67.72, None),
    ("parallel", "parallel.json", "ddp_tokens", 16825.1, None),
    ("plots_overhead", "plots_overhead.json", "child", 1.1641, None),
]


@pytest.mark.parametrize("bench, file, key, value, limit", EXTRACTED,
                         ids=[f"{b}'s {k} is read from {f}" for b, f, k, _, _ in EXTRACTED])
def test_each_extractor_reads_its_committed_result(bench, file, key, value, limit):
    b = forms.BY_NAME[bench]
    data = json.loads((RESULTS / file).read_text())
    assert b.accepts(file, data), f"{file} is not of {bench}'s form"
    point = sitting.figure_point(next(f for f in b.figures if f.key == key), data)
    assert point.value == pytest.approx(value, rel=1e-3)
    assert point.limit == (pytest.approx(limit, rel=1e-3) if limit is not None else None)


def test_the_step_breakdown_figure_is_the_median_its_script_writes():
    b = forms.BY_NAME["step_breakdown"]
    data = {"benchmark": "step_breakdown", "quick": False, "ratios": [1.0, 1.2, 1.01], "median": 1.01}
    assert b.accepts("x.json", data) and sitting.figure_point(b.figures[0], data) == Point(1.01)


@pytest.mark.parametrize("bench, file", [
    ("data_throughput_warm", "data_throughput_8epochs.json"),
    ("data_throughput_cold", "data_throughput_8epochs.json"),
    ("scheduler", "scheduler_handover.json"),
    ("sweep", "sweep_quick_tell_runner.json"),
    ("ddp_overhead", "ddp_overhead_1worker.json"),
    ("peer_copies_kill", "peer_copies_steady_dec05.json"),
    ("recovery", "recovery_hang.json"),
    ("recovery_hang", "recovery_reread.json"),
], ids=[
    "an 8-epoch read is neither the warm (40) nor the cold (1) form",
    "(the same)",
    "a file bundling two invocations is read by no form",
    "a sweep of 400-step trials (--quick) is not the 1,000-step form",
    "one worker is not ddp_overhead's form of two",
    "a run without the kill section holds no kill figures",
    "recovery.py's hang pair alone (--sections hang) holds no kill, node or drain figure",
    "recovery.py's four default faults hold no hang figure",
])
def test_a_result_of_another_form_is_not_a_last_figure(bench, file):
    data = json.loads((RESULTS / file).read_text())
    assert not forms.BY_NAME[bench].accepts(file, data)


@pytest.mark.parametrize("bench, file", [("scheduler", "scheduler.json"), ("recovery", "recovery.json"),
                                         ("checkpoint", "checkpoint.json")],
                         ids=["scheduler.py's", "recovery.py's", "checkpoint.py's"])
def test_a_smoke_test_of_the_same_flags_is_not_the_standard_form(bench, file):
    data = json.loads((RESULTS / file).read_text())
    assert forms.BY_NAME[bench].accepts(file, data)
    assert not forms.BY_NAME[bench].accepts(file, {**data, "quick": True})


def test_every_committed_result_reads_without_an_extractor_error():
    found, errors = sitting.history(sitting.committed_results())
    assert errors == []
    for b in forms.BENCHMARKS:
        if b.name != "step_breakdown":  # nothing committed of it before the first sitting
            assert any((b.name, f.key) in found for f in b.figures), b.name


def test_a_committed_sitting_gives_its_figures_of_todays_form_only():
    form = list(forms.BY_NAME["scheduler"].args)
    runs = {"scheduler": {"form": form, "started": "2026-12-08T00:00:00+00:00",
                          "figures": {"pause_slack_s": {"value": 0.4, "limit": None}}},
            "recovery": {"form": ["--scenarios", "drain"], "started": "2026-12-08T00:10:00+00:00",
                         "figures": {"drain_left_s": {"value": 0.2, "limit": 1.2}}}}
    found, errors = sitting.history({"sitting_x.json": ({"benchmark": "sitting", "runs": runs}, "2026-12-08")})
    assert errors == [] and list(found) == [("scheduler", "pause_slack_s")]
    assert found[("scheduler", "pause_slack_s")] == [dated(0.4, "2026-12-08T00:00:00+00:00", "sitting_x.json")]


def test_the_readme_table_is_the_newest_committed_figure_of_each():
    readme = sitting.README.read_text()
    found, _ = sitting.history(sitting.committed_results())
    lines = sitting.readme_table(sitting.make_rows(forms.BENCHMARKS, {}, {}, found))
    assert sitting.replace_table(readme, lines) == readme, "run: python benchmarks/sitting.py --readme"


def test_a_sittings_json_makes_its_table_again_without_running(tmp_path, capsys):
    runs = {"scheduler": {"form": list(forms.BY_NAME["scheduler"].args), "status": "ok",
                          "figures": {"pause_slack_s": {"value": 8.0, "limit": None}}},
            "sweep": {"form": list(forms.BY_NAME["sweep"].args), "status": "timed out after 25 min", "figures": {}}}
    path = tmp_path / "sitting_x.json"
    path.write_text(json.dumps({"benchmark": "sitting", "time": "2026-12-08T00:00:00+00:00", "runs": runs}))
    assert sitting.main(["--from-results", str(path), "--only", "scheduler,sweep"]) == 0
    out = capsys.readouterr().out.splitlines()
    pause = next(line for line in out if "beyond the checkpoint" in line)
    assert "8.00 s" in pause and "not met" in pause and pause.endswith("worse")
    assert any(line.startswith("sweep:") and "[timed out after 25 min]" in line for line in out)


# ----------------------------------------------------------------------------- the runner

def fake(tmp_path: Path, body: str, setup: tuple[str, ...] = ()) -> Benchmark:
    script = tmp_path / "fake_bench.py"
    script.write_text("import json, os, subprocess, sys, time\nout = sys.argv[sys.argv.index('--out') + 1]\n" + body)
    return Benchmark("fake", str(script), (), "a fake", 0.1, 1, (fig(goal=Goal("<=", 2.0, "2 s", "issue 0")),),
                     lambda f, d: True, setup)


def test_a_benchmark_that_writes_its_json_and_exits_1_gives_its_figures(tmp_path):
    # scheduler.py and sweep.py exit 1 when a goal is not met, their figures written all the same
    b = fake(tmp_path, "json.dump({'f': 2.5}, open(out, 'w'))\nsys.exit(1)\n")
    run = sitting.run_benchmark(b, tmp_path, 60)
    assert run["status"] == "ok" and run["figures"] == {"f": {"value": 2.5, "limit": None}}


def test_a_benchmark_that_fails_without_its_json_is_a_row_that_says_so(tmp_path):
    run = sitting.run_benchmark(fake(tmp_path, "print('boom'); sys.exit(3)\n"), tmp_path, 60)
    assert run["status"] == "failed (exit 3, no result JSON)" and run["figures"] == {}
    assert "boom" in Path(run["log"]).read_text()


def test_a_timed_out_benchmark_is_ended_with_its_children_and_says_so(tmp_path):
    body = ("child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
            f"open({str(tmp_path / 'child.pid')!r}, 'w').write(str(child.pid))\ntime.sleep(60)\n")
    t0 = time.monotonic()
    run = sitting.run_benchmark(fake(tmp_path, body), tmp_path, 3)
    assert run["status"] == "timed out after 3 s" and time.monotonic() - t0 < 30
    child = int((tmp_path / "child.pid").read_text())
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and Path(f"/proc/{child}").exists() and \
            Path(f"/proc/{child}/stat").read_text().split()[2] != "Z":
        time.sleep(0.1)
    assert not Path(f"/proc/{child}").exists() or Path(f"/proc/{child}/stat").read_text().split()[2] == "Z"


def test_a_failed_setup_stops_the_benchmark_before_it_runs(tmp_path):
    b = fake(tmp_path, "json.dump({'f': 1.0}, open(out, 'w'))\n", setup=("-c", "import sys; sys.exit(4)"))
    run = sitting.run_benchmark(b, tmp_path, 60)
    assert run["status"] == "setup failed (exit 4)" and not (tmp_path / "fake.json").exists()


def test_the_list_shows_each_forms_minutes_in_the_newest_sitting_that_ran_it():
    def one(minutes: float) -> dict:
        return {"benchmark": "sitting", "runs": {"sweep": {"wall_s": 60 * minutes}}}
    results = {"sitting_a.json": (one(9.0), "2026-12-08T00:00:00+00:00"),
               "sitting_b.json": (one(7.5), "2026-12-09T00:00:00+00:00"),
               "sweep_dec06.json": ({"benchmark": "sweep", "elapsed_s": 501.6}, "2026-12-06T01:44:19+00:00")}
    assert sitting.last_sitting_minutes(results) == {"sweep": "7.5 min on 2026-12-09"}
