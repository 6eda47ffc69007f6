"""Dependency-aware verdicts on a real lab: merge and unmerge that call a wrong lora_delta are told to fix
lora_delta first (the learner's merge is right; the ΔW it is handed is not)."""
LAB = "09_lora"


def test_merge_lora_calling_a_wrong_lora_delta_is_told_to_fix_lora_delta_first(write_lab, pytester):
    write_lab(LAB, {"lora_delta": "return (lora_A @ lora_B) * scaling"})
    recorder = pytester.inline_run(f"katas/{LAB}.py", "--kata-seed", "7", "-p", "no:cacheprovider",
                                   "--kata-function", "lora_delta", "--kata-function", "merge_lora",
                                   "--kata-function", "unmerge_lora", "-m", "not budget")
    reports = [r for r in recorder.getreports("pytest_runtest_logreport")
               if r.when == "call" and hasattr(r, "kata_status")]
    function = {id(r): r.nodeid.split("::")[1].split("[")[0] for r in reports}
    assert {r.kata_status for r in reports if function[id(r)] == "lora_delta"} == {"failed"}
    dependents = [r for r in reports if function[id(r)] in ("merge_lora", "unmerge_lora")]
    assert len(dependents) >= 4
    for r in dependents:
        name = function[id(r)]
        assert r.kata_status == "failed"
        assert str(r.longrepr).startswith(f"fix `lora_delta` first: `{name}` calls `lora_delta`"), \
            str(r.longrepr)[:300]
