"""common.sglang_output: SGLang's recorded /generate answers (batched, single, straddling a weight update) and
rollout_server's per-token versions read into GenerateOutput; inconsistent answers refused; string weight
versions as vapo's integers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from common.sglang_output import as_int, as_version, parse_generate_response

# Captured by ops/sglang_cpu/contract.py beside the actors' contract test, which holds rollout_server to it.
FIXTURE = json.loads((Path(__file__).parents[1] / "actors" / "fixtures" / "sglang_api.json").read_text())


# --------------------------------------------------------------------------- shapes
# The fixture is captured from the real SGLang 0.5.23 server (ops/sglang_cpu/contract.py): ids, log-probs and
# timings vary between captures, so these tests read them from the records instead of spelling them out.


def _body(name: str) -> Any:
    """A copy of a recorded answer's JSON body."""
    return json.loads(json.dumps(FIXTURE[name]["body"]))


def test_weight_versions_read_as_vapos_integers() -> None:
    """SGLang's weight_version is a string, 'default' until set: vapo's versions are its integers."""
    assert [as_int(v) for v in ("7", 7, "default", None, "3.5")] == [7, 7, None, None, None]
    assert [as_version(v) for v in ("7", 0, "default", None, "-2", "")] == [7, 0, 0, 0, 0, 0]


def test_parse_batched_fixture_response() -> None:
    rec = FIXTURE["generate_batched"]
    outs = parse_generate_response(_body("generate_batched"))
    prompts, n = rec["request"]["body"]["input_ids"], rec["request"]["body"]["sampling_params"]["n"]
    assert len(outs) == len(prompts) * n == 4
    for k, (o, item) in enumerate(zip(outs, rec["body"], strict=True)):
        meta = item["meta_info"]
        assert o.output_ids == item["output_ids"] and o.completion_tokens == len(o.output_ids) > 0
        assert o.output_logprobs == [t[0] for t in meta["output_token_logprobs"]]
        assert o.finish_reason == meta["finish_reason"]["type"] and o.finish_info == meta["finish_reason"]
        assert o.weight_version == meta["weight_version"] == o.min_weight_version and o.weight_version_int == 0
        assert o.prompt_tokens == len(prompts[k // n]) and o.rid == meta["id"] and o.text == item["text"]
        assert o.version_spans == [(0, len(o.output_ids))]  # from SGLang's weight_versions ranges


def test_parse_single_fixture_response_and_non_numeric_version() -> None:
    item = _body("generate_single")
    (o,) = parse_generate_response(item)
    assert o.output_ids == item["output_ids"] and o.text == item["text"] and o.weight_version_int == 0
    item["meta_info"]["weight_version"] = "default"
    del item["meta_info"]["weight_versions"]
    (o,) = parse_generate_response(item)
    assert o.weight_version == "default" and o.weight_version_int is None


def test_parse_a_response_that_straddled_a_weight_update() -> None:
    """SGLang 0.5.23 (utils/weight_versions.py): per-version token ranges; weight_version is the last range's."""
    (o,) = parse_generate_response(_body("generate_spanning_update"))
    ranges = FIXTURE["generate_spanning_update"]["body"]["meta_info"]["weight_versions"]
    assert len(ranges) == 2 and o.weight_version == ranges[-1]["version"]
    assert o.min_weight_version == ranges[0]["version"] and o.weight_version_int == int(ranges[0]["version"])
    assert o.version_spans == [(int(r["version"]), r["end"] - r["start"]) for r in ranges]
    assert sum(k for _, k in o.version_spans) == len(o.output_ids)


def test_min_weight_version_from_per_token_versions() -> None:
    item = _body("generate_batched")[1]
    n = len(item["output_ids"])
    del item["meta_info"]["weight_versions"]
    item["meta_info"]["output_weight_version_spans"] = [["9", 1], ["10", n - 2], ["11", 1]]  # rollout_server's
    item["meta_info"]["weight_version"] = "11"
    (o,) = parse_generate_response(item)
    assert o.weight_version == "11" and o.min_weight_version == "9" and o.weight_version_int == 9


def test_parse_rejects_inconsistent_logprobs() -> None:
    item = _body("generate_batched")[0]
    n = len(item["output_ids"])
    item["meta_info"]["output_token_logprobs"] = item["meta_info"]["output_token_logprobs"][:n - 1]
    with pytest.raises(ValueError, match=f"output logprobs for {n}"):
        parse_generate_response(item)
    with pytest.raises(ValueError, match="not a /generate result"):
        parse_generate_response({"error": {"message": "x"}})
