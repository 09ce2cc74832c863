"""How a publish wakes the hosts on PostgreSQL, and what that costs the publishers.

A transaction that NOTIFYs holds a cluster-wide lock from just before its commit until its commit
record is flushed, so publishers whose publishes notified committed one at a time instead of
sharing a flush. A publish on the driver's own connection therefore sends no NOTIFY itself: once
it has committed, the driver sends a bare ``pg_notify`` on the channel and with the payload the
publish returned, on the same connection, a transaction of its own, without waiting for the
answer. An enlisted publish still notifies at the caller's commit, and only if the caller
commits. The announcement names the subscriptions that got deliveries, so that hosts wake only
their consumers (a filter may keep some subscriptions of a topic from a message).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
import pytest
from django.db import connection, transaction

from tests.factories import SubscriptionFactory, TopicFactory
from tests.support.database import psycopg_params, queue_connection_settings
from tests.support.processes import run_python, subprocess_environment
from workqueue import publish, publish_many
from workqueue.driver import get_driver, postgresql
from workqueue.exceptions import TransientDriverError
from workqueue.models import Delivery, Topic

pytestmark = pytest.mark.usefixtures("queue_db")


@pytest.fixture
def topic() -> Topic:
    topic = TopicFactory()
    SubscriptionFactory(topic=topic)
    return topic


@pytest.fixture
def listener(topic: Topic) -> Iterator[psycopg.Connection]:
    """A session LISTENing on ``topic``'s channel, as a host's wake-up thread does."""
    with psycopg.connect(**psycopg_params(), autocommit=True) as listening:
        channel = get_driver().topic_channel(str(topic.id))
        listening.execute(f'LISTEN "{channel}"')
        yield listening


def notifications(listening: psycopg.Connection, wait: float) -> list[psycopg.Notify]:
    """The notifications that arrive within ``wait`` seconds (or until the first one)."""
    return list(listening.notifies(timeout=wait, stop_after=1))


@contextmanager
def announcements_failing(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every announcement refused by the server while the block runs: it names a topic whose
    channel would be longer than PostgreSQL allows a channel's name to be."""
    with monkeypatch.context() as patch:
        patch.setattr(postgresql, "_announcement", lambda rows: ("x" * 100, "", frozenset()))
        yield


