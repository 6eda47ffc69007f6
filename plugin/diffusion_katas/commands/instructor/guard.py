"""The files a grade depends on, remembered before grading and checked after every child.

A grading child trusts the package (its own code), the graders, and its scratch project (pytest.ini, the
kata files, and the absence of any conftest.py). Learner code runs as the same user, so it could change
any of them: append a `raise` to a grader, drop a conftest.py into a project (a later pass would load it
into the grading process), delete a sibling's project. The guard keeps every such file's bytes in memory;
after each child it compares, restores what changed, and says what it was, so that no report produced
while the files were not the instructor's is trusted (classgrade.py re-grades those submissions alone).
"""
from __future__ import annotations

import threading
from pathlib import Path

SKIPPED_DIRS = {"__pycache__", ".pytest_cache", ".kata"}  # written by the grading process itself


def _walk(root: Path):
    if root.is_file():
        yield root
        return
    if not root.is_dir():
        return
    for path in sorted(root.iterdir()):
        if path.is_symlink():
            yield path
        elif path.is_dir():
            if path.name not in SKIPPED_DIRS:
                yield from _walk(path)
        elif path.suffix not in (".pyc", ".pyo"):
            yield path


class Guard:
    """Bytes of every file under `roots` (folders are watched for new files too)."""

    def __init__(self, roots: list[Path]):
        self.roots = [Path(r) for r in roots]
        self._lock = threading.Lock()
        self.saved: dict[Path, bytes] = {}
        for root in self.roots:
            for path in _walk(root):
                self.saved[path] = path.read_bytes()

    def changes(self) -> list[str]:
        """What differs from the saved files: changed, removed and new files (paths)."""
        found = []
        seen = set()
        for root in self.roots:
            try:
                paths = list(_walk(root))
            except OSError:
                paths = []
            for path in paths:
                seen.add(path)
                if path not in self.saved:
                    found.append(f"{path} (new)")
                    continue
                try:
                    same = not path.is_symlink() and path.read_bytes() == self.saved[path]
                except OSError:
                    same = False
                if not same:
                    found.append(f"{path} (changed)")
        found += [f"{path} (removed)" for path in self.saved if path not in seen]
        return found

    def check_and_restore(self) -> list[str]:
        """The changes since the files were saved, after putting the saved files back (new ones removed)."""
        with self._lock:
            found = self.changes()
            if not found:
                return []
            for root in self.roots:
                for path in list(_walk(root)) if root.exists() else []:
                    if path not in self.saved:
                        path.unlink(missing_ok=True)
            for path, data in self.saved.items():
                try:
                    if path.is_symlink() or (path.exists() and path.read_bytes() != data):
                        path.unlink()
                    if not path.exists():
                        path.parent.mkdir(parents=True, exist_ok=True)
                        path.write_bytes(data)
                except OSError:
                    pass
            return found
