"""What the recipes, the demo (examples/demo.py) and the benchmarks share; none of it is part of hf_dpfilter.

* ``models``: the pretrained MiniLM that installs from PyPI (``packaged_model_path``) and the mean-pooled
  classifier on it;
* ``data``: readers of the GLUE TSV files;
* ``plotting``: epsilon and training-curve plots of a run's log history;
* ``generation_metrics``: the offline E2E / DART metrics (BLEU, NIST, METEOR, ROUGE-L, CIDEr);
* ``metrics``: the same as offline ``evaluate`` modules (``accuracy``, ``table2text``).

Scripts started by path (``python recipes/glue.py``, ``python examples/demo.py``) put the repository root on
``sys.path`` before importing from here.
"""
