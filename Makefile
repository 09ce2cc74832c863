# django-workqueue developer entry points. `make demo` and `make test` work on a fresh machine:
# they create .venv, install requirements.txt and use the embedded PostgreSQL (workqueue/localdb.py)
# unless DATABASE_URL is set (the demo with DJANGO_DEBUG=1, the suite with WORKQUEUE_LOCALDB=1).

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
VENV_PY := $(VENV)/bin/python
# Touched after a successful install: the venv is rebuilt only when requirements.txt is newer.
STAMP := $(VENV)/.requirements-installed
# pytest workers for `make test`: four on two cores, since most tests wait (README, Development).
PYTEST_WORKERS ?= 4

# Django 6 (its own django.tasks, not the backport) needs Python 3.12 or newer: `make test` runs
# the tests that reach Django's changing APIs once more on it, in $(VENV6), with the first such
# Python found (on PATH, else under pyenv). README, Development.
# pyenv's shims run only its selected version, so the versions it installed are looked at
# directly, under its root and beside the pyenv command found (root's, for a user whose HOME is
# elsewhere); the glob leaves out free-threaded "t" builds (psycopg has no binary wheels there).
PYENV_ROOT ?= $(or $(shell pyenv root 2>/dev/null),$(HOME)/.pyenv)
PYENV_ROOTS := $(sort $(PYENV_ROOT) $(patsubst %/bin/pyenv,%,$(shell command -v pyenv 2>/dev/null)))
ifndef PYTHON_FOR_DJANGO6
PYTHON_FOR_DJANGO6 := $(shell for p in python3.12 python3.13 python3.14 \
	$(PYENV_ROOTS:%=%/versions/3.1[2-4].*[0-9]/bin/python3); do \
	"$$p" -c 'import sys; assert sys.version_info >= (3, 12)' 2>/dev/null \
	&& { command -v "$$p"; break; }; done)
endif
# Found once: the sub-makes of `make test` take it as it is.
export PYTHON_FOR_DJANGO6
DJANGO6 := Django==6.1.3
VENV6 := .venv-django6
VENV6_PY := $(VENV6)/bin/python
STAMP6 := $(VENV6)/.requirements-installed
DJANGO6_TESTS := tests/unit tests/api tests/admin tests/integration/test_tasks_backend.py \
	tests/integration/test_tasks_at_the_edges.py tests/integration/test_tasks_runs_are_their_own.py \
	tests/integration/test_transactional_tasks.py tests/integration/test_testing_helpers.py \
	tests/integration/test_migrations.py::test_models_and_migrations_agree \
	tests/integration/test_migrations.py::test_an_upgraded_database_equals_a_fresh_one \
	tests/integration/test_container_job_examples.py \
	tests/runtime/test_scheduler.py tests/runtime/test_host_memory.py \
	tests/processes/test_tasks_host.py tests/processes/test_packaging.py \
	tests/processes/test_first_start_errors.py::test_a_command_against_a_database_that_is_not_there_says_so_in_a_line

.PHONY: venv test test-django6 lint format demo clean-db system-packages system-packages-for-tests

venv: $(STAMP)

$(STAMP): requirements.txt
	@# A venv whose interpreter no longer runs (e.g. its base Python was removed) is rebuilt.
	@if [ -d $(VENV) ] && ! $(VENV_PY) -c '' 2>/dev/null; then \
		echo "Rebuilding broken $(VENV)"; rm -rf $(VENV); fi
	@if [ ! -x $(VENV_PY) ]; then \
		test -n "$(PYTHON)" || { echo "No python3.11 or python3 on PATH" >&2; exit 1; }; \
		$(PYTHON) -m venv $(VENV); fi
	$(VENV_PY) -m pip install --disable-pip-version-check -q -r requirements.txt
	touch $@

# PostgreSQL server binaries and unixodbc (plus chromium and curl for the tests) when missing.
system-packages:
	@bash .ci/install-system-packages

system-packages-for-tests:
	@bash .ci/install-system-packages --for-tests

test: system-packages-for-tests venv
	$(VENV_PY) -m pytest -n $(PYTEST_WORKERS) --dist worksteal -m "not slow and not timing"
	$(VENV_PY) -m pytest -m "timing and not slow"
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	@$(MAKE) --no-print-directory test-django6

# Without a Python 3.12+ the leg is skipped with a notice, except in CI (CI set), where the
# machine has one and a missing leg must not pass unseen. $(VENV6) is made again when its
# interpreter no longer runs or another one was chosen (whatever the stamp's age).
test-django6: system-packages-for-tests
	@if [ -z "$(PYTHON_FOR_DJANGO6)" ]; then \
		if [ -n "$(CI)" ]; then \
			echo "Django 6 tests failed: no Python 3.12 or newer found (set PYTHON_FOR_DJANGO6)" >&2; \
			exit 1; fi; \
		echo "Django 6 tests skipped: no Python 3.12 or newer found (set PYTHON_FOR_DJANGO6)" >&2; \
	else \
		if [ -d $(VENV6) ] && { [ "$$(cat $(VENV6)/.made-with 2>/dev/null)" != "$(PYTHON_FOR_DJANGO6)" ] \
			|| ! $(VENV6_PY) -c '' 2>/dev/null; }; then \
			echo "Making $(VENV6) again, with $(PYTHON_FOR_DJANGO6)"; rm -rf $(VENV6); fi; \
		$(MAKE) --no-print-directory $(STAMP6) && \
		$(VENV6_PY) -m pytest -n $(PYTEST_WORKERS) --dist worksteal \
			-m "not slow and not timing and not browser" $(DJANGO6_TESTS); \
	fi

# requirements.txt with Django 6 in place of its Django 5.2 pin.
$(STAMP6): requirements.txt Makefile
	@if [ ! -x $(VENV6_PY) ]; then $(PYTHON_FOR_DJANGO6) -m venv $(VENV6) && \
		echo "$(PYTHON_FOR_DJANGO6)" > $(VENV6)/.made-with; fi
	grep -v '^Django==' requirements.txt > $(VENV6)/requirements.txt
	$(VENV6_PY) -m pip install --disable-pip-version-check -q -r $(VENV6)/requirements.txt "$(DJANGO6)"
	touch $@

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: venv
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

# The demo is a development run: project/settings.py fails closed (DEBUG off, no embedded
# database, no published secret key) unless DJANGO_DEBUG=1 says otherwise.
demo: export DJANGO_DEBUG = 1
demo: system-packages venv
	$(VENV_PY) manage.py migrate --verbosity 0
	$(VENV_PY) manage.py workqueue_samples demo
	@echo
	$(VENV_PY) manage.py workqueue stats
	@echo
	@echo "Next, in this shell:  export DJANGO_DEBUG=1  (development settings, as the demo used)"
	@echo "      create an admin user with  $(VENV_PY) manage.py createsuperuser"
	@echo "      then run  $(VENV_PY) manage.py runserver  and open http://127.0.0.1:8000/admin/"
	@echo "      Walkthrough: workqueue_samples/README.md"

# Stops the embedded PostgreSQL and deletes its folder (all its data). Does not touch a
# database named by DATABASE_URL.
clean-db: venv
	$(VENV_PY) -m workqueue.localdb destroy
