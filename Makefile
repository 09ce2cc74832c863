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

.PHONY: venv test lint format demo clean-db system-packages system-packages-for-tests

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
