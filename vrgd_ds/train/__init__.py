"""The BERT pretraining job."""
