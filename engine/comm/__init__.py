"""Communication: the transport interface and its torch.distributed, in-process and shared-memory
implementations; process groups; the TP group's collectives."""
