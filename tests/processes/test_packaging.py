"""The wheel is a real reusable package: a brand-new `django-admin startproject` project can
install it, add the app, migrate, publish and process a message with `workqueue_host`, and run
its own tests of publishing and handlers with `manage.py test` and with pytest."""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import pytest

pytestmark = pytest.mark.processes

ROOT = Path(__file__).resolve().parents[2]

HANDLER = """
from pathlib import Path

from workqueue import BaseWorkHandler, Outcome, register_handler


@register_handler("pkg.hello")
class Hello(BaseWorkHandler):
    def handle(self, message, context):
        Path(message.payload["marker"]).write_text(f"hello {message.payload['name']}")
        return Outcome.complete()
"""

SETTINGS = """
import environ
INSTALLED_APPS += ["workqueue", "hello"]
DATABASES = {"default": environ.Env.db_url_config(environ.Env().str("DATABASE_URL"))}
WORKQUEUE = {"SYSTEM_USER": "robot", "SUBSCRIPTIONS": [{"name": "*", "concurrency": 2}]}
"""

SETUP = """
from django.contrib.auth import get_user_model
from workqueue.models import Subscription, Topic, Transport
get_user_model().objects.create_user("robot")
topic = Topic.objects.create(name="pkg.greetings", transport=Transport.objects.get(name="Database"))
Subscription.objects.create(topic=topic, name="pkg.greetings-hello", handler_key="pkg.hello")
"""


def _run(
    args: list[str], cwd: Path, env: dict[str, str], timeout: float = 600, expect: int = 0
) -> str:
    done = subprocess.run(
        args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    assert done.returncode == expect, (
        f"{args} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    )
    return done.stdout + done.stderr


def _clean_environment() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WORKQUEUE_", "DJANGO_"))}
    env.pop("PYTHONPATH", None)
    return env


@dataclass(frozen=True)
class Installed:
    """A virtualenv holding the built wheel, as a user's project would have it."""

    venv: Path

    @property
    def python(self) -> str:
        return str(self.venv / "bin" / "python")

    def new_project(self, where: Path, env: dict[str, str]) -> Path:
        """``django-admin startproject newsite`` in ``where`` with the ``hello`` app added."""
        site = where / "newsite"
        site.mkdir()
        _run(
            # django-admin's console script is in the environment that installed Django, so
            # run it as a module; -P keeps the folder (with newsite/ in it) off sys.path.
            [self.python, "-P", "-m", "django", "startproject", "newsite", str(site)],
            where,
            env,
        )
        (site / "hello").mkdir()
        (site / "hello" / "__init__.py").write_text("")
        (site / "hello" / "work_handlers.py").write_text(HANDLER)
        with (site / "newsite" / "settings.py").open("a") as settings_file:
            settings_file.write(SETTINGS)
        return site


def _offline_build_problem() -> str | None:
    """Why this environment cannot build the wheel without the network, or None: the build
    backend pyproject.toml names (setuptools >= 68) must be installed, with ``bdist_wheel``
    (built into setuptools from 70.1, else the ``wheel`` package)."""
    try:
        found = tuple(int(part) for part in version("setuptools").split(".")[:2])
    except PackageNotFoundError:
        found = (0, 0)
    if found >= (70, 1) or (found >= (68, 0) and importlib.util.find_spec("wheel")):
        return None
    return (
        f"building the wheel offline needs setuptools>=70.1 in {sys.prefix} (found "
        f"{'.'.join(map(str, found)) if found > (0, 0) else 'none'}): "
        "pip install -r requirements.txt"
    )


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Installed:
    """The wheel built from this tree, installed in a new virtualenv as a user's project would
    have it, without the network: built with this environment's setuptools (build isolation
    would download it) and installed with ``--no-index --no-deps``; its dependencies and the
    test runners the project uses (django-environ, pytest, pytest-django) are this
    environment's, made visible to the new virtualenv by a ``.pth`` file, and ``pip check``
    proves they meet what the wheel declares."""
    problem = _offline_build_problem()
    if problem:
        # CI installs requirements.txt (make test), so there a missing backend is a failure.
        (pytest.fail if os.environ.get("CI") else pytest.skip)(problem)
    where = tmp_path_factory.mktemp("installed")
    env = _clean_environment()
    wheels = where / "wheels"
    offline = ["--no-index", "--no-deps", "-q"]
    pip_wheel = [sys.executable, "-m", "pip", "wheel", "--no-build-isolation", *offline]
    # Built from a copy of the tree: setuptools builds in the source directory, and a build/
    # left in the developer's checkout keeps every module since deleted, which the next wheel
    # built there ships.
    source = where / "source"
    shutil.copytree(
        ROOT,
        source,
        ignore=shutil.ignore_patterns(
            ".git", ".venv*", "build", "dist", "*.egg-info", "__pycache__", ".*_cache"
        ),
    )
    _run([*pip_wheel, "-w", str(wheels), str(source)], where, env)
    [wheel] = wheels.glob("django_workqueue-*.whl")
    venv = where / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], where, env)
    installed = Installed(venv)
    purelib = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    site_packages = Path(_run([installed.python, "-c", purelib], where, env).strip())
    visible = [path for path in sys.path if path.endswith("site-packages")]
    (site_packages / "workqueue-test-dependencies.pth").write_text("\n".join(visible) + "\n")
    _run([installed.python, "-m", "pip", "install", *offline, str(wheel)], where, env)
    _run([installed.python, "-m", "pip", "check"], where, env)
    return installed


