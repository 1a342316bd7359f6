"""vapo's pure-torch ``sgl_kernel`` (ops/sglang_cpu): the two operators SGLang's CPU path may call, against a
plain per-element reference, and the seven speculative-decoding names failing loudly.

Imported from its source (``ops.sglang_cpu.sgl_kernel``), so that it is tested whether or not
``ops/setup.sh --sglang`` installed it."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch

from ops.sglang_cpu.prepare import REQUIRED_SGL_KERNEL_NAMES


@pytest.fixture(scope="module")
def sgl_kernel() -> ModuleType:
    from ops.sglang_cpu import sgl_kernel as mod
    return mod


def test_exports_every_name_sglang_imports_on_cpu(sgl_kernel: ModuleType) -> None:
    missing = [n for n in REQUIRED_SGL_KERNEL_NAMES if not callable(getattr(sgl_kernel, n, None))]
    assert missing == []
    # SGLang reads this op's presence as "AMX kernels available" and would leave its torch-native layers
    assert not hasattr(torch.ops.sgl_kernel, "convert_weight_packed")


def test_copy_all_layer_kv_cache_matches_a_plain_row_copy_with_overlapping_locations(sgl_kernel: ModuleType) -> None:
    g = torch.Generator().manual_seed(0)
    # three "layers" of different dtypes and row sizes, as K/V buffers of a KV pool
    bufs = [torch.randn(10, 4, 8, generator=g), torch.randn(10, 6, generator=g).to(torch.bfloat16),
            torch.randint(0, 100, (10, 3), generator=g, dtype=torch.int32)]
    expected = [b.clone() for b in bufs]
    src = torch.tensor([1, 2, 3, 7])
    tgt = torch.tensor([2, 3, 9, 0])  # rows 2 and 3 are both read and written: sources read first
    for e in expected:
        rows = [e[int(s)].clone() for s in src]
        for t, r in zip(tgt.tolist(), rows, strict=True):
            e[t] = r
    ptrs = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.uint64)
    strides = torch.tensor([b[0].numel() * b.element_size() for b in bufs], dtype=torch.int64)
    sgl_kernel.copy_all_layer_kv_cache_cpu(ptrs, strides, tgt, src)
    for b, e in zip(bufs, expected, strict=True):
        assert torch.equal(b, e)
    sgl_kernel.copy_all_layer_kv_cache_cpu(ptrs, strides, tgt[:0], src[:0])  # nothing to copy: no error
    with pytest.raises(ValueError, match="entries"):
        sgl_kernel.copy_all_layer_kv_cache_cpu(ptrs, strides, tgt, src[:2])


def test_assign_req_to_token_pool_fills_each_requests_slice_in_order(sgl_kernel: ModuleType) -> None:
    pool_len = 8
    req_to_token = torch.full((4, pool_len), -1, dtype=torch.int32)
    req_pool_indices = torch.tensor([2, 0, 3])
    start = torch.tensor([1, 0, 5])
    end = torch.tensor([4, 2, 5])  # the third request gets nothing
    out_cache_loc = torch.tensor([11, 12, 13, 21, 22], dtype=torch.int64)
    expected = req_to_token.clone()
    at = 0
    for r, a, b in zip(req_pool_indices.tolist(), start.tolist(), end.tolist(), strict=True):
        for j in range(a, b):
            expected[r, j] = int(out_cache_loc[at])
            at += 1
    sgl_kernel.assign_req_to_token_pool_cpu(req_pool_indices, req_to_token, start, end, out_cache_loc, pool_len)
    assert torch.equal(req_to_token, expected)
    assert req_to_token[2, 1:4].tolist() == [11, 12, 13] and req_to_token[0, :2].tolist() == [21, 22]
    with pytest.raises(IndexError, match="pool length"):
        sgl_kernel.assign_req_to_token_pool_cpu(torch.tensor([0]), req_to_token, torch.tensor([6]),
                                                torch.tensor([9]), out_cache_loc, pool_len)


@pytest.mark.parametrize("name", REQUIRED_SGL_KERNEL_NAMES[2:])
def test_speculative_names_refuse_to_run(sgl_kernel: ModuleType, name: str) -> None:
    with pytest.raises(NotImplementedError, match=name):
        getattr(sgl_kernel, name)(torch.zeros(1))


def test_requirements_drop_cuda_only_packages_and_extras_but_keep_markers() -> None:
    from ops.sglang_cpu.prepare import requirements

    meta = "\n".join([
        "Name: sglang", "Requires-Dist: aiohttp", "Requires-Dist: torch==2.14.1", "Requires-Dist: flashinfer_python[cu13]==0.7.2",
        "Requires-Dist: nvidia-cutlass-dsl[cu13]==4.8.0", "Requires-Dist: sglang-kernel==0.4.10",
        "Requires-Dist: torch_memory_saver>=0.0.9.post1", "Requires-Dist: transformers==5.19.0",
        'Requires-Dist: av==16.1.0; sys_platform == "linux" and platform_machine == "aarch64"',
        'Requires-Dist: pytest; extra == "test"', "Requires-Dist: torchvision",
    ])
    assert requirements(meta) == ["aiohttp", "transformers==5.19.0",
                                  'av==16.1.0; sys_platform == "linux" and platform_machine == "aarch64"']


def test_torchvision_patch_guards_both_fake_registrations_once() -> None:
    from ops.sglang_cpu.prepare import patch_source

    src = ('import torchvision.extension\n@torch.library.register_fake("torchvision::nms")\ndef a(): pass\n'
           '@torch.library.register_fake("torchvision::qnms")\ndef b(): pass\n')
    out = patch_source(src)
    assert "@torch.library.register_fake(" not in out.replace("@(torch.library.register_fake(", "")
    assert out.count("if torchvision.extension._has_ops() else (lambda f: f))") == 2
    assert patch_source(out) == out  # idempotent: a second setup run changes nothing
    with pytest.raises(ValueError, match="torchvision::nms"):
        patch_source("nothing to patch here")
