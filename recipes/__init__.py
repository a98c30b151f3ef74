"""Application code built on hf_dpfilter: the recipes, and in ``recipes.common`` what they share with the demo
(examples/demo.py) and the benchmarks. Not part of the installed library: run from a checkout."""
