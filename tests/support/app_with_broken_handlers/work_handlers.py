from __future__ import annotations

import requests_oauthlib_not_installed  # noqa: F401
