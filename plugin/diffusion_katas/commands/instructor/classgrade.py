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

Known limit: the child is a process, not a sandbox. Learner code can read what the child can read
(including its command line, hence the report's path) and write where it can write: grade untrusted
submissions inside a container (Gradescope does: one container per submission).
"""
from __future__ import annotations

import csv
import io
import json
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from diffusion_katas.commands.instructor.catalog import Catalog, number_text
from diffusion_katas.core.course import Course
from diffusion_katas.commands.instructor.children import ChildRun, Grading, cuda_pass, first_pass, needs_cuda_pass, restore_signals, \
    terminate_as_exit
from diffusion_katas.commands.instructor.scoring import Graded, conclude
from diffusion_katas.commands.instructor.submissions import Prepared, lay_out, learner_names, scratch_config

DEFAULT_JOBS = 2
DEFAULT_CLASS_TIMEOUT = 900.0  # seconds per submission and pass (all labs of a correct one take ~40 s)


def pytest_options(args) -> list[str]:
    """The grading options a command passes on to every child."""
    options = ["--kata-seed", str(args.seed)]
    if getattr(args, "kata_timeout", None) is not None:
        options += ["--kata-timeout", f"{args.kata_timeout:g}"]
    if getattr(args, "hidden_seed", None) is not None:
        options += ["--kata-hidden-seed", str(args.hidden_seed)]
    if getattr(args, "hidden_cases", None):
        options += ["--kata-hidden-cases", str(Path(args.hidden_cases).resolve())]
    if getattr(args, "hidden_output", None):
        options += ["--kata-hidden-output", args.hidden_output]
    return options


def grade_class(course: Course, catalog: Catalog, args) -> None:
    """Grade every submission folder of args.submissions and write the class results in args.out."""
    out = Path(args.out)
    folders = [Path(p) for p in args.submissions]
    names = learner_names(folders)
    print(f"kata class: {len(folders)} submission(s), labs {', '.join(catalog.labs)}, seed {args.seed}, "
          f"{args.jobs} job(s), {args.timeout:g} s per submission and pass")
    with tempfile.TemporaryDirectory(prefix="kata-class-") as tmp:
        tmp = Path(tmp)
        reports = tmp / "reports"  # the children's reports: uuid names, never inside a submission's project
        reports.mkdir()
        grading = Grading(catalog, pytest_options(args), args.timeout, reports)
        preps = []
        for name, folder in zip(names, folders):
            project = tmp / "projects" / name
            project.mkdir(parents=True)
            config = project / "pytest.ini"
            scratch_config(course, config, catalog.labs)
            preps.append(lay_out(name, folder.resolve() if folder.exists() else folder, project, config, catalog))
        graded = grade_all(preps, grading, args.jobs)
    write_class(out, graded, catalog, args)


def grade_all(preps: list[Prepared], grading: Grading, jobs: int) -> list[Graded]:
    """First pass in parallel (`-m "not cuda"`), then the cuda pass one child at a time."""
    printing = threading.Lock()
    firsts: dict[str, ChildRun | None] = {}

    def first(prep: Prepared):
        run = first_pass(prep, grading)
        with printing:
            what = prep.problem or (run.reason if run.report is None else "report written")
            took = f" ({run.seconds:.1f} s)" if run else ""
            print(f"  {prep.learner}: {what}{took}", flush=True)
        return prep.learner, run

    pool = ThreadPoolExecutor(max_workers=jobs)
    cuda_runs: dict[str, list[ChildRun]] = {}
    previous = terminate_as_exit()
    try:
        for learner, run in pool.map(first, preps):
            firsts[learner] = run
        pool.shutdown()
        for prep in preps:  # one at a time: GPU budgets never share the device
            if needs_cuda_pass(prep, firsts[prep.learner], grading):
                run = cuda_pass(prep, grading)
                print(f"  {prep.learner}: cuda pass: {run.reason or 'report written'} ({run.seconds:.1f} s)",
                      flush=True)
                cuda_runs[prep.learner] = [run]
    except BaseException:  # Ctrl-C, SIGTERM: kill every child's group now, not after their time limits
        grading.children.kill_all()
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    finally:
        restore_signals(previous)
    graded = []
    for prep in preps:
        runs = [r for r in [firsts[prep.learner], *cuda_runs.get(prep.learner, [])] if r is not None]
        graded.append(conclude(prep, runs, grading.catalog))
    return graded


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
