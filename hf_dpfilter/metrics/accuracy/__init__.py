"""The packaged ``evaluate`` module ``accuracy`` (script: ``accuracy.py``); load it with ``hf_dpfilter.metrics.load``."""
