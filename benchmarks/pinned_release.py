"""Exits 1, saying why, unless this interpreter's sentencepiece is the release pyproject.toml pins
(``vrgd_ds.data_pipeline.tokenizer.TRAINER_RELEASE``): another release trains another tokenizer
from the same files, so the studies would read other data than their records. The GPU suite runs
it before the studies, with the checkout laid out on PYTHONPATH (``benchmarks/source_tree.sh``).

    python3 benchmarks/pinned_release.py
"""
import sys

import sentencepiece

from vrgd_ds.data_pipeline.tokenizer import TRAINER_RELEASE

if sentencepiece.__version__ != TRAINER_RELEASE:
    sys.exit(f"sentencepiece {sentencepiece.__version__} here, {TRAINER_RELEASE} pinned: it trains another "
             "tokenizer, so the studies would read other data than their records (benchmarks/gpu_wheels.sh)")