def _files(root: Path, package: str) -> set[Path]:
    return {
        path.relative_to(root)
        for path in (root / package).rglob("*")
        if path.is_file() and "__pycache__" not in path.parts
    }


def test_the_wheel_carries_every_file_of_the_packages(tmp_path, installed):
    """Templates, SQL, static files: one missing from the wheel works in a checkout and fails
    in a user's project (the admin's stylesheet needed package data of its own)."""
    find = "import os, workqueue; print(os.path.dirname(os.path.dirname(workqueue.__file__)))"
    env = _clean_environment()
    site_packages = Path(_run([installed.python, "-c", find], tmp_path, env).strip())

    for package in ("workqueue", "workqueue_samples"):
        missing = _files(ROOT, package) - _files(site_packages, package)
        assert not missing, (package, sorted(map(str, missing)))


def test_the_wheel_installs_into_a_new_project_and_processes_a_message(
    tmp_path, scratch_database, installed
):
    env = _clean_environment()
    env["DATABASE_URL"] = scratch_database
    python = installed.python
    site = installed.new_project(tmp_path, env)
    _run([python, "manage.py", "migrate", "-v0"], site, env)
    _run([python, "manage.py", "shell", "-c", SETUP], site, env)
    marker = tmp_path / "handled.txt"
    publish = (
        "from workqueue import publish; "
        f"print(publish('pkg.greetings', {{'name': 'wheel', 'marker': {str(marker)!r}}}).status)"
    )
    output = _run([python, "manage.py", "shell", "-c", publish], site, env)
    assert output.strip().splitlines()[-1] == "Accepted"

    host = subprocess.Popen(
        [python, "manage.py", "workqueue_host"],
        cwd=site,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not marker.exists() and time.monotonic() < deadline and host.poll() is None:
            time.sleep(0.2)
        assert marker.exists(), "the host did not run the handler"
        assert marker.read_text() == "hello wheel"
    finally:
        host.send_signal(signal.SIGTERM)
        output = host.communicate(timeout=60)[0]
    assert host.returncode == 0, output


# -- a user's own test suite -------------------------------------------------------------------

SHOP_MODELS = """
from django.db import models


class Invoice(models.Model):
    order = models.IntegerField(unique=True)
"""

SHOP_HANDLERS = """
from workqueue import BaseWorkHandler, Outcome, register_handler

from shop.models import Invoice


@register_handler("shop.invoice")
class InvoiceHandler(BaseWorkHandler):
    def handle(self, message, context):
        Invoice.objects.create(order=message.payload["order"])
        return Outcome.complete()
"""

# The README's "Testing your code" examples, run by both test runners.
SHOP_DJANGO_TESTS = """
from django.contrib.auth import get_user_model
from django.test import TestCase, TransactionTestCase

from workqueue import publish
from workqueue.models import Subscription, Topic, Transport
from workqueue.testing import run_until_idle, use_test_connection

from shop.models import Invoice


def make_topology():
    get_user_model().objects.create_user("robot")  # WORKQUEUE["SYSTEM_USER"]
    transport, _ = Transport.objects.get_or_create(name="Database")
    topic = Topic.objects.create(name="orders.created", transport=transport)
    Subscription.objects.create(
        topic=topic, name="orders.created-billing", handler_key="shop.invoice"
    )


@use_test_connection()
class InvoiceTests(TestCase):
    def test_an_order_gets_an_invoice(self):
        make_topology()
        result = publish("orders.created", {"order": 7})
        self.assertEqual(result.status, "Accepted")

        runs = run_until_idle()

        self.assertEqual([run.status for run in runs], ["Completed"])
        self.assertTrue(Invoice.objects.filter(order=7).exists())


class PublishingTests(TransactionTestCase):
    def test_publishing_commits_on_the_queue_connection(self):
        make_topology()
        self.assertEqual(publish("orders.created", {"order": 8}).status, "Accepted")

    def test_handlers_run_on_committed_rows(self):
        make_topology()
        publish("orders.created", {"order": 9})
        self.assertEqual([run.status for run in run_until_idle()], ["Completed"])
        self.assertTrue(Invoice.objects.filter(order=9).exists())
"""

SHOP_PYTEST_TESTS = """
import pytest

from workqueue import publish
from workqueue.testing import run_until_idle, use_test_connection

from shop.models import Invoice
from shop.tests import make_topology


@pytest.mark.django_db
@use_test_connection()
def test_an_order_gets_an_invoice():
    make_topology()
    publish("orders.created", {"order": 7})
    assert [run.status for run in run_until_idle()] == ["Completed"]
    assert Invoice.objects.filter(order=7).exists()


@pytest.mark.django_db(transaction=True)
def test_publishing_alone_in_a_transactional_test():
    make_topology()
    assert publish("orders.created", {"order": 8}).status == "Accepted"
"""


def test_a_new_projects_own_tests_pass_with_manage_py_test_and_with_pytest(
    tmp_path, scratch_database, installed
):
    """A user's suite publishing and running handlers in TestCase, TransactionTestCase and
    pytest-django tests: every runner exits 0, so the queue's connections never stop Django
    from dropping the test database and test mode sees the test's rows."""
    env = _clean_environment()
    env["DATABASE_URL"] = scratch_database
    site = installed.new_project(tmp_path, env)
    shop = site / "shop"
    shop.mkdir()
    (shop / "__init__.py").write_text("")
    (shop / "models.py").write_text(SHOP_MODELS)
    (shop / "work_handlers.py").write_text(SHOP_HANDLERS)
    (shop / "tests.py").write_text(SHOP_DJANGO_TESTS)
    (shop / "test_with_pytest.py").write_text(SHOP_PYTEST_TESTS)
    with (site / "newsite" / "settings.py").open("a") as settings_file:
        settings_file.write('INSTALLED_APPS += ["shop"]\n')
    (site / "pytest.ini").write_text(
        "[pytest]\nDJANGO_SETTINGS_MODULE = newsite.settings\npython_files = tests.py test_*.py\n"
    )
    _run([installed.python, "manage.py", "makemigrations", "shop", "-v0"], site, env)

    output = _run([installed.python, "manage.py", "test", "shop", "-v", "2"], site, env)
    assert "Ran 3 tests" in output and "\nOK" in output, output
    assert "Destroying test database" in output, output

    output = _run([installed.python, "-m", "pytest", "-p", "no:cacheprovider", "shop"], site, env)
    assert "5 passed" in output, output


def test_a_new_project_is_told_to_create_its_system_user_and_one_command_does_it(
    tmp_path, scratch_database, installed
):
    env = _clean_environment()
    env["DATABASE_URL"] = scratch_database
    python = installed.python
    site = installed.new_project(tmp_path, env)
    # The first migrate runs the database checks before the user table exists: not blocked.
    _run([python, "manage.py", "migrate", "-v0"], site, env)

    check = [python, "manage.py", "check", "--database", "default", "--fail-level", "WARNING"]
    report = _run(check, site, env, expect=1)
    assert "workqueue.W003" in report and "'robot'" in report
    assert "manage.py workqueue create-system-user" in report
    assert "superuser" not in report.lower()

    output = _run([python, "manage.py", "workqueue", "create-system-user"], site, env)
    assert "Created the system user 'robot'" in output
    _run([python, "manage.py", "check", "--database", "default"], site, env)
    check = (
        "from django.contrib.auth import get_user_model; "
        "u = get_user_model().objects.get(username='robot'); "
        "print(u.has_usable_password(), u.is_staff, u.is_superuser)"
    )
    output = _run([python, "manage.py", "shell", "-c", check], site, env)
    assert output.strip().splitlines()[-1] == "False False False"


# -- topology as code and publish results in a user's project ------------------------------------

TOPOLOGY_MODULE = """
TOPOLOGY = {
    "topics": {"pkg.orders": {"retention_days": 3}},
    "subscriptions": {
        "pkg.orders-hello": {"topic": "pkg.orders", "handler_key": "pkg.hello", "max_attempts": 4},
    },
}
"""

PUBLISH_SCRIPT = """
import datetime, decimal, uuid
from workqueue import PublishRejectedError, publish, publish_or_raise
from workqueue.models import Message

result = publish("pkg.orders", {"total": decimal.Decimal("9.90"),
                                "at": datetime.datetime(2026, 1, 2, 3, 4, tzinfo=datetime.UTC),
                                "id": uuid.UUID(int=1)})
print("status", type(result.status).__name__, result.status, result.accepted)
print("payload", sorted(Message.objects.get(id=result.message_id).payload.items()))
try:
    publish_or_raise("pkg.nowhere", {"n": 1})
except PublishRejectedError as exc:
    print("raised", exc.code, exc.result.message_id)
"""


def test_a_new_project_declares_its_topology_in_code_and_checks_publish_results(
    tmp_path, scratch_database, installed
):
    env = _clean_environment()
    env["DATABASE_URL"] = scratch_database
    python = installed.python
    site = installed.new_project(tmp_path, env)
    (site / "hello" / "topology.py").write_text(TOPOLOGY_MODULE)
    with (site / "newsite" / "settings.py").open("a") as settings_file:
        settings_file.write('WORKQUEUE["TOPOLOGY"] = "hello.topology.TOPOLOGY"\n')
    _run([python, "manage.py", "migrate", "-v0"], site, env)
    sync = [python, "manage.py", "workqueue", "sync-topology"]

    planned = _run([*sync, "--dry-run"], site, env)
    applied = _run(sync, site, env)
    again = _run(sync, site, env)
    published = _run([python, "manage.py", "shell", "-c", PUBLISH_SCRIPT], site, env)

    assert "+ topic pkg.orders (new: retention_days=3" in planned
    assert "Dry run: 2 change(s) validated, nothing written." in planned
    assert "+ subscription pkg.orders-hello (new: topic='pkg.orders'" in applied
    assert "Applied 2 change(s)." in applied
    assert "No changes" in again
    assert "status PublishStatus Accepted True" in published
    assert (
        "payload [('at', '2026-01-02T03:04:00Z'), ('id', '00000000-0000-0000-0000-000000000001'), "
        "('total', '9.90')]"
    ) in published
    assert "raised TopicNotFound None" in published


# -- the README's "Your first project, start to finish", block by block ----------------------


def _first_project_block(name: str) -> str:
    """The fenced block after ``<!-- first-project:NAME -->`` in the README."""
    readme = (ROOT / "README.md").read_text("utf-8")
    found = re.search(rf"<!-- first-project:{name} -->\n```\w*\n(.*?)```", readme, re.S)
    assert found, f"README has no first-project block {name!r}"
    return found.group(1)


def _commands(block: str, starting: tuple[str, ...]) -> list[list[str]]:
    """The block's command lines that start with one of ``starting``, without comments."""
    lines = [line.split("  #")[0].strip() for line in block.splitlines()]
    return [shlex.split(line) for line in lines if line.startswith(starting)]


def test_the_readmes_first_project_runs_as_written(tmp_path, scratch_database, installed):
    """Its settings, handler, commands and test, as a newcomer copies them (helper-158: the
    README had no settings to copy, and its handler example called functions it never
    defined). The shell's pip install and the embedded database's URL are the fixtures'."""
    env = _clean_environment()
    env["DATABASE_URL"] = scratch_database
    env["PATH"] = f"{installed.venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    setup = _commands(_first_project_block("shell-setup"), ("django-admin", "python manage.py"))
    assert [command[:2] for command in setup] == [
        ["django-admin", "startproject"],
        ["python", "manage.py"],
    ]
    for command in setup:
        # django-admin's console script is in the environment that installed Django.
        command = (
            [installed.python, "-m", "django", *command[1:]]
            if command[0] == "django-admin"
            else [installed.python, *command[1:]]
        )
        _run(command, tmp_path, env)
    with (tmp_path / "mysite" / "settings.py").open("a") as settings_file:
        settings_file.write("\n" + _first_project_block("settings"))
    (tmp_path / "greetings" / "work_handlers.py").write_text(_first_project_block("handlers"))
    (tmp_path / "greetings" / "tests.py").write_text(_first_project_block("tests"))
    (tmp_path / "pytest.ini").write_text(_first_project_block("pytest-ini"))

    *steps, run_host = _commands(_first_project_block("shell-run"), ("python manage.py",))
    for command in steps:
        _run([installed.python, *command[1:]], tmp_path, env)
    assert run_host == ["python", "manage.py", "workqueue_host"]
    log = tmp_path / "host.log"
    with log.open("w") as host_output:
        host = subprocess.Popen(
            [installed.python, *run_host[1:]],
            cwd=tmp_path,
            env=env,
            stdout=host_output,
            stderr=subprocess.STDOUT,
            text=True,
        )
        try:
            deadline = time.monotonic() + 60
            while "Hello, Ada!" not in log.read_text() and time.monotonic() < deadline:
                assert host.poll() is None, log.read_text()
                time.sleep(0.2)
        finally:
            host.send_signal(signal.SIGINT)  # the README's Ctrl-C
            host.wait(timeout=60)
    said = log.read_text()
    assert "Hello, Ada!" in said, said
    assert host.returncode == 0, said
    # Under this LOGGING the command printed what the host logs as well (helper-158): the
    # subscriptions' start and the drain were each said twice.
    assert said.count("greetings.requested-log: Running, concurrency") == 1, said
    assert said.count("draining running handlers") == 1, said
    assert "stopping (SIGINT)" in said, said
    assert said.count("every handler finished or was handed back") == 1, said

    output = _run([installed.python, "-m", "pytest", "-p", "no:cacheprovider"], tmp_path, env)
    assert "1 passed" in output, output
