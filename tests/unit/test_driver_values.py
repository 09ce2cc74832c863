"""How the driver turns Python values into a call's parameters and result rows back into
values: the same for every spelling a caller may use, whatever shortcut each takes."""

from __future__ import annotations

import datetime as dt
import uuid

import pytest

from workqueue.driver.base import BaseDriver, decode_value
from workqueue.driver.postgresql import PostgresDriver
from workqueue.driver.procedures import ParamType, get_procedure
from workqueue.exceptions import DriverError

ID = "0f8fad5b-d9cb-469f-a165-70867728950e"


@pytest.fixture
def driver() -> BaseDriver:
    return PostgresDriver("default")


@pytest.mark.parametrize(
    "spelling",
    [ID, ID.upper(), "{" + ID + "}", "urn:uuid:" + ID, ID.replace("-", ""), uuid.UUID(ID)],
)
def test_every_spelling_of_a_uuid_parameter_is_sent_in_canonical_text(driver, spelling):
    [message_id] = [p for p in get_procedure("wq_publish").params if p.name == "message_id"]
    assert driver.adapt(message_id, spelling) == ID


@pytest.mark.parametrize("bad", ["not-a-uuid", ID[:-1], ID + "0", ID.replace("f", "g")])
def test_a_malformed_uuid_parameter_is_refused_before_the_database(driver, bad):
    [message_id] = [p for p in get_procedure("wq_publish").params if p.name == "message_id"]
    with pytest.raises(ValueError):
        driver.adapt(message_id, bad)


def test_bind_orders_the_values_by_parameter_and_leaves_the_missing_ones_null(driver):
    procedure = get_procedure("wq_publish")
    values = driver.bind(
        procedure, {"topic_name": "t", "message_id": ID.upper(), "priority": "3", "payload": [1]}
    )
    by_name = dict(zip(procedure.param_names, values, strict=True))
    assert by_name["topic_name"] == "t"
    assert by_name["message_id"] == ID
    assert by_name["priority"] == 3
    assert by_name["payload"] == "[1]"
    assert [name for name, value in by_name.items() if value is not None] == [
        "topic_name",
        "message_id",
        "payload",
        "priority",
    ]
    with pytest.raises(TypeError, match="no parameter"):
        driver.bind(procedure, {"topic": "t"})


def test_result_rows_decode_each_column_by_its_type(driver):
    publish_many = get_procedure("wq_publish_many")
    assert driver.decode_row(publish_many, ("3", uuid.UUID(ID), "Accepted", None)) == {
        "item_index": 3,
        "message_id": ID,
        "status": "Accepted",
        "error_code": None,
    }
    assert driver.decode_row(publish_many, (0, ID.upper(), "Rejected", "X"))["message_id"] == ID
    naive = dt.datetime(2030, 1, 1, 12, 0)
    lease = driver.decode_row(get_procedure("wq_extend_lease"), ("Held", naive))
    assert lease["lease_expires_at"] == naive.replace(tzinfo=dt.UTC)


def test_a_row_read_by_position_may_carry_a_later_releases_columns_but_not_fewer(driver):
    # SQL Server's EXEC hands back every column by position: a later release's procedure that
    # adds one must not stop this release's hosts in the middle of a rolling upgrade.
    lease = get_procedure("wq_extend_lease")
    naive = dt.datetime(2030, 1, 1, 12, 0)
    assert driver.decode_row(lease, ("Held", naive, 30))["lease_state"] == "Held"
    with pytest.raises(DriverError, match=r"older than this code\. Run manage\.py migrate"):
        driver.decode_row(lease, ("Held",))


def test_every_column_type_has_a_decoder_and_null_stays_null():
    for kind in ParamType:
        assert decode_value(kind, None) is None
    assert decode_value(ParamType.JSON, '{"a":[1]}') == {"a": [1]}
    assert decode_value(ParamType.BOOL, 1) is True
    assert decode_value(ParamType.TEXT, "Text") == "Text"
    assert decode_value(ParamType.UUID, ID.upper()) == ID


def test_every_parameter_type_has_an_adapter():
    # BaseDriver.adapt looks a value's adapter up by its parameter's type: a type added without
    # one would fail every call that passes it a value.
    from workqueue.driver.base import _ADAPTERS
    from workqueue.driver.procedures import ParamType

    assert set(_ADAPTERS) == {kind.value for kind in ParamType}
