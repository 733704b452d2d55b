"""The anchor-gather kernel's check: the Triton kernel against its torch reference on one
steady-state tick's rows, its answer and its eager / graphed times (the torch reference alone on
the CPU or without triton)."""
from __future__ import annotations

import torch

from spd_engine.bench.device_check.check_env import free
from spd_engine.bench.device_check.check_plan import CheckPlan

KERNEL_SHAPES = {"smollm2-135m": (576, 30), "qwen3-4b": (2560, 36), "llama-3.1-8b": (4096, 32)}  # hidden, layers


def anchor_gather(plan: CheckPlan) -> dict:
    """The Triton anchor-gather kernel (kernels/anchor_gather.py) against its torch reference on the
    rows of one steady-state tick at n = 8 (the pending full-depth row and lags 0..n-1, as
    `spd bench-kernel`, which also streams the weights from HBM; here they may sit in L2): the
    answer (relative error) and eager / graphed times. On the CPU, or without triton, only the
    torch reference runs and the kernel is reported as not run."""
    from spd_engine.bench.profiling import events_ms
    from spd_engine.engine.protocol.anchors import AnchorPlan
    from spd_engine.engine.protocol.topology import default_stage_layers, stage_bounds
    from spd_engine.kernels.anchor_gather import anchor_rows, pack_projection_weights

    try:
        import triton  # noqa: F401
        has_triton = True
    except ImportError:
        has_triton = False
    cuda = plan.device.startswith("cuda")
    run_kernel = cuda and has_triton
    dev = torch.device(plan.device)
    dtype = torch.bfloat16 if cuda else torch.float32
    shapes = {}
    for name in plan.kernel_shapes:
        hidden, layers = KERNEL_SHAPES[name]
        if not cuda:
            hidden = 64  # the dry run: the same code on a small width
        n = 8
        ap = AnchorPlan.build(stage_bounds(default_stage_layers(layers, n)))
        row_types = [ap.type_at_depth(n)] + [ap.type_at_depth(j) for j in range(n)]
        T, R = ap.num_types, len(row_types)
        gen = torch.Generator(device=dev).manual_seed(0)
        ws = [torch.randn(hidden, (a + 1) * hidden, device=dev, generator=gen).div_(((a + 1) * hidden) ** 0.5)
              for a in range(T)]
        packed = pack_projection_weights([w.to(dtype) for w in ws])
        del ws
        ring = torch.randn(2 * R, T, hidden, device=dev, generator=gen).to(dtype)
        slots = torch.randperm(2 * R, device=dev, generator=gen)[:R].to(torch.int32)
        types = torch.tensor(row_types, dtype=torch.int32, device=dev)
        out = torch.empty(R, hidden, dtype=dtype, device=dev)
        ref = anchor_rows(ring, slots, types, packed, impl="torch").float()
        r: dict = {"hidden": hidden, "n": n, "rows": R, "types": T, "dtype": str(dtype).replace("torch.", "")}
        if run_kernel:
            got = anchor_rows(ring, slots, types, packed, impl="triton").float()
            r["rel_err_vs_torch"] = float((got - ref).norm() / ref.norm())
            iters = max(20, plan.iters * 5)
            for impl in ("triton", "torch"):
                # the names are deleted after the loop (freeing device memory), never before a call: F821 misreads it
                call = lambda impl=impl: anchor_rows(ring, slots, types, packed, out=out, impl=impl,  # noqa: E731,F821
                                                     check_indices=False)
                r[f"{'kernel' if impl == 'triton' else 'torch'}_eager_us"] = 1e3 * events_ms(call, iters)
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    call()
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    call()
                r[f"{'kernel' if impl == 'triton' else 'torch'}_graph_us"] = 1e3 * events_ms(graph.replay, iters)
        else:
            from spd_engine.bench.profiling import time_ms

            r["rel_err_vs_torch"] = None
            r["torch_eager_us"] = 1e3 * time_ms(lambda: anchor_rows(ring, slots, types, packed, out=out, impl="torch"),  # noqa: F821
                                                dev, plan.iters, plan.warmup)
        shapes[name] = r
        del packed, ring
        free(dev)
    if not run_kernel:
        return {"status": f"not run ({'no CUDA' if not cuda else 'no triton'}; torch reference timed only)",
                "shapes": shapes}
    ok = all(r["rel_err_vs_torch"] < 1e-2 for r in shapes.values())
    return {"status": "pass" if ok else "fail (kernel differs from the torch reference)", "shapes": shapes}
