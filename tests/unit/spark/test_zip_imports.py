"""The zip archives on a worker's import path: ``importlib.invalidate_caches()``, which
PySpark's worker calls before every task, reads an archive's directory again only when
the archive changed. Each case runs in a fresh interpreter, since the change is
process-wide."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from blockagg.spark.zip_imports import eagerly_reread

pytestmark = pytest.mark.skipif(not eagerly_reread(),
                                reason="this interpreter reads zip directories lazily (3.12+)")

TASKS = """
import importlib, os, sys, zipfile, zipimport
from blockagg.spark.zip_imports import keep_zip_directories
archive, mode = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(archive, "w") as z:
    z.writestr("first.py", "VALUE = 1\\n")
    for i in range(200):
        z.writestr(f"pkg/m{i}.py", "")
sys.path.insert(0, archive)
import first
if mode == "kept":
    assert keep_zip_directories()
reads = [0]
inner = zipimport._read_directory
def counted(path):
    reads[0] += 1
    return inner(path)
zipimport._read_directory = counted
for _ in range(10):  # ten tasks' starts
    importlib.invalidate_caches()
unchanged = reads[0]
with zipfile.ZipFile(archive, "a") as z:  # the archive rewritten: one module more
    z.writestr("second.py", "VALUE = 2\\n")
importlib.invalidate_caches()
import second
print(unchanged, reads[0] - unchanged, second.VALUE)
"""


def ten_task_starts(tmp_path: Path, mode: str) -> tuple[int, int, int]:
    out = subprocess.run([sys.executable, "-c", TASKS, str(tmp_path / "lib.zip"), mode],
                         capture_output=True, text=True, check=True)
    unchanged, changed, value = out.stdout.split()
    return int(unchanged), int(changed), int(value)


def test_an_unchanged_archive_is_read_once_not_at_every_tasks_start(tmp_path: Path) -> None:
    default = ten_task_starts(tmp_path, "default")
    assert default[0] == 10, f"this interpreter does not read again eagerly: {default}"
    unchanged, _, _ = ten_task_starts(tmp_path, "kept")
    assert unchanged == 1, f"the archive's directory was read {unchanged} times in 10 starts"


def test_an_archive_rewritten_in_place_is_read_again_and_its_new_module_imported(
        tmp_path: Path) -> None:
    _, changed, value = ten_task_starts(tmp_path, "kept")
    assert (changed, value) == (1, 2)



REMOVED = """
import importlib, os, sys, zipfile
from blockagg.spark.zip_imports import keep_zip_directories
archive = sys.argv[1]
with zipfile.ZipFile(archive, "w") as z:
    z.writestr("gone.py", "VALUE = 1\\n")
sys.path.insert(0, archive)
import gone
assert keep_zip_directories()
importlib.invalidate_caches()
os.remove(archive)
importlib.invalidate_caches()  # the interpreter's own handling: the archive's files dropped
del sys.modules["gone"]
try:
    import gone
except ImportError:
    print("not found")
"""


def test_a_removed_archive_is_left_to_the_interpreter_and_its_modules_no_longer_found(
        tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-c", REMOVED, str(tmp_path / "lib.zip")],
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "not found"
