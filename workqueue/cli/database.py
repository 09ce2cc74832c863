"""Verbs about the database itself: the embedded cluster, grants, the scaler query and the
conformance suite. These are the surfaces allowed to reach the driver directly."""

from __future__ import annotations

import argparse
from typing import Any

from django.core.management.base import BaseCommand, CommandError
from django.db import DatabaseError

from workqueue.cli import Verb
from workqueue.cli.output import to_json


class LocalDbVerb(Verb):
    name = "localdb"
    help = (
        "Control the embedded PostgreSQL that holds the database this project's settings name "
        "(DATABASES, at WORKQUEUE['DATABASE_ALIAS']): start it (making that database), stop "
        "it, or print that database's URL."
    )

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("action", choices=["start", "stop", "url"])

    def run(self, command: BaseCommand, options: dict[str, Any]) -> None:
        from django.db import connections

        from workqueue import localdb
        from workqueue.conf import get_settings

        action = options["action"]
        alias = get_settings().DATABASE_ALIAS
        settings_dict = connections[alias].settings_dict
        try:
            # The project's own database, not the repository demo's: one server holds a
            # database per project (`python -m workqueue.localdb start --database NAME`).
            database = localdb.database_named_by(settings_dict)
            if database is None:
                raise CommandError(_not_the_embedded_database(alias, settings_dict, action))
            if action == "start":
                command.stdout.write(localdb.ensure_running(database))
            elif action == "stop":
                localdb.stop()
                command.stdout.write("stopped")
            else:
                current = localdb.url(database)
                if current is None:
                    raise CommandError(
                        "The embedded PostgreSQL is not running; start it with "
                        "`manage.py workqueue localdb start`."
                    )
                command.stdout.write(current)
        except localdb.LocalDBError as exc:
            raise CommandError(str(exc)) from exc


def _not_the_embedded_database(alias: str, settings_dict: dict[str, Any], action: str) -> str:
    from workqueue import localdb

    host = localdb.settings_host(settings_dict)
    name = settings_dict.get("NAME")
    where = f"host {host!r}" if host else "the default host (no HOST)"
    elsewhere = (
        f"DATABASES[{alias!r}] names database {name!r} on {where}, not on the embedded "
        f"PostgreSQL of {localdb.data_dir()}"
    )
    if action == "stop":
        # An embedded server may still run from before the settings changed: stopped by its
        # own module, which needs no project.
        return (
            f"{elsewhere}, so this project has no embedded server to stop. To stop one started "
            "from elsewhere, run `python -m workqueue.localdb stop` (with "
            "WORKQUEUE_LOCALDB_DIR set to the folder it was started with)."
        )
    suggested = name if isinstance(name, str) and name.isidentifier() else "yourproject"
    return (
        f"{elsewhere}, so `manage.py workqueue localdb {action}` has nothing of this "
        "project's to act on. To develop on the embedded database, run "
        f"`python -m workqueue.localdb start --database {suggested.lower()}` and set "
        f"DATABASES[{alias!r}] to the URL it prints (DATABASE_URL, with django-environ); if it "
        "names an embedded database already, set WORKQUEUE_LOCALDB_DIR to the folder that "
        "database was started with."
    )


class _StatementsVerb(Verb):
    """A verb that runs a list of SQL statements, or with ``--print`` only shows them."""

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument(
            "--print",
            action="store_true",
            dest="print_only",
            help="Print the statements instead of running them.",
        )

    @staticmethod
    def printed(command: BaseCommand, options: dict[str, Any], statements: list[str]) -> bool:
        """Print ``statements`` if ``--print`` was given; whether they were."""
        if options["print_only"]:
            command.stdout.write(";\n".join(statements) + ";")
        return options["print_only"]


class _GrantVerb(_StatementsVerb):
    statements_for: str

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("role", help="An existing database role (login or group).")
        super().add_arguments(parser)

    def run(self, command: BaseCommand, options: dict[str, Any]) -> None:
        from django.db import connections

        from workqueue.conf import get_settings
        from workqueue.driver import get_driver, install
        from workqueue.exceptions import DriverError

        alias = get_settings().DATABASE_ALIAS
        if options["role"] == connections[alias].settings_dict.get("USER"):
            # The grants take back what they do not give: run on the owner of the tables (the
            # user this runs as), they would strip the procedures' owner of its own rights.
            raise CommandError(
                f"{options['role']!r} is the user this command connects as, which owns the "
                "work-queue tables and procedures: the grants are for the other roles (hosts, "
                "the web process). Name one of those."
            )
        # A role that may create objects beside the procedures can make their owner run its
        # code; granting more access to such a database would hide the problem.
        problem = get_driver(alias).schema_problem()
        if problem is not None:
            raise CommandError(problem)
        statements = getattr(install, self.statements_for)(options["role"], alias)
        if self.printed(command, options, statements):
            return
        try:
            install.apply_statements(statements, alias)
        except DriverError as exc:
            raise CommandError(
                f"Could not grant to {options['role']!r}: {exc}. Create the role first (for "
                f"example CREATE ROLE ... LOGIN PASSWORD '...') and run this as the database "
                "user that owns the work-queue tables."
            ) from exc
        command.stdout.write(f"Granted {len(statements)} privileges to {options['role']}.")


