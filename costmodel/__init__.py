"""The cost model (a library `spd plan` uses): tick and baseline times from compute profiles and interconnect
figures, partitions, branches, the eagle baseline."""
