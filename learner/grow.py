"""Grow a decoder deeper without changing what it computes (block expansion): a critic larger than the
policy when no larger pretrained model with the policy's tokenizer is at hand (``model.critic_path``).

    python -m learner.grow ops/bases/chain-tiny runs/bases/chain-tiny-x2 --layers 6

The source's layers are kept in order and copies are inserted after them, spread evenly. In each copy the
attention output projection and the MLP down projection are zero, so both residual branches of that
pre-norm block add zero and the block is the identity: the grown model's logits equal the source's (the test
checks it), and its surprise features (``learner.value_head_surprise``, read through its own LM head) are the
source's on the first step. The copies' other weights are the source layer's rather than fresh random ones,
so a block computes useful features as soon as its output projections move off zero (the block expansion of
LLaMA Pro, arXiv 2401.02415). They move off zero at about the critic's lr per Adam step, which at a
near-frozen backbone lr (1e-5) leaves them at a few percent of a trained block's scale for a whole study:
``learner.critic_grown_lr_scale`` gives the inserted layers (``inserted_layers``, from ``grow.json``) their own
rate (``lr_groups``). A truly larger pretrained critic (the common practice: a bigger model of the
same family) needs no tool: point ``model.critic_path`` at it.

Writes an HF directory (weights, config, the source's tokenizer) atomically, with ``grow.json`` recording
the source, its checksum, the layer plan and both parameter counts. Qwen2/Llama-style decoders only
(``model.layers[i].self_attn.o_proj``, ``mlp.down_proj``).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

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


def grow_model(model: PreTrainedModel, n_layers: int) -> PreTrainedModel:
    """A new ``n_layers``-layer model of ``model``'s class computing the same function (see the module doc)."""
    src_config: Any = model.config  # the model's own config class (PretrainedConfig's type names none of its fields)
    cfg = src_config.__class__.from_dict(src_config.to_dict())
    plan = expansion_plan(cfg.num_hidden_layers, n_layers)
    cfg.num_hidden_layers = n_layers
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = [src_config.layer_types[i] for i, _ in plan]
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


def inserted_layers(model_dir: str | Path) -> set[int]:
    """Indices of the layers ``grow`` inserted into the model in ``model_dir`` (from its ``grow.json``; empty
    for a model ``grow`` did not write)."""
    info = Path(model_dir) / "grow.json"
    if not info.is_file():
        return set()
    return {j for j, step in enumerate(json.loads(info.read_text())["plan"]) if step["identity"]}


_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def lr_groups(named: list[tuple[str, torch.nn.Parameter]], lr: float, head_lr_scale: float, grown: set[int],
              grown_lr_scale: float) -> list[dict[str, Any]]:
    """A critic's optimizer groups: the surprise MLP at ``lr * head_lr_scale``, the layers in ``grown`` at
    ``lr * grown_lr_scale``, the rest at ``lr`` (empty groups left out). Inserted blocks need their own rate:
    their output projections start at zero and Adam moves a weight by about lr per step, so at the backbone's
    near-frozen lr they stay a few percent of a trained block's scale for a whole study."""
    groups: dict[float, list[torch.nn.Parameter]] = {}
    for name, p in named:
        layer = _LAYER.search(name)
        scale = (head_lr_scale if name.startswith("surprise_head.")
                 else grown_lr_scale if layer is not None and int(layer.group(1)) in grown else 1.0)
        groups.setdefault(lr * scale, []).append(p)
    return [{"params": ps, "lr": group_lr} for group_lr, ps in groups.items()]


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
