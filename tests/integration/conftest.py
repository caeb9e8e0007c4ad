"""One prepared corpus for the session's jobs: the embedded corpus, a 2,000-piece tokenizer,
sample indices for every sequence length the integration configs use."""
from __future__ import annotations

import subprocess
import sys

import pytest

SEQ_LENS = (32, 64, 128)


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    data = tmp_path_factory.mktemp("corpus") / "data"
    seq = [arg for n in SEQ_LENS for arg in ("--seq-len", str(n))]
    subprocess.run([sys.executable, "-m", "vrgd_ds.data_pipeline", "prepare", str(data), "--vocab-size", "2000", *seq,
                    "--seed", "1234",  # the job's default seed: its sample indices are built here
                    "--no-progress"], check=True, capture_output=True, timeout=600)
    return data
