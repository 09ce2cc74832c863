"""Messages and deliveries keep their topic and subscription ids without foreign-key
constraints; triggers guard the deletes instead.

A foreign key is checked once per inserted row (a query that locks the topic or subscription
row, at commit): two checks per message with one subscription and one more per extra
subscription of a fan-out, about a sixth of ``publish_many``'s database time. What they
guarded is a delete of a topic or subscription that rows still refer to, which the triggers
``wq_topic_delete_guard`` and ``wq_subscription_delete_guard`` now refuse (installed with the
procedures, ``sql/*/publish.sql``). Each takes the topic's topology lock exclusive before it
looks, so a publish fanning out at that moment is seen, and one that starts later waits and
then no longer sees the deleted row. The ORM still refuses first (``on_delete=PROTECT``).

The constraints are dropped by the names the schema editor gave them, worked out the same way
(PostgreSQL truncates identifiers at 63 characters, SQL Server does not), so the SQL Server
DDL can still be generated without a server. Going back re-creates them.
"""

import copy

import django.db.models.deletion
from django.db import migrations, models

from workqueue.driver.install import install_procedures_step


class DropForeignKeyConstraint(migrations.operations.base.Operation):
    """Drop the database constraint of the ForeignKey ``model_name.name`` and nothing else (the
    state is changed by an AlterField beside it)."""

    reduces_to_sql = True
    reversible = True

    def __init__(self, model_name: str, name: str) -> None:
        self.model_name = model_name
        self.name = name

    def deconstruct(self):
        return self.__class__.__name__, [self.model_name, self.name], {}

    def state_forwards(self, app_label, state):
        pass

    def database_forwards(self, app_label, schema_editor, from_state, to_state):
        model = from_state.apps.get_model(app_label, self.model_name)
        if not self.allow_migrate_model(schema_editor.connection.alias, model):
            return  # as Django's own operations: the router keeps the app off this database
        field = model._meta.get_field(self.name)
        target = field.target_field
        # As BaseDatabaseSchemaEditor._fk_constraint_name names it when it creates it.
        name = schema_editor._create_index_name(
            model._meta.db_table,
            [field.column],
            suffix=f"_fk_{target.model._meta.db_table}_{target.column}",
        )
        schema_editor.execute(schema_editor._delete_fk_sql(model, name))

    def database_backwards(self, app_label, schema_editor, from_state, to_state):
        model = to_state.apps.get_model(app_label, self.model_name)
        if not self.allow_migrate_model(schema_editor.connection.alias, model):
            return
        constrained = model._meta.get_field(self.name)
        unconstrained = copy.copy(constrained)
        unconstrained.db_constraint = False
        schema_editor.alter_field(model, unconstrained, constrained)

    def describe(self):
        return f"Drop the foreign-key constraint of {self.model_name}.{self.name}"


class Migration(migrations.Migration):
    dependencies = [
        ("workqueue", "0024_time_ordered_ids"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            database_operations=[
                DropForeignKeyConstraint("message", "topic"),
                DropForeignKeyConstraint("delivery", "subscription"),
            ],
            state_operations=[
                migrations.AlterField(
                    model_name="message",
                    name="topic",
                    field=models.ForeignKey(
                        db_constraint=False,
                        db_index=False,
                        on_delete=django.db.models.deletion.PROTECT,
                        related_name="messages",
                        to="workqueue.topic",
                    ),
                ),
                migrations.AlterField(
                    model_name="delivery",
                    name="subscription",
                    field=models.ForeignKey(
                        db_constraint=False,
                        db_index=False,
                        on_delete=django.db.models.deletion.PROTECT,
                        related_name="deliveries",
                        to="workqueue.subscription",
                    ),
                ),
            ],
        ),
        migrations.RunPython(
            install_procedures_step("0025_queue_rows_without_topology_constraints"),
            migrations.RunPython.noop,
        ),
    ]
