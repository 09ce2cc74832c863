"""The embedded default database: a private PostgreSQL cluster owned by the project.

When ``DATABASE_URL`` is unset, the project's settings call :func:`django_database`, which (in
development only, see below) calls :func:`ensure_running`: it starts (or reuses) one cluster per
folder and returns its URL. Guarantees:

* **One server per folder.** An ``fcntl.flock`` on ``<folder>/lock`` serialises every start and
  stop, so any number of concurrent processes (pytest-xdist workers, subprocess hosts) start the
  cluster once and all get the same URL.
* **Cheap when running.** The fast path reads three small files and two ``/proc`` entries (well
  under a millisecond); it runs no subprocess, opens no connection and takes no lock.
* **Self-healing.** A stale ``postmaster.pid`` (killed or crashed server, a zombie postmaster), a
  deleted socket folder (``/tmp`` cleaned) or a half-finished ``initdb`` (marked by
  ``initdb.started``) lead to a clean restart. A cluster whose completed ``initdb`` left a version
  it can no longer read is reported damaged, never made again over its data.
  Before a new server starts on an existing data folder, the old server's shared memory must no
  longer be attached by any process, which is PostgreSQL's own interlock against two servers.
* **Durable.** ``fsync`` and ``synchronous_commit`` keep PostgreSQL's defaults; only
  ``shared_buffers`` and ``max_wal_size`` are raised for a queue's writes (SERVER_SETTINGS).
* **Private.** The server listens on no TCP port at all, only on a unix socket in a folder that
  only the server's OS account (and root) may enter: ``/tmp/wq-pg-*``, mode 0700. Entering that
  folder is the authentication (``pg_hba.conf``, rewritten before every start, has one ``local
  ... trust`` line and no ``host`` line), so other local accounts can neither connect nor, as the
  superuser, run ``COPY ... TO PROGRAM``.

URL: ``postgres://USER@/workqueue?host=/tmp/wq-pg-XXXX&port=5432``, a form both libpq (psycopg,
psql) and django-environ understand. The port only names the socket file (``.s.PGSQL.5432``),
which is why a fixed one is safe: no other server shares the folder.

Settings call :func:`django_database` rather than :func:`ensure_running`: it starts the cluster
only for development (``DEBUG`` on) or when ``WORKQUEUE_LOCALDB=1`` opts in, so a production
process whose ``DATABASE_URL`` went missing fails at start instead of writing into a private
database nobody backs up.

Folder (:func:`data_dir`): ``$WORKQUEUE_LOCALDB_DIR`` if set; otherwise
``$XDG_DATA_HOME/django-workqueue/pg`` (default ``~/.local/share/django-workqueue/pg``); as root
without ``XDG_DATA_HOME``, ``/var/lib/django-workqueue/pg``, because the server then runs as the
``postgres`` OS user (``initdb`` and ``postgres`` refuse root) and ``/root`` is private. The folder
holds ``data/`` (the cluster), ``server.log``, ``state.json``, ``lock``, the marks of an
``initdb`` begun and done (``initdb.started``, ``initdb.done``) and, when another local user
held the socket folder's usual name, the name chosen instead (``socket-folder``); a folder
holding anything else, or another user's file under one of these names, is not the embedded
database's to take over, stop or delete. Every start, stop and destroy holds the lock while it
changes the folder, and root writes nothing there through a link the server's account could
have left.

Server binaries are looked up in ``$WORKQUEUE_LOCALDB_BINDIR``, ``pg_config --bindir``,
``/usr/lib/postgresql/*/bin`` (newest first), ``/usr/local/pgsql/bin`` and ``PATH``; an existing
cluster is always started with binaries of its own major version.

Command line, without Django settings:
``python -m workqueue.localdb start|stop|url|path|destroy``.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import pwd
import re
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, quote, unquote, urlsplit

from django.core.exceptions import ImproperlyConfigured

DATABASE_NAME = "workqueue"
MAX_CONNECTIONS = 200
# A queue writes WAL fast: with PostgreSQL's 1 GB max_wal_size a busy queue checkpointed every
# half minute, and every page first touched after a checkpoint went to the WAL whole (a
# 1,000,000-delivery backlog drained at about two thirds of a small one's rate; with these, at
# 79-100 %). Neither setting weakens durability; see "PostgreSQL settings for a queue" in the
# README for servers the project does not run.
SERVER_SETTINGS = {"shared_buffers": "256MB", "max_wal_size": "4GB"}
# Only names the socket file in the private socket folder: the server opens no TCP port.
PORT = 5432
# The environment variable that lets a process with DEBUG off use the embedded database.
OPT_IN_VARIABLE = "WORKQUEUE_LOCALDB"
DIR_VARIABLE = "WORKQUEUE_LOCALDB_DIR"

_STATE_FILE = "state.json"
_LOCK_FILE = "lock"
_LOG_FILE = "server.log"
_INITDB_DONE = "initdb.done"
# Written before initdb runs: an initdb that was interrupted left a data folder of its own.
_INITDB_STARTED = "initdb.started"
_DATA = "data"
# Names the socket folder a start chose because another user held the usual one.
_SOCKET_NAME_FILE = "socket-folder"
_SOCKET_ROOT = Path("/tmp")
_CHOSEN_SOCKET_NAME = re.compile(r"wq-pg-[0-9a-f]{16}")
#: The files this module keeps in its folder (and one being written, ``state.json.<pid>.tmp``
#: or ``socket-folder.<pid>.tmp``), and its one folder, ``data``: a folder holding anything else is
#: not its own to take over (chown, chmod) or to delete.
_OWN_FILES = frozenset(
    {
        _STATE_FILE,
        _LOCK_FILE,
        _LOG_FILE,
        f"{_LOG_FILE}.1",
        _INITDB_DONE,
        _INITDB_STARTED,
        _SOCKET_NAME_FILE,
    }
)
_FILE_BEING_WRITTEN = re.compile(
    f"({re.escape(_STATE_FILE)}|{re.escape(_SOCKET_NAME_FILE)})" + r"\.\d+\.tmp"
)
_LOG_ROTATE_BYTES = 16 * 1024 * 1024
_INITDB_TIMEOUT_S = 300
_START_TIMEOUT_S = 60
# Longer than a start may take (an initdb, then the server's start), so that a second process
# waits a slow first start out instead of failing as if it were stuck.
_LOCK_TIMEOUT_S = float(_INITDB_TIMEOUT_S + _START_TIMEOUT_S + 60)
_STOP_TIMEOUT_S = 60.0
_SHMEM_RELEASE_TIMEOUT_S = 30.0
_SERVER_ACCOUNT_AS_ROOT = "postgres"
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"", "0", "false", "no", "off"})
# Rewritten before every start, so a cluster made by an older version (which trusted TCP on
# 127.0.0.1) or edited by hand is brought back to this.
_PG_HBA = """\
# Written by workqueue.localdb before every start; edits are lost.
# Unix socket only. Its folder (mode 0700) admits only the server's OS account and root, and
# that is the authentication. There is no "host" line: every TCP login is refused.
local all all trust
"""
_INSTALL_HINT = (
    "Install the PostgreSQL server (Debian/Ubuntu: `apt-get install postgresql`; macOS: "
    "`brew install postgresql`), or set DATABASE_URL to use an existing database "
    "(WORKQUEUE_LOCALDB_BINDIR may name the folder holding initdb, pg_ctl and postgres)."
)


class LocalDBError(ImproperlyConfigured):
    """The embedded database could not be found, initialised, started or stopped.

    A subclass of ``ImproperlyConfigured`` so that settings-time failures read like any other
    configuration problem; the message says what to do and includes the server log's tail.
    """


# ---------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------


def data_dir() -> Path:
    """Return the cluster's folder (see the module docstring); it may not exist yet.

    The path is canonical (symlinks resolved), so every process names the cluster alike.
    """
    override = os.environ.get(DIR_VARIABLE)
    if override:
        path = os.path.expanduser(override)
    elif os.environ.get("XDG_DATA_HOME"):
        path = os.path.join(os.environ["XDG_DATA_HOME"], "django-workqueue", "pg")
    elif os.geteuid() == 0:
        path = "/var/lib/django-workqueue/pg"
    else:
        try:
            home = Path.home()
        except RuntimeError:
            # No HOME and no account entry for this user id: a container run under an
            # arbitrary uid, say.
            raise LocalDBError(
                "The embedded database has no folder to live in: HOME is unset and user id "
                f"{os.geteuid()} has no account entry to find a home folder by. Set {DIR_VARIABLE} "
                "to a folder for it (or HOME), or set DATABASE_URL to use an existing database."
            ) from None
        path = os.path.join(home, ".local", "share", "django-workqueue", "pg")
    return Path(os.path.realpath(path))


def url(database: str = DATABASE_NAME) -> str | None:
    """Return the URL of ``database`` if this folder's server is running, else None.

    Running means: the postmaster recorded at the last start is alive (not a zombie), is the
    postmaster of this folder, and reports "ready" (it then listens on the URL's port). The
    ``workqueue`` database exists whenever a URL is returned; another ``database`` exists once
    :func:`ensure_running` made it. Runs no subprocess, opens no connection and takes no lock.
    """
    base = data_dir()
    try:
        state = json.loads((base / _STATE_FILE).read_text())
        pid, start, port, db_url = state["pid"], state["start"], state["port"], state["url"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    pgdata = base / "data"
    pm = _read_pidfile(pgdata)
    if pm is None or (pm.pid, pm.start, pm.port) != (pid, start, port) or pm.status != "ready":
        return None
    if pm.listen:
        return None  # listening on TCP (started by an older version or by hand): restart it
    if not _socket_dir_is_ours(base) or not (_socket_dir(base) / f".s.PGSQL.{port}").exists():
        # The socket folder was deleted (/tmp cleaned): restart it there. Or made again by
        # another user, whose server would read every query: the start refuses it.
        return None
    # A live, non-zombie process whose command line names this data folder: the postmaster
    # itself, not a process that reused its pid. (No TCP probe: each one forks a backend.)
    if not _process_alive(pid) or not _is_postmaster_of(pid, pgdata):
        return None
    if database != DATABASE_NAME:
        return _make_url(*_url_parts(str(db_url)), database)
    return str(db_url)


def settings_host(settings_dict: Mapping[str, Any]) -> Any:
    """The host a Django ``DATABASES`` entry connects to: ``HOST``, or ``OPTIONS["host"]`` as
    django-environ reads a URL's socket folder."""
    return settings_dict.get("HOST") or (settings_dict.get("OPTIONS") or {}).get("host")


def database_named_by(settings_dict: Mapping[str, Any]) -> str | None:
    """Return the name of the database a Django ``DATABASES`` entry names on this folder's
    server, or None when it names another server (or the embedded server of another folder).

    Told by the socket folder the entry connects through (``HOST``, or ``OPTIONS["host"]`` as
    django-environ reads the URL), which only this folder's server uses; whether the server
    runs does not matter.
    """
    host = settings_host(settings_dict)
    if not isinstance(host, str) or not host.startswith("/"):
        return None
    if os.path.realpath(host) != os.path.realpath(_socket_dir(data_dir())):
        return None
    name = settings_dict.get("NAME")
    return name if isinstance(name, str) and name else None


def ensure_running(database: str = DATABASE_NAME) -> str:
    """Start this folder's cluster unless it is running, and return the URL of its
    ``database`` (``workqueue`` by default; another name gives a project a database of its
    own on the one server, made on first use).

    Guarantees on return: the server runs as described in :func:`url` and the database
    exists. Only an explicit :func:`stop` (or a crash) stops it again; it outlives the calling
    process. Concurrent callers (threads or processes) start it once. The fast path of a
    running server opens no connection for the default database; another one costs a
    connection each call, to make sure it exists.
    Raises :class:`LocalDBError` (an ``ImproperlyConfigured``) when it cannot.
    """
    _check_database_name(database)
    current = url()
    if current is None:
        base = data_dir()
        account = _server_account()
        _make_folder(base, account)
        with _owned_and_locked(base, "take over"):
            _take_over(base, account)
            # Another process may have finished starting it while we waited for the lock.
            current = url() or _start(base, account)
    if database == DATABASE_NAME:
        return current
    user, sockdir, port = _url_parts(current)
    _create_database(user, sockdir, port, database)
    return _make_url(user, sockdir, port, database)


def django_database(*, debug: bool, database: str = DATABASE_NAME) -> dict[str, Any]:
    """Return the Django ``DATABASES`` entry of the embedded cluster's ``database``, starting
    the cluster (and making the database) if needed.

    For settings whose ``DATABASE_URL`` is unset. Starts nothing, and raises
    :class:`LocalDBError` naming the fix, unless ``debug`` is true or ``WORKQUEUE_LOCALDB``
    is 1/true/yes/on: a production process that lost its ``DATABASE_URL`` must stop, not
    write into a private database on the host's disk.
    """
    raw = os.environ.get(OPT_IN_VARIABLE, "").strip().lower()
    if raw not in _TRUE | _FALSE:
        raise LocalDBError(
            f"{OPT_IN_VARIABLE}={os.environ[OPT_IN_VARIABLE]!r} is not understood; use 1 to use "
            "the embedded development PostgreSQL, or unset it and set DATABASE_URL."
        )
    if not debug and raw not in _TRUE:
        raise LocalDBError(
            "DATABASE_URL is not set and DEBUG is off, so there is no database to use. Set "
            "DATABASE_URL to your database (e.g. postgres://USER:PASSWORD@HOST:5432/NAME). "
            f"For development or tests, set {OPT_IN_VARIABLE}=1 (or DEBUG on) to start the "
            "embedded PostgreSQL instead; it is for one developer's machine, never production."
        )
    parts = urlsplit(ensure_running(database))
    query = parse_qs(parts.query)
    # HOST and PORT rather than OPTIONS (django-environ's reading of the URL), so that
    # `manage.py dbshell` finds the socket too.
    return {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": parts.path.lstrip("/"),
        "USER": unquote(parts.username or ""),
        "HOST": query["host"][0],
        "PORT": query["port"][0],
    }


def stop() -> None:
    """Stop this folder's server (fast shutdown) if it runs; a no-op otherwise.

    On return no server runs on the folder. Needs no PostgreSQL binaries (it signals the
    postmaster directly).
    """
    base = data_dir()
    if not base.is_dir():
        return
    # Not someone else's server either (a cluster of theirs in a folder named data).
    with _owned_and_locked(base, "stop"):
        # state.json stays: it no longer matches postmaster.pid (url() returns None as soon as
        # the server reports "stopping"), and the next start rewrites it.
        _stop_postmaster(base / "data")


def destroy() -> None:
    """Stop the server and delete the folder (all data) and its socket folder; refuses a
    folder holding anything the embedded database did not put there (a mistyped
    ``WORKQUEUE_LOCALDB_DIR`` must not delete someone's files)."""
    base = data_dir()
    if not base.exists():
        _remove_socket_dir(base)
        return
    # Under the lock, so that no start runs meanwhile; the lock file goes last, while held (a
    # process waiting for it then finds it gone and takes the new one, see _locked).
    with _owned_and_locked(base, "delete"):
        _stop_postmaster(base / _DATA)
        _remove_socket_dir(base)
        for entry in base.iterdir():
            if not _is_own_entry(entry.name) or entry.name == _LOCK_FILE:
                continue  # appeared since the check: not ours to delete (the folder stays)
            # Found its own under the lock, which every start, stop and destroy holds.
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
        (base / _LOCK_FILE).unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        base.rmdir()


def _is_own_entry(name: str) -> bool:
    # A file being written (by another process starting now, or left by one killed before
    # its rename) is ours too.
    return name == _DATA or name in _OWN_FILES or _FILE_BEING_WRITTEN.fullmatch(name) is not None


def _is_own(entry: Path, names: set[str], owners: set[int]) -> bool:
    """Whether ``entry`` (of a folder holding ``names``) is what this module made: one of its
    files (a plain file, not a folder or a link by that name), or its data folder, which is
    its own only when empty or when an initdb of its own ran (or began) beside it: a user's
    ``data`` folder is not the embedded database's to empty because of its name. Made by one
    of ``owners`` either way: another user's file, however named (an open log file they could
    read on), is not the embedded database's to take over."""
    if not _is_own_entry(entry.name):
        return False
    try:
        st = entry.lstat()
    except FileNotFoundError:
        return True  # gone since it was listed
    if st.st_uid not in owners:
        return False
    if entry.name != _DATA:
        return stat.S_ISREG(st.st_mode)
    if not stat.S_ISDIR(st.st_mode):
        return False
    return bool({_INITDB_DONE, _INITDB_STARTED} & names) or next(entry.iterdir(), None) is None


def _own_accounts() -> set[int]:
    """The users whose files the embedded database's folder holds: this one, and the server's
    account when root runs the server as another (not made here if missing)."""
    owners = {os.geteuid()}
    if os.geteuid() == 0:
        with contextlib.suppress(KeyError):
            owners.add(pwd.getpwnam(_SERVER_ACCOUNT_AS_ROOT).pw_uid)
    return owners


def _require_own_folder(base: Path, action: str, *, strict: bool = True) -> None:
    """Raise unless ``base`` is missing, or a folder holding only what this module makes.

    Not ``strict``, only the entries' names are looked at: what a start does meanwhile
    (a state file renamed into place, a log rotated, an initdb's marks) changes no name's
    standing, so the check is sound without the lock. The strict check (each entry's kind and
    owner, the data folder's marks) is made under the lock (see _owned_and_locked)."""
    if base.exists() and not base.is_dir():
        raise LocalDBError(
            f"{base} is a file, not a folder: the embedded database will not {action} it. "
            f"Point {DIR_VARIABLE} at a new or empty folder."
        )
    if not base.is_dir():
        return
    entries = list(base.iterdir())
    if strict:
        names, owners = {entry.name for entry in entries}, _own_accounts()
        foreign = sorted(entry.name for entry in entries if not _is_own(entry, names, owners))
    else:
        foreign = sorted(entry.name for entry in entries if not _is_own_entry(entry.name))
    if foreign:
        shown = ", ".join(foreign[:5]) + (", ..." if len(foreign) > 5 else "")
        raise LocalDBError(
            f"{base} holds files the embedded database did not make ({shown}): it will not "
            f"{action} that folder. Check {DIR_VARIABLE}, and point it at a new or empty "
            "folder."
            + (
                f" (A {_DATA} folder is its own beside {_INITDB_DONE} or {_INITDB_STARTED}: one "
                "without either, left by an interrupted first start of an earlier release, is "
                "for you to delete.)"
                if _DATA in foreign
                and not (base / _DATA).is_symlink()
                and not (base / _DATA / "PG_VERSION").exists()
                else ""
            )
        )


# ---------------------------------------------------------------------------------------------
# Server account and folders
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Account:
    """The OS account the server runs as; ``switch`` when it differs from the caller (root)."""

    name: str
    uid: int
    gid: int
    switch: bool


def _server_account() -> _Account:
    if os.geteuid() != 0:
        uid = os.geteuid()
        try:
            name = pwd.getpwuid(uid).pw_name
        except KeyError:
            # Containers may run with an uid that has no passwd entry; initdb gets -U anyway.
            name = os.environ.get("USER") or "workqueue"
        return _Account(name=name, uid=uid, gid=os.getegid(), switch=False)
    try:
        entry = pwd.getpwnam(_SERVER_ACCOUNT_AS_ROOT)
    except KeyError:
        _create_postgres_account()
        entry = pwd.getpwnam(_SERVER_ACCOUNT_AS_ROOT)
    return _Account(name=entry.pw_name, uid=entry.pw_uid, gid=entry.pw_gid, switch=True)


def _create_postgres_account() -> None:
    import grp

    try:
        grp.getgrnam(_SERVER_ACCOUNT_AS_ROOT)
        group_args = ["-g", _SERVER_ACCOUNT_AS_ROOT]
    except KeyError:
        group_args = ["--user-group"]
    cmd = [
        "useradd",
        "--system",
        *group_args,
        "--no-create-home",
        "--home-dir",
        "/nonexistent",
        "--shell",
        "/usr/sbin/nologin",
        _SERVER_ACCOUNT_AS_ROOT,
    ]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    except OSError as exc:
        proc = None
        detail = str(exc)
    else:
        detail = (proc.stdout + proc.stderr).strip()
    if proc is None or proc.returncode != 0:
        raise LocalDBError(
            "Running as root, the embedded PostgreSQL must run as the 'postgres' OS user "
            f"(initdb refuses root), and creating it failed: {' '.join(cmd)}: {detail}"
        )


def _socket_dir(base: Path) -> Path:
    # Unix socket paths are limited to 107 bytes and the server account must reach the folder,
    # so it lives directly in /tmp under a short name: one derived from the owner and data
    # folder, or the one a start chose instead because another user had taken that.
    recorded = _recorded_socket_name(base)
    if recorded is not None:
        return _SOCKET_ROOT / recorded
    digest = hashlib.sha256(f"{os.geteuid()}:{base}".encode()).hexdigest()[:16]
    return _SOCKET_ROOT / f"wq-pg-{digest}"


def _recorded_socket_name(base: Path) -> str | None:
    """The socket folder's name a start recorded in ``base``, if it has the form a start gives
    it. The server's account owns ``base`` when root runs it: a link or a pipe put there must
    neither be followed nor hang the reader."""
    try:
        fd = os.open(
            base / _SOCKET_NAME_FILE,
            os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
        )
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        text = os.read(fd, 64).decode("ascii", "replace").strip()
    finally:
        os.close(fd)
    return text if _CHOSEN_SOCKET_NAME.fullmatch(text) else None


def _remove_socket_dir(base: Path) -> None:
    """Delete the socket folder if it is a folder of this user's or of the server account's:
    another user's at its name (which a start refuses to use) stays, whatever name the record
    in ``base`` gives."""
    path = _socket_dir(base)
    try:
        st = os.lstat(path)
    except OSError:
        return
    if stat.S_ISDIR(st.st_mode) and st.st_uid in _own_accounts():
        shutil.rmtree(path, ignore_errors=True)


def _make_folder(base: Path, account: _Account) -> None:
    """Make ``base`` (and its missing parents) unless it exists (whose it is, is checked
    under the lock: see _owned_and_locked)."""
    # pg_ctl runs the server through a shell, the folder's path in double quotes: these would
    # be read by the shell (a `$HOME` in the name started the server in another folder).
    shell_read = sorted(set('"$`\\') & set(str(base)))
    if shell_read:
        raise LocalDBError(
            f"The embedded database's folder {base} holds {' '.join(shell_read)}, which the "
            f"shell that starts PostgreSQL would read. Point {DIR_VARIABLE} at a folder without "
            "them."
        )
    missing = [p for p in (base, *base.parents) if not p.exists()]
    try:
        for folder in reversed(missing):
            with contextlib.suppress(FileExistsError):
                folder.mkdir()
            if account.switch and folder != base:
                # Folders we create on the way must be searchable by the server account even
                # under a strict umask.
                os.chmod(folder, 0o755)
    except OSError as exc:
        raise LocalDBError(f"Cannot create the embedded database folder {base}: {exc}") from exc


def _take_over(base: Path, account: _Account) -> None:
    """Give ``base``, found to be the embedded database's under the lock, to the server's
    account, mode 0700: through the folder opened, so that a link put at its name meanwhile
    (the account owns the folder, and may rename it in /tmp) gives away nothing."""
    if account.switch:
        _check_reachable(base, account)
    with _opened(base) as folder:
        if account.switch and os.fstat(folder).st_uid != account.uid:
            os.fchown(folder, account.uid, account.gid)
        os.fchmod(folder, 0o700)


def _check_reachable(base: Path, account: _Account) -> None:
    """Raise unless ``account`` can search every ancestor of ``base`` (root's home is 0700)."""
    groups = set(os.getgrouplist(account.name, account.gid))
    for parent in reversed(base.parents):
        st = parent.stat()
        if st.st_uid == account.uid:
            ok = bool(st.st_mode & 0o100)
        elif st.st_gid in groups:
            ok = bool(st.st_mode & 0o010)
        else:
            ok = bool(st.st_mode & 0o001)
        if not ok:
            raise LocalDBError(
                f"The embedded PostgreSQL runs as the OS user {account.name!r} (initdb refuses "
                f"root), which cannot reach {base} because {parent} is not searchable by it. "
                "Set WORKQUEUE_LOCALDB_DIR to a folder outside private home directories "
                "(e.g. /var/lib/django-workqueue/pg), or set DATABASE_URL."
            )


def _socket_dir_is_ours(base: Path) -> bool:
    """Whether the socket folder is the one a start made: a folder (not a link) that only its
    owner may enter, owned by the server's account (which owns ``base``) or by this user."""
    try:
        st = os.lstat(_socket_dir(base))
        owners = {os.geteuid(), base.stat().st_uid}
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and not st.st_mode & 0o077 and st.st_uid in owners


def _prepare_socket_dir(base: Path, account: _Account) -> Path:
    """The socket folder a start uses, made or taken back (the server's account's, mode 0700).

    The usual name is predictable, so another local user may hold a folder (or a link) there:
    it is never used (it could redirect the socket), and the start takes a folder under an
    unguessable name instead, recorded in ``base`` for every later start and ``url()``. A
    recorded folder taken after ``/tmp`` was cleaned is replaced the same way: nobody can lock
    the developer out."""
    path = _socket_dir(base)
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    if _make_own_socket_dir(path, account):
        return path
    chosen = _SOCKET_ROOT / f"wq-pg-{secrets.token_hex(8)}"
    try:
        os.mkdir(chosen, 0o700)  # a new name: a folder already there is nobody's to reuse
    except OSError as exc:
        raise LocalDBError(f"Cannot create the socket folder {chosen}: {exc}") from exc
    if not _make_own_socket_dir(chosen, account):
        raise LocalDBError(f"The socket folder {chosen} was replaced as it was made; retry.")
    _write_new(
        base,
        f"{_SOCKET_NAME_FILE}.{os.getpid()}.tmp",
        chosen.name + "\n",
        account,
        _SOCKET_NAME_FILE,
    )
    print(
        f"workqueue.localdb: {path} belongs to another user; the embedded database's socket "
        f"is in {chosen} instead.",
        file=sys.stderr,
    )
    return chosen


def _make_own_socket_dir(path: Path, account: _Account) -> bool:
    """Give the folder at ``path`` to the server's account, mode 0700, unless it is not a
    folder (a link or a file) or belongs to another user: then False, and nothing changed."""
    try:
        folder = _open_folder(path)
    except LocalDBError:
        return False
    try:
        st = os.fstat(folder)
        if st.st_uid not in (account.uid, os.geteuid()):
            return False
        # Through the folder opened: a link put at the name meanwhile changes nothing else.
        if account.switch and st.st_uid != account.uid:
            os.fchown(folder, account.uid, account.gid)
        os.fchmod(folder, 0o700)
    finally:
        os.close(folder)
    return True


@contextlib.contextmanager
def _owned_and_locked(base: Path, action: str) -> Iterator[None]:
    """Hold the folder's lock, once the folder is found to be the embedded database's (under
    the lock: every start, stop and destroy changes it only while holding it). A lock file
    made only to find the folder someone else's is removed again."""
    _require_own_folder(base, action, strict=False)
    created = not (base / _LOCK_FILE).exists()
    with _locked(base):
        try:
            _require_own_folder(base, action)
        except LocalDBError:
            if created:
                (base / _LOCK_FILE).unlink(missing_ok=True)
            raise
        yield


@contextlib.contextmanager
def _locked(base: Path) -> Iterator[None]:
    fd = _open_lock(base)
    try:
        deadline = time.monotonic() + _LOCK_TIMEOUT_S
        while True:
            # Polling (not a blocking flock) so a stuck holder becomes a clear error.
            with contextlib.suppress(BlockingIOError):
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                if _still_named(fd, base / _LOCK_FILE):
                    break
                # `destroy` deleted the file it locked while this waited: a lock on it
                # excludes no one who opens the name afresh. Lock the file now at that name.
                os.close(fd)
                fd = _open_lock(base)
            if time.monotonic() > deadline:
                raise LocalDBError(
                    f"Another process has held {base / _LOCK_FILE} for over "
                    f"{_LOCK_TIMEOUT_S:.0f}s while starting or stopping the embedded "
                    "PostgreSQL; see its server.log."
                )
            time.sleep(0.05)
        yield
    finally:
        os.close(fd)  # closing releases the flock


def _open_lock(base: Path) -> int:
    try:
        # Not through a link: root would create, or lock, the file it points at.
        return os.open(
            base / _LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600
        )
    except OSError as exc:
        raise LocalDBError(
            f"Cannot open {base / _LOCK_FILE} (a link is never followed; a folder deleted "
            f"meanwhile is made again by the next start): {exc}."
        ) from exc


def _still_named(fd: int, path: Path) -> bool:
    try:
        named = os.lstat(path)
    except FileNotFoundError:
        return False
    opened = os.fstat(fd)
    return (named.st_dev, named.st_ino) == (opened.st_dev, opened.st_ino)


# ---------------------------------------------------------------------------------------------
# Inspecting a server: postmaster.pid, /proc, shared memory
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Postmaster:
    pid: int
    start: str
    port: int
    listen: str  # the first TCP listen address; empty when the server has no TCP socket
    status: str
    shmid: int | None


def _read_pidfile(pgdata: Path) -> _Postmaster | None:
    """Parse ``postmaster.pid`` (pid, data dir, start time, port, socket dir, host, shm, status)."""
    try:
        lines = (pgdata / "postmaster.pid").read_text().splitlines()
        pid = int(lines[0])
        start = lines[2].strip()
        port = int(lines[3])
    except (OSError, ValueError, IndexError):
        return None
    listen = lines[5].strip() if len(lines) > 5 else ""
    shmid = None
    if len(lines) > 6:
        parts = lines[6].split()
        if len(parts) == 2 and parts[1].isdigit():
            shmid = int(parts[1])
    status = lines[7].strip() if len(lines) > 7 else ""
    return _Postmaster(pid=pid, start=start, port=port, listen=listen, status=status, shmid=shmid)


def _process_alive(pid: int) -> bool:
    """True if ``pid`` runs; zombies count as dead (this machine's init may never reap them)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            status_line = fh.read()
    except FileNotFoundError:
        if not os.path.isdir("/proc/self"):
            return _signal_alive(pid)
        return False
    except OSError:
        return _signal_alive(pid)
    state = status_line[status_line.rfind(b")") + 2 : status_line.rfind(b")") + 3]
    return state not in (b"Z", b"X", b"x")


def _signal_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _is_postmaster_of(pid: int, pgdata: Path) -> bool:
    """True unless ``/proc`` shows ``pid`` is something other than a postmaster on ``pgdata``."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            args = fh.read().split(b"\0")
    except OSError:
        return True  # cannot tell: assume it is, which errs on the safe side
    try:
        target = os.fsdecode(args[args.index(b"-D") + 1])
    except (ValueError, IndexError):
        return False  # pg_ctl always passes -D; a zombie's command line is empty
    try:
        return os.path.samestat(os.stat(target), os.stat(pgdata))
    except OSError:
        return target == str(pgdata)


def _shmem_attached(pm: _Postmaster) -> bool:
    """True while any process is attached to the old server's SysV segment.

    PostgreSQL itself refuses to start while the previous server's segment is attached; checking
    it here lets us remove a stale ``postmaster.pid`` (e.g. naming a zombie) without losing that
    protection against two servers on one data folder. The segment is that server's only if
    its postmaster made it: after a reboot (or in a new container) the recorded id may name
    another server's segment, which made a start wait 30 s and then fail.
    """
    if pm.shmid is None:
        return False
    try:
        rows = Path("/proc/sysvipc/shm").read_text().splitlines()[1:]
    except OSError:
        return False
    for row in rows:
        # key shmid perms size cpid lpid nattch ...
        cols = row.split()
        if len(cols) > 6 and cols[1] == str(pm.shmid) and cols[4] == str(pm.pid):
            return int(cols[6]) > 0
    return False


def _socket_accepts(sockdir: Path, port: int) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(2.0)
        try:
            sock.connect(str(sockdir / f".s.PGSQL.{port}"))
        except OSError:
            return False
    return True


# ---------------------------------------------------------------------------------------------
# Binaries
# ---------------------------------------------------------------------------------------------

_SERVER_PROGRAMS = ("initdb", "pg_ctl", "postgres")


def _has_server_programs(bindir: Path) -> bool:
    return all(os.access(bindir / prog, os.X_OK) for prog in _SERVER_PROGRAMS)


def _candidate_bindirs() -> list[Path]:
    found: list[Path] = []

    def add(path: Path | str | None) -> None:
        if path:
            p = Path(path)
            if p not in found and _has_server_programs(p):
                found.append(p)

    pg_config = shutil.which("pg_config")
    if pg_config:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            out = subprocess.run(
                [pg_config, "--bindir"],
                capture_output=True,
                text=True,
                stdin=subprocess.DEVNULL,
                timeout=30,
            )
            if out.returncode == 0:
                add(out.stdout.strip())

    def version_key(p: Path) -> tuple[int, ...]:
        return tuple(int(x) for x in re.findall(r"\d+", p.parent.name))

    for p in sorted(Path("/usr/lib/postgresql").glob("*/bin"), key=version_key, reverse=True):
        add(p)
    add("/usr/local/pgsql/bin")
    initdb = shutil.which("initdb")
    if initdb:
        add(Path(os.path.realpath(initdb)).parent)
    return found


def _major_version(bindir: Path) -> str | None:
    try:
        out = subprocess.run(
            [str(bindir / "postgres"), "--version"],
            capture_output=True,
            text=True,
            stdin=subprocess.DEVNULL,
            timeout=30,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    match = re.search(r"\)\s*(\d+)(?:\.(\d+))?", out)
    if not match:
        return None
    major = int(match.group(1))
    # Before PostgreSQL 10 the major version had two parts (9.6).
    return str(major) if major >= 10 else f"{major}.{match.group(2)}"


def _find_bindir(wanted: str | None) -> Path:
    """Binaries to use; ``wanted`` is the existing cluster's major version (PG_VERSION)."""
    override = os.environ.get("WORKQUEUE_LOCALDB_BINDIR")
    if override:
        if not _has_server_programs(Path(override)):
            raise LocalDBError(
                f"WORKQUEUE_LOCALDB_BINDIR={override} does not contain initdb, pg_ctl and "
                f"postgres. {_INSTALL_HINT}"
            )
        candidates = [Path(override)]
    else:
        candidates = _candidate_bindirs()
    if not candidates:
        raise LocalDBError(
            "No PostgreSQL server binaries (initdb, pg_ctl, postgres) were found for the embedded "
            f"database. {_INSTALL_HINT}"
        )
    if wanted is None:
        return candidates[0]
    for bindir in candidates:
        if _major_version(bindir) == wanted:
            return bindir
    raise LocalDBError(
        f"The embedded cluster in {data_dir()} was created by PostgreSQL {wanted}, but only other "
        f"versions were found ({', '.join(map(str, candidates))}). Install PostgreSQL {wanted}, "
        "or delete the cluster and its data with `make clean-db` (or "
        "`python -m workqueue.localdb destroy`)."
    )


# ---------------------------------------------------------------------------------------------
# Starting and stopping
# ---------------------------------------------------------------------------------------------


def _run_as(
    account: _Account, cmd: list[str], cwd: Path, timeout: float
) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    # English messages from the server tools; keep libpq variables from redirecting them.
    env["LC_ALL"] = "C"
    for key in ("PGDATA", "PGHOST", "PGPORT", "PGUSER", "PGDATABASE", "PGOPTIONS"):
        env.pop(key, None)
    extra: dict[str, object] = {}
    if account.switch:
        env["HOME"] = str(cwd)
        env["USER"] = env["LOGNAME"] = account.name
        extra = {"user": account.uid, "group": account.gid, "extra_groups": []}
    try:
        return subprocess.run(
            cmd,
            cwd=cwd,
            env=env,
            capture_output=True,
            text=True,
            stdin=subprocess.DEVNULL,
            timeout=timeout,
            **extra,  # type: ignore[arg-type]
        )
    except subprocess.TimeoutExpired as exc:
        raise LocalDBError(f"{' '.join(cmd)} did not finish within {timeout:.0f}s") from exc
    except OSError as exc:
        raise LocalDBError(f"Cannot run {cmd[0]}: {exc}. {_INSTALL_HINT}") from exc


def _log_tail(base: Path, lines: int = 30) -> str:
    try:
        text = (base / _LOG_FILE).read_text(errors="replace")
    except OSError:
        return "(no server log)"
    return "\n".join(text.splitlines()[-lines:]) or "(server log is empty)"


def _initialised_version(base: Path, pgdata: Path) -> str | None:
    """The cluster's major version, or None when there is no completed initdb. A completed
    one whose version cannot be read is damaged, not missing: it is never made again over
    (that would replace the database with an empty one without a word)."""
    if not (base / _INITDB_DONE).exists():
        return None
    try:
        version = (pgdata / "PG_VERSION").read_text().strip()
    except OSError as exc:
        version, problem = "", str(exc)
    else:
        problem = "it is empty"
    if not version:
        raise LocalDBError(
            f"The embedded database in {pgdata} looks damaged: its PG_VERSION cannot be read "
            f"({problem}), though its initdb completed. Restore the folder, or delete the "
            "database with `python -m workqueue.localdb destroy` (or `make clean-db`) to start "
            "with an empty one."
        )
    return version


def _initdb(base: Path, pgdata: Path, bindir: Path, account: _Account) -> None:
    # Called without a completed initdb: nothing there, or an initdb that was interrupted.
    # No server runs on it (the caller made sure), so start from scratch.
    # Before the data folder is made, and before the mark of a completed initdb goes, so that
    # the data folder is never left unclaimed: if initdb is interrupted, what it left is ours.
    if not (base / _INITDB_STARTED).is_file():
        _write_new(base, _INITDB_STARTED, f"{bindir}\n")
    (base / _INITDB_DONE).unlink(missing_ok=True)
    shutil.rmtree(pgdata, ignore_errors=True)
    cmd = [
        str(bindir / "initdb"),
        "-D",
        str(pgdata),
        # The socket folder's permissions admit the caller; TCP is refused outright.
        "--auth-local=trust",
        "--auth-host=reject",
        "-E",
        "UTF8",
        "--no-locale",
        "-U",
        account.name,
    ]
    proc = _run_as(account, cmd, cwd=base, timeout=_INITDB_TIMEOUT_S)
    if proc.returncode != 0:
        raise LocalDBError(
            f"initdb failed for the embedded database in {pgdata} (exit {proc.returncode}):\n"
            f"{(proc.stdout + proc.stderr).strip()}"
        )
    _write_new(base, _INITDB_DONE, f"{bindir}\n")
    (base / _INITDB_STARTED).unlink()


def _wait_until(predicate: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


def _stop_postmaster(pgdata: Path) -> None:
    pm = _read_pidfile(pgdata)
    if pm is None or not _process_alive(pm.pid) or not _is_postmaster_of(pm.pid, pgdata):
        return

    def gone() -> bool:
        return not _process_alive(pm.pid)

    # SIGINT is PostgreSQL's "fast" shutdown; SIGQUIT its "immediate" one (crash recovery next).
    for sig, timeout in ((signal.SIGINT, _STOP_TIMEOUT_S), (signal.SIGQUIT, 10.0)):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pm.pid, sig)
        if _wait_until(gone, timeout):
            return
    raise LocalDBError(f"The embedded PostgreSQL (pid {pm.pid}) did not stop.")


def _clear_stale_server(pgdata: Path, sockdir: Path) -> None:
    """Make sure no server runs on ``pgdata`` and no stale lock file blocks a new one."""
    pm = _read_pidfile(pgdata)
    if pm is None:
        return
    if _process_alive(pm.pid) and _is_postmaster_of(pm.pid, pgdata):
        # A live server we cannot use (not ready, not answering, or listening on TCP): stop it.
        _stop_postmaster(pgdata)
    # The postmaster is gone (maybe a zombie whose pid PostgreSQL would still consider alive);
    # its children exit on their own once they notice. Wait for them to detach.
    if not _wait_until(lambda: not _shmem_attached(pm), _SHMEM_RELEASE_TIMEOUT_S):
        raise LocalDBError(
            f"Processes of a previous PostgreSQL server on {pgdata} are still running "
            f"(shared memory segment {pm.shmid} is attached); stop them and retry."
        )
    with _opened(pgdata) as data, contextlib.suppress(FileNotFoundError):
        os.unlink("postmaster.pid", dir_fd=data)
    # Socket lock files in our private socket folder name the dead pid, too.
    for leftover in sockdir.glob(".s.PGSQL.*"):
        with contextlib.suppress(FileNotFoundError):
            leftover.unlink()


def _adopt_running(pgdata: Path, sockdir: Path) -> _Postmaster | None:
    """A ready, answering, socket-only server on ``pgdata`` (e.g. state file lost): use it."""
    pm = _read_pidfile(pgdata)
    if pm is None or not _process_alive(pm.pid) or not _is_postmaster_of(pm.pid, pgdata):
        return None
    if pm.status == "starting":
        pid = pm.pid
        _wait_until(
            lambda: (
                (cur := _read_pidfile(pgdata)) is None
                or cur.status != "starting"
                or not _process_alive(pid)
            ),
            _START_TIMEOUT_S,
        )
        pm = _read_pidfile(pgdata)
        if pm is None or not _process_alive(pm.pid):
            return None
        if pm.status == "starting":
            # Still starting: after a crash, recovery replays the WAL written since the last
            # checkpoint, which can take minutes. Stopped now (as a server that is not ready
            # would be), it would start the replay over at every attempt and never finish.
            raise LocalDBError(
                f"The embedded PostgreSQL on {pgdata} is still starting after "
                f"{_START_TIMEOUT_S:.0f}s, most likely recovering from a crash; leave it "
                f"running and try again in a minute. Last lines of {pgdata.parent / _LOG_FILE}:"
                f"\n{_log_tail(pgdata.parent)}"
            )
    # A server listening on TCP (an older version's) is not adopted: the caller restarts it.
    if pm.status == "ready" and not pm.listen and _socket_accepts(sockdir, pm.port):
        return pm
    return None


def _rotate_log(base: Path) -> None:
    log = base / _LOG_FILE
    with contextlib.suppress(OSError):
        if log.stat().st_size > _LOG_ROTATE_BYTES:
            os.replace(log, base / f"{_LOG_FILE}.1")


@contextlib.contextmanager
def _opened(folder: Path) -> Iterator[int]:
    """``folder`` opened (see _open_folder), for the block."""
    fd = _open_folder(folder)
    try:
        yield fd
    finally:
        os.close(fd)


def _open_folder(folder: Path) -> int:
    """``folder`` opened as a folder, following no link at its own name; the embedded
    database's ``base/data``, following none at either name."""
    try:
        if folder.name == _DATA:
            with _opened(folder.parent) as base:
                return os.open(_DATA, _FOLDER_FLAGS, dir_fd=base)
        return os.open(folder, _FOLDER_FLAGS)
    except OSError as exc:
        raise LocalDBError(
            f"Cannot open {folder} as a folder (a link is never followed): {exc}"
        ) from exc


_FOLDER_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _write_new(
    folder: Path, name: str, text: str, owner: _Account | None = None, rename_to: str = ""
) -> None:
    """Write ``text`` to a file made afresh at ``name`` in ``folder`` (mode 0600, owned by
    ``owner``'s account when the server runs as another), then rename it to ``rename_to`` if
    given. Never through whatever is at a name: the folders written in belong to the server's
    account, and a link it left there (``pg_hba.conf.<pid>.tmp`` pointing at ``/etc/passwd``,
    or ``data`` itself pointing at ``/etc``) would have had root write and hand over the file
    it points at. The folder is opened without following a link and every name is used
    relative to it; what is at ``name`` is removed first, and one planted again before the
    file is made fails the write."""
    with _opened(folder) as at:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=at)
        try:
            fd = os.open(
                name,
                os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                0o600,
                dir_fd=at,
            )
        except OSError as exc:
            raise LocalDBError(
                f"Cannot create {folder / name} for the embedded database: {exc}"
            ) from exc
        with os.fdopen(fd, "w") as file:
            if owner is not None and owner.switch:
                os.fchown(fd, owner.uid, owner.gid)
            file.write(text)
        if rename_to:
            os.replace(name, rename_to, src_dir_fd=at, dst_dir_fd=at)


def _write_pg_hba(pgdata: Path, account: _Account) -> None:
    _write_new(pgdata, f"pg_hba.conf.{os.getpid()}.tmp", _PG_HBA, account, "pg_hba.conf")


def _start_postmaster(
    base: Path, pgdata: Path, bindir: Path, account: _Account, sockdir: Path
) -> _Postmaster:
    _rotate_log(base)
    _write_pg_hba(pgdata, account)
    # pg_ctl hands -o to a shell: listen_addresses='' reaches the server as an empty value.
    options = (
        f"-c listen_addresses='' -c port={PORT} -c unix_socket_directories='{sockdir}' "
        f"-c unix_socket_permissions=0700 -c max_connections={MAX_CONNECTIONS} "
        + " ".join(f"-c {name}={value}" for name, value in SERVER_SETTINGS.items())
    )
    cmd = [
        str(bindir / "pg_ctl"),
        "start",
        "-D",
        str(pgdata),
        "-l",
        str(base / _LOG_FILE),
        "-w",
        "-t",
        str(_START_TIMEOUT_S),
        "-o",
        options,
    ]
    proc = _run_as(account, cmd, cwd=base, timeout=_START_TIMEOUT_S + 30)
    pm = _read_pidfile(pgdata)
    if proc.returncode == 0 and pm is not None and pm.status == "ready":
        return pm
    raise LocalDBError(
        f"The embedded PostgreSQL in {pgdata} did not start.\n"
        f"pg_ctl: {(proc.stdout + proc.stderr).strip()}\n"
        f"Last lines of {base / _LOG_FILE}:\n{_log_tail(base)}"
    )


def _make_url(user: str, sockdir: Path, port: int, database: str = DATABASE_NAME) -> str:
    return f"postgres://{quote(user, safe='')}@/{database}?host={quote(str(sockdir))}&port={port}"


def _url_parts(db_url: str) -> tuple[str, Path, int]:
    """(user, socket folder, port) of a URL ``_make_url`` made."""
    parts = urlsplit(db_url)
    query = parse_qs(parts.query)
    return unquote(parts.username or ""), Path(query["host"][0]), int(query["port"][0])


#: A database name a project may ask for: an unquoted PostgreSQL identifier.
_DATABASE_NAME_RULE = re.compile(r"\A[a-z][a-z0-9_]{0,62}\Z")


def _check_database_name(database: str) -> None:
    if not _DATABASE_NAME_RULE.match(database):
        raise LocalDBError(
            f"{database!r} cannot name an embedded database: use lower-case letters, digits "
            "and underscores, starting with a letter (at most 63), e.g. your project's name."
        )
    # The server's own (a project's tables in template1 would be copied into every database
    # made after), and the names Django gives test databases (another project's, or its own).
    if database == "postgres" or database.startswith(("template", "test_")):
        raise LocalDBError(
            f"{database!r} cannot name an embedded database: it is the server's own or names "
            "a test database (Django makes test_NAME itself). Use your project's name."
        )


def _create_database(user: str, sockdir: Path, port: int, database: str = DATABASE_NAME) -> None:
    import psycopg
    from psycopg import errors, sql

    try:
        with psycopg.connect(
            host=str(sockdir),
            port=port,
            user=user,
            dbname="postgres",
            autocommit=True,
            connect_timeout=10,
        ) as conn:
            exists = conn.execute(
                "SELECT 1 FROM pg_database WHERE datname = %s", (database,)
            ).fetchone()
            if not exists:
                with contextlib.suppress(errors.DuplicateDatabase):
                    conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(database)))
    except psycopg.Error as exc:
        raise LocalDBError(
            f"Cannot create the {database!r} database on the embedded PostgreSQL "
            f"(socket folder {sockdir}): {exc}"
        ) from exc


