"""Settings for the demo and test project. They fail closed:

* ``DEBUG`` is off unless ``DJANGO_DEBUG=1``.
* With ``DEBUG`` off, ``DJANGO_SECRET_KEY`` must be set to a real secret; the development key
  below (published in this file) is used only with ``DEBUG`` on.
* With ``DATABASE_URL`` unset, the project starts (or reuses) a private PostgreSQL cluster owned
  by the project (see ``workqueue.localdb``) only with ``DEBUG`` on or ``WORKQUEUE_LOCALDB=1``;
  otherwise start-up fails naming the fix. With ``DATABASE_URL`` set, nothing is started.

``make demo`` sets ``DJANGO_DEBUG=1``; the test suite sets ``WORKQUEUE_LOCALDB=1`` and a random
``DJANGO_SECRET_KEY`` (``tests/conftest.py``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import django
import environ
from django.core.exceptions import ImproperlyConfigured

BASE_DIR = Path(__file__).resolve().parent.parent

env = environ.Env()

DEBUG = env.bool("DJANGO_DEBUG", default=False)

# Anyone can read this key here, so sessions and signatures made with it protect nothing.
DEVELOPMENT_SECRET_KEY = "insecure-development-key-used-only-with-DJANGO_DEBUG-on"
SECRET_KEY = env.str("DJANGO_SECRET_KEY", default="")
if not SECRET_KEY and DEBUG:
    SECRET_KEY = DEVELOPMENT_SECRET_KEY
elif not DEBUG and SECRET_KEY in (
    "",
    DEVELOPMENT_SECRET_KEY,
    "insecure-demo-key-change-me-in-production",  # the default of earlier versions
):
    raise ImproperlyConfigured(
        "DJANGO_SECRET_KEY is unset or a published development key, and DJANGO_DEBUG is off. "
        "Set DJANGO_SECRET_KEY to a long random secret (e.g. the output of "
        "`python -c 'import secrets; print(secrets.token_urlsafe(50))'`), or set "
        "DJANGO_DEBUG=1 on a development machine."
    )
ALLOWED_HOSTS = env.list("DJANGO_ALLOWED_HOSTS", default=["localhost", "127.0.0.1", "testserver"])

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "ninja",
    # The Tasks API backport (its system checks and log lines); Django 6.0+ has django.tasks.
    *(["django_tasks"] if django.VERSION < (6, 0) else []),
    "workqueue",
    "workqueue_samples",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "project.urls"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

WSGI_APPLICATION = "project.wsgi.application"


def _database() -> dict[str, Any]:
    if "DATABASE_URL" in env.ENVIRON:
        config = env.db_url_config(env.str("DATABASE_URL"))
    else:
        from workqueue import localdb

        config = localdb.django_database(debug=DEBUG)
    # Keep connections between requests and between deliveries: a host's worker threads
    # otherwise open a new connection for every handler that uses the ORM (several ms each).
    # The health check replaces a connection the server closed before it is used.
    config.setdefault("CONN_MAX_AGE", env.int("DJANGO_CONN_MAX_AGE", default=60))
    config.setdefault("CONN_HEALTH_CHECKS", True)
    return config


DATABASES = {"default": _database()}

# A SQL Server to run the conformance suite against (tests/driver/test_conformance_sqlserver.py).
if "WORKQUEUE_TEST_MSSQL_URL" in env.ENVIRON:
    DATABASES["mssql"] = {
        **env.db_url_config(env.str("WORKQUEUE_TEST_MSSQL_URL")),
        "OPTIONS": {"python_driver": "mssql_python"},
    }

DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True
STATIC_URL = "static/"

WORKQUEUE = {
    "SYSTEM_USER": env.str("WORKQUEUE_SYSTEM_USER", default="workqueue-system"),
}

# Django's Tasks API on the work queue: queue "default" is topic and subscription tasks.default.
TASKS = {"default": {"BACKEND": "workqueue.tasks.WorkQueueBackend"}}

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "root": {"handlers": ["console"], "level": env.str("DJANGO_LOG_LEVEL", default="WARNING")},
    # Handlers log through "workqueue.handlers.<key>"; the sample's greetings are the demo.
    "loggers": {"workqueue.handlers": {"level": "INFO"}},
}
