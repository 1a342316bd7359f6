"""A /generate answer read into ``GenerateOutput`` (SGLang's shape and rollout_server's, recorded in
``tests/actors/fixtures/sglang_api.json``), and SGLang's string weight versions read as vapo's integers.

``GenerateOutput.min_weight_version`` is the oldest version among the output tokens when the server reports
them (SGLang 0.5.23's ``meta_info.weight_versions``: ``[{"version", "start", "end"}, ...]``; rollout_server's
``output_weight_version_spans``: ``[[version, n_tokens], ...]``), else the response's ``weight_version``.
Not a CLI; ``common.sglang_client`` parses every answer through here (and re-exports these names).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class GenerateOutput:
    """One sample of a /generate answer."""

    output_ids: list[int]
    output_logprobs: list[float] | None
    finish_reason: str  # stop | length | abort
    finish_info: dict[str, Any] | None
    weight_version: str | None
    min_weight_version: str | None
    prompt_tokens: int
    completion_tokens: int
    text: str | None = None
    rid: str | None = None
    meta_info: dict[str, Any] = field(default_factory=dict, repr=False)
    # [(version, n_tokens), ...] in token order when the server reports per-token versions and every one is
    # numeric (an update in place mid-generation gives several); else None.
    version_spans: list[tuple[int, int]] | None = None

    @property
    def weight_version_int(self) -> int | None:
        """``min_weight_version`` as an int (None when the server's version is not numeric, e.g. 'default')."""
        return as_int(self.min_weight_version)


def as_int(v: Any) -> int | None:
    """``v`` as an int, None when it is not one (SGLang's 'default' version, a missing field)."""
    try:
        return int(v)
    except (TypeError, ValueError):
        return None


def as_version(v: Any) -> int:
    """SGLang's weight_version is a string ('default' when never set): vapo's versions are its integers,
    0 for one that is not a number (or is negative)."""
    n = as_int(v)
    return 0 if n is None else max(0, n)


def _int_spans(pairs: list[tuple[Any, Any]], n_tokens: int) -> list[tuple[int, int]] | None:
    """``(version, n_tokens)`` spans as ints when every version is a number, every span is non-empty and
    they cover ``n_tokens`` exactly; else None."""
    spans: list[tuple[int, int]] = []
    for v, k in pairs:
        version, count = as_int(v), as_int(k)
        if version is None or not count:
            return None
        spans.append((version, count))
    return spans if spans and sum(k for _, k in spans) == n_tokens else None


def _min_version(versions: list[Any], fallback: Any) -> str | None:
    vals = [str(v) for v in versions if v is not None]
    if not vals:
        return None if fallback is None else str(fallback)
    ints = [as_int(v) for v in vals]
    if all(i is not None for i in ints):
        return str(min(i for i in ints if i is not None))
    return vals[0]  # non-numeric versions: the first token's


def parse_output(item: dict[str, Any]) -> GenerateOutput:
    """One /generate result dict → GenerateOutput; raises ValueError on a shape it does not understand."""
    if not isinstance(item, dict) or "meta_info" not in item or "output_ids" not in item:
        raise ValueError(f"not a /generate result: {str(item)[:200]}")
    meta = item["meta_info"]
    out_ids = item["output_ids"]
    if not isinstance(out_ids, list):
        raise ValueError("output_ids is not a list")
    fr = meta.get("finish_reason")
    if isinstance(fr, dict):
        reason = str(fr.get("type"))
    elif isinstance(fr, str):  # some versions/paths give a bare string
        reason, fr = fr, {"type": fr}
    else:
        reason = "abort"  # an unfinished request only reaches us when it was cut off
    lps = None
    triples = meta.get("output_token_logprobs")
    if triples is not None:
        lps = [t[0] if t[0] is not None else float("nan") for t in triples]
        ids = [t[1] for t in triples]
        if len(ids) != len(out_ids):
            raise ValueError(f"{len(ids)} output logprobs for {len(out_ids)} output tokens")
        if ids != out_ids:
            raise ValueError("output_token_logprobs token ids do not match output_ids")
    version = meta.get("weight_version")
    spans = meta.get("output_weight_version_spans")  # rollout_server extension: [[version, n_tokens], ...]
    sg_spans = meta.get("weight_versions")  # SGLang: [{"version", "start", "end"}, ...]
    pairs: list[tuple[Any, Any]] = []
    if spans:
        min_version = _min_version([v for v, _ in spans], version)
        pairs = [(v, k) for v, k in spans]
    elif sg_spans:
        min_version = _min_version([s.get("version") for s in sg_spans if isinstance(s, dict)], version)
        pairs = [(s.get("version"), end - start) for s in sg_spans if isinstance(s, dict)
                 and (end := as_int(s.get("end"))) is not None and (start := as_int(s.get("start"))) is not None]
    else:
        min_version = None if version is None else str(version)
    version_spans = _int_spans(pairs, len(out_ids))
    # Keep the scalar metadata only: per-token lists stay out of long-lived objects.
    small_meta = {k: v for k, v in meta.items() if not isinstance(v, list)}
    return GenerateOutput(
        output_ids=out_ids, output_logprobs=lps, finish_reason=reason, finish_info=fr,
        weight_version=None if version is None else str(version), min_weight_version=min_version,
        prompt_tokens=int(meta.get("prompt_tokens", 0)),
        completion_tokens=int(meta.get("completion_tokens", len(out_ids))),
        text=item.get("text"), rid=meta.get("id"), meta_info=small_meta, version_spans=version_spans)


def parse_generate_response(body: Any) -> list[GenerateOutput]:
    """A /generate body (one dict or a list of dicts) → outputs in SGLang's order (prompt-major with n)."""
    items = body if isinstance(body, list) else [body]
    return [parse_output(x) for x in items]
