"""The system user: the account handlers, the sweeper and default publishes act as
(``WORKQUEUE['SYSTEM_USER']``, a username or e-mail).

It needs no password and no admin rights: nobody logs in as it, and anyone who may publish can
make handler code run as it, so it should hold only the permissions the handlers need.
"""

from __future__ import annotations

from typing import Any

from django.contrib.auth import get_user_model

from workqueue.conf import WorkQueueSettings, get_settings
from workqueue.exceptions import WorkQueueConfigurationError

CREATE_COMMAND = "manage.py workqueue create-system-user"


def configured_name(conf: WorkQueueSettings | None = None) -> str:
    """The configured name; raises WorkQueueConfigurationError when it is not set."""
    name = ((conf or get_settings()).SYSTEM_USER or "").strip()
    if not name:
        raise WorkQueueConfigurationError(
            "WORKQUEUE['SYSTEM_USER'] is not set. Set it (or WORKQUEUE_SYSTEM_USER) to the "
            "username of the account handlers run as, then create that account with "
            f"`{CREATE_COMMAND}`."
        )
    return name


def find_system_user(conf: WorkQueueSettings | None = None) -> Any | None:
    """The configured user, matched by username, else by e-mail; None when there is none."""
    name = configured_name(conf)
    User = get_user_model()
    user = User._default_manager.filter(**{User.USERNAME_FIELD: name}).first()
    if user is None and hasattr(User, "email"):
        user = User._default_manager.filter(email__iexact=name).first()
    return user


def resolve_system_user(conf: WorkQueueSettings | None = None) -> Any:
    """The user handlers run as; raises WorkQueueConfigurationError naming the fix."""
    user = find_system_user(conf)
    if user is None:
        raise WorkQueueConfigurationError(unknown_user_message(configured_name(conf)))
    return user


def unknown_user_problem(name: str) -> str:
    return f"WORKQUEUE['SYSTEM_USER'] is {name!r}, but no user has that username or e-mail."


def unknown_user_message(name: str) -> str:
    return (
        f"{unknown_user_problem(name)} Create it with `{CREATE_COMMAND}` (an account with no "
        "password and no admin rights), or set WORKQUEUE['SYSTEM_USER'] to an existing account."
    )


def create_system_user(conf: WorkQueueSettings | None = None) -> tuple[Any, bool]:
    """Create the configured system user if it does not exist; return it and whether it was
    created. A new account has an unusable password and is neither staff nor superuser."""
    existing = find_system_user(conf)
    if existing is not None:
        return existing, False
    User = get_user_model()
    try:
        # No password given: Django stores an unusable one, so nobody can log in as it.
        user = User._default_manager.create_user(**{User.USERNAME_FIELD: configured_name(conf)})
    except TypeError as exc:
        raise WorkQueueConfigurationError(
            f"The user model {User._meta.label} needs more than a {User.USERNAME_FIELD} to "
            f"create a user ({exc}). Create the account yourself, without a password or admin "
            "rights, and set WORKQUEUE['SYSTEM_USER'] to its username."
        ) from exc
    return user, True
