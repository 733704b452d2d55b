"""The tick protocol's pure rules: tick and schedule, topology and anchors, the wire header, drafting sources,
the acceptance rule and distributions, counters. No torch.distributed."""
