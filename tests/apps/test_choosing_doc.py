"""docs/choosing.md: its accounting example runs as written and gives the figures the text states; the README
links the guide."""

from __future__ import annotations

import math
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GUIDE = os.path.join(ROOT, "docs", "choosing.md")


def test_the_tuning_accounting_example_runs_and_matches_the_text():
    text = open(GUIDE).read()
    block = re.search(r"<!-- tested[^>]*-->\n\s*```python\n(.*?)```", text, flags=re.S)
    assert block, "docs/choosing.md lost its tested python block"
    code = "\n".join(line[3:] if line.startswith("   ") else line for line in block.group(1).splitlines())
    namespace: dict = {}
    exec(compile(code, GUIDE, "exec"), namespace)  # noqa: S102 (the documentation's own example)
    assert round(namespace["spent"], 1) == 9.4
    assert round(namespace["sigma"], 2) == 0.61
    assert 15.5 < namespace["total"] <= 16.0 and round(namespace["total"], 1) == 15.9
    from hf_dpfilter import compute_epsilon

    alone = compute_epsilon([(0.9, 0.05, 100)], 1e-6)
    assert f"ε = {alone:.1f}" in text and math.isclose(alone, 5.17, abs_tol=0.01)


def test_the_readme_links_the_guide():
    readme = open(os.path.join(ROOT, "README.md")).read()
    assert "(docs/choosing.md)" in readme
