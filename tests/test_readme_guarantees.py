"""The README's guarantees table names the tests that fail when a guarantee breaks: each one
it names must exist under that name (three had been renamed or merged away, so the table
pointed at nothing for those guarantees)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# `tests/x.py`, `tests/x.py::test_y`, `x.py::test_y` (a file named by its name alone) and
# `::test_y` (in the file named last in the same cell); a parametrised id's brackets left out.
NAMED_TEST = re.compile(r"((?:tests/)?[\w/]+\.py)?(?:::(\w+)(?:\[[^\]]*\])?)?")


def _file(name: str) -> Path | None:
    if name.startswith("tests/"):
        return ROOT / name
    found = sorted((ROOT / "tests").rglob(Path(name).name))
    return found[0] if len(found) == 1 else None


def test_every_test_the_guarantees_table_names_exists():
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("## Guarantees") : readme.index("## Performance")]
    missing, named = [], 0
    for row in (line for line in table.splitlines() if line.startswith("| ")):
        for cell in row.split(" | ")[1:]:
            current: Path | None = None
            for token in re.findall(r"`([^`]+)`", cell):
                match = NAMED_TEST.fullmatch(token)
                if match is None or not (match.group(1) or match.group(2)):
                    continue
                if match.group(1):
                    current = _file(match.group(1))
                    if current is None or not current.is_file():
                        missing.append(token)
                        continue
                if match.group(2):
                    named += 1
                    if current is None or not re.search(
                        rf"^(async )?def {match.group(2)}\b", current.read_text(), re.M
                    ):
                        missing.append(token)
    assert named > 100  # the table was read
    assert missing == []


def test_the_readme_counts_the_conformance_cases_there_are():
    """The README said 46 cases for a round after C47 was added (review helper-198)."""
    from workqueue.testing.conformance import CASES

    readme = (ROOT / "README.md").read_text()
    (said,) = re.findall(r"holds the (\d+) transport conformance cases", readme)
    assert int(said) == len(CASES)
