"""The procedure files, read by name with importlib.resources.

Both vendors' folders hold the same file names; ``INSTALL_ORDER`` is the order in which a
vendor's files are applied (later files call functions defined by earlier ones).
"""

from __future__ import annotations

from importlib import resources

#: The latest migration that changes the procedures: the one that installs them (older ones are
#: no-ops; see ``workqueue.driver.install``), and the release the install's stamp names.
LATEST_PROCEDURE_MIGRATION = "0065_held_keys_reached_by_operators_and_kept_by_purges"

INSTALL_ORDER = (
    "filters",
    "publish",
    "claim",
    "lease",
    "rate_limit",
    "settle",
    "operator",
    "sweeper",
)


def read_sql(directory: str, name: str) -> str:
    """Return the text of ``workqueue/sql/<directory>/<name>.sql``."""
    return resources.files(__package__).joinpath(directory, f"{name}.sql").read_text("utf-8")


def load_procedures(directory: str) -> list[tuple[str, str]]:
    """Return ``(file name, text)`` for every procedure file of a vendor, in install order."""
    return [(name, read_sql(directory, name)) for name in INSTALL_ORDER]
