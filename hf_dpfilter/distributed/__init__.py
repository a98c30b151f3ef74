"""Several processes, one logical step.

* ``collectives``: the one seam every exchange between processes goes through (DDP buckets, FSDP2).
* ``processes``: several processes are one DP run, or the run is refused before training.
"""
