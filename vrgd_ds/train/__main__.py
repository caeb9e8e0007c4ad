"""``python -m vrgd_ds.train`` (also ``vrgd-pretrain``): the BERT pretraining job."""
import sys

from vrgd_ds.train.loop import run_process

if __name__ == "__main__":
    sys.exit(run_process())
