"""Outcomes of grading: TODO, passed, failed, timed out, and the progress summary."""


def test_an_untouched_function_is_reported_as_todo_and_the_run_fails(toy):
    result = toy.run("katas")
    result.stdout.fnmatch_lines(["katas/01_toy.py TTTT*", "*4 todo in*"])
    assert result.ret == 1
    assert "Traceback" not in result.stdout.str()
    assert "NotImplementedError" not in result.stdout.str()


def test_verbose_lines_say_todo_for_each_unwritten_function(toy):
    result = toy.run("katas", "-v")
    result.stdout.fnmatch_lines(["*01_toy.py::double?vs toyref.double? TODO*",
                                 "*01_toy.py::normalize?unit norm? TODO*"])


def test_a_correct_function_passes_and_the_others_stay_todo(toy):
    toy.kata(double="return x * 2")
    result = toy.run("katas")
    result.assert_outcomes(passed=2, failed=0)  # double's check and its budget
    result.stdout.fnmatch_lines(["*2 passed, 2 todo*"])
    assert result.ret == 1


def test_all_functions_correct_exits_zero_and_says_so(toy):
    toy.kata(double="return x * 2", normalize="return x / x.norm()", stay_put="return x")
    result = toy.run("katas")
    assert result.ret == 0
    result.stdout.fnmatch_lines(["*kata progress*", "*Lab 01 · Toy lab*3/3*", "*every visible check passes*"])


def test_the_summary_names_the_next_todo_and_its_first_hint(toy):
    toy.kata(double="return x * 2")
    result = toy.run("katas")
    result.stdout.fnmatch_lines([
        "*kata progress*",
        "*Lab 01 · Toy lab*1/3*",
        "*next: write `normalize` in katas/01_toy.py*",
        "*hint: divide by the norm*",
    ])


def test_a_failing_function_comes_before_a_todo_as_the_next_step(toy):
    toy.kata(double="return x * 3")
    result = toy.run("katas")
    result.stdout.fnmatch_lines(["*next: fix `double` in katas/01_toy.py*"])


def test_a_hang_fails_as_timed_out_and_the_run_goes_on(toy):
    toy.kata(double="while True:\n    pass", normalize="return x / x.norm()")
    result = toy.run("katas", "--kata-timeout", "1")
    result.stdout.fnmatch_lines(["*timed out after 1 s*the process running it was killed*"])
    result.assert_outcomes(passed=1, failed=1)
    assert result.parseoutcomes()["waiting"] == 1  # double's budget waits on its failing check


def test_an_exception_in_learner_code_shows_the_learners_own_line(toy):
    toy.kata(double="y = x.nonexistent_method()\nreturn y")
    result = toy.run("katas")
    result.stdout.fnmatch_lines([
        "*your function raised AttributeError*nonexistent_method*",
        "*katas/01_toy.py:* in double*",
        "*y = x.nonexistent_method()*",
    ])
    assert "site-packages" not in result.stdout.str()


def test_a_syntax_error_fails_every_item_of_the_file_with_its_line(toy):
    (toy.pytester.path / "katas" / "01_toy.py").write_text("def double(x):\n    return x *\n")
    result = toy.run("katas")
    result.assert_outcomes(failed=4)  # the budget fails with the file
    result.stdout.fnmatch_lines(["*katas/01_toy.py does not parse: invalid syntax at line 2*"])
    assert "error" not in result.stdout.lines[-1]


def test_a_deleted_function_fails_with_a_message_naming_it(toy):
    (toy.pytester.path / "katas" / "01_toy.py").write_text("def double(x):\n    return x * 2\n")
    result = toy.run("katas")
    result.stdout.fnmatch_lines(["*katas/01_toy.py has no function `normalize` (deleted or renamed?)*"])


def test_solutions_option_grades_solutions_with_the_same_graders(toy):
    result = toy.run("katas", "--solutions")
    result.assert_outcomes(passed=4)
    result.stdout.fnmatch_lines(["katas: grading solutions/ with seed*"])


def test_the_cuda_marker_is_registered_and_skips_without_cuda(pytester):
    pytester.makepyfile("""
        import pytest

        @pytest.mark.cuda
        def test_needs_a_gpu():
            import torch
            assert torch.cuda.is_available()
    """)
    result = pytester.runpytest("--strict-markers", "-rs")
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(["*SKIPPED*CUDA not available*"])


def test_the_options_appear_in_one_group_in_help(pytester):
    result = pytester.runpytest("--help")
    result.stdout.fnmatch_lines(["diffusion katas grading:", "*--solutions*", "*--kata-seed=N*",
                                 "*--kata-hints=N*", "*--kata-timeout=SECONDS*"])


def test_a_bad_hint_level_is_a_usage_error_naming_its_source(toy):
    result = toy.run("katas", "--kata-hints", "9")
    result.stderr.fnmatch_lines(["*--kata-hints takes 0 to 3, got 9 from the command line*"])


def test_kata_function_grades_only_the_named_function(toy):
    toy.kata(double="return x * 2")
    result = toy.run("katas", "--kata-function", "double", "-v")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["*2 deselected*"])


def test_last_failed_regrades_only_the_checks_that_did_not_pass_and_forgets_a_check_once_it_passes(toy):
    # pytest's own cache (--lf, --ff): a kata check's id is a parametrized test's, FILE::FUNCTION[CHECK]
    toy.kata(double="return x * 2")
    assert toy.run("katas", "-p", "cacheprovider").parseoutcomes() == {"passed": 2, "todo": 2}
    again = toy.run("katas", "-p", "cacheprovider", "--lf")
    again.stdout.fnmatch_lines(["*run-last-failure: rerun previous 2 failures*"])
    assert again.parseoutcomes() == {"todo": 2}
    toy.kata(double="return x * 2", normalize="return x / x.norm()")
    assert toy.run("katas", "-p", "cacheprovider", "--lf").parseoutcomes() == {"passed": 1, "todo": 1}
    assert toy.run("katas", "-p", "cacheprovider", "--lf").parseoutcomes() == {"todo": 1}


def test_xdist_is_refused_on_kata_files_and_left_alone_on_other_tests_in_a_course(toy):
    refused = toy.run("katas", "-n", "1")
    assert refused.ret == 4 and "-n (pytest-xdist) is not supported" in refused.stderr.str()
    toy.pytester.makepyfile(test_other="def test_it():\n    assert True\n")  # a course's own tests, beside katas/
    ran = toy.run("test_other.py", "-n", "1")
    assert ran.ret == 0, ran.stdout.str() + ran.stderr.str()
