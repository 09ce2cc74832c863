"""The OpenAPI document: well formed, every reference resolvable, the API-key scheme documented,
and the docs page served."""

from __future__ import annotations

import io
import json
import re
from typing import Any

import pytest
from django.core.management import call_command

from workqueue.api import api, docs

PREFIX = "/work-queue"
ENDPOINTS = {
    ("post", "/topics/{topic}/messages"),
    ("get", "/subscriptions/stats"),
    ("get", "/subscriptions/{name}/stats"),
    ("get", "/subscriptions/{name}/dead-letters"),
    ("get", "/subscriptions/{name}/partitions"),
    ("get", "/subscriptions/{name}/backlog"),
    ("post", "/subscriptions/{name}/deliveries/{delivery_id}/replay"),
    ("post", "/subscriptions/{name}/deliveries/{delivery_id}/discard"),
    ("post", "/subscriptions/{name}/dead-letters/replay"),
    ("post", "/subscriptions/{name}/dead-letters/discard"),
    ("post", "/subscriptions/{name}/pending/discard"),
    ("get", "/bindings/validate"),
    ("get", "/health"),
    ("get", "/metrics"),
}
HTTP_METHODS = {"get", "put", "post", "delete", "options", "head", "patch", "trace"}


@pytest.fixture(scope="module")
def schema() -> dict[str, Any]:
    # Round-trip through JSON: what clients receive must be plain JSON.
    return json.loads(json.dumps(api.get_openapi_schema(path_prefix=PREFIX)))


