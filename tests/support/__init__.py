"""Helpers shared by the test modules (test modules never import each other): database access
outside Django's cursor, the suite's environment and its subprocesses, database roles, waiting,
queue set-up (dead letters, bulk backlogs), samplers, hosts in this process and as processes,
the REST API's request helpers, the T-SQL parser and the headless browser. Fixtures built on
them live in tests/conftest.py."""