def _write_state(base: Path, pm: _Postmaster, user: str, sockdir: Path) -> str:
    db_url = _make_url(user, sockdir, pm.port)
    state = {"pid": pm.pid, "start": pm.start, "port": pm.port, "user": user, "url": db_url}
    # Renamed into place: readers never see a half-written file.
    _write_new(
        base, f"{_STATE_FILE}.{os.getpid()}.tmp", json.dumps(state) + "\n", None, _STATE_FILE
    )
    return db_url


def _start(base: Path, account: _Account) -> str:
    """Under the lock: initialise if needed, adopt or (re)start the server, create the DB."""
    pgdata = base / "data"
    sockdir = _prepare_socket_dir(base, account)
    pm = _adopt_running(pgdata, sockdir)
    if pm is None:
        _clear_stale_server(pgdata, sockdir)
        version = _initialised_version(base, pgdata)
        bindir = _find_bindir(version)
        if version is None:
            _initdb(base, pgdata, bindir, account)
        pm = _start_postmaster(base, pgdata, bindir, account, sockdir)
    _create_database(account.name, sockdir, pm.port)
    return _write_state(base, pm, account.name, sockdir)


# ---------------------------------------------------------------------------------------------
# Command line: python -m workqueue.localdb start|stop|url|path|destroy
# ---------------------------------------------------------------------------------------------


