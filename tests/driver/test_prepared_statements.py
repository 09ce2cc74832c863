"""The queue's own connections prepare the calls they repeat.

Parsed and planned once per connection instead of at every claim, settle and publish: about a
quarter of a single publish's PostgreSQL CPU. They do so unless the alias's ``OPTIONS`` set
``prepare_threshold`` themselves (``None`` turns it off); Django's own connection on the alias is
left as Django makes it. What makes this safe behind a pooler that loses prepared statements is
in ``test_prepared_statements_behind_a_pooler.py``. What a migration does to them is here: a
statement prepared before a procedure's result changed shape fails without running, the
connection is replaced, and the call runs on the new one.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import psycopg
import pytest
from django.db import connections

from tests.factories import SubscriptionFactory, TopicFactory
from tests.support.database import queue_connection_settings
from workqueue import publish
from workqueue.driver import get_driver

pytestmark = pytest.mark.usefixtures("queue_db")

REPEATED = "SELECT %s::int + 1"


def _prepared_on_the_queue_connection() -> list[str]:
    return [
        name
        for (name,) in get_driver().execute(
            "SELECT name FROM pg_prepared_statements ORDER BY name", []
        )
    ]


def test_the_queue_connections_prepare_the_calls_they_repeat_by_default():
    driver = get_driver()
    assert "prepare_threshold" not in connections[driver.alias].settings_dict.get("OPTIONS", {})
    driver.close()  # a connection opened now, with the project's settings as they are

    for n in range(6):
        assert driver.execute(REPEATED, [n]) == [(n + 1,)]

    [prepared] = _prepared_on_the_queue_connection()
    assert prepared.startswith("wq")  # under a name of the connection's own
    # Django's own connection on the alias prepares nothing: Django turns it off unless asked.
    connections[driver.alias].ensure_connection()
    assert connections[driver.alias].connection.prepare_threshold is None


def test_prepare_threshold_none_in_the_options_keeps_the_queue_connections_unprepared():
    driver = get_driver()
    with queue_connection_settings(options={"prepare_threshold": None}):
        driver.close()
        try:
            for n in range(6):
                assert driver.execute(REPEATED, [n]) == [(n + 1,)]
            prepared = _prepared_on_the_queue_connection()
        finally:
            driver.close()

    assert prepared == []


@pytest.fixture
def reshaped_procedure(pg_conn: psycopg.Connection) -> Iterator[str]:
    """A procedure of the test's own; its call, as the driver renders calls."""
    pg_conn.execute(
        "CREATE FUNCTION wq_test_reshaped(n integer) RETURNS TABLE (doubled integer) "
        "LANGUAGE sql AS 'SELECT n * 2'"
    )
    try:
        yield "SELECT * FROM wq_test_reshaped(n => %s)"
    finally:
        pg_conn.execute("DROP FUNCTION IF EXISTS wq_test_reshaped(integer)")


def reshape(pg_conn: psycopg.Connection, function: str, body: str) -> None:
    """What a procedure migration does to a function whose result changes: a result cannot
    change shape in place, so the function is dropped and created anew (operator.sql,
    wq_list_partitions), in one transaction, while hosts and publishers keep running."""
    with pg_conn.transaction():
        pg_conn.execute(f"DROP FUNCTION {function}")
        pg_conn.execute(body)


def test_a_call_prepared_before_a_migration_reshaped_its_result_runs_on_a_new_connection(
    pg_conn, reshaped_procedure, caplog
):
    caplog.set_level(logging.INFO, logger="workqueue.driver.postgresql")
    driver = get_driver()
    driver.close()
    for n in range(6):
        assert driver.execute(reshaped_procedure, [n]) == [(n * 2,)]
    prepared_on = driver._local.raw.connection
    assert any(name.startswith("wq") for name in _prepared_on_the_queue_connection())

    reshape(
        pg_conn,
        "wq_test_reshaped(integer)",
        "CREATE FUNCTION wq_test_reshaped(n integer) "
        "RETURNS TABLE (doubled integer, tripled integer) LANGUAGE sql AS 'SELECT n * 2, n * 3'",
    )

    # The prepared statement fails before it runs anything ("cached plan must not change
    # result type"), and would on every later call: the call runs again on a new connection.
    assert driver.execute(reshaped_procedure, [7]) == [(14, 21)]
    assert prepared_on.closed
    assert driver._local.raw.connection is not prepared_on
    assert "procedures changed" in caplog.text
    for n in range(6):  # and the new connection prepares the call in its new shape
        assert driver.execute(reshaped_procedure, [n]) == [(n * 2, n * 3)]


ANNOUNCEMENT = (
    "CREATE FUNCTION wq_test_announce(p_channel text, p_payload text) "
    "RETURNS TABLE ({columns}) LANGUAGE sql AS 'SELECT {values}'"
)


def _prepared_announcements() -> int:
    return sum(name.endswith("_announce") for name in _prepared_on_the_queue_connection())


def test_an_announcement_prepared_before_a_migration_reshaped_it_gets_a_new_connection(
    pg_conn, monkeypatch, caplog
):
    caplog.set_level(logging.INFO, logger="workqueue.driver.postgresql")
    topic = TopicFactory()
    SubscriptionFactory(topic=topic)
    # A function in place of the announcement's bare pg_notify, sent the way the driver sends
    # it, so that a migration can reshape what the prepared statement calls.
    pg_conn.execute(ANNOUNCEMENT.format(columns="announced boolean", values="true"))
    driver = get_driver()
    monkeypatch.setitem(
        driver.__dict__,
        "_announce_sql",
        b"SELECT * FROM wq_test_announce($1, $2)",
    )
    driver.close()
    try:
        assert publish(topic.name, {"n": 1}).accepted  # its announcement prepared at once
        prepared_on = driver._local.raw.connection
        assert _prepared_announcements() == 1

        reshape(
            pg_conn,
            "wq_test_announce(text, text)",
            ANNOUNCEMENT.format(columns="announced boolean, woken integer", values="true, 1"),
        )
        # That publish's wake-up is lost (hosts poll) and said so, and the connection that
        # would lose every later one is replaced: the next publish is announced again.
        assert publish(topic.name, {"n": 2}).accepted
        assert publish(topic.name, {"n": 3}).accepted
        assert _prepared_announcements() == 1
    finally:
        driver.close()
        pg_conn.execute("DROP FUNCTION IF EXISTS wq_test_announce(text, text)")

    assert prepared_on.closed
    assert caplog.text.count("Could not announce a publish to topic") == 1
    assert "procedures changed" in caplog.text
