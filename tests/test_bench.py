"""`spec bench humaneval` end to end on tiny models: files written, resume, and dataset errors."""

import gzip
import json

import pytest
from conftest import HUMANEVAL
from helpers import assert_clean_error, spec

from spec_cli import humaneval
from spec_cli.bench import summarize
from spec_cli.core.errors import SpecError

PROBLEMS = [
    {"task_id": "HumanEval/0", "prompt": "def add(a, b):\n", "entry_point": "add",
     "canonical_solution": "    return a + b\n", "test": "def check(f):\n    assert f(1, 2) == 3\n"},
    {"task_id": "HumanEval/1", "prompt": "def fib(n):\n", "entry_point": "fib",
     "canonical_solution": "    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
     "test": "def check(f):\n    assert f(10) == 55\n"},
    {"task_id": "HumanEval/2", "prompt": "import os\n\ndef name():\n", "entry_point": "name",
     "canonical_solution": "    return 'x'\n", "test": "def check(f):\n    assert f() == 'x'\n"},
]


@pytest.fixture
def dataset(tmp_path):
    path = tmp_path / "problems.jsonl.gz"
    with gzip.open(path, "wt") as f:
        for p in PROBLEMS:
            f.write(json.dumps(p) + "\n")
    return path


def bench(profile, dataset, out, *extra):
    return spec("bench", "humaneval", "-p", str(profile), "--dataset", str(dataset), "--out", str(out),
                "-n", "10", "--dtype", "float32", *extra)


def test_bench_writes_rows_summary_and_chart(profile, dataset, tmp_path):
    out = tmp_path / "run"
    result = bench(profile, dataset, out, "--methods", "baseline,speculative,staged,hf_assisted")
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert len(rows) == 3 * 2 * 4
    assert {(r["mode"], r["method"]) for r in rows} == {
        (mode, m) for mode in ("greedy", "topk") for m in ("baseline", "speculative", "staged", "hf_assisted")}
    greedy = [r for r in rows if r["mode"] == "greedy"]
    assert all(r["identical"] for r in greedy if r["method"] != "hf_assisted")
    for r in rows:
        assert 0 < r["new_tokens"] <= 10 and r["seconds"] > 0 and r["oracle_forwards"] > 0
        assert (r["method"] == "hf_assisted") == ("first_token_seconds" not in r)  # (its generate says nothing)
    summary = json.loads((out / "summary.json").read_text())
    for method in ("baseline", "speculative", "staged"):  # the median of the rows' times to the first token
        firsts = sorted(r["first_token_seconds"] for r in greedy if r["method"] == method)
        assert 0 < firsts[0] and summary["summary"]["greedy"][method]["first_token_median"] == round(firsts[1], 4)
    assert summary["summary"]["greedy"]["hf_assisted"]["first_token_median"] is None
    assert summary["complete"] and summary["dtype"] == "float32" and "torch" in summary["machine"]
    staged = summary["summary"]["greedy"]["staged"]
    assert staged["identical"] == 3 and staged["oracle_traffic"] <= 1 and len(staged["speedups"]) == 3
    assert summary["summary"]["greedy"]["speculative"]["oracle_traffic"] < 1
    topk = summary["summary"]["topk"]  # coupled sampling: every method samples baseline's text for the seed
    assert topk["speculative"]["identical"] == topk["staged"]["identical"] == 3
    assert "identical" not in topk["hf_assisted"]
    assert summary["summary"]["greedy"]["hf_assisted"]["oracle_traffic"] is not None
    assert "speedup" in result.stdout and "staged" in result.stdout  # the table
    if "relative-speed.png" in result.stderr:  # matplotlib present: the figure
        assert (out / "relative-speed.png").stat().st_size > 0 and (out / "relative-speed.svg").is_file()
    else:  # the terminal chart: one row per mode and method, one block per problem
        chart = result.stdout.split("speed relative to baseline per problem")[1]
        assert sum(line.split()[0] in ("greedy", "topk") for line in chart.splitlines() if line.strip()) == 6


