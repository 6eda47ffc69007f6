"""`kata report`: one static HTML page from the last grading record, checked as text and in a real browser.

The course holds lab 01 graded once for real (pytest in a subprocess writes .kata/last-grading.json): its first
function is wrong (a trap the grader names), one function raises with an HTML `<script>` in its message and
another prints one, so the page must show them as text. Two pictures sit in .kata/see/ as `kata see` leaves
them. The browser tests load the page in Debian's Chromium (headless, no network) and read the DOM it built;
they are skipped, with the reason, where no chromium is installed (.ci/run installs it when it can).
"""
from __future__ import annotations

import base64
import html
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from diffusion_katas.commands.learner import report as report_page
from diffusion_katas.commands.main import main
from diffusion_katas.commands.running import Grading

REPO = Path(__file__).resolve().parent.parent
LAB = "01_forward_noise"
GRADING_LIMIT = 300  # seconds; grading lab 01 takes 5-25 s
# What the learner's code plants: a script in an exception's message (it reaches the failure message) and one
# printed; either would retitle the page or mark the body if the page let it run.
RAISED = '<script>document.title="pwned"</script><img src=x onerror="document.body.dataset.pwned=1">'
PRINTED = '<script>document.body.dataset.printed=1</script><b>bold & co</b>'
PICTURE = (40, 24)  # the lab's picture, width x height
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="no chromium on PATH: the report page's browser tests need Debian's chromium "
                             "(apt-get install chromium; .ci/run installs it when it can)")


def solved(lab: str) -> str:
    """The solution file with its solution markers taken out: a kata a learner has solved."""
    source = (REPO / "solutions" / f"{lab}.py").read_text(encoding="utf-8")
    source = re.sub(r"[ \t]*# BEGIN SOLUTION[^\n]*\n", "", source)
    return re.sub(r"[ \t]*# END SOLUTION[^\n]*\n", "", source)


def replace_once(source: str, old: str, new: str) -> str:
    assert source.count(old) == 1, old
    return source.replace(old, new)


@pytest.fixture(scope="module")
def course(tmp_path_factory) -> Path:
    """A course with lab 01 graded once: scaled_linear_betas wrong (the linear-in-β trap), alphas_cumprod
    raising RAISED, cosine_betas printing PRINTED (and wrong), the rest right; and two pictures."""
    root = tmp_path_factory.mktemp("report")
    for folder in ("katas", "solutions", "graders"):
        (root / folder).mkdir()
        shutil.copy(REPO / folder / f"{LAB}.py", root / folder / f"{LAB}.py")
    kata = solved(LAB)
    kata = replace_once(kata, "return torch.linspace(beta_start**0.5, beta_end**0.5, num_train_timesteps, "
                              "dtype=torch.float32) ** 2",
                        "return torch.linspace(beta_start, beta_end, num_train_timesteps, dtype=torch.float32)")
    kata = replace_once(kata, "    return torch.cumprod(1.0 - betas, dim=0)", f"    raise ValueError({RAISED!r})")
    kata = replace_once(kata, "    return torch.tensor(betas, dtype=torch.float32)\n",
                        f"    print({PRINTED!r})\n    return torch.tensor(betas, dtype=torch.float32) * 1.5\n")
    (root / "katas" / f"{LAB}.py").write_text(kata, encoding="utf-8")
    done = subprocess.run([sys.executable, "-m", "pytest", f"katas/{LAB}.py", "-q", "-p", "no:cacheprovider"],
                          cwd=root, capture_output=True, text=True, encoding="utf-8", timeout=GRADING_LIMIT,
                          env=dict(os.environ, PYTHONUNBUFFERED="1"))
    assert (root / ".kata" / "last-grading.json").is_file(), done.stdout + done.stderr
    see = root / ".kata" / "see"
    see.mkdir()
    Image.new("RGB", PICTURE, (200, 40, 40)).save(see / f"{LAB}_schedules.png")
    Image.new("RGB", (8, 8), (0, 0, 255)).save(see / "99_elsewhere.png")
    return root


def write_page(root: Path, *args: str) -> tuple[int, str]:
    out = root / "page" / "report.html"
    code = main(["report", "--root", str(root), "--out", str(out), *args])
    return code, out.read_text(encoding="utf-8") if out.is_file() else ""


