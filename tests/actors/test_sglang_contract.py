"""rollout_server against the SGLang contract captured from the real server (``ops/sglang_cpu/contract.py``):
the same conversation, the same statuses, every field vapo reads with the same type, the same messages where
vapo or an operator acts on them. The live server is held to its own capture in ``test_sglang_live.py``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ops.sglang_cpu.contract import FIXTURE, conversation, violations
from tests.actors.actor_harness import REPO
from tests.actors.servers import start_rollout_server

BASE = REPO / "ops" / "bases" / "addition-tiny"
KEY = "contract-key"
# Where rollout_server's default mode knowingly differs from SGLang (its --imitate-sglang mode does not):
# it reports per-token versions as output_weight_version_spans, and it keeps no prefix cache, so a weight
# update never has a cache flush to refuse.
DEFAULT_MODE_DEVIATIONS = (
    "generate_single: no field meta_info.weight_versions.",
    "update_weights_from_disk_flush_refused: ",
)


@pytest.fixture(scope="module")
def reference() -> dict:
    return json.loads(FIXTURE.read_text())


@pytest.mark.parametrize("mode", ["imitate_sglang", "default"])
def test_rollout_server_keeps_the_contract_captured_from_sglang(reference: dict, tmp_path: Path, mode: str) -> None:
    extra = ["--imitate-sglang", "--enable-metrics"] if mode == "imitate_sglang" else []
    server = start_rollout_server(BASE, tmp_path, "--admin-api-key", KEY, "--weight-version", "0", *extra)
    try:
        records = conversation(server.url, KEY, BASE)
    finally:
        server.stop()
    found = violations(records, reference)
    if mode == "default":
        found = [v for v in found if not v.startswith(DEFAULT_MODE_DEVIATIONS)]
    assert found == []


def test_violations_name_a_changed_status_a_missing_field_and_a_changed_message(reference: dict) -> None:
    records = json.loads(json.dumps(reference))
    assert violations(records, reference) == []
    records["begin_weight_update_twice"]["status"] = 200
    del records["generate_single"]["body"]["meta_info"]["weight_version"]
    records["end_weight_update_without_session"]["body"]["message"] = "no session"
    records["model_info"]["body"]["weight_version"] = 3  # a number where SGLang sends a string
    assert violations(records, reference) == [
        "model_info: weight_version is number, the real server's is str",
        "generate_single: no field meta_info.weight_version",
        "begin_weight_update_twice: status 200, the real server answers 400",
        "end_weight_update_without_session: message 'no session', the real server's "
        "'no weight-update session is open; call begin_weight_update() first'",
    ]
