"""One grader per lab, named like the kata file it grades (loaded by path, not imported by name)."""