def text_of(fragment: str) -> str:
    """The text a reader sees in an HTML fragment: tags dropped, entities decoded, spaces collapsed."""
    return " ".join(html.unescape(re.sub(r"<[^>]+>", " ", fragment)).split())


def row(page: str, lab: str) -> list[str]:
    """The cells of a lab's row in the progress table, as text."""
    match = re.search(rf'<tr data-lab="{lab}">(.*?)</tr>', page, re.S)
    assert match, f"no row for {lab}"
    return [text_of(cell) for cell in re.findall(r"<td[^>]*>(.*?)</td>", match.group(1), re.S)]


# ---- the page as text (no browser) -----------------------------------------------------------------------
def test_the_record_keeps_what_the_learners_code_printed_beside_the_failure_message(course):
    saved = json.loads((course / ".kata" / "last-grading.json").read_text(encoding="utf-8"))
    by_function = {r["function"]: r for r in saved["results"]}
    assert set(by_function) == {"scaled_linear_betas", "cosine_betas", "alphas_cumprod"}
    assert PRINTED in by_function["cosine_betas"]["output"]
    assert RAISED in by_function["alphas_cumprod"]["message"]
    assert "a linspace over β itself" in by_function["scaled_linear_betas"]["message"]


def test_the_page_has_the_progress_row_the_failing_messages_the_next_step_and_its_hint(course, monkeypatch):
    monkeypatch.setattr(report_page, "grade", lambda *a, **k: pytest.fail("kata report must not grade"))
    code, page = write_page(course)
    assert code == 0
    # lab, solved/total, TODO, failing, over budget, next
    cells = row(page, LAB)
    assert cells[:5] == [LAB, "3/6", "0", "3", "0"]
    assert "next: scaled_linear_betas FAILED" in cells[5]
    text = text_of(page)
    assert "fix scaled_linear_betas in katas/01_forward_noise.py" in text
    assert "hint 1 (nudge): Stable Diffusion's schedule is evenly spaced in √β, not in β." in text
    assert "trap: a linspace over β itself (that is the 'linear' schedule)" in text  # the message as pytest shows it
    assert "check “vs DDPMScheduler.betas”" in text and "check “vs betas_for_alpha_bar”" in text
    assert f"your function raised ValueError: {RAISED}" in text
    assert f"what your code printed: {PRINTED}" in text


def test_everything_the_learners_code_wrote_is_escaped_and_the_page_has_no_script(course):
    _, page = write_page(course)
    assert "<script" not in page.lower() and "onerror=" not in page.replace("onerror=&quot;", "")
    assert html.escape(RAISED, quote=True) in page
    assert html.escape(PRINTED.rstrip(), quote=True) in page
    assert f'content="{html.escape(report_page.CSP, quote=True)}"' in page  # and the policy allows no script


def test_the_pictures_kata_see_wrote_are_embedded_beside_their_lab(course):
    _, page = write_page(course)
    lab = page[page.index(f'id="lab-{LAB}"'):]
    lab = lab[:lab.index("</section>")]
    (uri,) = re.findall(r'<img src="data:image/png;base64,([A-Za-z0-9+/=]+)"', lab)
    assert base64.b64decode(uri) == (course / ".kata" / "see" / f"{LAB}_schedules.png").read_bytes()
    assert ".kata/see/01_forward_noise_schedules.png · drawn" in text_of(lab)
    others = page[page.index('id="other-pictures"'):]
    assert "99_elsewhere.png" in others and "data:image/png;base64," in others
    assert "http:" not in page and "https:" not in page  # nothing to fetch


def test_a_record_from_before_printed_output_was_kept_still_makes_the_page(course, tmp_path):
    root = tmp_path / "old"
    shutil.copytree(course, root)
    path = root / ".kata" / "last-grading.json"
    saved = json.loads(path.read_text(encoding="utf-8"))
    for result in saved["results"]:
        result.pop("output", None)
    path.write_text(json.dumps(saved), encoding="utf-8")
    code, page = write_page(root)
    assert code == 0
    assert "what your code printed" not in page and "your function raised ValueError" in text_of(page)


