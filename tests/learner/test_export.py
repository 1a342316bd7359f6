"""Whole-model export streams: HF files byte-identical to save_pretrained, and under 2-rank ZeRO-3 only rank 0
copies to host and writes while the other rank's memory stays near its shard (measured).

``learner.export``: a checkpoint's policy (ZeRO-0, and a 2-rank bf16 ZeRO-3 one read by one CPU process) is
the published version of its number, tensor for tensor, loads with transformers and is served by the real
SGLang; a damaged checkpoint and an existing ``--out`` are refused."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

import learner.host_tensors as H
import learner.weights as W
from common.checksum import weights_sha256
from common.config import load_config, save_config
from common.modeling import build_char_tokenizer, build_tiny_qwen2, load_model, load_tokenizer, save_hf
from learner import export
from learner.data import ListSource
from learner.runner import Runner
from learner.synthetic import synth_groups
from tests.learner.synth import child_env
from tests.ports import free_port

REPO = Path(__file__).resolve().parents[2]
GATHER, SHARD = 4 << 20, 16 << 20  # bounds the 2-rank export runs with (the model is ~61 MB in fp32)

HARNESS = textwrap.dedent("""
    import ctypes, gc, json, os, re, sys
    from pathlib import Path
    import torch
    from safetensors.torch import save_file
    from transformers import AutoTokenizer
    from common.config import load_config
    from learner.dist import rank
    from learner.models import build_critic, build_policy, save_critic
    import learner.host_tensors as H
    import learner.weights as W
    from learner.host_tensors import load_host_tensors
    from learner.weights import publish_policy
    from learner.value_pretrain import _snapshot

    model, tiny, out = (Path(a) for a in sys.argv[1:4])
    H.GATHER_BYTES, W.SHARD_BYTES = {gather}, {shard}
    me = None
    written = []
    def audit(event, args):  # every Python-level write, mkdir, rename or removal under the test directory
        if me is None or not args or not isinstance(args[0], (str, bytes, os.PathLike)):
            return
        path = os.fsdecode(args[0])
        if not path.startswith(str(out)):
            return
        if event == "open" and not (any(c in str(args[1] or "") for c in "wax+") or (args[2] or 0) & 0o3):
            return
        if event in ("open", "os.mkdir", "os.rename", "os.replace", "os.remove", "os.rmdir", "shutil.rmtree"):
            written.append(f"{{event}} {{path}}")
    sys.addaudithook(audit)

    def status(key):
        return int(re.search(key + r":\\s+(\\d+)", Path("/proc/self/status").read_text()).group(1)) * 1024

    cfg = load_config(None, [f"model.path={{model}}", "learner.zero_stage=3", "metrics.prometheus=false"])
    policy = build_policy(cfg)
    tok = AutoTokenizer.from_pretrained(str(model))
    shard = sum(p.ds_tensor.numel() * p.ds_tensor.element_size() for p in policy.module.parameters())
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # freed heap goes back to the OS: RSS is what is live
    torch.distributed.barrier()
    before = status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM (peak RSS) to the current RSS
    me = rank()
    update = publish_policy(policy, tok if me == 0 else None, out / f"w{{me}}", 1, 2, None)
    peak = status("VmHWM")
    mine, me = list(written), None
    # The critic path: a snapshot held by rank 0 only, loaded back (shifted by 1) into every rank's
    # partition, then saved with every rank gathering and rank 0 alone writing.
    ccfg = load_config(None, [f"model.path={{tiny}}", "learner.zero_stage=3", "metrics.prometheus=false",
                              "learner.value_head_init_std=0.02"])
    critic = build_critic(ccfg)
    snap = _snapshot(critic)
    assert (snap is None) == (rank() != 0), "the snapshot must live on rank 0 only"
    load_host_tensors(critic, {{k: v + 1 for k, v in snap.items()}} if snap is not None else None)
    written.clear()
    me = rank()
    save_critic(critic, out / "critic")
    critic_writes, me = list(written), None
    if rank() == 0:
        save_file({{k: v.contiguous() for k, v in snap.items()}}, str(out / "snapshot.safetensors"))
    (out / f"rank{{rank()}}.json").write_text(json.dumps({{
        "rss_before": before, "peak": peak, "shard_bytes": shard, "writes": mine, "critic_writes": critic_writes,
        "sha256": update.sha256 if update is not None else None}}))
    from learner.dist import exit_process  # no interpreter finalisation: gloo's threads can abort it
    exit_process(0)
