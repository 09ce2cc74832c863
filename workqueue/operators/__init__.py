"""Operator operations shared by the CLI, the REST API and the admin (one implementation)."""
