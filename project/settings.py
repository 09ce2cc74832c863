"""Settings for the demo and test project.

With ``DATABASE_URL`` unset, the project starts (or reuses) a private PostgreSQL cluster owned by
the project (see ``workqueue.localdb``) only with ``DEBUG`` on or ``WORKQUEUE_LOCALDB=1``;
otherwise start-up fails naming the fix. With ``DATABASE_URL`` set, nothing is started.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import environ

BASE_DIR = Path(__file__).resolve().parent.parent

env = environ.Env()

SECRET_KEY = env("DJANGO_SECRET_KEY", default="insecure-demo-key-change-me-in-production")
DEBUG = env.bool("DJANGO_DEBUG", default=True)
ALLOWED_HOSTS = env.list("DJANGO_ALLOWED_HOSTS", default=["localhost", "127.0.0.1", "testserver"])

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "ninja",
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
        return env.db_url_config(env.str("DATABASE_URL"))
    from workqueue import localdb

    return localdb.django_database(debug=DEBUG)


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

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "root": {"handlers": ["console"], "level": env.str("DJANGO_LOG_LEVEL", default="WARNING")},
    # Handlers log through "workqueue.handlers.<key>"; the sample's greetings are the demo.
    "loggers": {"workqueue.handlers": {"level": "INFO"}},
}
