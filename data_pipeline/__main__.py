"""``python -m data_pipeline``: the ``vrgd-data`` command line (see :mod:`data_pipeline.cli`)."""
import sys

from data_pipeline.cli import main

if __name__ == "__main__":
    sys.exit(main())
