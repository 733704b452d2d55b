"""Anchor gather + projection: torch reference and Triton kernel against a float64 oracle, guards,
packing, and the `spd bench-kernel` argument handling.

The Triton kernel runs under the interpreter on CPU tensors; TRITON_INTERPRET=1 is set per test
(monkeypatch) and every test starts without it (tests/conftest.py), so no result depends on
whether the user's shell exports it. Inputs are
fresh random values on every run; the seed is in every failure message.
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from spd_engine.kernels.anchor_gather import (
    anchor_rows,
    num_types_of,
    pack_projection_weights,
    type_weight_t,
    unpack_projection_weights,
)

HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
TOL = {torch.float32: 1e-4, torch.float16: 1e-3, torch.bfloat16: 1e-2}
SLOW = pytest.mark.slow  # extra H=4096 / compile cases: seconds each on a shared CPU


@pytest.fixture
def rng() -> tuple[torch.Generator, int]:
    seed = int.from_bytes(os.urandom(4), "little")
    return torch.Generator().manual_seed(seed), seed


@pytest.fixture
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def make_case(gen: torch.Generator, hidden: int, num_types: int, rows: int, dtype: torch.dtype,
              num_slots: int = 6, extra_anchors: int = 0, index_dtype: torch.dtype = torch.int64):
    """Random weights (nn.Linear layout), ring, slots and mixed types (every type used when rows allow)."""
    ws = [(torch.randn(hidden, (a + 1) * hidden, generator=gen) / ((a + 1) * hidden) ** 0.5).to(dtype)
          for a in range(num_types)]
    ring = torch.randn(num_slots, num_types + extra_anchors, hidden, generator=gen).to(dtype)
    slots = torch.randint(0, num_slots, (rows,), generator=gen)
    types = torch.arange(rows) % num_types
    types = types[torch.randperm(rows, generator=gen)]
    return ws, ring, slots.to(index_dtype), types.to(index_dtype)


def oracle(ws: list[torch.Tensor], ring: torch.Tensor, slots: torch.Tensor, types: torch.Tensor) -> torch.Tensor:
    """float64, straight from the definition: row r = W_t . concat(ring[s, 0..t])."""
    ref = torch.empty(len(slots), ring.shape[2], dtype=torch.float64)
    for t in set(types.tolist()):
        w = ws[t].double()  # [H, (t+1)H]
        for r in (types == t).nonzero().flatten().tolist():
            ref[r] = w @ ring[slots[r], : t + 1].reshape(-1).double()
    return ref


def check_close(out: torch.Tensor, ref: torch.Tensor, tol: float, seed: int) -> None:
    assert torch.isfinite(out).all(), f"non-finite output (seed {seed})"
    err = ((out.double() - ref).norm() / ref.norm()).item()
    assert err <= tol, f"relative error {err:.3g} > {tol:g} (seed {seed})"


def run_case(gen, seed, impl, hidden, num_types, rows, dtype, out_dtype=None, config=None, **kw):
    ws, ring, slots, types = make_case(gen, hidden, num_types, rows, dtype, **kw)
    packed = pack_projection_weights(ws)
    out = torch.full((rows, hidden), float("nan"), dtype=out_dtype or dtype)  # poisoned
    result = anchor_rows(ring, slots, types, packed, out=out, impl=impl, config=config)
    assert result.data_ptr() == out.data_ptr(), "anchor_rows must write into `out`"
    check_close(out, oracle(ws, ring, slots, types), TOL[dtype], seed)


# ---- packing ----

def test_pack_unpack_round_trip(rng):
    gen, seed = rng
    ws = [torch.randn(8, (a + 1) * 8, generator=gen) for a in range(4)]
    packed = pack_projection_weights(ws)
    assert packed.shape == (10, 8, 8) and packed.is_contiguous() and num_types_of(packed) == 4
    for a, (w, back) in enumerate(zip(ws, unpack_projection_weights(packed))):
        assert torch.equal(w, back), f"type {a} (seed {seed})"
        assert torch.equal(type_weight_t(packed, a), w.t()), f"type {a} (seed {seed})"
    # Block a(a+1)/2 + k is W_a[:, kH:(k+1)H]^T: check one block by hand.
    assert torch.equal(packed[3 + 1], ws[2][:, 8:16].t())


# ---- torch reference (the specification) ----

@pytest.mark.parametrize("hidden,num_types,rows,dtype", [
    (64, 3, 1, torch.float32), (64, 4, 9, torch.bfloat16), (576, 4, 9, torch.float32),
    (576, 4, 9, torch.bfloat16), (4096, 3, 5, torch.float32),
    pytest.param(4096, 5, 9, torch.bfloat16, marks=SLOW),
])
def test_torch_matches_oracle(rng, hidden, num_types, rows, dtype):
    run_case(*rng, "torch", hidden, num_types, rows, dtype)


def test_torch_zero_rows_and_auto_on_cpu(rng, monkeypatch):
    gen, seed = rng
    ws, ring, slots, types = make_case(gen, 16, 2, 0, torch.float32)
    assert anchor_rows(ring, slots, types, pack_projection_weights(ws)).shape == (0, 16)
    if HAS_TRITON:  # "auto" must not reach the Triton launcher for CPU tensors
        import spd_engine.kernels._anchor_gather_triton as tri
        monkeypatch.setattr(tri, "launch", lambda *a, **k: pytest.fail("auto used Triton on CPU"))
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    ws, ring, slots, types = make_case(gen, 16, 2, 3, torch.float32)
    check_close(anchor_rows(ring, slots, types, pack_projection_weights(ws)), oracle(ws, ring, slots, types),
                TOL[torch.float32], seed)


def test_torch_path_without_triton():
    code = ("import sys; sys.modules['triton'] = None\n"
            "import torch\nfrom spd_engine.kernels.anchor_gather import anchor_rows, pack_projection_weights\n"
            "p = pack_projection_weights([torch.ones(4, 4), torch.ones(4, 8)])\n"
            "out = anchor_rows(torch.ones(2, 2, 4), torch.tensor([1]), torch.tensor([1]), p)\n"
            "assert out.tolist() == [[8.0] * 4], out\n"
            "try:\n    anchor_rows(torch.ones(2, 2, 4), torch.tensor([1]), torch.tensor([1]), p, impl='triton')\n"
            "except ValueError as e:\n    assert 'not installed' in str(e), e\nelse:\n    raise SystemExit('no error')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


# ---- Triton kernel (interpreter on CPU) ----

@needs_triton
@pytest.mark.parametrize("hidden,num_types,rows,dtype", [
    (64, 3, 9, torch.float32), (64, 3, 5, torch.bfloat16),
    (576, 4, 9, torch.float32), (576, 2, 9, torch.bfloat16),
    (4096, 2, 3, torch.float32), pytest.param(4096, 2, 3, torch.bfloat16, marks=SLOW),
])
def test_triton_matches_oracle(rng, interpret, hidden, num_types, rows, dtype):
    run_case(*rng, "triton", hidden, num_types, rows, dtype)


@needs_triton
def test_triton_gpu_tiles_and_edge_cases(rng, interpret):
    """The CUDA tile sizes (partial N and K tiles), > 16 rows, int32 indices, fp16, fp32 out,
    a ring with more anchors than types, one row, and types that no row uses."""
    gen, seed = rng
    gpu_tiles = {"block_n": 32, "block_k": 128}
    run_case(gen, seed, "triton", 96, 3, 17, torch.float32, config=gpu_tiles, index_dtype=torch.int32)
    run_case(gen, seed, "triton", 80, 3, 7, torch.float16, out_dtype=torch.float32, extra_anchors=2)
    run_case(gen, seed, "triton", 64, 4, 1, torch.bfloat16)
    ws, ring, slots, types = make_case(gen, 48, 3, 4, torch.float32)
    types.fill_(1)  # types 0 and 2 unused
    out = anchor_rows(ring, slots, types, pack_projection_weights(ws), impl="triton")
    check_close(out, oracle(ws, ring, slots, types), TOL[torch.float32], seed)


@needs_triton
def test_triton_needs_interpreter_on_cpu(rng, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    ws, ring, slots, types = make_case(rng[0], 16, 2, 2, torch.float32)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        anchor_rows(ring, slots, types, pack_projection_weights(ws), impl="triton")


def _has_nvidia_backend() -> bool:
    if not HAS_TRITON:
        return False
    from triton.backends import backends
    return "nvidia" in backends


@pytest.mark.skipif(not _has_nvidia_backend(), reason="triton without its NVIDIA backend")
@pytest.mark.parametrize("dtype", ["bf16", pytest.param("fp32", marks=SLOW)])
def test_triton_compiles_for_hopper_without_a_gpu(dtype, monkeypatch):
    """The interpreter accepts code the compiler rejects: build the CUDA kernel (ttir -> ptx ->
    cubin with triton's bundled ptxas) for sm_90, as the driver would launch it, and check that
    the K-loop is software-pipelined (async copies) with the default tile sizes. Compiling needs
    `triton.jit` to return a compilable function, not the interpreter's."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from spd_engine.kernels._anchor_gather_triton import BLOCK_R, _anchor_rows_body, default_config
    fn = triton.jit(_anchor_rows_body)
    cfg = default_config(4096, interpret=False)
    sig = {name: "constexpr" for name in fn.arg_names}
    sig.update({"ring_ptr": f"*{dtype}", "slots_ptr": "*i32", "types_ptr": "*i32", "packed_ptr": f"*{dtype}",
                "out_ptr": f"*{dtype}", "num_rows": "i32", "num_slots": "i32", "slot_stride": "i32", "hidden": "i32"})
    consts = {"NUM_TYPES": 5, "BLOCK_R": BLOCK_R, "BLOCK_N": cfg["block_n"], "BLOCK_K": cfg["block_k"],
              "DOT_FP32": dtype == "fp32", "BF16_BITS": False}
    aligned = ("ring_ptr", "slots_ptr", "types_ptr", "packed_ptr", "out_ptr", "slot_stride", "hidden")
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}  # what a launch specialises
    compiled = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]})
    assert len(compiled.asm["cubin"]) > 0
    assert "async_copy" in compiled.asm["ttgir"], "K-loop loads are not pipelined"


