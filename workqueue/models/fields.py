"""Field types with vendor-specific storage details."""

from __future__ import annotations

from typing import Any

from django.db import models


class ByteExactKeyField(models.CharField):
    """A key compared byte for byte (``Venue-42`` differs from ``venue-42``).

    The binary collation differs per vendor, so it is asked of the driver when the column is
    created rather than written into the migration.
    """

    def db_parameters(self, connection: Any) -> dict[str, Any]:
        # Imported here: models must not depend on the driver at import time (layering rule).
        from workqueue.driver import binary_collation

        params = super().db_parameters(connection)
        params["collation"] = binary_collation(connection)
        return params
