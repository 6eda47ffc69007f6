"""`kata watch` re-grades only what a save changed (commands/learner/incremental.py): which functions, and
how their verdicts merge into the last report."""
from __future__ import annotations

import textwrap

from diffusion_katas.commands.learner.incremental import all_pass, code_shape, merge, to_regrade

KATA = '''
"""Lab 99 · Toy"""
import torch

SCALE = 2


def helper(x):
    return x * SCALE


def double(x):
    return helper(x)


def triple(x):
    return x * 3


def uses_double(x):
    return double(x) + 1
'''


def shape(tmp_path, text, name="k.py"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return code_shape(path)


def test_a_changed_body_regrades_that_function_and_every_function_that_names_it_transitively(tmp_path):
    before = shape(tmp_path, KATA)
    now = shape(tmp_path, KATA.replace("return x * SCALE", "return x + x"))
    assert to_regrade(before, now) == {"helper", "double", "uses_double"}
    assert to_regrade(before, shape(tmp_path, KATA.replace("x * 3", "3 * x"))) == {"triple"}


def test_comments_and_blank_lines_are_not_code_and_regrade_nothing(tmp_path):
    before = shape(tmp_path, KATA)
    now = shape(tmp_path, KATA.replace("def triple(x):\n", "def triple(x):\n    # times three\n\n"))
    assert to_regrade(before, now) == set()


def test_anything_outside_the_functions_regrades_the_whole_lab(tmp_path):
    before = shape(tmp_path, KATA)
    for edit in (KATA.replace("SCALE = 2", "SCALE = 3"),  # a global
                 KATA.replace("import torch", "import torch\nimport math"),  # an import
                 KATA + "\n\ndef extra(x):\n    return x\n",  # a function added
                 KATA.replace("def triple(x):\n    return x * 3\n", ""),  # one removed
                 KATA.replace("triple", "thrice")):  # one renamed
        assert to_regrade(before, shape(tmp_path, edit)) is None, edit


def test_a_file_that_does_not_parse_or_no_earlier_grading_regrades_the_whole_lab(tmp_path):
    before = shape(tmp_path, KATA)
    assert shape(tmp_path, KATA.replace("def triple(x):", "def triple(x:")) is None
    assert to_regrade(before, None) is None and to_regrade(None, before) is None


def report(statuses: dict, failing: dict = {}, lab="99_toy"):
    return {"seed": 1, "labs": [{"lab": lab, "title": "Lab 99", "functions": [
        {"name": n, "status": s} for n, s in statuses.items()]}],
        "results": [{"lab": lab, "function": n, "status": "failed", "message": m, "reason": r}
                    for n, (m, r) in failing.items()]}


def test_merged_verdicts_take_the_regraded_functions_from_the_new_grading_and_keep_the_others():
    last = report({"double": "failed", "triple": "failed", "helper": "todo"},
                  {"double": ("old double", "values"), "triple": ("old triple", "values")})
    partial = report({"double": "passed"})
    merged = merge(last, partial, "99_toy", {"double"})
    assert [(f["name"], f["status"]) for f in merged["labs"][0]["functions"]] == [
        ("double", "passed"), ("triple", "failed"), ("helper", "todo")]  # in the lab's order
    assert [r["message"] for r in merged["results"]] == ["old triple"]
    assert last["labs"][0]["functions"][0]["status"] == "failed"  # the last report is left as it was
    assert not all_pass(merged, "99_toy")


def test_a_partial_grading_that_cannot_stand_for_its_functions_asks_for_the_whole_lab():
    last = report({"double": "failed", "triple": "passed"})
    assert merge(last, {"labs": [], "results": []}, "99_toy", {"double"}) is None  # nothing graded
    assert merge(last, report({"triple": "passed"}), "99_toy", {"double"}) is None  # not the one asked for
    no_import = report({"double": "failed"}, {"double": ("does not import", "import error")})
    assert merge(last, no_import, "99_toy", {"double"}) is None  # a file-level failure
