"""The locks the procedures take by name (a partition key's claim lock, a deduplication key's,
a topic's topology lock) are PostgreSQL advisory locks, which any login to the database may
take (review helper-173): a session holding a key's claim lock kept that key's deliveries
Pending for as long as it liked. ``manage.py workqueue restrict-advisory-locks`` lets only the
procedures' owner (and the roles it names) take advisory locks of bigint keys; the procedures
run as their owner, so the granted roles publish and claim as before."""

from __future__ import annotations

import io
from collections.abc import Iterator

import psycopg
import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from tests.factories import SubscriptionFactory
from tests.support.roles import (
    acting_as_granted_role,
    connect_as,
    database_role,
    queue_connections_as,
)
from workqueue import publish
from workqueue.transport import Receiver

pytestmark = pytest.mark.usefixtures("queue_db")


def claim_lock(subscription_id: object, key: str) -> tuple[str, list[str]]:
    return "SELECT pg_advisory_lock(hashtextextended(%s, 0))", [f"wq-claim:{subscription_id}:{key}"]


@pytest.fixture
def restricted() -> Iterator[None]:
    """Advisory locks restricted in this test database; every role's right given back after."""
    call_command("workqueue", "restrict-advisory-locks", stdout=io.StringIO())
    try:
        yield
    finally:
        call_command("workqueue", "restrict-advisory-locks", "--undo", stdout=io.StringIO())


def test_a_login_that_is_not_the_queues_cannot_hold_back_a_partition_key(pg_conn):
    """The attack, then the fix: a login with no grant at all holds a key's claim lock."""
    subscription = SubscriptionFactory(partition_mode="Exclusive")
    held, free = (
        publish(subscription.topic.name, {}, partition_key=key).message_id for key in ("k", "j")
    )
    with database_role(pg_conn, "wq_stranger") as stranger, connect_as(stranger) as session:
        session.execute(*claim_lock(subscription.id, "k"))
        claimed = [d.message_id for d in Receiver(str(subscription.id)).receive(10).deliveries]
        assert claimed == [free], "the held key's delivery was claimed: the attack is moot"

        call_command("workqueue", "restrict-advisory-locks", stdout=io.StringIO())
        try:
            with (
                database_role(pg_conn, "wq_stranger") as another,
                connect_as(another) as late,
                pytest.raises(psycopg.errors.InsufficientPrivilege),
            ):
                late.execute(*claim_lock(subscription.id, "k"))
        finally:
            call_command("workqueue", "restrict-advisory-locks", "--undo", stdout=io.StringIO())
        # Let go before closing: a closed connection's server process may hold its locks a
        # moment after the close returns (a CI run claimed while it still did).
        session.execute("SELECT pg_advisory_unlock_all()")
    assert [d.message_id for d in Receiver(str(subscription.id)).receive(10).deliveries] == [held]


def test_granted_roles_publish_and_claim_with_advisory_locks_restricted(pg_conn, restricted):
    """Every lock of a publish (the topology lock, an Ordered key's publish order, a
    deduplication key) and of a claim (the key's claim lock) is taken inside a procedure,
    as its owner: a runtime role that may take no advisory lock itself works as before."""
    subscription = SubscriptionFactory(partition_mode="Ordered")
    with acting_as_granted_role(pg_conn, "wq_host", "grant-runtime") as role:
        accepted = publish(subscription.topic.name, {}, partition_key="k", deduplication_key="d")
        duplicate = publish(subscription.topic.name, {}, partition_key="k", deduplication_key="d")
        receiver = Receiver(str(subscription.id))
        (delivery,) = receiver.receive(10).deliveries
        assert receiver.complete(delivery).settled
        with connect_as(role) as session, pytest.raises(psycopg.errors.InsufficientPrivilege):
            session.execute(*claim_lock(subscription.id, "k"))

    assert (accepted.status, duplicate.status) == ("Accepted", "Duplicate")
    assert delivery.message_id == accepted.message_id


def test_a_role_allowed_keeps_advisory_locks_and_undo_gives_them_back_to_every_role(pg_conn):
    """Another application of the same database that uses advisory locks is named with
    --allow; --undo puts PostgreSQL's default back."""
    with database_role(pg_conn, "wq_app") as app, database_role(pg_conn, "wq_other") as other:
        call_command("workqueue", "restrict-advisory-locks", "--allow", app, stdout=io.StringIO())
        try:
            with connect_as(app) as allowed, connect_as(other) as refused:
                allowed.execute("SELECT pg_advisory_xact_lock(42)")
                with pytest.raises(psycopg.errors.InsufficientPrivilege):
                    refused.execute("SELECT pg_try_advisory_lock_shared(42)")
        finally:
            call_command("workqueue", "restrict-advisory-locks", "--undo", stdout=io.StringIO())
        with connect_as(other) as again:
            assert again.execute("SELECT pg_try_advisory_lock(42)").fetchone() == (True,)


def test_restricting_advisory_locks_as_a_role_that_may_not_says_how(pg_conn, settings):
    """PostgreSQL's built-in functions belong to its bootstrap superuser: the owner of the
    queue's tables, if no superuser, is told to run it as one or to print the statements."""
    out = io.StringIO()
    call_command("workqueue", "restrict-advisory-locks", "--print", stdout=out)
    printed = out.getvalue()
    assert "REVOKE EXECUTE ON FUNCTION pg_catalog.pg_advisory_xact_lock(bigint) FROM PUBLIC" in (
        printed
    )
    with (
        database_role(pg_conn, "wq_no_superuser") as role,
        queue_connections_as(role),
        pytest.raises(CommandError, match=r"Nothing changed: .* run this as a superuser"),
    ):
        call_command("workqueue", "restrict-advisory-locks", stdout=io.StringIO())
    still = "SELECT has_function_privilege('public', 'pg_advisory_lock(bigint)', 'EXECUTE')"
    assert pg_conn.execute(still).fetchone() == (True,)