@contextmanager
def announcements_unpreparable(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The announcement's statement reads a table that does not exist while the block runs, so
    the server refuses to prepare it (or, unprepared, to run it)."""
    with monkeypatch.context() as patch:
        statement = b"SELECT pg_notify($1, $2) FROM wq_no_such_table"
        patch.setattr(postgresql.PostgresDriver, "_announce_sql", statement)
        yield


def test_the_transaction_that_writes_a_publish_sends_no_notification(
    topic, listener, monkeypatch, caplog
):
    with announcements_failing(monkeypatch):
        result = publish(topic.name, {"n": 1})
        # The connection's next statement reads the failed announcement's answer.
        assert publish(topic.name, {"n": 2}).accepted

    # Stored and committed, and yet nobody was woken: the publish's own transaction held no
    # notification lock while its commit record was flushed; only the announcement notifies.
    assert result.accepted
    assert Delivery.objects.filter(message_id=result.message_id).exists()
    assert notifications(listener, wait=0.5) == []
    assert "Could not announce a publish to topic" in caplog.text

    # The connection that carried the failed announcements goes on publishing and announcing.
    assert publish(topic.name, {"n": 3}).accepted
    assert len(notifications(listener, wait=5)) == 1


def test_a_publish_and_a_batch_wake_the_listening_hosts_once_committed(topic, listener):
    assert publish(topic.name, {"n": 1}).accepted
    assert len(notifications(listener, wait=5)) == 1

    results = publish_many(topic.name, [{"payload": {"n": n}} for n in range(3)])

    assert all(r.accepted for r in results)
    assert len(notifications(listener, wait=5)) == 1


def test_a_publish_that_is_not_accepted_announces_nothing(topic, listener):
    first = publish(topic.name, {"n": 1}, message_id="0190f3c0-0000-7000-8000-000000000001")
    assert first.accepted
    assert notifications(listener, wait=5)

    again = publish(topic.name, {"n": 1}, message_id="0190f3c0-0000-7000-8000-000000000001")

    assert again.status == "Duplicate"
    assert notifications(listener, wait=0.5) == []


def test_an_enlisted_publish_notifies_when_the_callers_transaction_commits(topic, listener):
    with transaction.atomic():
        assert publish(topic.name, {"n": 1}, enlist=True).accepted
        caller_backend = connection.connection.info.backend_pid
        assert notifications(listener, wait=0.3) == []

    [notice] = notifications(listener, wait=5)
    assert notice.pid == caller_backend


def test_an_enlisted_batch_notifies_once_when_the_callers_transaction_commits(topic, listener):
    with transaction.atomic():
        results = publish_many(
            topic.name, [{"payload": {"n": 1}}, {"payload": {"n": 2}}], enlist=True
        )
        assert all(r.accepted for r in results)
        assert notifications(listener, wait=0.3) == []

    assert len(notifications(listener, wait=5)) == 1


def test_an_enlisted_publish_that_rolls_back_wakes_nobody(topic, listener):
    class Rollback(Exception):
        pass

    with pytest.raises(Rollback), transaction.atomic():
        assert publish(topic.name, {"n": 1}, enlist=True).accepted
        raise Rollback

    assert notifications(listener, wait=0.5) == []


def test_a_process_that_exits_right_after_publishing_still_wakes_the_hosts(topic, listener):
    # A cron job or a one-off command: the announcement's answer is never read, but the
    # statement was with the server before publish returned.
    script = (
        "import django; django.setup()\n"
        "from workqueue import publish\n"
        f"assert publish({topic.name!r}, {{'n': 1}}).accepted\n"
    )
    run_python("-c", script, env=subprocess_environment(), check=True)

    notices = notifications(listener, wait=5)

    assert len(notices) == 1, "the process exited without announcing its publish"


def test_a_publishing_connection_the_server_dropped_is_replaced_without_losing_the_wake_up(
    topic, listener, pg_conn, caplog
):
    assert publish(topic.name, {"n": 1}).accepted
    [first] = notifications(listener, wait=5)
    # The publishing session is idle between publishes; a server restart or an idle-session
    # timeout ends it, with an announcement's answer still unread.
    pg_conn.execute("SELECT pg_terminate_backend(%s)", [first.pid])

    assert publish(topic.name, {"n": 2}).accepted

    [second] = notifications(listener, wait=5)
    assert second.pid != first.pid
    assert "Could not announce" not in caplog.text


def _clicks_only() -> dict:
    return {"logic": "and", "filters": [{"field": "eventType", "operator": "eq", "value": "click"}]}


def test_a_filtered_topics_announcement_names_the_subscriptions_that_got_deliveries(
    topic, listener
):
    everything = topic.subscriptions.get()
    clicks = SubscriptionFactory(topic=topic, filter=_clicks_only())

    assert publish(topic.name, {"n": 1}, attributes={"eventType": "view"}).accepted
    [view] = notifications(listener, wait=5)
    assert publish_many(
        topic.name,
        [{"payload": {"n": 2}, "attributes": {"eventType": "click"}}, {"payload": {"n": 3}}],
    )[0].accepted
    [batch] = notifications(listener, wait=5)

    # A host kicks only the consumers named: the click-only subscription's sleeps through views.
    assert view.payload == str(everything.id)
    assert sorted(batch.payload.split(",")) == sorted([str(everything.id), str(clicks.id)])


def test_a_batch_whose_first_item_is_refused_is_announced_all_the_same(topic, listener):
    taken = "0190f3c0-0000-7000-8000-000000000002"
    assert publish(topic.name, {"n": 0}, message_id=taken).accepted
    assert notifications(listener, wait=5)

    # The batch's announcement rides on its first row, here the database's refusal of an item
    # whose id another message holds.
    results = publish_many(
        topic.name, [{"payload": {"n": 1}, "message_id": taken}, {"payload": {"n": 2}}]
    )

    assert [r.status for r in results] == ["Rejected", "Accepted"]
    assert results[0].error.code == "MessageIDConflict"
    [notice] = notifications(listener, wait=5)
    assert notice.payload == str(topic.subscriptions.get().id)


def test_a_publish_that_no_subscription_receives_wakes_nobody(listener, topic):
    topic.subscriptions.update(filter=_clicks_only())

    result = publish(topic.name, {"n": 1}, attributes={"eventType": "view"})

    assert result.accepted  # stored, for no subscription
    assert notifications(listener, wait=0.5) == []


def test_a_batch_that_no_subscription_receives_wakes_nobody(listener, topic):
    topic.subscriptions.update(filter=_clicks_only())
    views = [{"payload": {"n": n}, "attributes": {"eventType": "view"}} for n in range(2)]

    assert all(r.accepted for r in publish_many(topic.name, views))
    with transaction.atomic():
        assert all(r.accepted for r in publish_many(topic.name, views[:1], enlist=True))
        assert all(r.accepted for r in publish_many(topic.name, views, enlist=True))

    assert notifications(listener, wait=0.5) == []


def test_an_unfiltered_topics_announcement_names_every_subscription_that_got_a_delivery(
    topic, listener
):
    second = SubscriptionFactory(topic=topic)

    assert publish(topic.name, {"n": 1}).accepted
    [notice] = notifications(listener, wait=5)

    expected = sorted(str(s.id) for s in topic.subscriptions.all())
    assert str(second.id) in expected
    assert sorted(notice.payload.split(",")) == expected


def test_a_batch_published_item_by_item_is_announced_once_naming_what_any_item_reached(
    topic, listener
):
    everything = topic.subscriptions.get()
    clicks = SubscriptionFactory(topic=topic, filter=_clicks_only())
    # A deduplication key sends the batch through wq_publish item by item: each accepted
    # item's row asks for its own announcement, and the driver sends one for all of them.
    results = publish_many(
        topic.name,
        [
            {"payload": {"n": 1}, "attributes": {"eventType": "click"}, "deduplication_key": "a"},
            {"payload": {"n": 2}, "attributes": {"eventType": "view"}, "deduplication_key": "b"},
        ],
    )

    assert all(r.accepted for r in results)
    [notice] = notifications(listener, wait=5)
    assert sorted(notice.payload.split(",")) == sorted([str(everything.id), str(clicks.id)])
    assert notifications(listener, wait=0.5) == []


def test_names_that_would_not_fit_a_notification_wake_every_consumer(topic, listener, monkeypatch):
    # A notification's payload holds under 8000 bytes; the driver names subscriptions in up to
    # 7000 of them. Here a limit one id fits under and two do not, on a topic of two.
    SubscriptionFactory(topic=topic)
    monkeypatch.setattr(postgresql, "ANNOUNCEMENT_PAYLOAD_MAX", 40)
    assert publish_many(topic.name, [{"payload": {}, "deduplication_key": "a"}])[0].accepted
    [notice] = notifications(listener, wait=5)

    assert notice.payload == ""


def test_the_previous_releases_announcement_still_wakes_the_hosts(topic, listener):
    # During an upgrade, processes of the release before 0032 publish, then call wq_announce
    # with the ids they published, as they always did.
    [row] = get_driver().call(
        "wq_publish",
        {
            "topic_name": topic.name,
            "message_id": "0190f3c0-0000-7000-8000-000000000003",
            "payload": {"n": 1},
            "envelope_bytes": 100,
            "external": False,
            "published_by": "previous-release",
            "caller_announces": True,
        },
    )
    assert row["status"] == "Accepted"
    assert notifications(listener, wait=0.5) == []

    [announced] = get_driver().call(
        "wq_announce",
        {"topic_name": topic.name, "message_ids": ["0190f3c0-0000-7000-8000-000000000003"]},
    )

    assert announced == {"announced": True}
    assert len(notifications(listener, wait=5)) == 1


@pytest.fixture
def prepared_statements() -> Iterator[None]:
    """The queue's connections opened meanwhile prepare their statements, as
    ``"prepare_threshold": 5`` in the alias's OPTIONS makes them do (README, PgBouncer)."""
    driver = get_driver()
    with queue_connection_settings(options={"prepare_threshold": 5}):
        driver.close()  # this thread's connection is opened again, with the option
        try:
            yield
        finally:
            driver.close()


def _prepared_announcements() -> int:
    [(count,)] = get_driver().execute(
        "SELECT count(*) FROM pg_prepared_statements WHERE name LIKE 'wq%%\\_announce'", []
    )
    return count


def test_a_connection_that_prepares_its_statements_prepares_the_announcement_once(
    topic, listener, prepared_statements
):
    for n in range(3):
        assert publish(topic.name, {"n": n}).accepted
        assert len(notifications(listener, wait=5)) == 1

    # Parsed and planned once for the session, not at every publish.
    assert _prepared_announcements() == 1


def test_a_connection_that_lost_its_prepared_announcement_stops_preparing(
    topic, listener, prepared_statements, caplog
):
    # What a pooler that keeps no prepared statements does to every connection behind it.
    assert publish(topic.name, {"n": 1}).accepted
    assert len(notifications(listener, wait=5)) == 1
    get_driver().execute("DEALLOCATE ALL", [])

    # That publish's wake-up is lost (hosts poll), and said so; the next ones are announced
    # unprepared, and the connection prepares nothing more.
    assert publish(topic.name, {"n": 2}).accepted
    assert publish(topic.name, {"n": 3}).accepted

    assert "Could not announce a publish to topic" in caplog.text
    assert "stops preparing statements" in caplog.text
    assert len(notifications(listener, wait=5)) == 1
    assert _prepared_announcements() == 0
    assert get_driver()._local.raw.connection.prepare_threshold is None


def test_an_announcement_that_cannot_be_prepared_is_reported_and_prepared_later(
    topic, listener, prepared_statements, monkeypatch, caplog
):
    with announcements_unpreparable(monkeypatch):
        assert publish(topic.name, {"n": 1}).accepted
        assert notifications(listener, wait=0.5) == []
        assert "Could not announce a publish to topic" in caplog.text

    assert publish(topic.name, {"n": 2}).accepted
    assert len(notifications(listener, wait=5)) == 1
    assert _prepared_announcements() == 1


def test_a_connection_lost_before_the_announcement_is_prepared_is_replaced_at_once(
    topic, listener, pg_conn, prepared_statements, monkeypatch, caplog
):
    driver = get_driver()
    execute = driver.execute
    publish_calls: list[str] = []

    def execute_then_lose_the_connection(sql: str, values: list, connection=None):
        publishing = "wq_publish(" in sql
        if publishing:
            publish_calls.append("wq_publish")  # every attempt, failed ones too
        rows = execute(sql, values, connection)
        if publishing and publish_calls == ["wq_publish"]:  # the server ends the session now
            [(pid,)] = execute("SELECT pg_backend_pid()", [])
            pg_conn.execute("SELECT pg_terminate_backend(%s, 5000)", [pid])
        return rows

    monkeypatch.setattr(driver, "execute", execute_then_lose_the_connection)

    assert publish(topic.name, {"n": 1}).accepted
    assert "Could not announce a publish to topic" in caplog.text
    assert publish(topic.name, {"n": 2}).accepted

    # The second publish went out on a new connection at its first attempt (a transient error
    # would have been retried after a pause), and was announced.
    assert publish_calls == ["wq_publish", "wq_publish"]
    assert len(notifications(listener, wait=5)) == 1


def test_a_publish_whose_answer_was_lost_is_announced_when_its_retry_finds_it(
    topic, listener, monkeypatch
):
    """The lost sending's announcement went with its connection, and the retry (a Duplicate of
    it) made no deliveries to announce: hosts elsewhere saw the message only at their next
    poll."""
    driver = get_driver()
    original, calls = driver.publish, []

    def committed_then_lost(name: str, params: Any = None, **kwargs: Any) -> Any:
        calls.append(name)
        if len(calls) == 1:
            # Committed without its announcement, which would follow on the lost connection.
            driver.call(name, {**params, "caller_announces": True})
            raise TransientDriverError("server closed the connection unexpectedly (test)")
        return original(name, params, **kwargs)

    monkeypatch.setattr(driver, "publish", committed_then_lost)

    result = publish(topic.name, {"n": 1})

    assert (result.status, calls) == ("Accepted", ["wq_publish", "wq_publish"])
    assert len(notifications(listener, wait=5)) == 1
