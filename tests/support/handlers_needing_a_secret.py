"""A handler module that cannot be imported where its environment is missing (as a worker's
handlers may not be, in a web-only image): it raises at import, not ImportError."""

from __future__ import annotations

raise RuntimeError("needs SOME_API_KEY in the environment")
