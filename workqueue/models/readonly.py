"""Read-only guard for the tables the stored procedures own.

A full-row ``save()`` from a stale snapshot would write back an old lease token, attempt count or
cancel flag and so step around the fencing rules. The ORM may read these tables; every write must
go through a ``wq_*`` procedure.

The guard covers the paths Django itself takes behind the public API as well: the base manager
(related lookups, ``Model.save()``'s own UPDATE) is the guarded manager, the queryset refuses its
private ``_update``, ``_insert`` and ``_raw_delete`` (what ``save_base`` and the deletion
collector write through), and ``pre_save`` / ``pre_delete`` receivers (connected in
``WorkqueueConfig.ready``) refuse ``Model.save_base(raw=True)`` (``loaddata``) and an unbound
``Model.delete``.
"""

from __future__ import annotations

from typing import Any, NoReturn

from django.db import models

from workqueue.exceptions import DriverOwnedWriteError

_ADVICE = (
    "{model} rows are managed by the work-queue procedures and cannot be written through the ORM; "
    "use workqueue.publish() to add work and the operator API (workqueue.operators: replay, "
    "discard) or `manage.py workqueue replay|discard` to change it."
)


def _refuse(model: type[models.Model]) -> NoReturn:
    raise DriverOwnedWriteError(_ADVICE.format(model=model.__name__))


class DriverOwnedQuerySet(models.QuerySet):
    def update(self, **kwargs: Any) -> NoReturn:
        _refuse(self.model)

    def delete(self) -> NoReturn:
        _refuse(self.model)

    def create(self, **kwargs: Any) -> NoReturn:
        _refuse(self.model)

    def bulk_create(self, *args: Any, **kwargs: Any) -> NoReturn:
        _refuse(self.model)

    def bulk_update(self, *args: Any, **kwargs: Any) -> NoReturn:
        _refuse(self.model)

    def get_or_create(self, *args: Any, **kwargs: Any) -> NoReturn:
        _refuse(self.model)

    def update_or_create(self, *args: Any, **kwargs: Any) -> NoReturn:
        _refuse(self.model)

    async def aupdate(self, **kwargs: Any) -> NoReturn:
        _refuse(self.model)

    async def adelete(self) -> NoReturn:
        _refuse(self.model)

    async def acreate(self, **kwargs: Any) -> NoReturn:
        _refuse(self.model)

    async def abulk_create(self, *args: Any, **kwargs: Any) -> NoReturn:
        _refuse(self.model)

    # Django's own write paths below the public API (Model.save_base, the deletion collector).
    def _update(self, values: Any) -> NoReturn:
        _refuse(self.model)

    def _insert(self, *args: Any, **kwargs: Any) -> NoReturn:
        _refuse(self.model)

    def _raw_delete(self, using: Any) -> NoReturn:
        _refuse(self.model)


class DriverOwnedModel(models.Model):
    """Base for models whose rows only the stored procedures may write."""

    objects = DriverOwnedQuerySet.as_manager()

    class Meta:
        abstract = True
        # Subclasses inherit it through their parents (Options.base_manager), so Django's
        # internal writes meet the guarded queryset too; no migration is involved.
        base_manager_name = "objects"

    def save(self, *args: Any, **kwargs: Any) -> NoReturn:
        _refuse(type(self))

    def delete(self, *args: Any, **kwargs: Any) -> NoReturn:
        _refuse(type(self))

    async def asave(self, *args: Any, **kwargs: Any) -> NoReturn:
        _refuse(type(self))

    async def adelete(self, *args: Any, **kwargs: Any) -> NoReturn:
        _refuse(type(self))


#: Added for a raw save: rows being loaded, which no one means as a write to the queue.
_LOADING_ADVICE = (
    " Loading rows cannot write them either: leave the work queue's tables out of fixtures "
    "(loaddata), and for a TransactionTestCase's serialized_rollback, which saves every model's "
    "rows back, add 'workqueue' to TEST_NON_SERIALIZED_APPS (declared topology comes back "
    "with `manage.py workqueue sync-topology`)."
)


def refuse_signalled_write(sender: type[models.Model], **kwargs: Any) -> NoReturn:
    """``pre_save`` / ``pre_delete`` receiver: no save, raw or not, and no delete gets through."""
    if kwargs.get("raw"):
        raise DriverOwnedWriteError(_ADVICE.format(model=sender.__name__) + _LOADING_ADVICE)
    _refuse(sender)