class GrantRuntimeVerb(_GrantVerb):
    name = "grant-runtime"
    help = (
        "Let a role run hosts and publish: EXECUTE on the claim, heartbeat, settle, publish "
        "and sweeper procedures and SELECT on the tables except the lease tokens, never "
        "INSERT/UPDATE/DELETE on the queue tables."
    )
    statements_for = "grant_runtime_statements"


class GrantOperatorVerb(_GrantVerb):
    name = "grant-operator"
    help = (
        "Let a role operate the queue: EXECUTE on the stats, listing, backlog, replay, discard, "
        "cancel and topology-lock procedures and SELECT on the tables except the lease tokens. "
        "The process serving the admin and the operator API needs it (besides grant-runtime "
        "to publish); hosts do not."
    )
    statements_for = "grant_operator_statements"


class GrantScalerVerb(_GrantVerb):
    name = "grant-scaler"
    help = "Let an autoscaler login read what its scaler query needs, nothing else."
    statements_for = "grant_scaler_statements"


class RestrictAdvisoryLocksVerb(_StatementsVerb):
    name = "restrict-advisory-locks"
    help = (
        "Let only the procedures' owner (and the roles given with --allow) take PostgreSQL "
        "advisory locks in this database, so that no other login can hold the locks the "
        "procedures take by name (a partition key's claim lock, a deduplication key's, a "
        "topic's topology lock); --undo lets every role again. Run as a superuser."
    )

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument(
            "--allow",
            nargs="+",
            default=[],
            metavar="ROLE",
            help="Roles that keep the right: other applications in this database that use "
            "advisory locks of bigint keys.",
        )
        parser.add_argument(
            "--undo", action="store_true", help="Give every role the right back (PUBLIC)."
        )
        super().add_arguments(parser)

    def run(self, command: BaseCommand, options: dict[str, Any]) -> None:
        from workqueue.conf import get_settings
        from workqueue.driver import get_driver, install
        from workqueue.exceptions import DriverError, WorkQueueConfigurationError

        alias = get_settings().DATABASE_ALIAS
        if options["undo"] and options["allow"]:
            raise CommandError("--undo gives the right to every role: drop --allow.")
        driver = get_driver(alias)
        try:
            statements = driver.advisory_lock_statements(
                options["allow"], restrict=not options["undo"]
            )
        except WorkQueueConfigurationError as exc:
            raise CommandError(str(exc)) from None
        if self.printed(command, options, statements):
            return
        how = (
            "PostgreSQL's built-in functions belong to its bootstrap superuser: run this as a "
            "superuser, or run it with --print and have one run the statements"
        )
        try:
            install.apply_statements(statements, alias)
        except DriverError as exc:
            raise CommandError(
                f"Could not change who may take advisory locks: {exc}. {how}; every --allow "
                "role must exist."
            ) from exc
        # A REVOKE or GRANT by a role that may not make it is only a warning: read the outcome.
        if driver.advisory_locks_open_to_all() == (not options["undo"]):
            raise CommandError(f"Nothing changed: this user may not change the rights. {how}.")
        if options["undo"]:
            command.stdout.write("Every role may take advisory locks again.")
        else:
            allowed = ", ".join(options["allow"])
            command.stdout.write(
                "Only the work queue's procedures"
                + (f" and {allowed}" if allowed else "")
                + " may take advisory locks of bigint keys in this database now."
            )


class ScalerQueryVerb(Verb):
    name = "scaler-query"
    help = (
        "Print the autoscaler SQL for this database's vendor: one column, Backlog, claimable "
        "plus in-flight deliveries, each capped at 1000."
    )

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("-s", "--subscription", required=True)

    def run(self, command: BaseCommand, options: dict[str, Any]) -> None:
        from workqueue.cli.operators import _operation_errors
        from workqueue.conf import get_settings
        from workqueue.driver import get_driver
        from workqueue.operators import operations

        name = options["subscription"].strip().lower()
        if _operation_errors(lambda: operations.check_scaler_query(name)) is False:
            command.stderr.write(
                f"No subscription is named {name!r} (yet): the query answers 0 until one is. "
                "Check the name with `manage.py workqueue stats`."
            )
        sql = get_driver(get_settings().DATABASE_ALIAS).scaler_query(name)
        if options["json"]:
            command.stdout.write(to_json({"subscription": name, "sql": sql}))
        else:
            command.stdout.write(sql)


