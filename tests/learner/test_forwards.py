"""learner.forwards: packed and padded micro-batches give the same log-probs, entropies and values; the LM head is
one module call per micro-batch and pass whatever its chunk count (what keeps ZeRO-3's trace complete)."""

from __future__ import annotations

from pathlib import Path

import torch

from learner.batch import collate
from learner.forwards import critic_values, policy_logprobs
from learner.schedule import Micro, MicroLimits
from learner.synthetic import synth_groups
from learner.train import Learner
from tests.learner.train_fixtures import VOCAB, make_cfg


def _batch():
    return collate(synth_groups(3, 3, VOCAB, seed=4, resp_len=(1, 30), max_new_tokens=30), pad_id=0)


def test_packed_and_padded_logprobs_entropies_and_gradients_agree(tiny_model_dir: Path) -> None:
    learner = Learner(make_cfg(tiny_model_dir), None)
    b = _batch()
    rows = torch.tensor([4, 0, 7, 2])
    out = {}
    for packed in (False, True):
        lim = MicroLimits(logit_elements=3 * VOCAB, packed=packed)  # 3 tokens per LM-head chunk
        learner.policy.module.zero_grad()
        logp, ent, sub = policy_logprobs(learner.policy, b, Micro(rows, 1.0, packed), lim, entropy=True)
        learner.policy.backward((logp * sub.mask).sum(), scale_wrt_gas=False)
        grad = torch.cat([p.grad.flatten() for p in learner.policy.module.parameters() if p.grad is not None])
        out[packed] = (logp, ent, grad)
    assert out[False][0].shape == (4, int(b.lengths[rows].max()))
    for a, c in zip(out[False], out[True], strict=True):
        assert torch.allclose(a, c, atol=1e-5)
    # The log-probs are of the sampled tokens under the model (not zeros): padding slots alone are 0.
    assert bool((out[True][0] * b.select(rows).mask).abs().sum() > 1.0)


def test_the_lm_head_is_called_once_per_micro_batch_and_pass(tiny_model_dir: Path) -> None:
    learner = Learner(make_cfg(tiny_model_dir), None)
    b = _batch()
    head = learner.policy.module.get_output_embeddings()
    calls = [0]
    head.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    for elements in (VOCAB, 7 * VOCAB, 1 << 20):  # one token a chunk, seven, all at once
        for packed in (False, True):
            calls[0] = 0
            lim = MicroLimits(logit_elements=elements, packed=packed)
            logp, _, _ = policy_logprobs(learner.policy, b, Micro(torch.arange(b.size), 1.0, packed), lim)
            learner.policy.backward(logp.sum(), scale_wrt_gas=False)
            assert calls[0] == 1, (elements, packed, calls[0])


def test_packed_and_padded_values_agree_with_the_surprise_head(tiny_model_dir: Path) -> None:
    learner = Learner(make_cfg(tiny_model_dir, "learner.value_head_surprise=true"), None)
    torch.manual_seed(0)
    with torch.no_grad():  # the MLP's last layer starts at zero: give it weight so its features show
        learner.critic.module.surprise_head[2].weight.normal_(0.0, 1.0)
    b = _batch()
    rows = torch.tensor([8, 1, 5])
    padded = critic_values(learner.critic, b, Micro(rows, 1.0, False))
    packed = critic_values(learner.critic, b, Micro(rows, 1.0, True))
    m = b.select(rows).mask
    assert torch.allclose(padded * m, packed * m, atol=1e-5)
    # The running minimum restarts per row: the values differ from those of a head without surprise features.
    with torch.no_grad():
        learner.critic.module.surprise_head[2].weight.zero_()
    plain = critic_values(learner.critic, b, Micro(rows, 1.0, True))
    assert float(((plain - packed) * m).abs().max()) > 1e-3
