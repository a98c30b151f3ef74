"""Test-wide settings.

The tests use tiny models, whose operations are far too small to gain from intra-op threads: one thread per
process avoids thread spin-up and contention, and keeps the suite fast and its timing steady.
"""

import os

import torch

torch.set_num_threads(1)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
