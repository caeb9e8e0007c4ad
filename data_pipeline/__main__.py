"""``python -m vrgd_ds.data_pipeline``: the ``vrgd-data`` command line (see :mod:`vrgd_ds.data_pipeline.cli`)."""
import sys

from vrgd_ds.commands import data

if __name__ == "__main__":
    sys.exit(data())
