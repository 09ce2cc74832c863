"""Debian's chromium for the playwright tests (``playwright install`` cannot download a browser
here), with the flags that keep it off the network."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--headless",
]

# A browser test's marks: `browser`, so `-m "not browser"` leaves it out; skipped where chromium
# is missing, except on CI, which installs it (.ci/run), so there a missing browser fails.
BROWSER_MARKS = [
    pytest.mark.browser,
    pytest.mark.skipif(
        not CHROMIUM.exists() and not os.environ.get("CI"),
        reason=f"needs Debian's chromium at {CHROMIUM} (apt-get install -y chromium)",
    ),
]
