"""`kata class`: every submission graded in a scratch project by its own children, then the class tables.

How a submission is graded (shared by `kata class` and the Gradescope autograder, plugin/bundle.py; see
/work/shared/notes/grading-reliability.md, sections 1 and 5-6):

- The learner's kata files are copied into a scratch project (plugin/submissions.py); a selected lab
  whose file is missing gets a placeholder that fails to import, so its functions score 0.
- pytest runs in a child process, in its own process group, under a wall-clock limit; on expiry the
  whole group is killed (plugin/children.py). The score comes only from the report the child wrote,
  read by the parent (plugin/scoring.py): no report, a zero with the reason.
- Items marked `cuda` (GPU budgets) never share a GPU: the first pass runs `-m "not cuda"` (children in
  parallel), then one serial pass runs `-m cuda` per submission, one child at a time, for the labs that
  have such items (without CUDA they are skipped with "CUDA not available"). A submission's score uses
  both passes; if either wrote no report, it scores 0.

Learner code never runs in the child itself: each check runs it in a runner process inside the sandbox
(engine/sandbox.py), which as root is a box user of its own per child (KATA_BOX, its project opened to it
alone), and anywhere confined by Landlock, seccomp and rlimits: it can read its own project, the package and
the graders, write nothing the grading reads, and see or signal no other process. The guard below stays as a
second line for where the sandbox has fewer layers (no Landlock, not root).
"""
from __future__ import annotations

import csv
import io
import shutil
import json
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from diffusion_katas.commands.instructor.catalog import Catalog, number_text
from diffusion_katas.core.course import Course
from diffusion_katas.commands.instructor.children import ChildRun, Grading, cuda_pass, cuda_present, first_pass, \
    needs_cuda_pass, restore_signals, terminate_as_exit
from diffusion_katas.commands.instructor.guard import Guard
from diffusion_katas.commands.running import PACKAGE_PARENT
from diffusion_katas.commands.instructor.hidden import Hidden
from diffusion_katas.commands.instructor.scoring import Graded, conclude
from diffusion_katas.commands.instructor.submissions import Prepared, lay_out, learner_names, scratch_config

DEFAULT_JOBS = 2
DEFAULT_CLASS_TIMEOUT = 900.0  # seconds per submission and pass (all labs of a correct one take ~40 s)


def pytest_options(args) -> list[str]:
    """The grading options a command passes on to every child (the hidden seed and cases are not options:
    they go through a pipe, hidden.py)."""
    options = ["--kata-seed", str(args.seed)]
    if getattr(args, "kata_timeout", None) is not None:
        options += ["--kata-timeout", f"{args.kata_timeout:g}"]
    if getattr(args, "hidden_output", None):
        options += ["--kata-hidden-output", args.hidden_output]
    return options


def grade_class(course: Course, catalog: Catalog, args, hidden: Hidden | None = None) -> None:
    """Grade every submission folder of args.submissions and write the class results in args.out."""
    out = Path(args.out)
    folders = [Path(p) for p in args.submissions]
    names = learner_names(folders)
    print(f"kata class: {len(folders)} submission(s), labs {', '.join(catalog.labs)}, seed {args.seed}, "
          f"{args.jobs} job(s), {args.timeout:g} s per submission and pass")
    with tempfile.TemporaryDirectory(prefix="kata-class-") as tmp:
        tmp = Path(tmp)
        reports = tmp / "reports"  # the children's reports: uuid names, never inside a submission's project
        reports.mkdir(mode=0o700)  # the reports of every child: no box may list or read them
        # What the children trust, copied where the guard watches it: the instructor's own package and
        # graders are never where learner code could write, and never restored over.
        trusted = tmp / "trusted"
        skip = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
        shutil.copytree(PACKAGE_PARENT / "diffusion_katas", trusted / "package" / "diffusion_katas", ignore=skip)
        shutil.copytree(course.graders, trusted / "graders", ignore=skip)
        grading = Grading(catalog, pytest_options(args), args.timeout, reports,
                          secret=hidden.secret() if hidden else None, cuda=cuda_present(),
                          package_parent=trusted / "package")
        preps = []
        (tmp / "projects").mkdir(mode=0o711)  # entered by each submission's box, listed by none
        for name, folder in zip(names, folders):
            project = tmp / "projects" / name
            project.mkdir(parents=True)
            config = project / "pytest.ini"
            scratch_config(course, config, catalog.labs, graders=trusted / "graders")
            preps.append(lay_out(name, folder.resolve() if folder.exists() else folder, project, config, catalog))
        graded = grade_all(preps, grading, args.jobs, guarded=[trusted])
    write_class(out, graded, catalog, args)