""")


def _model(root: Path) -> Path:
    """~15M parameters (61 MB fp32): large enough that a whole-model copy dwarfs allocator noise."""
    tok = build_char_tokenizer()
    model = build_tiny_qwen2(len(tok), hidden_size=512, num_layers=4, num_heads=8, num_kv_heads=2,
                             intermediate_size=2048, seed=3)
    return save_hf(model, tok, root / "mid")


def test_export_is_save_pretrained_byte_for_byte_and_shards_load(tiny_model_dir: Path, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    model, tok = load_model(tiny_model_dir), load_tokenizer(tiny_model_dir)
    ref = tmp_path / "ref"
    model.save_pretrained(ref, safe_serialization=True)
    one = Path(W.write_version(tmp_path / "w", 1, model, tok).path)
    assert weights_sha256(one) == weights_sha256(ref)  # same bytes as save_pretrained, tied lm_head dropped
    assert json.loads((one / "config.json").read_text()) == json.loads((ref / "config.json").read_text())
    assert (one / "generation_config.json").is_file() and (one / "tokenizer.json").is_file()
    monkeypatch.setattr(W, "SHARD_BYTES", 20_000)
    monkeypatch.setattr(H, "GATHER_BYTES", 30_000)
    many = Path(W.write_version(tmp_path / "w", 2, model, tok).path)
    files = json.loads((many / "STABLE").read_text())["files"]
    index = json.loads((many / W.INDEX_NAME).read_text())
    assert len(files) > 2 and sorted(set(index["weight_map"].values())) == files
    assert files[0] == f"model-00001-of-{len(files):05d}.safetensors" and not list(many.glob(".part-*"))
    again = AutoModelForCausalLM.from_pretrained(str(many))
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values(), strict=True))
    # A model whose tensors transformers converts on save (some MoE layouts) goes through save_pretrained.
    monkeypatch.setattr(W, "_needs_conversion", lambda module: True)
    converted = Path(W.write_version(tmp_path / "w", 3, model, tok).path)
    again = AutoModelForCausalLM.from_pretrained(str(converted))
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values(), strict=True))


def test_non_finite_weights_are_never_published(tiny_model_dir: Path, tmp_path: Path) -> None:
    # SGLang would load them silently; the export refuses, and no version directory appears.
    model, tok = load_model(tiny_model_dir), load_tokenizer(tiny_model_dir)
    with torch.no_grad():
        next(iter(model.parameters()))[0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN or Inf"):
        W.write_version(tmp_path / "w", 1, model, tok)
    assert W.complete_versions(tmp_path / "w") == [] and not (tmp_path / "w" / "v1").exists()


def test_two_rank_zero3_export_writes_on_rank0_only_and_streams(tiny_model_dir: Path, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    from learner.models import load_critic_module

    model_dir = _model(tmp_path)
    out = tmp_path / "run"
    out.mkdir()
    harness = tmp_path / "export_harness.py"
    harness.write_text(HARNESS.format(gather=GATHER, shard=SHARD))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), str(harness), str(model_dir), str(tiny_model_dir), str(out)]
    # glibc raises its mmap threshold after the first multi-MB free and then keeps freed blocks in the heap,
    # so RSS would measure the allocator's retention (it grows on every repeated export, and malloc_trim
    # gives it back), not what is live. A fixed threshold gives every tensor >= 64 KiB its own mapping,
    # returned on free. On a GPU the gathers happen in device memory and this does not arise.
    env = child_env(OMP_NUM_THREADS="1", VAPO_DS_SHM="0", MALLOC_MMAP_THRESHOLD_="65536")
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert p.returncode == 0, (p.stdout[-2000:], p.stderr[-4000:])
    r0, r1 = (json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1))

    # Memory: the whole model vs what each rank's peak RSS rose by during the export.
    reference = load_model(model_dir)
    model_bytes = sum(t.numel() * t.element_size() for t in reference.parameters())
    d0, d1 = (r["peak"] - r["rss_before"] for r in (r0, r1))
    print(json.dumps({"model_bytes": model_bytes, "rank0_peak_delta": d0, "rank1_peak_delta": d1,
                      "rank1_shard_bytes": r1["shard_bytes"], "gather_bytes": GATHER, "shard_file_bytes": SHARD}))
    assert r1["shard_bytes"] < 0.6 * model_bytes
    # Rank 1 holds its partition (already resident) plus one gathered group (<= 4 MiB here); gathering the
    # whole model on it would add at least model_bytes.
    assert d1 < 0.25 * model_bytes, (d1, model_bytes)
    # Rank 0 holds one shard file's tensors plus one group (~20 MiB), not the whole model.
    assert d0 < 0.75 * model_bytes, (d0, model_bytes)

    # Only rank 0 touched the file system; rank 1's weight directory was never created.
    assert r1["writes"] == [] and r1["critic_writes"] == [] and not (out / "w1").exists()
    assert any("v1.tmp" in w for w in r0["writes"]) and any("critic.tmp" in w for w in r0["critic_writes"])

    # The published version equals a one-rank export of the unsharded model, byte for byte.
    monkeypatch.setattr(H, "GATHER_BYTES", GATHER)
    monkeypatch.setattr(W, "SHARD_BYTES", SHARD)
    one = W.write_version(tmp_path / "one", 1, reference, load_tokenizer(model_dir))
    published = out / "w0" / "v1"
    assert r0["sha256"] == one.sha256 == weights_sha256(published)
    assert (published / W.INDEX_NAME).is_file()  # several shards: the index path ran too
    loaded = AutoModelForCausalLM.from_pretrained(str(published))
    assert all(torch.equal(a, b) for a, b in zip(reference.state_dict().values(), loaded.state_dict().values(),
                                                 strict=True))

    # The critic saved under ZeRO-3 is the snapshot + 1 everywhere: both ranks' partitions were loaded.
    snap = load_file(str(out / "snapshot.safetensors"))
    cfg = load_config(None, [f"model.path={tiny_model_dir}", "learner.value_head_init_std=0.02"])
    critic = load_critic_module(cfg, out / "critic")
    got = critic.state_dict()
    assert got.keys() == snap.keys()
    assert all(torch.equal(got[k], snap[k] + 1) for k in snap), [k for k in snap if not torch.equal(got[k], snap[k] + 1)]


# ------------------------------------------------------------------ learner.export: a checkpoint's policy out

RUN = ["run.name=r", "learner.total_steps=3", "learner.batch_groups=2", "learner.checkpoint_every=1",
       "learner.keep_checkpoints=3", "learner.keep_weights=5", "learner.eval_every=0", "metrics.prometheus=false",
       "learner.value_head_init_std=0.02"]

ZERO3_HARNESS = textwrap.dedent("""
    import sys
    from common.config import load_config
    from learner.data import ListSource
    from learner.dist import exit_process, rank
    from learner.runner import Runner
    from learner.synthetic import synth_groups

    cfg = load_config(None, sys.argv[1:])
    Runner(cfg, ListSource(synth_groups(8, 2, 60, seed=4)) if rank() == 0 else None).start().run()
    exit_process(0)  # no interpreter finalisation: gloo's threads can abort it
