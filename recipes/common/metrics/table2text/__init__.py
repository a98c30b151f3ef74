"""The packaged ``evaluate`` module ``table2text`` (script: ``table2text.py``); load it with
``recipes.common.metrics.load``."""
