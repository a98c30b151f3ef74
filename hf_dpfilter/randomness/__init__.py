"""The mechanism's secret randomness.

* ``sampling``: Poisson sampling of the logical batches (:class:`PoissonBatchSampler`).
* ``noise``: the Gaussian noise, drawn once per logical step across all processes.
* ``secure_rng``: the OS CSPRNG behind ``secure_rng=True`` (noise and sampling).
* ``example_keys``: each example's own keyed randomness: dropout masks and collator draws derived from a
  secret key, the step and the example's content, never from its position in the batch.
"""
