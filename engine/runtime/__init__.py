"""The runtime: the run config, building a rank's parts, the driver, stage workers, baselines, the in-process
executor and the launcher."""