def test_baseline_again_is_the_noise_floor_of_a_per_problem_ratio(profile, dataset, tmp_path):
    """The oracle alone timed twice: the same tokens and forwards, and its ratios to the first timing show how
    far apart two timings of the same work fall on this machine (what "below 0.9 of best" must be read against)."""
    out = tmp_path / "run"
    result = bench(profile, dataset, out, "--methods", "baseline,speculative,baseline:again", "--modes", "greedy")
    assert result.returncode == 0, result.stderr
    rows = {(r["task_id"], r["method"]): r for r in map(json.loads, (out / "results.jsonl").read_text().splitlines())}
    for p in PROBLEMS:
        first, again = rows[(p["task_id"], "baseline")], rows[(p["task_id"], "baseline:again")]
        assert again["tokens"] == first["tokens"] and again["oracle_forwards"] == first["oracle_forwards"]
        assert again["settings"]["method"] == "baseline" and again["draft_forwards"] == 0
    summary = json.loads((out / "summary.json").read_text())["summary"]["greedy"]["baseline:again"]
    assert len(summary["speedups"]) == 3 and len(summary["vs_best"]) == 3 and summary["identical"] == 3
    assert "baseline:again" in result.stdout


def test_bench_resume_continues_without_duplicates(profile, dataset, tmp_path, monkeypatch):
    """Interrupted, the run prints how to continue; that command, exactly as printed, finishes it (run.json
    remembers the profile, dataset, limits and methods); a resume that changes a setting names it."""
    from spec_cli import bench as bench_module

    out = tmp_path / "run"
    real, calls = bench_module.measure, []

    def interrupted(*args, **kwargs):
        calls.append(args[1])
        if len(calls) == 6:  # after the warm-up (2) and three rows
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(bench_module, "measure", interrupted)
    first = bench(profile, dataset, out, "--limit", "3", "--methods", "baseline,staged", "--modes", "greedy")
    monkeypatch.setattr(bench_module, "measure", real)
    assert first.returncode == 130 and len(_rows(out)) == 3, first.stderr
    hint = first.stderr.split("continue with: ")[1].strip()
    assert hint == f"spec bench humaneval --resume --out {out}"
    again = bench(profile, dataset, out, "--limit", "3", "--methods", "baseline,staged", "--modes", "greedy")
    assert_clean_error(again, "already has results; pass --resume")
    with (out / "results.jsonl").open("a") as f:
        f.write('{"task_id": "HumanEval/2", "mo')  # a row cut short by Ctrl-C
    resumed = spec(*hint.split()[1:])  # as printed: no profile, dataset, limit or methods given
    assert resumed.returncode == 0, resumed.stderr
    keys = [(r["task_id"], r["method"]) for r in _rows(out)]
    assert sorted(keys) == sorted({(p["task_id"], m) for p in PROBLEMS for m in ("baseline", "staged")})
    assert all(r["mode"] == "greedy" and r["new_tokens"] <= 10 for r in _rows(out))
    changed = bench(profile, dataset, out, "--resume", "-n", "11", "--modes", "greedy,topk")
    assert_clean_error(changed, "cannot resume the run in")
    assert "--modes is greedy there, greedy,topk here; --max-new-tokens is 10 there, 11 here" in changed.stderr
    same = bench(profile, dataset, out, "--resume", "--limit", "3")  # the same values may be repeated
    assert same.returncode == 0, same.stderr


def test_a_disk_that_fills_mid_run_keeps_every_row_measured_in_view_and_the_written_ones_for_resume(
        profile, dataset, tmp_path, monkeypatch):
    import errno

    from spec_cli import benchview

    out = tmp_path / "run"
    real, written = benchview.append, []

    def append(f, row):
        if len(written) == 2:
            f.write('{"task_id": "HumanEval/1", "mo')  # (what a full disk lets through)
            f.flush()
            raise OSError(errno.ENOSPC, "No space left on device")
        written.append(row)
        real(f, row)

    monkeypatch.setattr(benchview, "append", append)
    full = bench(profile, dataset, out, "--limit", "3", "--methods", "baseline,staged", "--modes", "greedy")
    monkeypatch.setattr(benchview, "append", real)
    said = [line for line in full.stderr.splitlines() if line.strip()]
    assert full.returncode == 1 and "Traceback" not in full.stderr
    assert said[-1].startswith(f"error: cannot write to {out}: No space left on device; the table holds all 3 rows "
                               "measured, results.jsonl the first 2")
    assert "staged" in full.stdout and "baseline" in full.stdout  # (the table of the rows measured)
    hint = said[-1].split("continue with: ")[1]
    resumed = spec(*hint.split()[1:])
    assert resumed.returncode == 0, resumed.stderr
    keys = [(r["task_id"], r["method"]) for r in _rows(out)]
    assert sorted(keys) == sorted({(p["task_id"], m) for p in PROBLEMS for m in ("baseline", "staged")})
    (tmp_path / "a-file").write_text("")
    assert_clean_error(bench(profile, dataset, tmp_path / "a-file" / "run"), "cannot write the run's files in")


