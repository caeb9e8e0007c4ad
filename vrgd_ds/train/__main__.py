"""``python -m vrgd_ds.train`` (also ``vrgd-pretrain``): the BERT pretraining job."""
import sys

from vrgd_ds.train.loop import main

if __name__ == "__main__":
    sys.exit(main())