""")


def _ports() -> list[str]:
    return [f"learner.publish_addr=tcp://127.0.0.1:{free_port()}", f"learner.query_addr=tcp://127.0.0.1:{free_port()}"]


@pytest.fixture(scope="module")
def zero0_run(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 3-step one-rank run checkpointing and publishing every version (v1..v3 of both kept), with the
    resolved config saved as ``python -m learner`` saves it (the export's model.path)."""
    cfg = load_config(None, [f"run.root={tmp_path_factory.mktemp('export')}", f"model.path={tiny_model_dir}", *RUN,
                             "learner.publish_addr=tcp://127.0.0.1:0", "learner.query_addr=tcp://127.0.0.1:0"])
    save_config(cfg, cfg.run_dir / "learner_config.yaml")
    Runner(cfg, ListSource(synth_groups(8, 2, 60, seed=4))).start().run()
    return cfg.run_dir


def _assert_is_published(out: Path, run: Path, version: int) -> dict[str, torch.Tensor]:
    """``out`` loads with transformers and equals the run's published ``weights/v<version>`` tensor for tensor."""
    published = load_file(str(run / "weights" / f"v{version}" / "model.safetensors"))
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype="auto")
    got = model.state_dict()
    assert got.keys() - published.keys() <= {"lm_head.weight"}  # tied: stored once, as published
    for k, v in published.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
    if model.config.tie_word_embeddings:
        assert torch.equal(got["lm_head.weight"], published["model.embed_tokens.weight"])
    return published


