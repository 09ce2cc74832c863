"""The project's WSGI application served over HTTP by a fixed number of threads, as a
production server (gunicorn's ``--threads``, uWSGI, mod_wsgi) serves it, for tests with
hundreds of clients at once.

``manage.py runserver`` starts a thread per client connection and keeps the connection open
between requests: 500 clients make 500 threads, each request holding a database connection
(two, with the queue's own) while it waits its turn for the interpreter, past a server's
``max_connections``, and the threads' switching slows every other process on the machine.
Here ``THREADS`` threads take connections from one accept queue; a response closes its
connection (Django's development handler does so on a server that is not thread-per-connection)
and the client's next request opens a new one, so waiting clients hold no thread and no
database connection.

Run in a project subprocess (``manage.py shell -c``, see :func:`command`); prints
``PORT_LINE`` and the port it bound, then serves until killed.
"""

from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from django.core.servers.basehttp import (
    WSGIRequestHandler,
    WSGIServer,
    get_internal_wsgi_application,
)

PORT_LINE = "Serving HTTP on 127.0.0.1 port "
THREADS = 16


class PooledWSGIServer(WSGIServer):
    """Hands each accepted connection to a fixed pool of threads."""

    # The accept queue: clients beyond the threads wait here, not in threads of their own.
    request_queue_size = 1024

    def __init__(self, *args: Any, threads: int = THREADS, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="http")

    def process_request(self, request: Any, client_address: Any) -> None:
        self._pool.submit(self._serve, request, client_address)

    def _serve(self, request: Any, client_address: Any) -> None:
        try:
            self.finish_request(request, client_address)
        except Exception:
            self.handle_error(request, client_address)
        finally:
            self.shutdown_request(request)


def serve(threads: int = THREADS) -> None:
    server = PooledWSGIServer(("127.0.0.1", 0), WSGIRequestHandler, threads=threads)
    server.set_app(get_internal_wsgi_application())
    print(f"{PORT_LINE}{server.server_port}", flush=True)
    sys.stdout.flush()
    server.serve_forever()


def command(threads: int = THREADS) -> list[str]:
    """The ``manage.py`` arguments that run :func:`serve`."""
    return ["shell", "-c", f"from tests.support.rest_server import serve; serve({threads})"]
