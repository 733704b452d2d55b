"""The model: configs, Megatron-named blocks, KV cache, CUDA-graph steps, the PDM and eagle heads,
tensor-parallel shards, checkpoints, tokenizer, the greedy oracle."""