_USAGE = """usage: python -m workqueue.localdb {start|stop|url|path|destroy} [--database NAME]

  start    start the embedded PostgreSQL (made on first use) and print its URL
  stop     stop it
  url      print its URL, if it runs
  path     print its folder (WORKQUEUE_LOCALDB_DIR, or the default)
  destroy  stop it and delete its folder (only a folder it made)

  --database NAME  (start, url) the URL of a database of NAME on that server, which start
                   makes on first use: one per project, since every project of this account
                   shares the one server and its default database, workqueue"""


def _main(argv: list[str]) -> int:
    verbs = ("start", "stop", "url", "path", "destroy")
    if argv in (["-h"], ["--help"]):
        print(_USAGE)
        return 0
    database = DATABASE_NAME
    if len(argv) == 3 and argv[0] in ("start", "url") and argv[1] == "--database":
        argv, database = argv[:1], argv[2]
    if len(argv) != 1 or argv[0] not in verbs:
        print(_USAGE, file=sys.stderr)
        return 2
    verb = argv[0]
    try:
        _check_database_name(database)
        if verb == "start":
            print(ensure_running(database))
        elif verb == "stop":
            stop()
            print("stopped")
        elif verb == "destroy":
            destroy()
            print("destroyed")
        elif verb == "path":
            print(data_dir())
        else:
            current = url(database)
            if current is None:
                print("The embedded PostgreSQL is not running.", file=sys.stderr)
                return 1
            print(current)
    except ImproperlyConfigured as exc:
        print(exc, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
