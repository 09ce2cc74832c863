"""The OpenAPI docs page in a real headless browser, as on a network without internet access:
every request that does not go to the test server is refused, and Swagger UI still renders
the API."""

from __future__ import annotations

import pytest
from playwright.sync_api import sync_playwright

from tests.support.browser import BROWSER_MARKS, CHROMIUM, CHROMIUM_ARGS

pytestmark = [pytest.mark.django_db(transaction=True), *BROWSER_MARKS]


def test_swagger_ui_renders_the_api_with_every_other_host_unreachable(live_server, settings):
    # As in a new project: django-ninja is not an installed app, so it has no static files.
    settings.INSTALLED_APPS = [app for app in settings.INSTALLED_APPS if app != "ninja"]
    elsewhere: list[str] = []

    def only_this_server(route) -> None:
        if route.request.url.startswith(live_server.url):
            route.continue_()
        else:
            elsewhere.append(route.request.url)
            route.abort()

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page()
            page.set_default_timeout(15_000)
            page.route("**/*", only_this_server)
            page.goto(f"{live_server.url}/work-queue/docs")
            page.wait_for_selector(".swagger-ui .info .title")
            title = page.inner_text(".swagger-ui .info .title")
            # The operations come from the schema, fetched from this server too.
            page.wait_for_selector("[data-path='/work-queue/health']")
        finally:
            browser.close()

    assert title.startswith("Work queue")
    assert elsewhere == []
