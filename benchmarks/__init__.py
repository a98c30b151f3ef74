"""The benchmarks behind the figures the docs quote: one entry point, ``python -m benchmarks <sub-command>``.

Run from the repository root (``python -m benchmarks --help`` lists the sub-commands and the page each one
backs). The sub-commands share one set-up module, :mod:`benchmarks.common` (models, data, the interleaved
timing loop, memory peaks); the registry of sub-commands is :data:`benchmarks.__main__.SUBCOMMANDS`.
"""
