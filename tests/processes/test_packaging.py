"""The wheel is a real reusable package: a brand-new `django-admin startproject` project can
install it, add the app, migrate, publish and process a message with `workqueue_host`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

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


def _run(args: list[str], cwd: Path, env: dict[str, str], timeout: float = 600) -> str:
    done = subprocess.run(
        args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    assert done.returncode == 0, f"{args} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def test_the_wheel_installs_into_a_new_project_and_processes_a_message(tmp_path, scratch_database):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WORKQUEUE_", "DJANGO_"))}
    env.pop("PYTHONPATH", None)
    env["DATABASE_URL"] = scratch_database
    wheels = tmp_path / "wheels"
    _run(
        [sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "-q", "-w", str(wheels)],
        tmp_path,
        env,
    )
    [wheel] = wheels.glob("django_workqueue-*.whl")
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], tmp_path, env)
    python = str(venv / "bin" / "python")
    _run([python, "-m", "pip", "install", "-q", str(wheel), "django-environ"], tmp_path, env)

    site = tmp_path / "newsite"
    site.mkdir()
    _run([str(venv / "bin" / "django-admin"), "startproject", "newsite", str(site)], tmp_path, env)
    (site / "hello").mkdir()
    (site / "hello" / "__init__.py").write_text("")
    (site / "hello" / "work_handlers.py").write_text(HANDLER)
    with (site / "newsite" / "settings.py").open("a") as settings_file:
        settings_file.write(SETTINGS)
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
