"""Read-only guard for the tables the stored procedures own.

A full-row ``save()`` from a stale snapshot would write back an old lease token, attempt count or
cancel flag and so step around the fencing rules. The ORM may read these tables; every write must
go through a ``wq_*`` procedure.
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


class DriverOwnedModel(models.Model):
    """Base for models whose rows only the stored procedures may write."""

    objects = DriverOwnedQuerySet.as_manager()

    class Meta:
        abstract = True

    def save(self, *args: Any, **kwargs: Any) -> NoReturn:
        _refuse(type(self))

    def delete(self, *args: Any, **kwargs: Any) -> NoReturn:
        _refuse(type(self))

    async def asave(self, *args: Any, **kwargs: Any) -> NoReturn:
        _refuse(type(self))

    async def adelete(self, *args: Any, **kwargs: Any) -> NoReturn:
        _refuse(type(self))