@pytest.mark.gpu
@needs_triton
@pytest.mark.parametrize("hidden,num_types,rows", [(576, 4, 5), (4096, 5, 9)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_cuda_matches_oracle(rng, monkeypatch, hidden, num_types, rows, dtype):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    gen, seed = rng
    ws, ring, slots, types = make_case(gen, hidden, num_types, rows, dtype)
    cuda = [t.cuda() for t in (ring, slots, types)]
    out = torch.full((rows, hidden), float("nan"), dtype=dtype, device="cuda")
    anchor_rows(*cuda, pack_projection_weights([w.cuda() for w in ws]), out=out)  # auto -> Triton
    check_close(out.cpu(), oracle(ws, ring, slots, types), TOL[dtype], seed)


# ---- guards ----

def _bad_inputs(name: str):
    """A valid call with one argument broken; returns (args, kwargs)."""
    ws = [torch.randn(8, (a + 1) * 8) for a in range(3)]
    args = {"ring": torch.randn(4, 3, 8), "slots": torch.tensor([0, 3]), "types": torch.tensor([2, 0]),
            "packed": pack_projection_weights(ws)}
    kw: dict = {}
    broken = {
        "ring 2-D": ("ring", torch.randn(4, 8)),
        "ring int": ("ring", torch.ones(4, 3, 8, dtype=torch.int32)),
        "ring strided": ("ring", torch.randn(4, 8, 3).transpose(1, 2)),
        "packed dtype": ("packed", args["packed"].double()),
        "packed blocks": ("packed", args["packed"][:5].contiguous()),
        "packed H": ("packed", pack_projection_weights([torch.randn(4, 4)])),
        "packed types": ("packed", pack_projection_weights([torch.randn(8, (a + 1) * 8) for a in range(4)])),
        "packed strided": ("packed", args["packed"].transpose(1, 2)),
        "slots float": ("slots", torch.tensor([0.0, 1.0])),
        "slots 2-D": ("slots", torch.tensor([[0, 1]])),
        "slots device": ("slots", torch.tensor([0, 1], device="meta")),
        "types length": ("types", torch.tensor([0])),
        "slot high": ("slots", torch.tensor([0, 4])),
        "slot negative": ("slots", torch.tensor([-1, 0])),
        "type high": ("types", torch.tensor([0, 3])),
        "type negative": ("types", torch.tensor([0, -1])),
    }
    if name in broken:
        key, value = broken[name]
        args[key] = value
    elif name == "out shape":
        kw["out"] = torch.empty(3, 8)
    elif name == "out dtype":
        kw["out"] = torch.empty(2, 8, dtype=torch.float16)
    elif name == "out strided":
        kw["out"] = torch.empty(8, 2).t()
    elif name == "impl":
        kw["impl"] = "cuda"
    return args, kw


GUARDS = {
    "ring 2-D": "ring must be 3-D", "ring int": "ring dtype", "ring strided": "ring must be contiguous",
    "packed dtype": "packed dtype", "packed blocks": "triangular", "packed H": "H=4 but ring has H=8",
    "packed types": "4 types but ring holds only 3 anchors", "packed strided": "packed must be contiguous",
    "slots float": "slots dtype", "slots 2-D": "slots must be 1-D", "slots device": "slots is on meta",
    "types length": "slots has 2 rows but types has 1", "slot high": "slots out of range",
    "slot negative": "slots out of range", "type high": "types out of range",
    "type negative": "types out of range", "out shape": "out must have shape", "out dtype": "out dtype",
    "out strided": "out must be contiguous", "impl": "impl must be one of",
}


@pytest.mark.parametrize("impl", ["torch", pytest.param("triton", marks=needs_triton)])
@pytest.mark.parametrize("name", sorted(GUARDS))
def test_guards(interpret, name, impl):
    args, kw = _bad_inputs(name)
    kw.setdefault("impl", impl)
    with pytest.raises(ValueError, match=GUARDS[name]):
        anchor_rows(**args, **kw)


def test_guards_accept_the_valid_call():
    args, kw = _bad_inputs("none")
    assert anchor_rows(**args, impl="torch").shape == (2, 8)


def test_pack_guards():
    with pytest.raises(ValueError, match="at least one"):
        pack_projection_weights([])
    with pytest.raises(ValueError, match=r"projection weight 1 must have shape \[H, \(a\+1\)H\] = \[8, 16\]"):
        pack_projection_weights([torch.randn(8, 8), torch.randn(8, 24)])
    with pytest.raises(ValueError, match="projection weight 1 is torch.float64"):
        pack_projection_weights([torch.randn(8, 8), torch.randn(8, 16, dtype=torch.float64)])


# ---- spd bench-kernel: argument handling and CPU refusal (the timing itself needs a GPU) ----

def test_bench_refuses_without_cuda(monkeypatch, capsys):
    from spd_engine.tools.cli import main
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["bench-kernel", "--shapes", "smollm2-135m"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_bench_rejects_bad_arguments(monkeypatch, capsys):
    from spd_engine.tools.cli import main
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["bench-kernel", "--shapes", "smollm2-135m,gpt-5"]) == 2
    assert "unknown shape 'gpt-5'" in capsys.readouterr().err
    assert main(["bench-kernel", "--iters", "0"]) == 2
    assert "--iters must be >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench-kernel", "--dtype", "int8"])


def test_bench_rows_follow_the_anchor_plan():
    from spd_engine.tools.bench_kernel import SHAPES, bench_rows, bytes_moved
    # SmolLM2 30 layers at n=4 (8,8,7,7): anchors {0, 8, 23, 29}; A(0..4) = 0, 1, 1, 2, 3;
    # rows: the pending full-depth row, then lags 0..3.
    assert bench_rows(SHAPES["smollm2-135m"]) == (4, [3, 0, 1, 1, 2])
    # Qwen3-4B 36 layers at n=8 (5,5,5,5,4,4,4,4): anchors {0, 5, 15, 28, 35}.
    assert bench_rows(SHAPES["qwen3-4b"]) == (5, [4, 0, 1, 1, 2, 2, 2, 3, 3])
    # H=2, 2-byte elements, types [1, 0, 1]: weights of types 0 and 1 = (1 + 2) * 4 elements,
    # ring reads (2 + 1 + 2) * 2, output 3 * 2 elements, plus two int32 index vectors.
    assert bytes_moved(2, [1, 0, 1], 2) == (3 * 4 + 5 * 2 + 3 * 2) * 2 + 2 * 3 * 4
