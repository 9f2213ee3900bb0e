"""The web page's routes without a browser: served at / without a key while the API keeps its key,
`--no-ui` leaves it out, and /doctor answers (and refuses bad input with 400s)."""
import pytest
from fastapi.testclient import TestClient

from tokenfab.cli import build_parser
from tokenfab.server.app import build_app
from tokenfab.server.cli import server_config_from_args
from tokenfab.server.config import ServerConfig


@pytest.fixture(scope="module")
def keyed(bundled_llm):
    # No lifespan (no `with`): these routes never reach the engine loop.
    return TestClient(build_app(bundled_llm.engine, ServerConfig(api_keys=["sesame"], access_log=False)))


def test_page_and_assets_need_no_key_but_the_api_and_doctor_do(keyed):
    page = keyed.get("/")
    assert page.status_code == 200 and "<title>tokenfab</title>" in page.text and "sesame" not in page.text
    for asset in ("/ui/app.js", "/ui/style.css", "/ui/vendor/uplot/uPlot.iife.min.js", "/ui/vendor/uplot/LICENSE"):
        assert keyed.get(asset).status_code == 200, asset
    assert keyed.get("/v1/models").status_code == 401
    assert keyed.get("/doctor").status_code == 401
    assert keyed.get("/ui/../v1/models").status_code in (401, 404)   # no way around the key via the prefix


def test_no_ui_flag_leaves_the_page_out(bundled_llm):
    args = build_parser().parse_args(["serve", "--no-ui"])
    assert server_config_from_args(args).ui is False
    assert server_config_from_args(build_parser().parse_args(["serve"])).ui is True
    client = TestClient(build_app(bundled_llm.engine, ServerConfig(ui=False, access_log=False)))
    assert client.get("/").status_code == 404 and client.get("/ui/app.js").status_code == 404
    assert client.get("/version").status_code == 200


def test_doctor_endpoint_answers_and_refuses_bad_input(keyed):
    auth = {"Authorization": "Bearer sesame"}
    doc = keyed.get("/doctor", headers=auth).json()
    assert doc["findings"] == [] and doc["measured"]["config"]["max_num_seqs"] > 0
    assert any("idle" in n for n in doc["notes"])
    r = keyed.get("/doctor", params={"hardware": "no-such-gpu"}, headers=auth)
    assert r.status_code == 400 and r.json()["error"]["param"] == "hardware"
    r = keyed.post("/doctor", json={"bench": {"schema": "nope"}}, headers=auth)
    assert r.status_code == 400 and r.json()["error"]["param"] == "bench"
    r = keyed.post("/doctor", content=b"[1, 2]", headers=auth)
    assert r.status_code == 400
    r = keyed.get("/doctor", params={"hardware": "dev-vm-2core"}, headers=auth)
    assert r.status_code == 200 and r.json()["hardware"] == "dev-vm-2core"