class ReindexVerb(_StatementsVerb):
    name = "reindex"
    help = (
        "Rebuild the queue tables' indexes online. After a large backlog drains, the partial "
        "indexes keep their size while holding few entries, and the planner starts to avoid "
        "them; run this then, as the database user that owns the tables."
    )

    def run(self, command: BaseCommand, options: dict[str, Any]) -> None:
        from django.db import DatabaseError, connections

        from workqueue.conf import get_settings
        from workqueue.driver import get_driver

        alias = get_settings().DATABASE_ALIAS
        driver = get_driver(alias)
        statements = driver.rebuild_index_statements()
        if self.printed(command, options, statements):
            return
        connection = connections[alias]
        before = driver.queue_index_bytes(connection)
        try:
            for statement in statements:
                # Each on its own: an online rebuild cannot run inside a transaction.
                with connection.cursor() as cursor:
                    cursor.execute(statement)
        except DatabaseError as exc:
            raise CommandError(
                f"Could not rebuild the queue indexes: {exc}. Run `workqueue reindex` as the "
                "database user that owns the work-queue tables (the one that runs migrate)."
            ) from exc
        after = driver.queue_index_bytes(connection)
        if options["json"]:
            command.stdout.write(to_json({"bytes_before": before, "bytes_after": after}))
        else:
            command.stdout.write(
                f"Rebuilt the queue tables' indexes: {before / 1e6:.1f} MB before, "
                f"{after / 1e6:.1f} MB after."
            )


class InstallProceduresVerb(Verb):
    name = "install-procedures"
    help = (
        "Install this release's procedures and renew the grants, as its latest migration does. "
        "Needed only when the database records that migration but holds another release's "
        "procedures: a migrate that failed after the work-queue migrations had committed, "
        "then a roll-back of the code."
    )

    def run(self, command: BaseCommand, options: dict[str, Any]) -> None:
        from django.db import connections

        from workqueue.conf import get_settings
        from workqueue.driver import get_driver, install

        alias = get_settings().DATABASE_ALIAS
        connection = connections[alias]
        if not install.latest_procedure_migration_applied(connection):
            raise CommandError(
                f"Migration workqueue.{install.LATEST_PROCEDURE_MIGRATION} is not applied to "
                f"database {alias!r}: run `manage.py migrate`, which installs the procedures."
            )
        installed = get_driver(alias).installed_procedures()
        if installed is not None and installed > install.LATEST_PROCEDURE_MIGRATION:
            # A rolling deploy's old process following a warning would take back what the new
            # release's processes call.
            raise CommandError(
                f"The procedures installed are a later release's ({installed}); installing "
                f"this release's ({install.LATEST_PROCEDURE_MIGRATION}) would take back what "
                "that release's processes call. Run install-procedures from that release."
            )
        try:
            holders = install.reinstall_procedures(connection)
        except DatabaseError as exc:
            raise CommandError(
                f"Could not install the procedures: {exc}. Run it as the database user that "
                "owns the work-queue tables (the one that runs migrate)."
            ) from exc
        renewed = [f"{role} ({grant.value})" for grant, roles in holders.items() for role in roles]
        command.stdout.write(
            f"Installed the procedures of workqueue.{install.LATEST_PROCEDURE_MIGRATION}; "
            f"renewed grants: {', '.join(renewed) or 'none held'}."
        )


class ConformanceVerb(Verb):
    name = "conformance"
    help = "Run the transport conformance suite against the configured database."

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument(
            "--case",
            action="append",
            dest="cases",
            metavar="ID",
            help="Run only this case (repeatable), e.g. --case C14.",
        )

    def run(self, command: BaseCommand, options: dict[str, Any]) -> None:
        from workqueue.conf import get_settings
        from workqueue.testing.conformance.runner import format_table, run_conformance

        try:
            results = run_conformance(get_settings().DATABASE_ALIAS, only=options["cases"])
        except KeyError as exc:
            raise CommandError(exc.args[0]) from None
        if options["json"]:
            command.stdout.write(to_json([r.as_dict() for r in results]))
        else:
            command.stdout.write(format_table(results))
        failed = [r for r in results if not r.passed]
        if failed or not results:
            raise CommandError(
                f"{len(failed)} of {len(results)} conformance cases failed."
                if results
                else "No conformance case matched."
            )


DATABASE_VERBS = [
    LocalDbVerb,
    GrantRuntimeVerb,
    GrantOperatorVerb,
    GrantScalerVerb,
    RestrictAdvisoryLocksVerb,
    ScalerQueryVerb,
    ReindexVerb,
    InstallProceduresVerb,
    ConformanceVerb,
]
