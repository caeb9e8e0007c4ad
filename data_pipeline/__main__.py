"""``python -m vrgd_ds.data_pipeline``: the ``vrgd-data`` command line (see :mod:`vrgd_ds.data_pipeline.cli`)."""
import sys

from vrgd_ds.data_pipeline.cli import main

if __name__ == "__main__":
    sys.exit(main())
