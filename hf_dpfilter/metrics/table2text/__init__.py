"""The packaged ``evaluate`` module ``table2text`` (script: ``table2text.py``); load it with ``hf_dpfilter.metrics.load``."""