def test_an_edited_lab_is_marked_and_update_grades_only_what_changed(course, tmp_path, monkeypatch):
    root = tmp_path / "edited"
    shutil.copytree(course, root)
    code, page = write_page(root, "--update")  # nothing changed: nothing graded
    assert code == 0 and "edited since" not in page
    kata = root / "katas" / f"{LAB}.py"
    kata.write_text(kata.read_text(encoding="utf-8") + "\n# edited\n", encoding="utf-8")
    _, page = write_page(root)
    assert "edited since" in row(page, LAB)[5]
    graded = []

    def grade(course, *targets):  # grading itself is `kata progress`'s, tested there
        graded.append(targets)
        return Grading(None, "(not graded in this test)", 1, 0.0)

    monkeypatch.setattr(report_page, "grade", grade)
    code, _ = write_page(root, "--update")
    assert code == 1  # pytest wrote no report: the command says so
    assert graded == [(f"katas/{LAB}.py", "--continue-on-collection-errors")]


def test_before_any_grading_the_command_says_how_to_get_a_record(tmp_path, capsys):
    for folder in ("katas", "graders"):
        (tmp_path / folder).mkdir()
        shutil.copy(REPO / folder / f"{LAB}.py", tmp_path / folder / f"{LAB}.py")
    code = main(["report", "--root", str(tmp_path)])
    assert code == 1
    assert "no grading recorded yet" in capsys.readouterr().err
    assert not (tmp_path / ".kata" / "report.html").exists()


# ---- the page in a real browser --------------------------------------------------------------------------
PROBE = """<script>
window.addEventListener("load", () => {
  const images = [...document.images].map(i => ({name: i.dataset.picture, w: i.naturalWidth, h: i.naturalHeight,
                                                  complete: i.complete}));
  const probe = document.createElement("div");
  probe.id = "probe";
  probe.textContent = JSON.stringify({title: document.title, images, scripts: document.scripts.length,
                                      pwned: document.body.dataset.pwned || null,
                                      printed: document.body.dataset.printed || null});
  document.body.appendChild(probe);
});
</script>"""


def browse(page: Path, profile: Path) -> str:
    """The DOM Chromium built from the page (headless, no network, its own profile), serialized."""
    done = subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         f"--user-data-dir={profile}", "--virtual-time-budget=5000", "--dump-dom", page.as_uri()],
        capture_output=True, text=True, encoding="utf-8", timeout=180)
    assert done.returncode == 0 and "</html>" in done.stdout, done.stderr[-2000:]
    return done.stdout


@needs_chromium
def test_chromium_shows_the_table_the_failing_messages_as_text_and_runs_nothing_planted(course, tmp_path):
    write_page(course)
    dom = browse(course / "page" / "report.html", tmp_path / "profile")
    assert row(dom, LAB)[:5] == [LAB, "3/6", "0", "3", "0"]
    title = re.search(r"<title>(.*?)</title>", dom, re.S).group(1)
    assert title == f"kata report · {course.name}"  # the planted script did not retitle it
    text = text_of(dom)
    assert f"your function raised ValueError: {RAISED}" in text  # shown as text, whole
    assert f"what your code printed: {PRINTED}" in text
    assert "data-pwned" not in dom and "data-printed" not in dom
    assert not re.search(r"<script", dom, re.I)  # no script element came out of the planted text


@needs_chromium
def test_chromium_decodes_the_pictures_and_escaping_alone_stops_the_planted_scripts(course, tmp_path):
    # A copy of the page without its Content-Security-Policy and with a probe script of ours: the planted text
    # must stay inert by escaping alone, and the probe reads the pictures' decoded sizes once the page loaded.
    write_page(course)
    page = (course / "page" / "report.html").read_text(encoding="utf-8")
    policy = re.search(r'<meta http-equiv="Content-Security-Policy"[^>]*>', page).group(0)
    probed = tmp_path / "probed.html"
    probed.write_text(page.replace(policy, "").replace("</body>", PROBE + "</body>"), encoding="utf-8")
    dom = browse(probed, tmp_path / "profile")
    match = re.search(r'<div id="probe">(.*?)</div>', dom, re.S)
    assert match, "the probe did not run"
    probe = json.loads(html.unescape(match.group(1)))
    assert probe["title"] == f"kata report · {course.name}"
    assert probe["pwned"] is None and probe["printed"] is None
    assert probe["scripts"] == 1  # the probe only
    sizes = {i["name"]: (i["w"], i["h"]) for i in probe["images"]}
    assert sizes == {f"{LAB}_schedules.png": PICTURE, "99_elsewhere.png": (8, 8)}
