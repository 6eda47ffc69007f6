"""Hidden checks and machine-readable results (our JSON, Gradescope's results.json, JUnit)."""
import json

# Fields and values from Gradescope's results.json specification (see shared notes, section 5).
TOP_LEVEL = {"score", "max_score", "execution_time", "output", "output_format", "test_output_format",
             "test_name_format", "visibility", "stdout_visibility", "extra_data", "tests", "leaderboard"}
PER_TEST = {"score", "max_score", "status", "name", "name_format", "number", "output", "output_format",
            "tags", "visibility", "extra_data"}
VISIBILITY = {"hidden", "after_due_date", "after_published", "visible"}


def assert_valid_gradescope(data: dict) -> None:
    assert set(data) <= TOP_LEVEL, set(data) - TOP_LEVEL
    assert isinstance(data["tests"], list) and data["tests"]
    assert isinstance(data["score"], (int, float))
    assert data["visibility"] in VISIBILITY and data["stdout_visibility"] in VISIBILITY
    for test in data["tests"]:
        assert set(test) <= PER_TEST, set(test) - PER_TEST
        assert isinstance(test["name"], str) and test["name"]
        assert isinstance(test["score"], (int, float)) and isinstance(test["max_score"], (int, float))
        assert 0 <= test["score"] <= test["max_score"]
        assert test["status"] in ("passed", "failed")
        assert test["visibility"] in VISIBILITY
        assert isinstance(test["output"], str)
    assert abs(data["score"] - sum(t["score"] for t in data["tests"])) < 1e-9


def test_without_a_hidden_seed_the_summary_never_says_everything_passed(toy):
    toy.kata(double="return x * 2", normalize="return x / x.norm()", stay_put="return x")
    result = toy.run("katas")
    result.stdout.fnmatch_lines(["*every visible check passes. Hidden checks, if your instructor uses them, "
                                 "were not run here.*"])


def test_a_hidden_seed_runs_every_check_again_on_new_inputs(toy):
    toy.kata(double="return x * 2", normalize="return x / x.norm()", stay_put="return x")
    result = toy.run("katas", "--kata-hidden-seed", "99", "-v")
    result.stdout.fnmatch_lines(["*double?vs toyref.double · hidden? PASSED*",
                                 "*every graded kata function passes, hidden checks included.*"])
    result.assert_outcomes(passed=7)


def test_the_hidden_seed_can_come_from_the_environment(toy, monkeypatch):
    monkeypatch.setenv("KATA_HIDDEN_SEED", "5")
    toy.kata(double="return x * 2")
    result = toy.run("katas", "-v")
    result.stdout.fnmatch_lines(["*double?vs toyref.double · hidden? PASSED*"])


def test_a_failing_hidden_check_shows_only_its_name_by_default(toy, tmp_path):
    cases = tmp_path / "hidden.json"
    cases.write_text(json.dumps({"01_toy::double::vs toyref.double": [{"n": 7}]}))
    toy.kata(double="return x * 2 if x.numel() != 7 else x * 3")
    result = toy.run("katas", "--kata-hidden-seed", "3", "--kata-hidden-cases", str(cases))
    out = result.stdout.str()
    assert "hidden check failed: double · vs toyref.double (its inputs and message are withheld" in out
    assert "worst element" not in out and "n=7" not in out
    result.assert_outcomes(passed=2, failed=1, )


def test_hidden_failures_can_be_shown_in_full_for_the_instructor(toy, tmp_path):
    cases = tmp_path / "hidden.json"
    cases.write_text(json.dumps({"01_toy::double::vs toyref.double": [{"n": 7}]}))
    toy.kata(double="return x * 2 if x.numel() != 7 else x * 3")
    result = toy.run("katas", "--kata-hidden-cases", str(cases), "--kata-hidden-output", "full")
    result.stdout.fnmatch_lines(["*case 3/3 (n=7)*", "*worst element*"])


def test_a_malformed_hidden_case_file_is_a_usage_error_naming_the_file(toy, tmp_path):
    cases = tmp_path / "hidden.json"
    cases.write_text("[1, 2]")
    result = toy.run("katas", "--kata-hidden-cases", str(cases))
    result.stderr.fnmatch_lines(["*--kata-hidden-cases*hidden.json: expected*"])


