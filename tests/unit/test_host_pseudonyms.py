"""A host's pseudonym (what a key limited to named subscriptions sees of hosts) stays the same
across releases and Django versions: operators and dashboards compare the names from one
deploy to the next, and two releases serve them side by side during a rolling deploy."""

from __future__ import annotations

import hashlib
import hmac

from django.test import override_settings

from workqueue.operators.display import host_pseudonym


@override_settings(SECRET_KEY="a secret key kept for this test")
def test_a_hosts_pseudonym_is_the_hmac_it_has_been_since_it_was_first_given():
    # Django's salted_hmac as first used: SHA-1, its key the SHA-1 of the salt and the secret.
    # Django 6.1 warns that the default becomes SHA-256: the algorithm is named, not defaulted.
    key = hashlib.sha1(b"workqueue.api.health.host" + b"a secret key kept for this test").digest()
    expected = hmac.new(key, b"web-1:4242", hashlib.sha1).hexdigest()[:16]

    assert host_pseudonym("web-1:4242") == "host-" + expected
