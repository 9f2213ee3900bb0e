"""Fuzzing the HTTP API from its own /openapi.json with schemathesis: no 5xx, no response outside its schema.

Bounded for the default run: a tiny random Llama (steps take milliseconds), max_model_len 128, at
most 4 choices and 8 sequences per request, FUZZ_EXAMPLES examples per operation (default 8).
`scripts/fuzz_api.sh` runs the longer fuzz against `tokenfab serve` on the bundled model.
"""
from __future__ import annotations

import os

import pytest

schemathesis = pytest.importorskip("schemathesis", reason="schemathesis (the test extra) is not installed")

from hypothesis import HealthCheck, Phase, settings  # noqa: E402
from schemathesis.checks import (  # noqa: E402
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from tests.oracle import make_tiny_model  # noqa: E402
from tokenfab import LLM  # noqa: E402
from tokenfab.server.app import build_app  # noqa: E402
from tokenfab.server.config import ServerConfig  # noqa: E402
from tokenfab.server.launch import ServerThread  # noqa: E402

pytestmark = pytest.mark.timeout(600)
EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "8"))
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory, bundled_tokenizer):
    folder = tmp_path_factory.mktemp("fuzz-llama")
    make_tiny_model("llama", str(folder), bundled_tokenizer)
    llm = LLM(model=str(folder), max_model_len=128, num_kv_blocks=128, block_size=16)
    app = build_app(llm.engine, ServerConfig(access_log=False, max_n=4, max_request_sequences=8,
                                             served_model_names=["tiny"]))
    with ServerThread(app) as srv:
        yield srv.url
    assert llm.engine.block_manager.num_used_blocks() == 0


@pytest.fixture(scope="module")
def api_schema(fuzz_server):
    return schemathesis.openapi.from_url(fuzz_server + "/openapi.json")


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, phases=[Phase.explicit, Phase.generate],
          suppress_health_check=list(HealthCheck))
def test_fuzzed_requests_get_no_5xx_and_responses_match_the_spec(case):
    case.call_and_validate(checks=CHECKS, timeout=120)
