import pathlib

import pytest
import torch

SHARED = pathlib.Path(__file__).resolve().parents[2] / "shared"


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def shared_data() -> pathlib.Path:
    path = SHARED / "data" / "wikitext-2"
    if not path.is_dir():
        pytest.skip("../shared/data/wikitext-2 is not present")
    return path
