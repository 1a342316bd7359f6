"""learner.sft: a few-step bootstrap is deterministic and saves a model the HF Auto classes load."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from common.config import load_config
from common.tasks import decode_response, encode_prompt, get_task
from common.tasks.addition import teacher_response
from learner.sft import BatchMaker, main, run, train

TINY = [
    "model.bootstrap.hidden_size=32", "model.bootstrap.num_layers=1", "model.bootstrap.num_heads=2",
    "model.bootstrap.num_kv_heads=1", "model.bootstrap.intermediate_size=64", "model.bootstrap.max_steps=6",
    "model.bootstrap.batch_size=8", "model.bootstrap.threads=1", "task.eval_size=8", "task.max_digits=3",
    "actors.max_new_tokens=40",
]


def test_batches_train_only_on_response_tokens_and_cover_the_stream() -> None:
    cfg = load_config(None, TINY)
    from common.modeling import build_char_tokenizer

    tok, task = build_char_tokenizer(), get_task(cfg.task)
    make = BatchMaker(tok, task, 4, 0, 0.0, group=3)  # type: ignore[arg-type]
    seen: list[int] = []
    widths = []
    for step in range(6):
        ids, mask, idx = make(step)
        widths.append(ids.shape[1])
        seen.extend(idx)
        for i, j in enumerate(idx):
            p = task.train_prompt(j)
            plen = len(encode_prompt(tok, p))
            targets = ids[i, 1:][mask[i].bool()].tolist()
            assert targets[-1] == tok.eos_token_id
            assert decode_response(tok, targets) == teacher_response(p)
            assert mask[i, : plen - 1].sum() == 0
    assert sorted(seen) == list(range(24))  # every prompt exactly once, grouped by length
    assert make(1)[2] == BatchMaker(tok, task, 4, 0, 0.0, group=3)(1)[2]


def test_chain_task_bootstraps_from_its_own_teacher() -> None:
    # learner.sft takes the teacher from the task, so the long-horizon task trains on its own traces.
    from common.modeling import build_char_tokenizer
    from common.tasks.chain import teacher_response as chain_teacher

    cfg = load_config(None, [*TINY, "task.name=chain", "task.max_steps=8"])
    tok, task = build_char_tokenizer(), get_task(cfg.task)
    ids, mask, idx = BatchMaker(tok, task, 3, 0, 0.0)(0)
    for i, j in enumerate(idx):
        targets = ids[i, 1:][mask[i].bool()].tolist()
        assert decode_response(tok, targets) == chain_teacher(task.train_prompt(j))
    m, _, stats = train(load_config(None, [*TINY, "task.name=chain", "task.max_steps=8", "model.bootstrap.max_steps=2"]),
                        log=lambda _: None)
    assert stats["steps"] == 2
    # Tasks without a teacher are refused with a pointer to what to do instead.
    with pytest.raises(ValueError, match="point model.path at a pretrained HF model"):
        train(load_config(None, [*TINY, "task.name=reasoning_gym:basic_arithmetic"]), log=lambda _: None)


def test_sft_is_deterministic_given_the_seed() -> None:
    cfg = load_config(None, [*TINY, "model.bootstrap.eval_k=0"])
    m1, _, s1 = train(cfg, log=lambda _: None)
    m2, _, _ = train(cfg, log=lambda _: None)
    assert s1["steps"] == 6 and not s1["stopped_by_time_cap"]
    for (n, a), (_, b) in zip(m1.state_dict().items(), m2.state_dict().items(), strict=True):
        assert torch.equal(a, b), n
    other = load_config(None, [*TINY, "model.bootstrap.seed=1"])
    m3, _, _ = train(other, log=lambda _: None)
    assert not torch.equal(m1.state_dict()["model.embed_tokens.weight"], m3.state_dict()["model.embed_tokens.weight"])


def test_sft_saves_a_loadable_model_with_stats(tmp_path: Path) -> None:
    out = tmp_path / "base"
    cfg = load_config(None, [*TINY, f"model.path={out}", "model.bootstrap.eval_k=2"])
    stats = run(cfg, log=lambda _: None)
    model = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    assert sum(p.numel() for p in model.parameters()) == stats["parameters"]
    assert tok.decode(tok.encode("Q:1+2\n", add_special_tokens=False)) == "Q:1+2\n"
    info = json.loads((out / "vapo_info.json").read_text())["bootstrap"]
    assert info["steps"] == 6 and 0.0 <= info["eval"]["avg_at_k"] <= 1.0 and info["eval"]["k"] == 2
    assert not (tmp_path / "base.tmp").exists()


def test_cli_help_and_bad_config(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0 and "model.bootstrap" in capsys.readouterr().out
    assert main(["model.bootstrap.nope=1"]) == 2
    assert "model.bootstrap.nope" in capsys.readouterr().err
    assert main(["task.name=jsonl:/no/such.jsonl"]) == 2
    assert "not found" in capsys.readouterr().err


def test_sft_writes_a_manifest_that_names_what_built_the_base(tmp_path: Path) -> None:
    from common.checksum import weights_sha256

    out = tmp_path / "base"
    assert main([*TINY, f"model.path={out}", "model.bootstrap.eval_k=2"]) == 0
    m = json.loads((out / "manifest.json").read_text())
    info = json.loads((out / "vapo_info.json").read_text())["bootstrap"]
    assert m["name"] == "base" and m["sha256"] == weights_sha256(out)
    assert m["command"].startswith("python -m learner.sft ") and f"model.path={out}" in m["command"]
    assert m["config"]["bootstrap"]["max_steps"] == 6 and m["config"]["task"]["max_digits"] == 3
    assert m["heldout"]["avg@2"] == info["eval"]["avg_at_k"] and m["heldout"]["greedy"] == info["eval"]["greedy_accuracy"]
    assert m["machine"]["cpu"]["model"] and m["machine"]["versions"]["torch"] == torch.__version__
    assert m["machine"]["threads"]["bootstrap"] == 1 and m["sft"]["steps"] == 6
    # A shorter check build of the same base is recorded in the base's manifest for the rebuild test.
    check = tmp_path / "check"
    assert main([*TINY, f"model.path={check}", "model.bootstrap.eval_k=2", "--stop-after", "3",
                 f"--record-check={out}"]) == 0
    rc = json.loads((out / "manifest.json").read_text())["rebuild_check"]
    assert rc["overrides"] == [*TINY, "model.bootstrap.eval_k=2"] and rc["stop_after"] == 3
    assert rc["sha256"] == weights_sha256(check) and rc["sft"]["steps"] == 3
    assert json.loads((out / "manifest.json").read_text())["sha256"] == weights_sha256(out)  # the rest unchanged


def test_stop_after_cuts_the_same_schedule_short() -> None:
    cfg = load_config(None, [*TINY, "model.bootstrap.eval_k=0", "model.bootstrap.max_steps=8"])
    m1, _, s1 = train(cfg, log=lambda _: None, stop_after=3)
    short = load_config(None, [*TINY, "model.bootstrap.eval_k=0", "model.bootstrap.max_steps=3"])
    m2, _, s2 = train(short, log=lambda _: None)
    assert s1["steps"] == s2["steps"] == 3 and s1["max_steps"] == 8 and s1["stop_after"] == 3
    # Three steps of an 8-step schedule keep a higher learning rate at step 3 than a 3-step schedule.
    w = "model.embed_tokens.weight"
    assert not torch.equal(m1.state_dict()[w], m2.state_dict()[w])
