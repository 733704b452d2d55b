"""Every GPU path of the engine checked on one CUDA device in one run (`spd gpu-check`, `make gpu-check`).

A GPU window is short and has no network, so this is one run under a time guard that writes
OUT/gpu-check.json and OUT/gpu-check.md (docs/gpu-check.md):

- lossless: SPD at n = 2, 4, 8 with every rank a thread of this process on the one device
  (engine/runtime/reference.py: the very driver and stage objects of a distributed run, over the
  in-process transport, so what differs from a multi-GPU run is only the transport), random
  weights of real shapes, eager and CUDA-graph steps, fp32 and bf16. The oracle is greedy
  decoding through the same steps on the same device (the `pp` baseline with the same split,
  step mode and dtype: docs/testing.md, the same computation, so tokens must be bit-equal), with
  the head's own drafts and with oracle drafts that are wrong at fixed positions (accepts and
  rejections both happen). T > 0 keyed sampling twice; branch width 2 (equal up to a near-tie);
- timings, written as `spd-profile/1` JSONs that `spd plan --profile` reads (bench/profiling.py):
  per stage, PDM at K = 1, 2, 4, verification, the AR step, graph against eager, host syncs per
  tick, the anchor-gather kernel against its torch reference, a W-row stage step, and the
  co-located tick against its stages' compute (the per-tick overhead beyond compute as a share
  of a stage);
- training: a few bf16 steps of `spd train` (PDM) and `spd train --method eagle`;
- what one GPU cannot check, listed as not checked.

The dry run (`--dry`) is the same code on the CPU with tiny shapes and the same report keys, in
the default test suite, so the script cannot rot between GPU windows. Every item that is not run
(the time guard, no CUDA, no triton) says so in the report; nothing is filled in.

The modules, in the order the run uses them: check_plan (what is checked, the time guard),
check_env (labels, device helpers), check_patches (random weights on the device, graph modes),
check_lossless, check_kernel, check_timings, check_training, check_report (summary, markdown),
check_run (the whole run).
"""
