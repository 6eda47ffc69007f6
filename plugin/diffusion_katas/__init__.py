"""diffusion katas: learn diffusion inference by writing it, graded live against diffusers and peft.

Subpackages by role, dependencies pointing one way (a test reads the imports):
    core           pure: the grader vocabulary, tolerances, the results model and its formats, the Course
    engine         grading machinery: comparison, learner calls and the answer key, meters, tiny models,
                   shared grading helpers
    pytest_plugin  the pytest plugin (entry point `diffusion_katas`): options, collection, reporting
    commands       the `kata` command line: learner, instructor and maintainer commands, which talk to
                   pytest only through its subprocess and the results file

PYTEST_DONT_REWRITE: the package asserts nothing that pytest's rewriting would explain, and the warm grader
(commands/warm.py) imports it before its first pytest.main, which would otherwise warn about every run.
"""


def load_ipython_extension(ipython):
    """`%load_ext diffusion_katas`: the `%kata` magic of a lab's notebook (commands/learner/notebook.py)."""
    from diffusion_katas.commands.learner.notebook import load

    load(ipython)
