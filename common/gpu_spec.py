"""GPU lists of the placement keys (``placement.engine_gpus``, ``placement.learner_gpus``) and GPUs per engine,
shared by the placement plan (``common.placement``) and the SGLang command lines (``common.sglang_args``)."""

from __future__ import annotations

from common.config import Config, ConfigError


def parse_gpus(spec: str, key: str) -> list[int]:
    """'0-3,8,10-11' -> [0, 1, 2, 3, 8, 10, 11]; ConfigError naming ``key`` on anything else or repeats."""
    out: list[int] = []
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        try:
            if "-" in part:
                lo, hi = (int(x) for x in part.split("-", 1))
                if hi < lo:
                    raise ValueError
                out.extend(range(lo, hi + 1))
            else:
                out.append(int(part))
        except ValueError:
            raise ConfigError(f"{key}: {spec!r} is not a GPU list like '0-3' or '0,2,5-7'") from None
    if any(g < 0 for g in out):
        raise ConfigError(f"{key}: GPU indices must be >= 0")
    if len(set(out)) != len(out):
        raise ConfigError(f"{key}: {spec!r} names a GPU twice")
    return out


def engine_tp(cfg: Config) -> int:
    """GPUs per engine: SGLang's tensor-parallel size; our rollout_server uses one device."""
    return cfg.engine.sglang_tp_size if cfg.engine.kind == "sglang" else 1
