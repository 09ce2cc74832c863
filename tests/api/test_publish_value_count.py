"""Review helper-172: the pre-parse JSON value count (workqueue/input_limits.py)."""

from __future__ import annotations

import json
import threading

import pytest

from workqueue.input_limits import holds_more_json_values


def test_a_utf16_body_is_counted_no_higher_than_its_values():
    """json.loads (what the publish view parses with) reads UTF-16 and UTF-32 bytes too, where
    a character inside a string can hold the byte of a quote (U+2200 is 00 22 in UTF-16-LE):
    the string pattern then ends there, and the next real quote opens a "string" that swallows
    the structure after it, so the count falls far below the values the body holds."""
    payload = ["\u2200", *([{}] * 5000), "\u2200"]
    text = json.dumps(
        {"messages": [{"payload": payload}]}, ensure_ascii=False, separators=(",", ":")
    )
    raw = text.encode("utf-16-le")
    parsed = json.loads(raw)  # the publish view's _parse accepts it
    assert len(parsed["messages"][0]["payload"]) == 5002
    assert holds_more_json_values(text.encode("utf-8"), 1000)  # as UTF-8: refused
    assert holds_more_json_values(raw, 1000), "as UTF-16-LE the same body passes the count"


def test_an_unterminated_string_of_escaped_quotes_is_counted_in_one_pass():
    """Every escaped quote was a place the string pattern could start, and from each it
    scanned to the end of the body before failing (no closing quote): quadratic, some 5 s for
    48 KB and days for the 3 MB body the default limit lets through to the count. Here 300 KB,
    which one pass reads in milliseconds and the quadratic scan in many minutes; the quick
    first count needs PUBLISH_MAX_JSON_VALUES marks anywhere, the string's own included."""
    raw = b'"' + b'\\",' * 100_000  # 100,000 commas (marks) and escaped quotes, never closed
    counted: list[bool] = []
    counter = threading.Thread(
        target=lambda: counted.append(holds_more_json_values(raw, 50_000)), daemon=True
    )
    counter.start()
    counter.join(30)
    assert counted == [False], "still counting after 30 s"


@pytest.mark.usefixtures("queue_db")
def test_a_utf16_publish_body_over_the_value_limit_is_413(client, settings):
    from tests.factories import ApiKeyFactory, SubscriptionFactory, TopicFactory
    from tests.support.api import post

    settings.WORKQUEUE = {**settings.WORKQUEUE, "PUBLISH_MAX_JSON_VALUES": 1000}
    topic = TopicFactory(allow_external_publish=True)
    SubscriptionFactory(topic=topic)
    key = ApiKeyFactory(scopes=["workqueue:publish"])
    payload = ["\u2200", *([{}] * 5000), "\u2200"]
    text = json.dumps({"messages": [{"payload": payload}]}, ensure_ascii=False)

    assert post(client, topic.name, raw=text.encode("utf-8"), key=key).status_code == 413
    response = post(client, topic.name, raw=text.encode("utf-16-le"), key=key)

    assert response.status_code == 413, (response.status_code, response.content[:200])
