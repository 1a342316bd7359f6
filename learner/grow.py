"""Grow a decoder deeper without changing what it computes (block expansion): a critic larger than the
policy when no larger pretrained model with the policy's tokenizer is at hand (``model.critic_path``).

    python -m learner.grow ops/bases/chain-tiny runs/bases/chain-tiny-x2 --layers 6

The source's layers are kept in order and copies are inserted after them, spread evenly. In each copy the
attention output projection and the MLP down projection are zero, so both residual branches of that
pre-norm block add zero and the block is the identity: the grown model's logits equal the source's (the test
checks it), and its surprise features (``learner.value_head_surprise``, read through its own LM head) are the
source's on the first step. The copies' other weights are the source layer's rather than fresh random ones,
so a block computes useful features as soon as its output projections move off zero (the block expansion of
LLaMA Pro, arXiv 2401.02415). A truly larger pretrained critic (the common practice: a bigger model of the
same family) needs no tool: point ``model.critic_path`` at it.

Writes an HF directory (weights, config, the source's tokenizer) atomically, with ``grow.json`` recording
the source, its checksum, the layer plan and both parameter counts. Qwen2/Llama-style decoders only
(``model.layers[i].self_attn.o_proj``, ``mlp.down_proj``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from common.checksum import weights_sha256
from common.modeling import load_tokenizer


def expansion_plan(n_src: int, n_out: int) -> list[tuple[int, bool]]:
    """For each of ``n_out`` layers: (source layer it copies, whether it is an inserted identity copy).
    Source layer i is followed by ``(i + 1)·k // n_src − i·k // n_src`` copies, k = n_out − n_src."""
    if n_out < n_src or n_src < 1:
        raise ValueError(f"cannot grow {n_src} layers into {n_out}: the target must have at least the source's layers")
    k = n_out - n_src
    plan: list[tuple[int, bool]] = []
    for i in range(n_src):
        plan.append((i, False))
        plan += [(i, True)] * ((i + 1) * k // n_src - i * k // n_src)
    return plan


def grow_model(model: torch.nn.Module, n_layers: int) -> torch.nn.Module:
    """A new ``n_layers``-layer model of ``model``'s class computing the same function (see the module doc)."""
    cfg = model.config.__class__.from_dict(model.config.to_dict())
    plan = expansion_plan(cfg.num_hidden_layers, n_layers)
    cfg.num_hidden_layers = n_layers
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = [model.config.layer_types[i] for i, _ in plan]
    grown = model.__class__(cfg)
    src = model.state_dict()
    state = {k: v for k, v in src.items() if not k.startswith("model.layers.")}
    for j, (i, inserted) in enumerate(plan):
        prefix = f"model.layers.{i}."
        for key, value in src.items():
            if key.startswith(prefix):
                name = key[len(prefix):]
                zero = inserted and name in ("self_attn.o_proj.weight", "mlp.down_proj.weight")
                state[f"model.layers.{j}.{name}"] = torch.zeros_like(value) if zero else value.clone()
    missing, unexpected = grown.load_state_dict(state, strict=False)
    # Tied LM heads are not in the state dict under their own name; anything else missing is a bug.
    if [k for k in missing if k != "lm_head.weight"] or unexpected:
        raise ValueError(f"cannot grow this architecture: missing {missing}, unexpected {unexpected}")
    if cfg.tie_word_embeddings:
        grown.tie_weights()
    return grown


def n_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def grow(src: str | Path, out: str | Path, n_layers: int) -> Path:
    """Write the grown copy of the HF model in ``src`` to ``out`` (refused if ``out`` exists)."""
    src, out = Path(src), Path(out)
    if out.exists():
        raise FileExistsError(f"{out} exists: remove it or choose another directory")
    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    grown = grow_model(model, n_layers)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    grown.save_pretrained(tmp)
    load_tokenizer(src).save_pretrained(tmp)
    info = {"source": str(src), "source_sha256": weights_sha256(src), "layers": n_layers,
            "plan": [{"copies": i, "identity": ins} for i, ins in expansion_plan(model.config.num_hidden_layers, n_layers)],
            "parameters": {"source": n_parameters(model), "grown": n_parameters(grown)}}
    (tmp / "grow.json").write_text(json.dumps(info, indent=1) + "\n")
    tmp.rename(out)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m learner.grow", description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("source", help="HF model directory to grow")
    ap.add_argument("out", help="new directory (must not exist)")
    ap.add_argument("--layers", type=int, required=True, help="layers of the grown model (>= the source's)")
    args = ap.parse_args(argv)
    try:
        out = grow(args.source, args.out, args.layers)
    except (FileExistsError, ValueError, OSError) as e:
        print(f"learner.grow: {e}", file=sys.stderr)
        return 2
    info = json.loads((out / "grow.json").read_text())
    print(f"{out}: {info['parameters']['source']:,} -> {info['parameters']['grown']:,} parameters, {args.layers} layers")
    return 0


if __name__ == "__main__":
    sys.exit(main())