def grade_all(preps: list[Prepared], grading: Grading, jobs: int, guarded: list[Path] = ()) -> list[Graded]:
    """First pass in parallel (`-m "not cuda"`), then the cuda pass one child at a time.

    After every child the guard compares the package, the graders and every scratch project with the
    bytes saved before grading, and restores them. A change means learner code wrote there: every
    submission whose child ran while the files were not the instructor's is graded again, alone, with a
    check after it; one whose own solo run changes them is the one that did it and scores 0 with the reason.
    """
    printing = threading.Lock()
    guard = Guard([*guarded, *(p.project for p in preps if not p.problem)])
    checked = [time.monotonic()]  # when the files were last found intact
    windows: list[tuple[float, float]] = []  # (last intact, found changed): nothing ran in them is trusted
    changed: list[str] = []
    spans: dict[str, tuple[float, float]] = {}

    def inspect() -> list[str]:
        with printing:
            now = time.monotonic()
            found = guard.check_and_restore()
            if found:
                windows.append((checked[0], now))
                changed.extend(found)
            checked[0] = now
            return found

    def first(prep: Prepared):
        start = time.monotonic()
        run = first_pass(prep, grading)
        spans[prep.learner] = (start, time.monotonic())
        inspect()
        with printing:
            what = prep.problem or (run.reason if run.report is None else "report written")
            took = f" ({run.seconds:.1f} s)" if run else ""
            print(f"  {prep.learner}: {what}{took}", flush=True)
        return prep.learner, run

    pool = ThreadPoolExecutor(max_workers=jobs)
    firsts: dict[str, ChildRun | None] = {}
    cuda_runs: dict[str, list[ChildRun]] = {}
    culprits: dict[str, str] = {}
    previous = terminate_as_exit()
    try:
        for learner, run in pool.map(first, preps):
            firsts[learner] = run
        pool.shutdown()
        suspects = [p for p in preps if p.learner in spans
                    and any(s < end and spans[p.learner][1] > s for s, end in windows)]
        if suspects:
            print(f"  grading files were changed while children ran ({'; '.join(changed[:3])}"
                  f"{' ...' if len(changed) > 3 else ''}): restored; grading {len(suspects)} submission(s) "
                  "again, one at a time", flush=True)
        for prep in suspects:
            run = first_pass(prep, grading)
            found = inspect()
            if found:
                culprits[prep.learner] = found[0]
            firsts[prep.learner] = run
            print(f"  {prep.learner}: again, alone: "
                  + (f"it changed {found[0]}" if found else (run.reason or "report written")), flush=True)
        # A grading process that died without a report (killed by a signal, the machine out of memory) is no
        # verdict on the submission: it is graded once more, alone, and that run's result is its result.
        died = [p for p in preps if p not in suspects and p.learner not in culprits and firsts.get(p.learner)
                is not None and firsts[p.learner].report is None and firsts[p.learner].outcome == "crashed"]
        for prep in died:
            print(f"  {prep.learner}: its grading process ended without a report ({firsts[prep.learner].reason}); "
                  "grading it again, alone", flush=True)
            run = first_pass(prep, grading)
            found = inspect()
            if found:
                culprits[prep.learner] = found[0]
            firsts[prep.learner] = run
            print(f"  {prep.learner}: again, alone: " + (run.reason or "report written"), flush=True)
        if not grading.cuda and any(set(p.present) & set(grading.catalog.cuda_labs()) for p in preps):
            print("  cuda pass skipped: CUDA is not available here; GPU budgets count as skipped", flush=True)
        for prep in preps:  # one at a time: GPU budgets never share the device
            if prep.learner not in culprits and needs_cuda_pass(prep, firsts[prep.learner], grading):
                run = cuda_pass(prep, grading)
                found = inspect()
                if found:
                    culprits[prep.learner] = found[0]
                print(f"  {prep.learner}: cuda pass: {run.reason or 'report written'} ({run.seconds:.1f} s)",
                      flush=True)
                cuda_runs[prep.learner] = [run]
    except BaseException:  # Ctrl-C, SIGTERM: kill every child's group now, not after their time limits
        grading.children.kill_all()
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    finally:
        restore_signals(previous)
        guard.check_and_restore()
    graded = []
    for prep in preps:
        if prep.learner in culprits:
            graded.append(tampered(prep, grading.catalog, culprits[prep.learner], firsts[prep.learner]))
            continue
        runs = [r for r in [firsts[prep.learner], *cuda_runs.get(prep.learner, [])] if r is not None]
        graded.append(conclude(prep, runs, grading.catalog,
                               cuda_skipped=not grading.cuda and bool(prep.present)))
    return graded


def tampered(prep: Prepared, catalog: Catalog, what: str, run: ChildRun | None) -> Graded:
    """A zero for a submission whose code changed the files its grade depends on."""
    run = run or ChildRun("not cuda")
    run.report, run.outcome = None, "tampered"
    run.reason = (f"the submission's code changed a file the grading relies on ({what}); it was restored and "
                  "this submission scores 0")
    return conclude(prep, [run], catalog)