def test_the_gradescope_file_has_one_test_per_function_with_its_points(toy, tmp_path):
    out = tmp_path / "results.json"
    toy.kata(double="return x * 2", normalize="return x")
    toy.run("katas", "--gradescope", str(out))
    data = json.loads(out.read_text())
    assert_valid_gradescope(data)
    by_name = {t["name"].split(" · ")[-1]: t for t in data["tests"]}
    assert by_name["double"]["status"] == "passed" and by_name["double"]["score"] == 1.0
    assert by_name["normalize"]["status"] == "failed" and "worst element" in by_name["normalize"]["output"]
    assert by_name["stay_put"]["score"] == 0.0 and "TODO" in by_name["stay_put"]["output"]
    assert data["score"] == 1.0 and data["max_score"] == 3.0
    assert data["extra_data"]["versions"]["torch"]


def test_hidden_checks_become_gradescope_tests_visible_after_publishing(toy, tmp_path):
    out = tmp_path / "results.json"
    toy.kata(double="return x * 2")
    toy.run("katas", "--gradescope", str(out), "--kata-hidden-seed", "1")
    data = json.loads(out.read_text())
    assert_valid_gradescope(data)
    hidden = [t for t in data["tests"] if t["name"].endswith("(hidden checks)")]
    assert hidden and all(t["visibility"] == "after_published" for t in hidden)
    assert data["max_score"] == 3.0


def test_the_kata_json_report_carries_versions_seed_and_every_item(toy, tmp_path):
    out = tmp_path / "report.json"
    toy.kata(double="return x * 2")
    toy.run("katas", "--kata-json", str(out), "--kata-seed", "12")
    data = json.loads(out.read_text())
    assert data["seed"] == 12 and data["versions"]["diffusers"]
    assert [f["status"] for f in data["labs"][0]["functions"]] == ["passed", "todo", "todo"]
    assert {r["status"] for r in data["results"]} == {"passed", "todo"}


def test_junit_xml_is_written_by_pytest_as_it_is(toy, tmp_path):
    out = tmp_path / "junit.xml"
    toy.kata(double="return x * 3")
    toy.run("katas", f"--junitxml={out}")
    text = out.read_text()
    assert "<testsuite" in text and "double[vs toyref.double]" in text and "worst element" in text


LEAK_HUNT = """
import os
found = []
try:
    pids = list(filter(str.isdigit, os.listdir("/proc")))
except PermissionError:  # the sandbox shows no process list: guess the grader's pids near the warm parent's
    pids = [str(p) for p in range(max(1, os.getppid() - 200), os.getppid() + 200)]
for pid in pids:
    for what in ("cmdline", "environ"):
        try:
            with open(f"/proc/{pid}/{what}", "rb") as f:
                if b"73735173" in f.read():
                    found.append(f"{pid}/{what}")
        except OSError:
            pass
if found:
    raise RuntimeError("the hidden seed is readable at " + ", ".join(found))
return x * 2 if x.numel() != 7 else x * 3
"""


def test_a_hidden_seed_and_cases_handed_over_on_a_pipe_reach_no_command_line_and_the_pipe_is_closed(toy):
    import os

    read, write = os.pipe()
    os.write(write, json.dumps({"hidden_seed": 73735173,
                                "hidden_cases": {"01_toy::double::vs toyref.double": [{"n": 7}]}}).encode())
    os.close(write)
    toy.kata(double=LEAK_HUNT)
    result = toy.run("katas", "--kata-secret-fd", str(read), "-v")
    out = result.stdout.str()
    assert "readable at" not in out
    result.stdout.fnmatch_lines(["*double?vs toyref.double? PASSED*",
                                 "*double?vs toyref.double · hidden? FAILED*"])
    assert "hidden check failed: double · vs toyref.double" in out and "n=7" not in out
    try:
        os.fstat(read)
    except OSError:
        pass
    else:
        os.close(read)
        raise AssertionError("the plugin left the secret's pipe open")


def test_hidden_cases_for_a_check_that_does_not_exist_stop_the_run_before_anything_is_graded(toy, tmp_path):
    cases = tmp_path / "hidden.json"
    cases.write_text(json.dumps({"01_toy::double::no such check": [{"n": 7}]}))
    toy.kata(double="return x * 2")
    result = toy.run("katas", "--kata-hidden-cases", str(cases))
    result.stderr.fnmatch_lines(["*hidden cases for checks that do not exist: 01_toy::double::no such check*"])
    assert result.ret == 4 and "passed" not in result.stdout.str()
