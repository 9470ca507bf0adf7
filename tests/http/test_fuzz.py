"""Property-based fuzzing of every endpoint from the server's own OpenAPI schema (schemathesis): no input
the schema allows or forbids makes the server answer 5xx, and every answer conforms to the schema."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.specs.openapi.checks import response_schema_conformance

from tests.helpers import factories
from tests.helpers.server import ServerProcess
from tserve.service.app import build_app
from tserve.service.settings import Settings


@pytest.fixture(scope="module")
def fuzzed_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    models = factories.tiny_model_set(root)
    args = factories.model_flags(models)
    srv = ServerProcess([*args, "--max-attention-floats", "20000"], root / "server.log").wait_ready()
    yield srv
    srv.stop()


# The schema comes from the app itself (no server needed to collect the tests); the calls go to a real one.
schema = schemathesis.openapi.from_dict(build_app(Settings(), load_models=False).openapi())


@schema.parametrize()
@settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_server_errors_and_schema_conformance(case, fuzzed_server):
    response = case.call(base_url=fuzzed_server.url, timeout=60)
    assert response.status_code < 500, (case.method, case.path, case.body, response.text[:300])
    case.validate_response(response, checks=[response_schema_conformance])