def _md(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def check_rows(graded: list[Graded], catalog: Catalog) -> list[dict]:
    """Per (lab, function, check): how many learners passed it, out of the whole class."""
    rows = []
    seen = {key for g in graded for key in g.checks}
    for f in catalog.all_functions():
        visible = [c for c in f.checks if not c.startswith("budget: ")]
        budgets = [c for c in f.checks if c.startswith("budget: ")]
        extra = sorted({c for (lab, fn, c) in seen if lab == f.lab and fn == f.name and c not in f.checks})
        names = visible + extra + budgets  # the order the items run in: checks, hidden checks, budgets
        for check in names:
            statuses = [g.checks.get((f.lab, f.name, check)) for g in graded]
            passed = sum(s == "passed" for s in statuses)
            skipped = sum(s == "skipped" for s in statuses)
            rows.append({"lab": f.lab, "function": f.name, "check": check, "passed": passed,
                         "skipped": skipped, "learners": len(graded),
                         "pass_rate": round(passed / len(graded), 4) if graded else 0.0,
                         "cuda": check in f.cuda_checks})
    return rows


def write_class(out: Path, graded: list[Graded], catalog: Catalog, args) -> None:
    from diffusion_katas.core.results import versions as library_versions

    out.mkdir(parents=True, exist_ok=True)
    gs_dir = out / "gradescope"
    gs_dir.mkdir(exist_ok=True)
    for old in gs_dir.glob("*.json"):  # a previous roster's files must not linger
        old.unlink()
    functions = catalog.all_functions()
    keys = [(f.lab, f.name) for f in functions]
    rows = check_rows(graded, catalog)

    for g in graded:
        (gs_dir / f"{g.learner}.json").write_text(g.gradescope_text, encoding="utf-8")

    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(["learner", "score", "max_score", "outcome", "reason"] + [f"{lab}::{fn}" for lab, fn in keys])
    for g in graded:
        writer.writerow([g.learner, number_text(g.score), number_text(g.max_score), g.outcome, g.reason]
                        + [g.cells[k].status for k in keys])
    (out / "class.csv").write_text(buffer.getvalue(), encoding="utf-8")

    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(["lab", "function", "check", "passed", "skipped", "learners", "pass_rate"])
    for row in rows:
        writer.writerow([row["lab"], row["function"], row["check"], row["passed"], row["skipped"],
                         row["learners"], row["pass_rate"]])
    (out / "checks.csv").write_text(buffer.getvalue(), encoding="utf-8")

    versions = library_versions()
    md = ["# Class results", "",
          f"{len(graded)} submission(s) graded on {', '.join(catalog.labs)} with seed {args.seed} "
          f"(torch {versions['torch']}, diffusers {versions['diffusers']}); {args.jobs} in parallel, "
          f"{args.timeout:g} s wall clock per submission and pass. A score counts only what the grading "
          "process reported; no report (a crash, a hang, os._exit) scores 0 with the reason.", "",
          "## Learners", "",
          "| learner | score | outcome | reason | " + " | ".join(f"{lab[:2]} {fn}" for lab, fn in keys) + " |",
          "|---|---|---|---|" + "---|" * len(keys)]
    for g in graded:
        md.append(f"| {_md(g.learner)} | {number_text(g.score)}/{number_text(g.max_score)} | {g.outcome} | "
                  f"{_md(g.reason)} | " + " | ".join(g.cells[k].status for k in keys) + " |")
    md += ["", "## Pass rate per check", "",
           "Out of the whole class: a learner whose submission was not graded counts as not passing. "
           "Skipped: items that did not run (GPU budgets without CUDA).", "",
           "| lab | function | check | passed | rate | skipped |", "|---|---|---|---|---|---|"]
    for row in rows:
        md.append(f"| {row['lab']} | {row['function']} | {_md(row['check'])} | "
                  f"{row['passed']}/{row['learners']} | {row['pass_rate']:.0%} | {row['skipped'] or ''} |")
    (out / "class.md").write_text("\n".join(md) + "\n", encoding="utf-8")

    data = {"seed": args.seed, "labs": catalog.labs, "jobs": args.jobs, "timeout": args.timeout,
            "versions": versions, "max_score": catalog.points(),
            "learners": [{"learner": g.learner, "source": g.source, "score": g.score, "max_score": g.max_score,
                          "outcome": g.outcome, "reason": g.reason, "seconds": round(g.seconds, 2),
                          "passes": g.passes,
                          "functions": [{"lab": lab, "function": fn, "status": g.cells[(lab, fn)].status,
                                         "score": g.cells[(lab, fn)].score,
                                         "max_score": g.cells[(lab, fn)].max_score} for lab, fn in keys]}
                         for g in graded],
            "checks": rows}
    (out / "class.json").write_text(json.dumps(data, indent=2, ensure_ascii=False), encoding="utf-8")

    width = max([len(g.learner) for g in graded] + [7])
    print()
    for g in graded:
        print(f"  {g.learner:<{width}}  {number_text(g.score):>5}/{number_text(g.max_score):<5} {g.outcome}"
              + (f": {g.reason}" if g.reason else ""))
    print(f"\nwrote {out / 'class.csv'}, {out / 'checks.csv'}, {out / 'class.md'}, {out / 'class.json'} "
          f"and {len(graded)} file(s) in {gs_dir}/")
