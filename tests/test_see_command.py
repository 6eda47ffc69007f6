"""`kata see LAB`: the learner's own lab 05 functions draw with the trained shapes model, beside diffusers.

Each test runs `kata see` in a subprocess, as a learner types it, on a temporary course holding lab 05 (and
lab 01, which has no picture), and reads the PNG back: three rows of six 128×128 tiles (diffusers' samples,
the learner's, their absolute difference ×4).
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
    for lab in (LAB, "01_forward_noise"):
        for folder in ("katas", "solutions", "graders"):
            (tmp_path / folder).mkdir(exist_ok=True)
            shutil.copy(REPO / folder / f"{lab}.py", tmp_path / folder / f"{lab}.py")
    return tmp_path


def kata_see(course: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, "-m", "diffusion_katas", "see", *args, "--root", str(course)],
                          capture_output=True, text=True, encoding="utf-8", env=env, timeout=LIMIT)


def write_kata(course: Path, old: str, new: str) -> None:
    """katas/05 = the solution with `old` replaced by `new` (a deliberate bug)."""
    source = (REPO / "solutions" / f"{LAB}.py").read_text(encoding="utf-8")
    assert source.count(old) == 1, old
    (course / "katas" / f"{LAB}.py").write_text(source.replace(old, new), encoding="utf-8")


def rows(png: Path) -> list[np.ndarray]:
    """The three rows of six tiles, each (128, 6·128, 3) uint8: titles and gaps left out."""
    image = np.asarray(Image.open(png).convert("RGB"))
    cell = 16 * see.SCALE
    tops = [see.GAP + i * (TITLE + cell + see.GAP) + TITLE for i in range(3)]
    assert image.shape[0] == tops[-1] + cell + see.GAP
    lefts = [see.GAP + i * (cell + see.GAP) for i in range(6)]
    assert image.shape[1] == lefts[-1] + cell + see.GAP
    return [np.concatenate([image[top:top + cell, left:left + cell] for left in lefts], axis=1) for top in tops]


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


def test_see_runs_the_learners_code_in_a_process_of_its_own(course):
    # a generate that ends its process: the picture is not made, and `kata see` itself reports it and exits
    write_kata(course, "    channels, size = unet.config.in_channels, unet.config.sample_size\n",
               "    import os; os._exit(3)\n")
    done = kata_see(course, "05", "--out", str(course / "see.png"))
    assert done.returncode == 1, done.stdout + done.stderr
    assert "did not answer" in done.stdout and "exit" in done.stdout
    assert not (course / "see.png").exists()


def test_see_names_the_labs_it_can_draw_for_a_lab_without_a_picture(course):
    done = kata_see(course, "01")
    assert done.returncode == 3
    assert "no picture for 01_forward_noise yet" in done.stdout and LAB in done.stdout
