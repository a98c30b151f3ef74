"""The packaged ``evaluate`` module ``accuracy`` (script: ``accuracy.py``); load it with
``recipes.common.metrics.load``."""
