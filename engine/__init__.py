"""The SPD runtime: config, topology, transport, model blocks, KV cache, stage worker, driver."""
