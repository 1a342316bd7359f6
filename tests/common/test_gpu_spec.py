"""common.gpu_spec: GPU lists as the placement keys write them, refused by key when malformed; GPUs per engine."""

from __future__ import annotations

import pytest

from common.config import Config, ConfigError
from common.gpu_spec import engine_tp, parse_gpus


@pytest.mark.parametrize(
    "spec, gpus",
    [("0-3,8,10-11", [0, 1, 2, 3, 8, 10, 11]), ("5", [5]), (" 2 , 0 ", [2, 0]), ("", []), ("1-1,", [1])],
)
def test_ranges_and_single_gpus_in_the_order_written(spec: str, gpus: list[int]) -> None:
    assert parse_gpus(spec, "placement.engine_gpus") == gpus


@pytest.mark.parametrize(
    "spec, needle",
    [("3-1", "is not a GPU list"), ("a", "is not a GPU list"), ("0-2,2", "names a GPU twice"),
     ("-1", "is not a GPU list"), ("1--2", "is not a GPU list")],
)
def test_malformed_lists_name_the_key(spec: str, needle: str) -> None:
    with pytest.raises(ConfigError, match=rf"^placement\.learner_gpus: .*{needle}"):
        parse_gpus(spec, "placement.learner_gpus")


def test_an_sglang_engine_spans_its_tensor_parallel_gpus_a_rollout_server_one() -> None:
    cfg = Config()
    cfg.engine.sglang_tp_size = 4
    cfg.engine.kind = "sglang"
    assert engine_tp(cfg) == 4
    cfg.engine.kind = "rollout_server"
    assert engine_tp(cfg) == 1
