"""The OpenAPI docs page (Swagger UI) from the files django-ninja ships, served by the API
itself, so it works on a network without internet access.

Without ``"ninja"`` in ``INSTALLED_APPS`` django-ninja's own page loads Swagger UI from a CDN;
with it, the files are static files that ``collectstatic`` and a static file server must
provide. Here the page and its few files come from the installed package through the API's
URLs, whatever the project's static file set-up.
"""

from __future__ import annotations

import mimetypes
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ninja
from django.http import FileResponse, Http404, HttpRequest, HttpResponse
from django.shortcuts import render
from ninja import Router
from ninja.openapi.docs import Swagger, _csrf_needed

if TYPE_CHECKING:
    from ninja import NinjaAPI

#: django-ninja's copy of Swagger UI.
ASSET_DIRECTORY = Path(ninja.__file__).parent / "static" / "ninja"
#: The files the page loads: a fixed list, so no request can name any other file.
ASSETS = frozenset(
    {"swagger-ui.css", "swagger-ui-bundle.js", "swagger-ui-init.js", "favicon.svg", "favicon.png"}
)
ASSET_MAX_AGE_SECONDS = 24 * 3600

# Public like the docs page itself, and left out of the schema it documents.
router = Router()


class OfflineSwagger(Swagger):
    """Swagger UI whose page and files all come from this server."""

    # Swagger UI otherwise sends the schema's URL to validator.swagger.io for a badge.
    default_settings = {**Swagger.default_settings, "validatorUrl": None}

    def render_page(self, request: HttpRequest, api: NinjaAPI, **kwargs: Any) -> HttpResponse:
        self.settings["url"] = self.get_openapi_url(api, kwargs)
        context = {
            # Written by json_script in the template, which escapes <, > and &: a value holding
            # "</script>" cannot end the element and start markup of its own (django-ninja's
            # page writes the JSON with |safe; review helper-143).
            "swagger_settings": self.settings,
            "api": api,
            "add_csrf": _csrf_needed(api),
        }
        return render(request, "workqueue/api/swagger.html", context)


@router.get("/docs/assets/{name}", auth=None, include_in_schema=False, url_name="docs-asset")
def asset(request: HttpRequest, name: str) -> FileResponse:
    """One of Swagger UI's files, from the installed django-ninja package."""
    if name not in ASSETS:
        raise Http404("No such documentation file.")
    content_type, _ = mimetypes.guess_type(name)
    response = FileResponse(
        (ASSET_DIRECTORY / name).open("rb"), content_type=content_type or "text/plain"
    )
    response["Cache-Control"] = f"public, max-age={ASSET_MAX_AGE_SECONDS}"
    return response
