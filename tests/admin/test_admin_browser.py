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


# Where each character of an element's text is drawn: its line's top and its left edge (a cell
# may wrap the text onto a second line).
CHARACTER_POSITIONS = """(element) => {
    const text = element.firstChild;
    const positions = [];
    for (let i = 0; i < text.length; i++) {
        const range = document.createRange();
        range.setStart(text, i);
        range.setEnd(text, i + 1);
        const box = range.getBoundingClientRect();
        if (box.width > 0) positions.push([Math.round(box.top), box.left]);
    }
    return positions;
}"""


def test_a_key_that_reorders_its_own_text_is_drawn_in_the_order_it_is_stored(live_server):
    """Review helper-143: a partition key published as "\\u202e24-remotsuc" (a RIGHT-TO-LEFT
    OVERRIDE) was drawn backwards, as "customer-42", in the delivery list an operator replays
    and discards from. Seen failing: its characters were drawn right to left."""
    _operator()
    subscription = SubscriptionFactory(name="orders.ordered", partition_mode="Ordered")
    dead_letter(subscription, {"order": 7}, partition_key="\u202e24-remotsuc")

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page()
            page.set_default_timeout(15_000)
            page.goto(f"{live_server.url}/admin/login/?next=/admin/workqueue/delivery/")
            page.fill("#id_username", "operator")
            page.fill("#id_password", "operator-pw")
            page.click("input[type=submit]")
            # field-partition_key: the column's name before the fix.
            cell = page.locator("#result_list td.field-key, #result_list td.field-partition_key")
            cell = cell.first
            text = cell.inner_text()
            positions = cell.evaluate(CHARACTER_POSITIONS)
        finally:
            browser.close()

    # Line by line, left to right: in the order the characters are stored.
    assert positions == sorted(positions), ("the key is not drawn as stored", positions)
    assert text == "\\u202e24-remotsuc"
    assert len(positions) == len(text)