def test_export_of_each_version_is_its_published_weights_and_loads(zero0_run: Path, tiny_model_dir: Path,
                                                                  tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # The run directory alone: its newest checkpoint (v3).
    assert export.main([str(zero0_run), "--out", str(tmp_path / "newest")]) == 0
    prov = json.loads(capsys.readouterr().out)
    assert prov == json.loads((tmp_path / "newest" / export.PROVENANCE).read_text())
    assert (prov["run"], prov["version"], prov["checkpoint"]) == ("r", 3, str((zero0_run / "checkpoints" / "v3").resolve()))
    assert prov["checkpoint_verified"] and prov["zero_stage"] == 0 and prov["dtype"] == "float32"
    assert prov["model_source"] == str(tiny_model_dir.resolve())  # the run's model.path, from its saved config
    # The same bytes as the published version (its STABLE digest), not merely close.
    stable = json.loads((zero0_run / "weights" / "v3" / W.STABLE).read_text())
    assert prov["weights_sha256"] == stable["sha256"] == weights_sha256(tmp_path / "newest")
    v3 = _assert_is_published(tmp_path / "newest", zero0_run, 3)
    # An older version by number, from the checkpoint directory itself too.
    assert export.main([str(zero0_run), "--version", "1", "--out", str(tmp_path / "v1")]) == 0
    assert export.main([str(zero0_run / "checkpoints" / "v1"), "--out", str(tmp_path / "v1-by-path")]) == 0
    v1 = _assert_is_published(tmp_path / "v1", zero0_run, 1)
    assert weights_sha256(tmp_path / "v1-by-path") == weights_sha256(tmp_path / "v1")
    assert any(not torch.equal(v1[k], v3[k]) for k in v1)  # the versions differ: the right one was read
    tok, base = AutoTokenizer.from_pretrained(str(tmp_path / "v1")), load_tokenizer(tiny_model_dir)
    assert tok.get_vocab() == base.get_vocab() and tok("12+34=")["input_ids"] == base("12+34=")["input_ids"]
    assert (tmp_path / "v1" / "generation_config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["newest", "v1", "v1-by-path"]  # no temporary left


def test_two_rank_zero3_bf16_checkpoint_exports_on_one_cpu_process(tiny_model_dir: Path, tmp_path: Path) -> None:
    harness = tmp_path / "harness.py"
    harness.write_text(ZERO3_HARNESS)
    args = [f"run.root={tmp_path}", f"model.path={tiny_model_dir}", *RUN, "learner.total_steps=2",
            "learner.zero_stage=3", "learner.precision=bf16", *_ports()]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), str(harness), *args]
    p = subprocess.run(cmd, env=child_env(OMP_NUM_THREADS="1", VAPO_DS_SHM="0"), capture_output=True, text=True,
                       timeout=600, cwd=REPO)
    assert p.returncode == 0, (p.stdout[-2000:], p.stderr[-4000:])
    run = tmp_path / "r"
    # Each rank's partition of the fp32 master weights is its own file: there is no whole model to copy.
    assert len(list((run / "checkpoints" / "v2" / "policy" / "state").glob("*zero_pp_rank_*optim_states.pt"))) == 2
    ckpt, verified = export.pick_checkpoint(run)
    assert ckpt == run / "checkpoints" / "v2" and verified
    prov = export.export(ckpt, tmp_path / "out", model=tiny_model_dir)
    assert (prov["zero_stage"], prov["ranks"], prov["dtype"]) == (3, 2, "bfloat16")
    published = _assert_is_published(tmp_path / "out", run, 2)
    assert prov["weights_sha256"] == json.loads((run / "weights" / "v2" / W.STABLE).read_text())["sha256"]
    # --dtype float32 gives the optimizer's fp32 master weights, which round to the published bf16 ones.
    export.export(ckpt, tmp_path / "fp32", dtype="float32", model=tiny_model_dir)
    master = load_file(str(tmp_path / "fp32" / "model.safetensors"))
    assert all(master[k].dtype == torch.float32 and torch.equal(master[k].bfloat16(), v) for k, v in published.items())
    assert any(not torch.equal(master[k], v.float()) for k, v in published.items())  # more than bf16 upcast


