"""Checkpoint tools: HF <-> Megatron-layout conversion, stage/TP sharding, GGUF import, verify."""
