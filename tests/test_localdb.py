"""The embedded PostgreSQL (``workqueue.localdb``): reuse, single start under concurrency, recovery.

Every test runs its own throwaway cluster (``WORKQUEUE_LOCALDB_DIR``) so that nothing here stops
or kills the shared cluster the rest of the suite uses.
"""

from __future__ import annotations

import fcntl
import os
import pwd
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import environ
import psycopg
import pytest
from django.core.exceptions import ImproperlyConfigured

from workqueue import localdb

pytestmark = pytest.mark.processes

REPO = Path(__file__).resolve().parents[1]
READY_LINE = "database system is ready to accept connections"


@pytest.fixture
def cluster_dir(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    # Not tmp_path: pytest's temp root is private (0700), and as root the server runs as the
    # 'postgres' OS user, which must be able to reach the folder.
    path = Path(tempfile.mkdtemp(prefix="wq-localdb-test-", dir="/tmp"))
    monkeypatch.setenv("WORKQUEUE_LOCALDB_DIR", str(path))
    try:
        yield path
    finally:
        localdb.destroy()


def postmaster_pid(cluster: Path) -> int:
    return int((cluster / "data" / "postmaster.pid").read_text().split()[0])


def starts_logged(cluster: Path) -> int:
    return (cluster / "server.log").read_text().count(READY_LINE)


def select_one(url: str) -> tuple[str, str]:
    with psycopg.connect(url, connect_timeout=10) as conn:
        row = conn.execute("SELECT current_database(), current_user").fetchone()
    assert row is not None
    return row[0], row[1]


def wait_dead(pid: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while localdb._process_alive(pid):
        assert time.monotonic() < deadline, f"pid {pid} still alive"
        time.sleep(0.05)


@pytest.mark.timing
def test_second_call_reuses_the_running_server(cluster_dir: Path) -> None:
    first = localdb.ensure_running()
    pid = postmaster_pid(cluster_dir)

    started = time.perf_counter()
    second = localdb.ensure_running()
    elapsed = time.perf_counter() - started

    assert second == first == localdb.url()
    assert postmaster_pid(cluster_dir) == pid
    assert starts_logged(cluster_dir) == 1
    # The fast path reads a few files; a generous bound that still catches any restart.
    assert elapsed < 0.1
    # Subprocess settings parse it with django-environ; psycopg connects with it as it is.
    config = environ.Env.db_url_config(first)
    assert config["ENGINE"] == "django.db.backends.postgresql"
    assert config["NAME"] == "workqueue"
    assert config["OPTIONS"]["host"] == str(localdb._socket_dir(cluster_dir))
    assert select_one(first) == ("workqueue", config["USER"])


def test_each_project_can_have_a_database_of_its_own_on_the_one_server(
    cluster_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every project of an account shares the one server and its default database: a second
    project's `migrate` went into the first one's tables without a word (helper-118)."""
    default = localdb.ensure_running()
    shop = localdb.ensure_running("shop")

    assert select_one(shop)[0] == "shop"
    assert select_one(default)[0] == "workqueue"
    assert starts_logged(cluster_dir) == 1  # one server for both
    assert localdb.ensure_running("shop") == shop  # made once, then reused
    assert localdb.django_database(debug=True, database="shop")["NAME"] == "shop"
    assert localdb._main(["url", "--database", "shop"]) == 0
    assert capsys.readouterr().out.strip() == shop
    assert localdb._main(["start", "--database", "blog"]) == 0
    assert select_one(capsys.readouterr().out.strip())[0] == "blog"
    # Only a plain identifier: the name goes into CREATE DATABASE and a URL's path.
    with pytest.raises(ImproperlyConfigured, match="cannot name an embedded database"):
        localdb.ensure_running('shop"; DROP DATABASE workqueue; --')
    assert localdb._main(["start", "--database", "Shop-2"]) == 1
    assert "cannot name an embedded database" in capsys.readouterr().err
    # The server's own, and test databases' (review helper-119: template1 was taken, whose
    # tables every later database copies).
    for taken in ("template1", "template0", "postgres", "test_shop", "_shop"):
        with pytest.raises(ImproperlyConfigured, match="cannot name an embedded database"):
            localdb.ensure_running(taken)


def test_concurrent_first_calls_start_one_server(cluster_dir: Path) -> None:
    code = "from workqueue import localdb; print(localdb.ensure_running())"
    env = {**os.environ, "WORKQUEUE_LOCALDB_DIR": str(cluster_dir)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(4)
    ]
    results = [proc.communicate(timeout=120) for proc in procs]

    for proc, (_out, err) in zip(procs, results, strict=True):
        assert proc.returncode == 0, err
    urls = {out.strip() for out, _err in results}
    assert len(urls) == 1
    assert starts_logged(cluster_dir) == 1
    assert localdb.url() == urls.pop()


def test_restarts_after_the_postmaster_is_killed(cluster_dir: Path) -> None:
    url = localdb.ensure_running()
    pid = postmaster_pid(cluster_dir)
    socket_dir = Path((cluster_dir / "data" / "postmaster.pid").read_text().splitlines()[4])

    # A crash plus a cleaned /tmp: the pid file stays behind (naming a zombie, on machines whose
    # init does not reap) and the socket folder is gone.
    os.kill(pid, signal.SIGKILL)
    wait_dead(pid)
    for leftover in socket_dir.iterdir():
        leftover.unlink()
    socket_dir.rmdir()
    assert localdb.url() is None

    restarted = localdb.ensure_running()

    assert postmaster_pid(cluster_dir) != pid
    assert restarted == url  # the port is kept when still free, so old URLs keep working
    assert socket_dir.is_dir()
    assert select_one(restarted)[0] == "workqueue"


def test_stop_then_start_keeps_the_url(cluster_dir: Path) -> None:
    url = localdb.ensure_running()
    localdb.stop()
    assert localdb.url() is None
    assert not (cluster_dir / "data" / "postmaster.pid").exists()

    assert localdb.ensure_running() == url
    assert starts_logged(cluster_dir) == 2


def test_missing_server_binaries_say_how_to_fix_it(
    cluster_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(localdb, "_candidate_bindirs", list)
    with pytest.raises(ImproperlyConfigured) as excinfo:
        localdb.ensure_running()
    message = str(excinfo.value)
    assert "apt-get install postgresql" in message
    assert "DATABASE_URL" in message


def postmaster_port(cluster: Path) -> int:
    return int((cluster / "data" / "postmaster.pid").read_text().splitlines()[3])


def test_the_server_keeps_durability_and_is_sized_for_a_queues_writes(cluster_dir: Path) -> None:
    url = localdb.ensure_running()
    names = ["fsync", "synchronous_commit", "full_page_writes", "max_wal_size", "shared_buffers"]
    with psycopg.connect(url, connect_timeout=10) as conn:
        shown = {name: conn.execute(f"SHOW {name}").fetchone()[0] for name in names}
    assert shown == {
        "fsync": "on",
        "synchronous_commit": "on",
        "full_page_writes": "on",
        "max_wal_size": "4GB",
        "shared_buffers": "256MB",
    }


def test_the_server_refuses_tcp_connections(cluster_dir: Path) -> None:
    url = localdb.ensure_running()
    user = environ.Env.db_url_config(url)["USER"]

    # The attack of issue 10 item 5: any local account could reach a loopback port and log in
    # as the superuser (trust). Nothing may answer on TCP, and a server started by hand with
    # TCP on would still find no pg_hba.conf entry for it.
    with (
        pytest.raises(psycopg.OperationalError),
        psycopg.connect(
            host="127.0.0.1",
            port=postmaster_port(cluster_dir),
            user=user,
            dbname="workqueue",
            connect_timeout=5,
        ),
    ):
        pass
    hba_methods = [
        line.split()[0]
        for line in (cluster_dir / "data" / "pg_hba.conf").read_text().splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]
    assert hba_methods == ["local"]


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another OS user")
def test_another_os_user_cannot_connect_or_run_programs(cluster_dir: Path) -> None:
    url = localdb.ensure_running()
    psql = localdb._find_bindir(None) / "psql"
    if not psql.exists():
        pytest.skip("psql is not installed beside the server binaries")
    # The server account may write there. Removed at the end should an attempt get through,
    # since destroy() refuses a folder holding files it did not make.
    marker = cluster_dir / "pwned"
    nobody = pwd.getpwnam("nobody")
    copy_to_program = f"COPY (SELECT 1) TO PROGRAM 'touch {marker}'"

    # psql, not this interpreter: 'nobody' cannot reach the virtualenv's Python under /root.
    attempts = {
        "the URL": [str(psql), "-X", "-w", "-d", url, "-c", copy_to_program],
        "TCP": [
            str(psql), "-X", "-w", "-h", "127.0.0.1", "-p", str(postmaster_port(cluster_dir)),
            "-U", environ.Env.db_url_config(url)["USER"], "-d", "workqueue", "-c", copy_to_program,
        ],
    }  # fmt: skip
    for what, cmd in attempts.items():
        attack = subprocess.run(
            cmd,
            cwd="/",
            env={"PATH": "/usr/bin:/bin", "HOME": "/nonexistent", "PGCONNECT_TIMEOUT": "5"},
            user=nobody.pw_uid,
            group=nobody.pw_gid,
            extra_groups=[],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        # psql exits 2 when it cannot connect (1 would mean connected but the command failed).
        got_through = attack.returncode != 2 or marker.exists()
        marker.unlink(missing_ok=True)
        assert not got_through, (what, attack.returncode, attack.stdout, attack.stderr)


def test_a_server_listening_on_tcp_is_replaced_by_a_socket_only_one(cluster_dir: Path) -> None:
    localdb.ensure_running()
    localdb.stop()
    # What an earlier version left running: the same cluster, trusted on a loopback port.
    account = localdb._server_account()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        tcp_port = sock.getsockname()[1]
    options = (
        f"-c listen_addresses=127.0.0.1 -c port={tcp_port} "
        f"-c unix_socket_directories='{localdb._socket_dir(cluster_dir)}'"
    )
    pg_ctl = str(localdb._find_bindir(None) / "pg_ctl")
    data = str(cluster_dir / "data")
    started = localdb._run_as(
        account,
        [pg_ctl, "start", "-D", data, "-l", str(cluster_dir / "server.log"), "-w", "-o", options],
        cluster_dir,
        90,
    )
    assert started.returncode == 0, started.stderr
    old_pid = postmaster_pid(cluster_dir)
    assert localdb.url() is None  # not used as it is ...

    url = localdb.ensure_running()  # ... but stopped and started again without TCP

    assert postmaster_pid(cluster_dir) != old_pid
    assert select_one(url)[0] == "workqueue"
    with (
        pytest.raises(psycopg.OperationalError),
        psycopg.connect(host="127.0.0.1", port=tcp_port, dbname="workqueue", connect_timeout=5),
    ):
        pass


# -- folders that are not the embedded database's, a cleaned /tmp, a long recovery -------------
# (audit helper-71)


# A user's folder: by the name of one of its entries (a folder named "data" or "server.log"
# was taken for the embedded database's own by its name alone: emptied by a start, deleted by
# `destroy`; audit helper-106), and the entry the error names.
USERS_FOLDERS = {
    "a folder of documents": ("docs/thesis.txt", "docs"),
    "a folder named data": ("data/thesis.txt", "data"),
    "a folder named as a log": ("server.log/thesis.txt", "server.log"),
}


@pytest.mark.parametrize("layout", USERS_FOLDERS)
def test_destroy_refuses_a_folder_holding_anything_else_and_deletes_nothing(
    monkeypatch: pytest.MonkeyPatch, layout: str
) -> None:
    # A mistyped WORKQUEUE_LOCALDB_DIR (a home directory) was deleted whole by `destroy`.
    users_file, named = USERS_FOLDERS[layout]
    folder = Path(tempfile.mkdtemp(prefix="wq-not-a-cluster-", dir="/tmp"))
    (folder / users_file).parent.mkdir()
    (folder / users_file).write_text("important")
    monkeypatch.setenv("WORKQUEUE_LOCALDB_DIR", str(folder))
    try:
        with pytest.raises(localdb.LocalDBError, match=rf"did not make \({re.escape(named)}\)"):
            localdb.destroy()
        assert (folder / users_file).read_text() == "important"
    finally:
        subprocess.run(["rm", "-rf", str(folder)], check=True)


@pytest.mark.parametrize("shape", ["a folder with files of its own", "a file", *USERS_FOLDERS])
def test_a_start_refuses_a_path_that_is_not_its_own_and_changes_nothing(
    monkeypatch: pytest.MonkeyPatch, shape: str
) -> None:
    # A start chown-ed the folder to the server's account and made it 0700 (a file too).
    folder = Path(tempfile.mkdtemp(prefix="wq-not-a-cluster-", dir="/tmp"))
    target = folder / "notes.txt" if shape == "a file" else folder
    users_file = USERS_FOLDERS[shape][0] if shape in USERS_FOLDERS else "notes.txt"
    (folder / users_file).parent.mkdir(exist_ok=True)
    (folder / users_file).write_text("mine")
    os.chmod(folder, 0o755)
    before = target.stat()
    monkeypatch.setenv("WORKQUEUE_LOCALDB_DIR", str(target))
    try:
        with pytest.raises(localdb.LocalDBError, match="WORKQUEUE_LOCALDB_DIR"):
            localdb.ensure_running()
        after = target.stat()
        assert (after.st_uid, after.st_mode) == (before.st_uid, before.st_mode)
        assert (folder / users_file).read_text() == "mine"
    finally:
        subprocess.run(["rm", "-rf", str(folder)], check=True)


def test_a_first_start_interrupted_during_initdb_is_made_again(cluster_dir: Path) -> None:
    # What initdb leaves when killed: a data folder with part of a cluster, its start marked.
    localdb.ensure_running()
    localdb.stop()
    (cluster_dir / "initdb.done").rename(cluster_dir / "initdb.started")
    (cluster_dir / "data" / "PG_VERSION").unlink()

    assert select_one(localdb.ensure_running())[0] == "workqueue"
    assert (cluster_dir / "initdb.done").is_file()
    assert not (cluster_dir / "initdb.started").exists()


# -- what another account can plant, and a damaged cluster (audit helper-108) -------------------


@pytest.fixture
def victim() -> Iterator[Path]:
    """A file of the caller's that a link planted in the cluster's folders points at."""
    folder = Path(tempfile.mkdtemp(prefix="wq-victim-", dir="/tmp"))
    path = folder / "victim"
    path.write_text("untouched")
    os.chmod(path, 0o600)
    yield path
    subprocess.run(["rm", "-rf", str(folder)], check=True)


def test_a_start_writes_through_no_link_planted_in_the_data_folder(
    cluster_dir: Path, victim: Path
) -> None:
    """The data folder is the server account's: a link it left at the name a start writes
    pg_hba.conf to had root overwrite the file it points at and give it to that account."""
    localdb.ensure_running()
    localdb.stop()
    before = victim.stat()
    (cluster_dir / "data" / f"pg_hba.conf.{os.getpid()}.tmp").symlink_to(victim)

    assert select_one(localdb.ensure_running())[0] == "workqueue"

    assert victim.read_text() == "untouched"
    assert (victim.stat().st_uid, victim.stat().st_mode) == (before.st_uid, before.st_mode)


def test_a_start_writes_its_state_through_no_link_planted_while_it_starts(
    cluster_dir: Path, victim: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    create_database = localdb._create_database

    def plant_then_create(*args: Any) -> None:
        (cluster_dir / f"state.json.{os.getpid()}.tmp").symlink_to(victim)
        create_database(*args)

    monkeypatch.setattr(localdb, "_create_database", plant_then_create)

    assert select_one(localdb.ensure_running())[0] == "workqueue"

    assert victim.read_text() == "untouched"
    assert not (cluster_dir / "state.json").is_symlink()


def test_a_lock_file_that_is_a_link_is_refused_and_creates_nothing(cluster_dir: Path) -> None:
    localdb.ensure_running()
    localdb.stop()
    target = Path(tempfile.mkdtemp(prefix="wq-victim-", dir="/tmp")) / "nologin"
    (cluster_dir / "lock").unlink()
    (cluster_dir / "lock").symlink_to(target)
    try:
        for action in (localdb.stop, localdb.ensure_running):
            with pytest.raises(localdb.LocalDBError):
                action()
        assert not target.exists()
    finally:
        (cluster_dir / "lock").unlink()
        subprocess.run(["rm", "-rf", str(target.parent)], check=True)


def test_a_cluster_whose_version_cannot_be_read_is_not_made_again_over_its_data(
    cluster_dir: Path,
) -> None:
    """It was taken for an initdb never done: deleted and replaced by an empty database, and
    the start succeeded without a word."""
    localdb.ensure_running()
    localdb.stop()
    (cluster_dir / "data" / "PG_VERSION").unlink()
    (cluster_dir / "data" / "keep.txt").write_text("the data")

    with pytest.raises(localdb.LocalDBError, match="looks damaged"):
        localdb.ensure_running()

    assert (cluster_dir / "data" / "keep.txt").read_text() == "the data"


def test_stop_refuses_a_folder_it_did_not_make_and_touches_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`start` and `destroy` refused it, `stop` did not: it stopped someone's own cluster kept
    in a folder named data, and left a lock file there."""
    folder = Path(tempfile.mkdtemp(prefix="wq-not-a-cluster-", dir="/tmp"))
    (folder / "data").mkdir()
    (folder / "data" / "PG_VERSION").write_text("15\n")
    monkeypatch.setenv("WORKQUEUE_LOCALDB_DIR", str(folder))
    try:
        with pytest.raises(localdb.LocalDBError, match=r"did not make \(data\)") as refused:
            localdb.stop()
        assert "for you to delete" not in str(refused.value)  # a cluster: no such advice
        assert sorted(p.name for p in folder.iterdir()) == ["data"]
    finally:
        subprocess.run(["rm", "-rf", str(folder)], check=True)


def squat(folder: Path) -> socket.socket:
    """Make ``folder`` as another local user would to catch the embedded database's socket: an
    open folder of theirs, a server of theirs listening where the database's would."""
    folder.mkdir()
    nobody = pwd.getpwnam("nobody")
    os.chown(folder, nobody.pw_uid, nobody.pw_gid)
    os.chmod(folder, 0o777)
    impostor = socket.socket(socket.AF_UNIX)
    impostor.bind(str(folder / f".s.PGSQL.{localdb.PORT}"))
    impostor.listen()
    impostor.setblocking(False)
    return impostor


def assert_never_reached(impostor: socket.socket, folder: Path) -> None:
    with pytest.raises(BlockingIOError):
        impostor.accept()  # nobody connected to it
    impostor.close()
    assert folder.stat().st_uid == pwd.getpwnam("nobody").pw_uid  # theirs, left as it was


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another OS user")
def test_a_socket_folder_another_user_made_again_is_never_handed_out(cluster_dir: Path) -> None:
    """/tmp cleaned while the server ran, and the socket folder's name taken by another user
    with a server of their own: url() handed it out, and every query went to it. Then every
    start refused the folder, and the developer was locked out until someone removed it."""
    url = localdb.ensure_running()
    taken = localdb._socket_dir(cluster_dir)
    subprocess.run(["rm", "-rf", str(taken)], check=True)
    impostor = squat(taken)
    try:
        assert localdb.url() is None

        restarted = localdb.ensure_running()

        assert restarted != url and localdb.url() == restarted
        assert localdb._socket_dir(cluster_dir) != taken
        assert select_one(restarted) == ("workqueue", "postgres")
        assert_never_reached(impostor, taken)
    finally:
        impostor.close()
        subprocess.run(["rm", "-rf", str(taken)], check=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another OS user")
def test_a_socket_folder_name_taken_before_the_first_start_locks_nobody_out(
    cluster_dir: Path,
) -> None:
    """The socket folder's name in /tmp follows from the user id and the data folder, so
    another local user could make it before the developer's first start: every start refused
    it ("exists but is not a folder owned by this user") until an administrator removed it.
    The start now takes a folder of its own under an unguessable name, and keeps using it."""
    taken = localdb._socket_dir(cluster_dir)
    impostor = squat(taken)
    try:
        url = localdb.ensure_running()
        chosen = localdb._socket_dir(cluster_dir)

        assert chosen != taken and chosen.parent == taken.parent
        assert chosen.stat().st_uid == pwd.getpwnam("postgres").pw_uid
        assert chosen.stat().st_mode & 0o777 == 0o700
        assert f"host={chosen}&" in url
        assert select_one(url) == ("workqueue", "postgres")
        localdb.stop()
        assert localdb.ensure_running() == url  # the next start finds the same folder
        assert_never_reached(impostor, taken)
    finally:
        impostor.close()
        subprocess.run(["rm", "-rf", str(taken)], check=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another OS user")
def test_destroy_leaves_another_users_folder_at_the_socket_folders_name(cluster_dir: Path) -> None:
    """destroy() deleted whatever folder the socket folder's name (or the name recorded in the
    cluster's folder, which the server's account may write) pointed at: another user's
    included (helper-115's review)."""
    taken = localdb._socket_dir(cluster_dir)
    theirs = Path(tempfile.mkdtemp(prefix="wq-pg-", dir="/tmp"))
    elsewhere = theirs.with_name(f"wq-pg-{'ab' * 8}")
    theirs.rename(elsewhere)
    impostor = squat(taken)
    try:
        nobody = pwd.getpwnam("nobody")
        os.chown(elsewhere, nobody.pw_uid, nobody.pw_gid)
        localdb.destroy()  # no cluster: the name derived from the folder
        assert taken.is_dir()
        cluster_dir.mkdir()
        (cluster_dir / "socket-folder").write_text(elsewhere.name + "\n")
        localdb.destroy()  # the recorded name
        assert elsewhere.is_dir() and taken.is_dir()
    finally:
        impostor.close()
        subprocess.run(["rm", "-rf", str(taken), str(elsewhere)], check=True)


def test_a_pipe_at_the_recorded_socket_name_neither_hangs_nor_misleads(cluster_dir: Path) -> None:
    """The record is read by every process asking for the URL; the server's account, which
    owns the folder, could leave a pipe there for readers to wait on for ever."""
    url = localdb.ensure_running()
    os.mkfifo(cluster_dir / "socket-folder")
    try:
        done = subprocess.run(
            [sys.executable, "-m", "workqueue.localdb", "url"],
            env={**os.environ, "WORKQUEUE_LOCALDB_DIR": str(cluster_dir)},
            capture_output=True,
            text=True,
            timeout=30,
        )
    finally:
        (cluster_dir / "socket-folder").unlink()  # not the database's own: destroy refuses it

    assert done.returncode == 0 and done.stdout.strip() == url, done


def test_a_stale_pidfile_naming_another_servers_segment_does_not_hold_up_a_start(
    cluster_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Segment ids are reused after a reboot or in a new container: a stale postmaster.pid
    naming one that another server now holds made a start wait 30 s, then fail saying
    processes of the old server were still running (audit helper-108)."""
    localdb.ensure_running()
    live = (cluster_dir / "data" / "postmaster.pid").read_text().splitlines()
    other = Path(tempfile.mkdtemp(prefix="wq-localdb-test-", dir="/tmp"))
    monkeypatch.setenv("WORKQUEUE_LOCALDB_DIR", str(other))
    try:
        localdb.ensure_running()
        localdb.stop()
        finished = subprocess.Popen(["true"])
        finished.wait()
        # The other cluster's pidfile as a crash would leave it, with the live one's segment.
        stale = [str(finished.pid), *live[1:7], "ready"]
        (other / "data" / "postmaster.pid").write_text("\n".join(stale) + "\n")
        began = time.monotonic()

        assert select_one(localdb.ensure_running())[0] == "workqueue"
        assert time.monotonic() - began < 20  # not the 30 s wait for a segment to detach
    finally:
        localdb.destroy()
        monkeypatch.setenv("WORKQUEUE_LOCALDB_DIR", str(cluster_dir))


def test_a_folder_whose_path_the_starting_shell_would_read_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """pg_ctl starts the server through a shell, the path in double quotes: a folder named
    `price$HOME` started in another folder, and a quote or backtick would run as shell."""
    parent = Path(tempfile.mkdtemp(prefix="wq-localdb-test-", dir="/tmp"))
    folder = parent / "price$HOME"
    monkeypatch.setenv("WORKQUEUE_LOCALDB_DIR", str(folder))
    try:
        with pytest.raises(localdb.LocalDBError, match=r"holds \$, which the shell"):
            localdb.ensure_running()
        assert not folder.exists()
    finally:
        subprocess.run(["rm", "-rf", str(parent)], check=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another OS user")
def test_a_folder_holding_another_users_file_is_not_taken_over(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A log file named as the embedded database's own but made (and held open) by another
    user was kept as it was in the taken-over folder: that user read every query error."""
    folder = Path(tempfile.mkdtemp(prefix="wq-not-a-cluster-", dir="/tmp"))
    os.chmod(folder, 0o755)
    log = folder / "server.log"
    log.write_text("")
    nobody = pwd.getpwnam("nobody")
    os.chown(log, nobody.pw_uid, nobody.pw_gid)
    before = folder.stat()
    monkeypatch.setenv("WORKQUEUE_LOCALDB_DIR", str(folder))
    try:
        with pytest.raises(localdb.LocalDBError, match=r"did not make \(server\.log\)"):
            localdb.ensure_running()
        after = folder.stat()
        assert (after.st_uid, after.st_mode) == (before.st_uid, before.st_mode)
        assert sorted(p.name for p in folder.iterdir()) == ["server.log"]
    finally:
        subprocess.run(["rm", "-rf", str(folder)], check=True)


def test_a_start_waiting_through_a_destroy_holds_the_lock_the_next_one_takes(
    cluster_dir: Path,
) -> None:
    """`destroy` deletes the lock file it holds: a start that waited for it locked the deleted
    file, and a third process, opening the name afresh, ran beside it (audit helper-108)."""
    cluster_dir.mkdir(exist_ok=True)
    waiting, held = threading.Event(), []

    def start_waiting() -> None:
        waiting.set()
        with localdb._locked(cluster_dir):
            lock = cluster_dir / "lock"
            held.append(lock.exists() and not fcntl_free(lock))

    with localdb._locked(cluster_dir):
        waiter = threading.Thread(target=start_waiting)
        waiter.start()
        assert waiting.wait(5)
        time.sleep(0.3)  # polling for the lock
        (cluster_dir / "lock").unlink()  # as destroy does, last, while holding it
    waiter.join(10)

    assert held == [True]


def fcntl_free(path: Path) -> bool:
    """Whether a new open of ``path`` could take its lock now (another process's view)."""
    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)
    return True


def test_a_data_folder_swapped_for_a_link_during_a_start_is_written_through_by_nothing(
    cluster_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server's account owns the data folder and may swap it for a link while a start
    runs: root then made pg_hba.conf wherever the link pointed, and gave it to that account
    (helper-109; the temp file's own name was already safe)."""
    localdb.ensure_running()
    localdb.stop()
    elsewhere = Path(tempfile.mkdtemp(prefix="wq-victim-", dir="/tmp"))
    find_bindir = localdb._find_bindir

    def swap_then_find(*args: Any) -> Any:
        (cluster_dir / "data").rename(cluster_dir / "data.real")
        (cluster_dir / "data").symlink_to(elsewhere)
        return find_bindir(*args)

    monkeypatch.setattr(localdb, "_find_bindir", swap_then_find)
    try:
        with pytest.raises(localdb.LocalDBError, match="a link is never followed"):
            localdb.ensure_running()
        assert list(elsewhere.iterdir()) == []
    finally:
        (cluster_dir / "data").unlink()
        (cluster_dir / "data.real").rename(cluster_dir / "data")
        subprocess.run(["rm", "-rf", str(elsewhere)], check=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another OS user")
def test_a_folder_swapped_for_a_link_during_a_start_gives_away_nothing(
    cluster_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server's account owns the folder and may rename it in /tmp: swapped for a link
    after the check, root chown-ed and chmod-ed what the link pointed at (helper-109)."""
    localdb.ensure_running()
    localdb.stop()
    elsewhere = Path(tempfile.mkdtemp(prefix="wq-victim-", dir="/tmp"))
    os.chmod(elsewhere, 0o755)
    before = elsewhere.stat()
    check_reachable = localdb._check_reachable

    def swap_then_check(base: Path, account: Any) -> None:
        check_reachable(base, account)
        base.rename(base.with_name(base.name + ".real"))
        base.symlink_to(elsewhere)

    monkeypatch.setattr(localdb, "_check_reachable", swap_then_check)
    try:
        with pytest.raises(localdb.LocalDBError, match="a link is never followed"):
            localdb.ensure_running()
        after = elsewhere.stat()
        assert (after.st_uid, after.st_mode) == (before.st_uid, before.st_mode)
    finally:
        cluster_dir.unlink()
        cluster_dir.with_name(cluster_dir.name + ".real").rename(cluster_dir)
        subprocess.run(["rm", "-rf", str(elsewhere)], check=True)


def test_a_deleted_socket_folder_is_made_again(cluster_dir: Path) -> None:
    # /tmp cleaned while the server ran: its URL kept being handed out, and every connection
    # failed ("No such file or directory") until someone stopped the server by hand.
    url = localdb.ensure_running()
    subprocess.run(["rm", "-rf", str(localdb._socket_dir(cluster_dir))], check=True)

    assert localdb.url() is None
    assert select_one(localdb.ensure_running())[0] == "workqueue"
    assert localdb.ensure_running() == url


def test_a_server_still_recovering_is_left_to_finish(
    cluster_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A start that found the server still starting after its wait (crash recovery of a few
    GB of WAL) stopped it: every later attempt restarted the replay, which never finished."""
    localdb.ensure_running()
    pgdata = cluster_dir / "data"
    running = localdb._read_pidfile(pgdata)
    assert running is not None
    recovering = localdb._Postmaster(
        running.pid, running.start, running.port, "", "starting", running.shmid
    )
    stopped: list[Path] = []
    # Undone before the fixture's destroy(), which must really stop the server: left patched,
    # it deleted the folder under a server that ran on.
    with monkeypatch.context() as patched:
        patched.setattr(localdb, "_read_pidfile", lambda _pgdata: recovering)
        patched.setattr(localdb, "_START_TIMEOUT_S", 0.2)
        patched.setattr(localdb, "_stop_postmaster", stopped.append)

        with pytest.raises(localdb.LocalDBError, match="still starting"):
            localdb.ensure_running()
    assert stopped == []


def test_a_user_without_a_home_folder_is_told_which_setting_names_the_folder(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # As a container started under an arbitrary user id runs: no HOME, and no account entry
    # for the id (this process keeps its own rights; only the id it reports is another).
    uid = next(n for n in range(54321, 60000) if not _has_account(n))
    for variable in ("HOME", "XDG_DATA_HOME", localdb.DIR_VARIABLE):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setattr(os, "getuid", lambda: uid)
    monkeypatch.setattr(os, "geteuid", lambda: uid)

    with pytest.raises(localdb.LocalDBError) as refused:
        localdb.data_dir()

    assert "HOME is unset" in str(refused.value)
    assert f"user id {uid} has no account entry" in str(refused.value)
    assert localdb.DIR_VARIABLE in str(refused.value)


def _has_account(uid: int) -> bool:
    try:
        pwd.getpwuid(uid)
    except KeyError:
        return False
    return True


def test_the_command_line_explains_itself_and_says_what_it_did(capsys):
    """`--help` was a usage error (exit 2) and `stop` printed nothing."""
    assert localdb._main(["--help"]) == 0
    assert "destroy  stop it and delete its folder" in capsys.readouterr().out
    assert localdb._main(["strat"]) == 2
    assert "start    start the embedded PostgreSQL" in capsys.readouterr().err