def operations(schema: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    return [
        (method, path, operation)
        for path, item in schema["paths"].items()
        for method, operation in item.items()
        if method in HTTP_METHODS
    ]


def refs(node: Any) -> list[str]:
    if isinstance(node, dict):
        found = [node["$ref"]] if isinstance(node.get("$ref"), str) else []
        return found + [r for value in node.values() for r in refs(value)]
    if isinstance(node, list):
        return [r for value in node for r in refs(value)]
    return []


def test_the_document_has_the_required_openapi_3_fields(schema):
    assert schema["openapi"].startswith("3.")
    assert schema["info"]["title"] and schema["info"]["version"]
    assert isinstance(schema["paths"], dict) and schema["paths"]
    for _method, _path, operation in operations(schema):
        assert operation["responses"], operation["operationId"]
        for status, response in operation["responses"].items():
            assert status.isdigit() and response["description"]


def test_every_endpoint_is_documented_once_with_a_unique_operation_id(schema):
    documented = {(method, path.removeprefix(PREFIX)) for method, path, _ in operations(schema)}
    assert documented == ENDPOINTS
    ids = [operation["operationId"] for _, _, operation in operations(schema)]
    assert len(ids) == len(set(ids))


def test_every_reference_resolves_to_a_component(schema):
    components = schema["components"]["schemas"]
    for ref in refs(schema):
        assert ref.startswith("#/components/schemas/"), ref
        assert ref.removeprefix("#/components/schemas/") in components, ref


def test_every_path_parameter_is_declared(schema):
    for _method, path, operation in operations(schema):
        declared = {p["name"] for p in operation.get("parameters", []) if p["in"] == "path"}
        in_path = {part[1:-1] for part in path.split("/") if part.startswith("{")}
        assert declared == in_path, path


def test_the_api_key_header_scheme_is_documented_and_used(schema):
    schemes = schema["components"]["securitySchemes"]
    api_key = [s for s in schemes.values() if s.get("in") == "header"]
    assert api_key == [
        {
            "type": "apiKey",
            "in": "header",
            "name": "X-API-Key",
            "description": api_key[0]["description"],
        }
    ]
    key_scheme = next(name for name, s in schemes.items() if s.get("in") == "header")
    for _method, path, operation in operations(schema):
        assert {key_scheme: []} in operation["security"], path


def test_the_publish_operation_documents_its_body_and_status_codes(schema):
    operation = schema["paths"][f"{PREFIX}/topics/{{topic}}/messages"]["post"]
    assert set(operation["responses"]) == {"202", "400", "401", "403", "404", "413"}
    body = operation["requestBody"]["content"]["application/json"]["schema"]
    assert body["required"] == ["messages"]
    message = body["properties"]["messages"]["items"]
    assert {
        "messageId",
        "partitionKey",
        "attributes",
        "payload",
        "payloadRef",
        "correlationId",
        "deduplicationKey",
        "deduplicationTtlSeconds",
        "notBefore",
        "delaySeconds",
        "priority",
    } == set(message["properties"])
    result = schema["components"]["schemas"]["PublishResultOut"]
    assert {"messageId", "status", "error"} <= set(result["properties"])


JSON_SCHEMA_TYPES = {"object", "array", "string", "integer", "number", "boolean", "null"}


def schema_problems(node: Any, where: str = "#") -> list[str]:
    """What is malformed in the JSON Schema objects under ``node``: an unknown ``type``, a
    ``required`` name that is not a property, ``properties`` or ``items`` that are not schemas.
    (The checks of openapi-spec-validator that matter here, without the extra dependency.)"""
    problems: list[str] = []
    if isinstance(node, list):
        for n, value in enumerate(node):
            problems += schema_problems(value, f"{where}/{n}")
        return problems
    if not isinstance(node, dict):
        return problems
    kind = node.get("type")
    kinds = kind if isinstance(kind, list) else [kind] if kind is not None else []
    problems += [f"{where}: unknown type {k!r}" for k in kinds if k not in JSON_SCHEMA_TYPES]
    properties = node.get("properties")
    if properties is not None and not isinstance(properties, dict):
        problems.append(f"{where}: properties is not an object")
    elif isinstance(node.get("required"), list) and node.get("type") == "object":
        missing = sorted(set(node["required"]) - set(properties or {}))
        problems += [f"{where}: required {name!r} is not a property" for name in missing]
    if "items" in node and not isinstance(node["items"], dict):
        problems.append(f"{where}: items is not a schema")
    for key, value in node.items():
        problems += schema_problems(value, f"{where}/{key}")
    return problems


def test_every_schema_in_the_document_is_well_formed(schema):
    assert schema_problems(schema["components"]["schemas"]) == []
    assert schema_problems(schema["paths"]) == []
    # The check bites: a required field that is no property and a made-up type are found.
    broken = json.loads(json.dumps(schema["components"]["schemas"]))
    broken["PublishResultOut"]["required"] = ["messageId", "noSuchField"]
    broken["PublishResultOut"]["properties"]["status"]["type"] = "text"
    assert schema_problems(broken) == [
        "#/PublishResultOut: required 'noSuchField' is not a property",
        "#/PublishResultOut/properties/status: unknown type 'text'",
    ]


@pytest.mark.django_db
def test_the_schema_is_served_as_json(client):
    response = client.get(f"{PREFIX}/openapi.json")

    assert response.status_code == 200
    assert (
        response.json()["paths"].keys()
        == api.get_openapi_schema(path_prefix=PREFIX)["paths"].keys()
    )


def _docs_page(client: Any) -> tuple[str, list[str]]:
    """The docs page and every URL it loads (src and href attributes)."""
    response = client.get(f"{PREFIX}/docs")
    assert response.status_code == 200
    html = response.content.decode()
    return html, re.findall(r"""(?:src|href)\s*=\s*["']([^"']+)["']""", html)


def _assert_served_here(client: Any, html: str, urls: list[str]) -> None:
    # No absolute URL of any host, not even scheme-relative: an air-gapped network reaches none.
    assert not re.search(r"https?:|//[a-z0-9]", html, re.IGNORECASE), html
    assert '"validatorUrl": null' in html  # Swagger UI would otherwise call validator.swagger.io
    assert {url.rsplit("/", 1)[-1] for url in urls} == docs.ASSETS
    for url in urls:
        assert url.startswith(f"{PREFIX}/docs/assets/")
        response = client.get(url)
        assert response.status_code == 200, url
        name = url.rsplit("/", 1)[-1]
        assert b"".join(response.streaming_content) == (docs.ASSET_DIRECTORY / name).read_bytes()


@pytest.mark.django_db
def test_the_docs_page_loads_swagger_ui_from_this_server_and_no_other_host(client):
    html, urls = _docs_page(client)

    assert "swagger-ui" in html
    assert f"{PREFIX}/openapi.json" in html
    _assert_served_here(client, html, urls)


@pytest.mark.django_db
def test_the_docs_page_needs_neither_ninja_nor_staticfiles_in_installed_apps(client, settings):
    settings.INSTALLED_APPS = [
        app for app in settings.INSTALLED_APPS if app not in {"ninja", "django.contrib.staticfiles"}
    ]
    html, urls = _docs_page(client)

    _assert_served_here(client, html, urls)


@pytest.mark.django_db
def test_the_docs_pages_settings_cannot_end_their_script_element(client, monkeypatch):
    """Review helper-143: the settings went into the page as JSON with |safe, as django-ninja's
    own page writes them, so a value holding "</script>" ended the element and what followed
    was markup. Seen failing: the page held <script>alert(1)</script>."""
    hostile = "</script><script>alert(1)</script><!--"
    monkeypatch.setitem(api.docs.settings, "docExpansion", hostile)

    html, _ = _docs_page(client)

    assert "<script>alert(1)" not in html
    found = re.search(
        r'<script id="swagger-settings" type="application/json">(.*?)</script>', html, re.S
    )
    assert found is not None
    settings = json.loads(found.group(1))
    assert settings["docExpansion"] == hostile
    assert settings["url"] == f"{PREFIX}/openapi.json"


@pytest.mark.django_db
def test_only_swagger_uis_own_files_are_served(client):
    for name in ("redoc.standalone.js", "..%2F..%2F__init__.py", "swagger-ui-bundle.js.map"):
        assert client.get(f"{PREFIX}/docs/assets/{name}").status_code == 404, name
    assert "/docs/assets/" not in json.dumps(api.get_openapi_schema(path_prefix=PREFIX))


def test_export_openapi_schema_writes_the_document():
    out = io.StringIO()

    call_command("export_openapi_schema", "--api", "workqueue.api.api", stdout=out)

    exported = json.loads(out.getvalue())
    assert exported["components"]["securitySchemes"]