def _largest(d: Path) -> Path:
    return max((p for p in d.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


def test_a_damaged_checkpoint_is_refused_naming_the_file_and_the_intact_one(
        zero0_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "r"
    shutil.copytree(zero0_run, run)
    victim = _largest(run / "checkpoints" / "v3" / "policy")
    size = victim.stat().st_size
    os.truncate(victim, size // 3)
    rel = victim.relative_to(run / "checkpoints" / "v3")
    for target in ([str(run)], [str(run), "--version", "3"], [str(run / "checkpoints" / "v3")]):
        assert export.main([*target, "--out", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err
        assert f"v3 damaged ({rel}: size {size // 3} != {size}); not exported" in err, err
        assert f"the newest intact checkpoint is {run / 'checkpoints' / 'v2'} (--version 2)" in err, err
    assert not (tmp_path / "out").exists() and (run / "checkpoints" / "v3").is_dir()  # nothing renamed aside
    assert export.main([str(run), "--version", "7", "--out", str(tmp_path / "out")]) == 2
    assert "no complete checkpoint v7; complete: v1, v2, v3" in capsys.readouterr().err
    assert export.main([str(run), "--version", "2", "--out", str(tmp_path / "out")]) == 0
    _assert_is_published(tmp_path / "out", run, 2)


def test_an_existing_out_is_refused_without_force_and_replaced_with_it(
        zero0_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert export.main([str(zero0_run), "--out", str(out)]) == 2
    assert f"--out {out} exists and is not empty; --force replaces it" in capsys.readouterr().err
    assert [p.name for p in out.iterdir()] == ["notes.txt"]
    assert export.main([str(zero0_run), "--out", str(out), "--force"]) == 0
    assert not (out / "notes.txt").exists() and (out / "model.safetensors").is_file()
    _assert_is_published(out, zero0_run, 3)
    (tmp_path / "empty").mkdir()  # an empty directory is no export to lose
    assert export.main([str(zero0_run), "--version", "2", "--out", str(tmp_path / "empty")]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "out"]


@pytest.mark.sglang
def test_the_real_sglang_serves_an_export(tmp_path: Path) -> None:
    """A checkpoint of a run on the shipped base, exported and served by SGLang on the CPU (float32): /generate
    answers, with log-probs that are transformers' on the exported directory."""
    from common.sglang_client import SGLangClient
    from ops.sglang_cpu.live import LiveSGLang

    base = REPO / "ops" / "bases" / "addition-tiny"
    cfg = load_config(None, [f"run.root={tmp_path}", f"model.path={base}", *RUN, "learner.total_steps=1",
                             "learner.publish_addr=tcp://127.0.0.1:0", "learner.query_addr=tcp://127.0.0.1:0"])
    Runner(cfg, ListSource(synth_groups(4, 2, 60, seed=4))).start().run()
    assert export.main([str(cfg.run_dir), "--version", "1", "--out", str(tmp_path / "out"), "--model", str(base)]) == 0
    prompt = [5, 6, 7, 8]
    server = LiveSGLang.start(tmp_path / "out", tmp_path)
    try:
        async def go() -> Any:
            async with SGLangClient(server.url, timeout_s=120, control_timeout_s=60) as c:
                return await c.generate(prompt, {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True})

        (out,) = asyncio.run(go())
    finally:
        server.stop()
    assert len(out.output_ids) == 8 and out.output_logprobs is not None
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), dtype=torch.float32).eval()
    ids = torch.tensor([prompt + out.output_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:-1]
    ours = torch.log_softmax(logits.float(), -1).gather(-1, ids[0, len(prompt):, None])[:, 0]
    assert torch.allclose(torch.tensor(out.output_logprobs), ours, atol=2e-3), (torch.tensor(out.output_logprobs) - ours)


def test_zero2_bf16_exports_the_published_weights_and_with_float32_the_fp32_master(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    cfg = load_config(None, [f"run.root={tmp_path}", f"model.path={tiny_model_dir}", *RUN, "learner.total_steps=2",
                             "learner.zero_stage=2", "learner.precision=bf16",
                             "learner.publish_addr=tcp://127.0.0.1:0", "learner.query_addr=tcp://127.0.0.1:0"])
    Runner(cfg, ListSource(synth_groups(8, 2, 60, seed=4))).start().run()
    ckpt = cfg.run_dir / "checkpoints" / "v2"
    prov = export.export(ckpt, tmp_path / "out")
    assert (prov["zero_stage"], prov["dtype"]) == (2, "bfloat16")
    published = _assert_is_published(tmp_path / "out", cfg.run_dir, 2)
    export.export(ckpt, tmp_path / "fp32", dtype="float32")
    master = load_file(str(tmp_path / "fp32" / "model.safetensors"))
    assert all(master[k].dtype == torch.float32 and torch.equal(master[k].bfloat16(), v) for k, v in published.items())
    assert any(not torch.equal(master[k], v.float()) for k, v in published.items())