def test_repeats_are_interleaved_and_each_row_holds_the_median(profile, dataset, tmp_path, monkeypatch):
    """With --repeats, a problem's methods take turns (every other round in reverse), so a slow spell of a busy
    machine falls on every method alike; each row's time is the median of its method's timings."""
    from spec_cli import bench as bench_module

    out, real, calls = tmp_path / "run", bench_module.measure, []

    def recorded(*args, **kwargs):
        m = real(*args, **kwargs)
        calls.append((args[1], m.seconds, m.first))
        return m

    monkeypatch.setattr(bench_module, "measure", recorded)
    result = bench(profile, dataset, out, "--limit", "1", "--methods", "baseline,staged", "--modes", "greedy",
                   "--repeats", "3")
    assert result.returncode == 0, result.stderr
    firsts_timed = calls[2:]  # after the warm-up
    timed = [(m, s) for m, s, _ in firsts_timed]
    assert [m for m, _ in timed] == ["baseline", "staged", "staged", "baseline", "baseline", "staged"]
    rows = _rows(out)
    assert len(rows) == 2
    for row in rows:
        mine = [s for m, s in timed if m == row["method"]]
        assert row["repeats"] == 3 and row["seconds"] == pytest.approx(sorted(mine)[1], abs=1e-6)
        firsts = [f for m, _, f in firsts_timed if m == row["method"]]
        assert row["first_token_seconds"] == pytest.approx(sorted(firsts)[1], abs=1e-6)
    assert all(r["identical"] for r in rows)


def _rows(out):
    rows = []
    for line in (out / "results.jsonl").read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def test_bench_dataset_errors(profile, tmp_path):
    assert_clean_error(bench(profile, tmp_path / "missing.jsonl", tmp_path / "o"), "dataset not found")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(PROBLEMS[0]) + "\n{not json\n")
    assert_clean_error(bench(profile, bad, tmp_path / "o"), "bad.jsonl:2: not a JSON object")
    promptless = tmp_path / "promptless.jsonl"
    promptless.write_text('{"task_id": "x"}\n')
    assert_clean_error(bench(profile, promptless, tmp_path / "o"), "promptless.jsonl:1: each line needs")
    untested = tmp_path / "prompts.jsonl"
    untested.write_text('{"prompt": "def f(x):"}\n')
    assert_clean_error(bench(profile, untested, tmp_path / "o", "--check"), "--check: prompts/0 has no tests")
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps(PROBLEMS[0]) + "\n")
    assert_clean_error(bench(profile, good, tmp_path / "o", "--tasks", "7"), "unknown task(s): HumanEval/7")
    assert_clean_error(bench(profile, good, tmp_path / "o", "--methods", "warp"), "unknown method 'warp'")


def test_check_runs_the_tests_in_a_separate_process():
    problem = PROBLEMS[1]
    assert humaneval.check(problem, problem["canonical_solution"])
    assert not humaneval.check(problem, "    return 0\n")
    assert not humaneval.check(problem, "    while True:\n        pass\n", timeout=1)


@pytest.mark.skipif(not HUMANEVAL.is_file(), reason="needs ../shared")
def test_real_humaneval_file_and_canonical_solutions():
    problems = humaneval.load(HUMANEVAL)
    assert len(problems) == 164 and problems[0]["task_id"] == "HumanEval/0"
    for p in humaneval.select(problems, ["0,1", "HumanEval/2"], None):
        assert humaneval.check(p, p["canonical_solution"])


def test_run_json_keeps_draft2_files_as_absolute_paths(tmp_path, monkeypatch):
    from spec_cli.benchview import _canonical

    monkeypatch.chdir(tmp_path)
    for given, kept in [("x.npz", tmp_path / "x.npz"), ("prompt-lookup+x.npz", f"prompt-lookup+{tmp_path / 'x.npz'}"),
                        ("prompt-lookup", "prompt-lookup"), ("none", "none")]:
        assert _canonical({"draft2": given})["draft2"] == str(kept)


