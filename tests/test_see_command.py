"""`kata see LAB`: the learner's own functions of labs 01, 02 and 05 draw with the trained shapes model, beside
diffusers.

Each test runs `kata see` in a subprocess, as a learner types it, on a temporary course holding labs 01, 02 and
05 (and lab 03, which has no picture), and reads the PNG back: rows of six 128×128 tiles (diffusers', the
learner's, their absolute difference ×4), under lab 01's two curve panels.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from diffusion_katas.engine import see

REPO = Path(__file__).resolve().parent.parent
LAB = "05_sampling_loop"
LIMIT = 600  # seconds; a run takes 10-60 s on a loaded 2-core machine
TITLE = 14  # write_png's title strip above each row


@pytest.fixture
def course(tmp_path: Path) -> Path:
    for lab in (LAB, "01_forward_noise", "02_denoising_step", "03_scheduler_reading", "15_karras_edm"):
        for folder in ("katas", "solutions", "graders"):
            (tmp_path / folder).mkdir(exist_ok=True)
            shutil.copy(REPO / folder / f"{lab}.py", tmp_path / folder / f"{lab}.py")
    return tmp_path


def kata_see(course: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, "-m", "diffusion_katas", "see", *args, "--root", str(course)],
                          capture_output=True, text=True, encoding="utf-8", env=env, timeout=LIMIT)


def write_kata(course: Path, old: str, new: str, lab: str = LAB) -> None:
    """katas/<lab> = the solution with `old` replaced by `new` (a deliberate bug)."""
    source = (REPO / "solutions" / f"{lab}.py").read_text(encoding="utf-8")
    assert source.count(old) == 1, old
    (course / "katas" / f"{lab}.py").write_text(source.replace(old, new), encoding="utf-8")


def rows(png: Path, count: int = 3, top: int = 0) -> list[np.ndarray]:
    """`count` rows of six tiles starting `top` pixels down, each (128, 6·128, 3) uint8: titles and gaps left out."""
    image = np.asarray(Image.open(png).convert("RGB"))
    cell = 16 * see.SCALE
    tops = [top + see.GAP + i * (TITLE + cell + see.GAP) + TITLE for i in range(count)]
    assert image.shape[0] == tops[-1] + cell + see.GAP
    lefts = [see.GAP + i * (cell + see.GAP) for i in range(6)]
    assert image.shape[1] >= lefts[-1] + cell + see.GAP
    return [np.concatenate([image[t:t + cell, left:left + cell] for left in lefts], axis=1) for t in tops]


PLOTS = see.TITLE_H + see.PLOT_H + 2 * see.GAP + 12  # lab 01's curve panels above its image rows


def test_see_with_the_solutions_draws_the_same_shapes_as_diffusers_and_a_black_difference(course):
    out = course / "see.png"
    done = kata_see(course, "05", "--solutions", "--out", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "identical to diffusers, bit for bit" in done.stdout
    reference, mine, difference = rows(out)
    assert np.array_equal(reference, mine)
    assert difference.max() == 0
    # the samples stand out of their background: bright coloured pixels and darker ones
    assert (mine.max(axis=2) > 200).mean() > 0.05 and (mine.max(axis=2) < 120).mean() > 0.3
    assert "your samples read as:" in done.stdout


def test_see_on_a_kata_with_a_step_bug_shows_the_difference(course):
    # the UNet is asked about the wrong timestep at every step
    write_kata(course, "unet(model_input, t).sample", "unet(model_input, t // 2).sample")
    done = kata_see(course, "05")
    assert done.returncode == 0, done.stdout + done.stderr
    out = course / ".kata" / "see" / f"{LAB}.png"  # the default place
    assert "max |difference|" in done.stdout and "bit for bit" not in done.stdout
    reference, mine, difference = rows(out)
    assert not np.array_equal(reference, mine)
    assert (difference > 64).mean() > 0.01  # differences of 1/16 or more, visibly grey to white


def test_see_on_a_todo_kata_says_which_function_to_write(course):
    done = kata_see(course, "05", "--out", str(course / "see.png"))
    assert done.returncode == 2, done.stdout + done.stderr
    assert "is still TODO" in done.stdout and "katas/05_sampling_loop.py" in done.stdout
    assert not (course / "see.png").exists()
    # read from the untouched file: no runner started, nothing drawn (the drawing's header line never printed)
    assert done.stdout.startswith("kata see 05_sampling_loop: `initial_noise` is still TODO"), done.stdout


def test_see_with_the_solutions_keeps_its_picture_apart_from_the_learners(course):
    from diffusion_katas.commands.learner.report import pictures
    from diffusion_katas.core.course import Course

    done = kata_see(course, "01", "--solutions")
    assert done.returncode == 0, done.stdout + done.stderr
    assert (course / ".kata" / "see" / "solutions" / "01_forward_noise.png").is_file()
    assert not (course / ".kata" / "see" / "01_forward_noise.png").exists()
    assert pictures(Course(course)) == {}  # the report shows the learner's pictures only


def test_see_runs_the_learners_code_in_a_process_of_its_own(course):
    # a generate that ends its process: the picture is not made, and `kata see` itself reports it and exits
    write_kata(course, "    channels, size = unet.config.in_channels, unet.config.sample_size\n",
               "    import os; os._exit(3)\n")
    done = kata_see(course, "05", "--out", str(course / "see.png"))
    assert done.returncode == 1, done.stdout + done.stderr
    assert "did not answer" in done.stdout and "exit" in done.stdout
    assert not (course / "see.png").exists()


def test_see_names_the_labs_it_can_draw_for_a_lab_without_a_picture(course):
    done = kata_see(course, "03")
    assert done.returncode == 3
    assert "no picture for 03_scheduler_reading yet" in done.stdout and LAB in done.stdout


def test_see_01_draws_the_learners_schedules_and_add_noise_beside_diffusers(course):
    out = course / "see01.png"
    done = kata_see(course, "01", "--solutions", "--out", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("(the curves coincide)") == 3 and "identical to diffusers, bit for bit" in done.stdout
    theirs, mine, difference = rows(out, top=PLOTS)
    assert np.array_equal(theirs, mine) and difference.max() == 0
    assert (theirs[:, :128].max(axis=2) > 200).mean() > 0.05  # t = 0: the clean shape stands out
    # each plot's legend: a swatch of every schedule's colour (drawn nowhere else: curves are darker or lighter)
    picture = np.asarray(Image.open(out).convert("RGB"))
    for panel in range(2):
        x1 = see.GAP + panel * (see.PLOT_W + see.GAP) + see.PLOT_W
        box = picture[see.GAP + see.TITLE_H:see.GAP + see.TITLE_H + 80, x1 - see.LEGEND_W:x1]
        for colour in see.CURVE_COLOURS:
            assert (box == colour).all(axis=2).sum() > 20, (panel, colour)


def test_see_01_shows_a_wrong_schedule_and_a_wrong_add_noise(course):
    lab = "01_forward_noise"
    source = (REPO / "solutions" / f"{lab}.py").read_text(encoding="utf-8")
    old_noise = "return sqrt_abar * x0 + sqrt_one_minus_abar * noise"
    old_cumprod = "return torch.cumprod(1.0 - betas, dim=0)"
    assert source.count(old_noise) == 1 and source.count(old_cumprod) == 1
    (course / "katas" / f"{lab}.py").write_text(  # ᾱ used for √ᾱ, and ᾱ off by one step
        source.replace(old_noise, "return sqrt_abar**2 * x0 + sqrt_one_minus_abar * noise")
              .replace(old_cumprod, "return torch.cumprod(1.0 - betas, dim=0).roll(1)"), encoding="utf-8")
    done = kata_see(course, "01", "--out", str(course / "see01.png"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "(the curves coincide)" not in done.stdout and "max |difference|" in done.stdout
    _, _, difference = rows(course / "see01.png", top=PLOTS)
    assert (difference > 64).mean() > 0.01


def test_see_02_steps_the_trained_model_with_the_learners_ddim_step(course):
    out = course / "see02.png"
    done = kata_see(course, "02", "--solutions", "--out", str(out), "--steps", "10")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "identical to diffusers, bit for bit" in done.stdout
    theirs, mine, difference, their_x0, my_x0, x0_difference = rows(out, count=6)
    assert np.array_equal(theirs, mine) and difference.max() == 0 and x0_difference.max() == 0
    assert "your samples read as:" in done.stdout


def test_see_02_shows_a_step_bug_and_a_todo(course):
    lab = "02_denoising_step"
    # the direction term without its coefficient: every step lands off diffusers' trajectory
    write_kata(course, "pred_sample_direction = (1 - alpha_prod_t_prev - std_dev_t**2) ** (0.5) * pred_epsilon",
               "pred_sample_direction = pred_epsilon", lab)
    done = kata_see(course, "02", "--out", str(course / "see02.png"), "--steps", "10")
    assert done.returncode == 0, done.stdout + done.stderr
    _, _, difference, *_ = rows(course / "see02.png", count=6)
    assert (difference > 64).mean() > 0.01
    shutil.copy(REPO / "katas" / f"{lab}.py", course / "katas" / f"{lab}.py")
    done = kata_see(course, "02", "--out", str(course / "todo.png"), "--steps", "10")
    assert done.returncode == 2, done.stdout + done.stderr
    assert "`predict_x0` is still TODO" in done.stdout and not (course / "todo.png").exists()


def test_watch_with_see_draws_the_picture_again_after_the_verdict(course):
    lab = "01_forward_noise"
    shutil.copy(REPO / "solutions" / f"{lab}.py", course / "katas" / f"{lab}.py")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    done = subprocess.run([sys.executable, "-m", "diffusion_katas", "watch", "01", "--once", "--see", "--root",
                           str(course)], capture_output=True, text=True, encoding="utf-8", env=env, timeout=LIMIT)
    assert done.returncode == 0, done.stdout + done.stderr
    verdict, picture = done.stdout.index("add_noise"), done.stdout.index("picture: ")
    assert verdict < picture  # the verdict first, the picture after it
    assert "drawn again from your code (identical to diffusers, bit for bit)" in done.stdout
    assert (course / ".kata" / "see" / f"{lab}.png").is_file()
    done = subprocess.run([sys.executable, "-m", "diffusion_katas", "watch", "03", "--once", "--see", "--root",
                           str(course)], capture_output=True, text=True, encoding="utf-8", env=env, timeout=LIMIT)
    assert "picture: no picture for 03_scheduler_reading yet" in done.stdout, done.stdout


def test_see_15_samples_the_two_moons_toy_set_with_the_learners_edm_loop(course):
    out = course / "see15.png"
    done = kata_see(course, "15", "--solutions", "--out", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 of 256 samples differ by more than 1e-3" in done.stdout
    image = np.asarray(Image.open(out).convert("RGB"))
    assert image.shape[0] == see.TITLE_H + 300 + 2 * see.GAP
    # a bug: the network fed x itself (c_in forgotten): the samples leave the moons
    write_kata(course, "model_output = network(x_in, c_noise[0])", "model_output = network(x, c_noise[0])",
               "15_karras_edm")
    done = kata_see(course, "15", "--out", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 of 256" not in done.stdout and "samples differ by more than 1e-3" in done.stdout
