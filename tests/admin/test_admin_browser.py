"""End to end in a real headless browser: Debian's chromium driven by playwright-python.

The live server runs in a thread of this process and the driver writes on its own connection,
so the data is committed (``queue_db``). Playwright's sync API runs an event loop in this thread
while it is open, and Django refuses ORM calls from a thread with a running loop: all database
work happens before the browser starts or after it has closed.
"""

from __future__ import annotations

import pytest
from django.contrib.auth.models import Permission, User
from playwright.sync_api import sync_playwright

from tests.factories import SubscriptionFactory
from tests.support.browser import BROWSER_MARKS, CHROMIUM, CHROMIUM_ARGS
from tests.support.queue import dead_letter
from workqueue.models import Delivery

pytestmark = [pytest.mark.usefixtures("queue_db"), *BROWSER_MARKS]


def _operator() -> None:
    user = User.objects.create_user("operator", password="operator-pw", is_staff=True)
    user.user_permissions.set(
        Permission.objects.filter(
            content_type__app_label="workqueue",
            codename__in=[
                "view_delivery",
                "view_message",
                "view_subscription",
                "operate_subscription",
            ],
        )
    )


def test_an_operator_logs_in_opens_the_dashboard_and_replays_a_dead_letter(live_server):
    _operator()
    subscription_name = "orders.billing"
    delivery_id = dead_letter(SubscriptionFactory(name=subscription_name), {"order": 7})

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page()
            page.set_default_timeout(15_000)

            page.goto(f"{live_server.url}/admin/login/?next=/admin/")
            page.fill("#id_username", "operator")
            page.fill("#id_password", "operator-pw")
            page.click("input[type=submit]")
            page.click("#workqueue-dashboard-link a:text('Dashboard')")

            row = page.locator(f"#workqueue-stats tr[data-subscription='{subscription_name}']")
            assert row.locator("td.dead-lettered").inner_text() == "1"
            assert page.locator("svg#workqueue-chart rect").count() == 24

            row.locator("td.dead-lettered a").click()
            page.check(f"input[name=_selected_action][value='{delivery_id}']")
            page.select_option("select[name=action]", "replay_deliveries")
            page.click("button[name=index]")
            page.fill("textarea[name=note]", "fixed the parser")
            page.click("#workqueue-action-form input[type=submit]")

            message = page.locator("ul.messagelist li").first.inner_text()
        finally:
            browser.close()

    assert message == "Replayed 1"
    replayed = Delivery.objects.get(pk=delivery_id)
    assert replayed.status == "Pending"
    assert (replayed.resolved_by, replayed.resolution_note) == ("operator", "fixed the parser")