def test_tasks_take_numbers_ids_and_ranges():
    problems = [{"task_id": f"HumanEval/{i}"} for i in range(20)]
    chosen = humaneval.select(problems, ["3,HumanEval/0", "10-12"], None)
    assert [p["task_id"] for p in chosen] == ["HumanEval/0", "HumanEval/3", "HumanEval/10", "HumanEval/11",
                                               "HumanEval/12"]
    with pytest.raises(SpecError, match="HumanEval/20"):
        humaneval.select(problems, ["18-20"], None)


def test_a_file_of_prompts_is_a_dataset_named_by_the_file(profile, tmp_path):
    prompts = tmp_path / "edits.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["def f(x):", "import os", "class A:"])
                       + json.dumps({"task_id": "mine", "prompt": "x = "}) + "\n")
    problems = humaneval.load(prompts)
    assert [p["task_id"] for p in problems] == ["edits/0", "edits/1", "edits/2", "mine"]
    assert [p["task_id"] for p in humaneval.select(problems, ["2,0-1", "mine"], None)] == \
        ["edits/0", "edits/1", "edits/2", "mine"]
    with pytest.raises(SpecError, match="edits/4"):
        humaneval.select(problems, ["4"], None)
    out = tmp_path / "run"
    result = bench(profile, prompts, out, "--methods", "baseline,staged", "--modes", "greedy", "--tasks", "0,2")
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert sorted({r["task_id"] for r in rows}) == ["edits/0", "edits/2"] and len(rows) == 4
    assert json.loads((out / "summary.json").read_text())["summary"]["greedy"]["staged"]["identical"] == 2


def test_truncate_at_code_stops():
    text, stopped = humaneval.truncate("    return 1\n\ndef other():\n", humaneval.CODE_STOPS)
    assert stopped and text == "    return 1\n"


def test_dataset_is_downloaded_once_into_the_cache(tmp_path, monkeypatch, dataset):
    monkeypatch.setattr(humaneval, "URL", dataset.as_uri())
    monkeypatch.setattr(humaneval, "cached_path", lambda: tmp_path / "cache" / "HumanEval.jsonl.gz")
    assert [p["task_id"] for p in humaneval.load()] == [p["task_id"] for p in PROBLEMS]
    assert (tmp_path / "cache" / "HumanEval.jsonl.gz").is_file()
    monkeypatch.setattr(humaneval, "URL", (tmp_path / "gone.gz").as_uri())
    assert len(humaneval.load()) == 3  # from the cache, no second download
    (tmp_path / "cache" / "HumanEval.jsonl.gz").unlink()
    with pytest.raises(humaneval.SpecError, match="cannot download HumanEval"):
        humaneval.load()


def test_summary_holds_each_method_against_the_better_of_baseline_and_speculative():
    def row(task, method, rate):
        return {"task_id": task, "mode": "greedy", "method": method, "new_tokens": 10, "seconds": 10 / rate,
                "tokens_per_second": rate, "oracle_forwards": 10, "proposed": {}, "accepted": {}}

    rows = [row("t1", "baseline", 100), row("t1", "speculative", 150), row("t1", "staged", 120),
            row("t2", "baseline", 100), row("t2", "speculative", 50), row("t2", "staged", 110)]
    staged = summarize(rows)["greedy"]["staged"]
    assert staged["vs_best"] == [0.8, 1.1]  # t1 against speculative, t2 against baseline
    assert staged["below_0.9_of_best"] == 1
    assert staged["vs_best_geomean"] == pytest.approx((0.8 * 1.1) ** 0.5, abs=1e-4)
    assert summarize(rows)["greedy"]["speculative"]["vs_best_geomean"] is None


def test_the_top_p_mode_samples_baseline_s_text_with_every_method(profile, dataset, tmp_path):
    """--modes topp: the usual chat setting (top-p 0.95, temperature 0.8, no top-k), coupled: every method's text
    is baseline's for the problem's seed."""
    out = tmp_path / "run"
    result = bench(profile, dataset, out, "--methods", "baseline,speculative,staged", "--modes", "topp")
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert {r["mode"] for r in rows} == {"topp"} and len(rows) == 3 * 3
    topp = json.loads((out / "summary.json").read_text())["summary"]["topp"]
    assert topp["speculative"]["identical"] == topp["staged"]["identical"] == 3
    assert_clean_error(bench(profile, dataset, out, "--modes", "nucleus"), "unknown mode 'nucleus'")
