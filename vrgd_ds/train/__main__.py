"""``python -m vrgd_ds.train`` (also ``vrgd-pretrain``): the BERT pretraining job."""
import sys

from vrgd_ds.commands import pretrain

if __name__ == "__main__":
    sys.exit(pretrain())
