"""Accounting: what a run's releases cost in (epsilon, delta).

* ``accountant``: :class:`PrivacyAccountant` (PRV, RDP, PLD) and :func:`compute_epsilon`.
* ``calibration``: :func:`calibrate_noise_multiplier`, the sigma that meets a target epsilon.
* ``rdp_analysis``: the Renyi-DP analysis of the subsampled Gaussian (Opacus' analysis, loaded alone).
* ``budget``: refuse a step that would take epsilon above the target, before it runs.

The mechanisms a DP method releases per step (``Mechanism``, ``NoiseRound``) are declared by the method, in
:mod:`hf_dpfilter.optimizers.method_config`.
"""
