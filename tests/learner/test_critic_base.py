"""model.critic_path: a critic whose backbone is another (here larger) model than the policy, as large
critics are used in practice; it must read the policy's token ids, or its values would be noise."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from common.config import ConfigError
from common.modeling import CHARSET, build_char_tokenizer, build_tiny_qwen2, save_hf
from learner.models import check_critic_base, load_critic_module, save_critic
from learner.synthetic import synth_groups
from learner.train import Learner
from tests.learner.train_fixtures import VOCAB, make_cfg

WIDE = dict(hidden_size=48, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=96)


def _save(path: Path, tok: object = None, vocab: int | None = None, positions: int = 256) -> Path:
    tok = tok or build_char_tokenizer()
    model = build_tiny_qwen2(vocab or len(tok), max_position_embeddings=positions, seed=3, **WIDE)
    return save_hf(model, tok, path)


@pytest.fixture(scope="module")
def wide_critic_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer, 48-wide model on the tiny policy's tokenizer (the policy: 1 layer, 32 wide)."""
    return _save(tmp_path_factory.mktemp("critic") / "wide")


def test_the_critic_is_built_from_critic_path_and_reads_the_policys_tokens(tiny_model_dir: Path,
                                                                          wide_critic_dir: Path,
                                                                          tmp_path: Path) -> None:
    cfg = make_cfg(tiny_model_dir, f"model.critic_path={wide_critic_dir}")
    critic = load_critic_module(cfg)
    assert critic.backbone.config.hidden_size == 48 and critic.backbone.config.num_hidden_layers == 2
    assert critic.value_head.in_features == 48
    assert load_critic_module(make_cfg(tiny_model_dir)).value_head.in_features == 32  # empty: the policy's base
    x = torch.randint(3, VOCAB, (2, 9))
    v = critic(x, torch.ones_like(x))
    assert v.shape == (2, 9) and torch.isfinite(v).all()
    # A saved critic (value pretraining's output, a checkpoint) is loaded from its own directory as it is.
    with torch.no_grad():
        critic.value_head.weight.normal_()
    again = load_critic_module(cfg, save_critic(critic, tmp_path / "saved"))
    assert again.value_head.in_features == 48
    assert torch.allclose(again(x, torch.ones_like(x)), critic(x, torch.ones_like(x)))


def test_a_learner_step_trains_the_larger_critic(tiny_model_dir: Path, wide_critic_dir: Path) -> None:
    """One RL step with the wide critic: its value head (zero at init) receives the critic loss's gradient,
    and the policy keeps its own shape."""
    learner = Learner(make_cfg(tiny_model_dir, f"model.critic_path={wide_critic_dir}",
                               "learner.value_head_init_std=0"), None)
    head = learner.critic.module.value_head
    assert float(head.weight.detach().abs().sum()) == 0.0
    learner.step(synth_groups(4, 4, VOCAB, seed=9))
    assert torch.isfinite(torch.tensor(learner.last["critic_loss"]))
    assert float(head.weight.detach().abs().sum()) > 0.0  # Adam moved it: the gradient was not zero
    assert learner.policy.module.config.hidden_size == 32


@pytest.mark.parametrize("problem", ["vocabulary", "vocab_size", "context"])
def test_a_critic_base_that_cannot_read_the_policys_tokens_is_refused(tiny_model_dir: Path, tmp_path: Path,
                                                                      problem: str) -> None:
    tok = build_char_tokenizer()
    if problem == "vocabulary":  # same size, two characters swapped: every id still embeds, but the wrong token
        charset = list(CHARSET)
        charset[0], charset[1] = charset[1], charset[0]
        other = _save(tmp_path / "m", build_char_tokenizer(charset), vocab=len(tok))
    elif problem == "vocab_size":
        other = _save(tmp_path / "m", vocab=len(tok) - 1)
    else:
        other = _save(tmp_path / "m", positions=128)
    expected = {"vocabulary": "vocabulary differs", "vocab_size": "vocab_size", "context": "max_position_embeddings"}
    with pytest.raises(ConfigError, match=expected[problem]):
        check_critic_base(tiny_model_dir, other)
    with pytest.raises(ConfigError, match="model.critic_path"):
        load_critic_module(make_cfg(tiny_model_dir, f"model.critic_path={other}"))
    check_critic_base(tiny_model_dir, tiny_model_dir)  # the policy's own base passes
