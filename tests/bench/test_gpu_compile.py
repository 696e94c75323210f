"""`python -m tessera.bench.gpu_compile`: the package's Triton kernels compiled for sm_80 and sm_90 with what
their launchers really pass (no GPU needed: triton's compiler and ptxas only), and the harness itself: a
kernel that does not compile, one over the shared-memory limit and one that no launcher reaches are failures."""

from __future__ import annotations

import io

import pytest
import torch
import triton
import triton.language as tl
from triton.runtime.jit import mangle_type

from tessera.bench import gpu_compile
from tessera.models.families import FAMILIES


@triton.jit
def _window_start(X, Lens, window):
    # The shape of the bug the decode kernel had: `start` is int32, the branch makes it the loaded type.
    n = tl.load(Lens)
    start = 0
    if window > 0:
        start = tl.maximum(n - window, 0)
    tl.store(X + start, 1.0)


TOY = {f"{__name__}:_window_start": _window_start}


def _toy_launch(index_dtype: torch.dtype) -> gpu_compile.Launch:
    return gpu_compile.Launch(_window_start, (torch.zeros(4), torch.ones(1, dtype=index_dtype), 3), {},
                              f"toy {index_dtype}")


@pytest.fixture(scope="module")
def recorded():
    kernels = gpu_compile.discover_kernels()
    return kernels, gpu_compile.record_launches(kernels)


# Several hundred kernels through ptxas: about 75 s alone on 2 cores, past the suite's 300 s default when the
# other xdist workers load the machine and triton's cache is cold (a fresh clone).
@pytest.mark.timeout(900)
def test_every_kernel_compiles_for_sm_80_and_sm_90(recorded) -> None:
    out = io.StringIO()
    failures = gpu_compile.run([80, 90], jobs=2, out=out, recorded=recorded)
    report = out.getvalue()
    assert failures == 0, report
    n = int(report.split()[0])
    assert n > 0 and report.startswith(f"{n} of {n} compiled"), report


def test_the_launches_cover_every_family_dtype_and_plan(recorded) -> None:
    kernels, launches = recorded
    assert {key.split(":")[1] for key in kernels} >= {"decode_kernel", "extend_kernel"}
    fused_names = ("_rmsnorm_kernel", "_norm_add_kernel", "_gated_mul_kernel", "_rotary_store_kernel")
    assert {key.split(":")[1] for key in kernels} >= set(fused_names)
    seen, fused, lora, moe = set(), set(), set(), set()
    for launch in launches:
        sig = gpu_compile.bind(launch, 90)[0]
        if launch.kernel.__name__.startswith("lora_"):  # layers/lora/triton_lora.py: every one in every dtype
            lora.add((launch.kernel.__name__, sig.get("X", sig.get("Y"))))
        elif "SeqLens" in sig:  # attention
            seen.add((launch.kernel.__name__, sig["Q"], sig["SeqLens"]))
        elif "PartAcc" in sig:  # split-KV decode's second pass
            seen.add((launch.kernel.__name__, sig["Out"], None))
        elif "BlockExpert" in sig:  # layers/moe_triton.py: every dtype, both block sizes, both weight placements
            moe.add((sig["A"], *(launch.kwargs[k] for k in ("BLOCK_M", "SCALE_A", "SCALE_C"))))
        else:  # the layers' fused kernels: every one in every dtype
            fused.add((launch.kernel.__name__, next(sig[k] for k in ("X", "QKV", "A") if k in sig)))
    dtypes = {mangle_type(torch.empty(0, dtype=d)) for d in gpu_compile.DTYPES}  # "*bf16", ...
    assert {(k, q, i) for k, q, i in seen if k == "decode_kernel"} == {
        ("decode_kernel", q, i) for q in dtypes for i in ("*i32", "*i64")}  # host plan and CUDA-graph plan
    assert {q for k, q, _ in seen if k == "extend_kernel"} == dtypes
    assert {(q, i) for k, q, i in seen if k == "decode_split_kernel"} == {(q, i) for q in dtypes
                                                                         for i in ("*i32", "*i64")}
    assert {q for k, q, _ in seen if k == "decode_reduce_kernel"} == dtypes
    assert fused == {(k, d) for k in fused_names for d in dtypes}
    assert lora == {(k, d) for k in ("lora_shrink_kernel", "lora_expand_kernel") for d in dtypes}
    # Per dtype and block size: x @ w13 (input scaled or not), then @ w2 (output scaled where the input was not).
    assert moe == {(d, m, scale_a, scale_c) for d in dtypes for m in (16, 64)
                   for scale_a, scale_c in ((False, False), (True, False), (False, True))}
    labels = " | ".join(launch.label for launch in launches)
    for family in FAMILIES.values():
        assert family.name in labels
    for step in ("prefill", "extend-prefix", "masked-extend", "graph-decode", "window="):
        assert step in labels


def test_a_kernel_that_does_not_compile_is_a_failure_line() -> None:
    out = io.StringIO()
    launches = [_toy_launch(torch.int32), _toy_launch(torch.int64)]
    assert gpu_compile.run([90], jobs=1, out=out, recorded=(TOY, launches)) == 1
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and lines[1].startswith("1 of 2 compiled"), lines
    assert lines[0].startswith("FAIL _window_start sm_90 [X=*fp32 Lens=*i64") and "int64" in lines[0], lines


def test_shared_memory_over_the_limit_is_a_failure(monkeypatch) -> None:
    monkeypatch.setitem(gpu_compile.SHARED_LIMIT, 90, -1)
    ok, message = gpu_compile.compile_case(gpu_compile.collect(TOY, [_toy_launch(torch.int32)], [90])[0])
    assert not ok and "shared memory" in message and "sm_90 limit" in message


def test_a_kernel_no_launcher_reaches_is_a_failure() -> None:
    out = io.StringIO()
    assert gpu_compile.run([90], jobs=1, out=out, recorded=(TOY, [])) == 1
    assert "_window_start: no launcher drives it" in out.getvalue()


@pytest.mark.parametrize("argv,field", [(["--arch", "sm90"], "--arch"), (["--jobs", "0"], "--jobs")])
def test_bad_options_name_the_option(argv, field, capsys) -> None:
    with pytest.raises(SystemExit):
        gpu_compile.main(argv)
    assert field in capsys.readouterr().err
