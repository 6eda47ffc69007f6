"""Reading a lab's lesson from the terminal."""
import subprocess
import sys
from pathlib import Path

import pytest

from diffusion_katas.core.course import find_lab
from diffusion_katas.core.lessons import lesson, render

REPO = Path(__file__).resolve().parent.parent
KATAS = REPO / "katas"


def test_a_lab_is_found_by_number_or_by_name():
    assert find_lab("1", KATAS).name == "01_forward_noise.py"
    assert find_lab("01_forward_noise", KATAS).name == "01_forward_noise.py"
    assert find_lab("forward", KATAS).name == "01_forward_noise.py"


def test_an_unknown_lab_lists_the_labs_there_are():
    with pytest.raises(LookupError, match="the labs are: 01_forward_noise"):
        find_lab("99", KATAS)


def test_the_lesson_has_every_section_the_workshop_reads_aloud():
    title, sections = lesson(REPO / "katas" / "01_forward_noise.py")
    assert title == "Lab 01 · Forward noise process"
    assert {"Concept", "Mental model", "Traps", "Say it out loud"} <= set(sections)
    assert "√ᾱ_t" in sections["Traps"]


def test_one_section_can_be_printed_alone():
    text = render(REPO / "katas" / "01_forward_noise.py", "say it out loud")
    assert "Say it out loud:" in text and "Traps:" not in text


def test_the_command_prints_a_lab_without_importing_torch():
    proc = subprocess.run([sys.executable, "-c",
                           "import sys; from diffusion_katas.commands.main import main; main(['explain', '01']); "
                           "print('TORCH', 'torch' in sys.modules)"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert "Lab 01 · Forward noise process" in proc.stdout
    assert "TORCH False" in proc.stdout
