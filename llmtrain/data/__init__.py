"""Data pipeline: tokenizers, Megatron-format indexed datasets, GPT sampling, blending, the default corpus.

`build_data(job, dp_rank, dp_size) -> DataModule` is what the trainer calls (contract E).
"""

from llmtrain.data.errors import DataError
from llmtrain.data.gpt_dataset import BlendedDataset, GPTDataset, split_ranges
from llmtrain.data.indexed import IndexedDataset, IndexedDatasetWriter, dtype_for_vocab
from llmtrain.data.tokenizer import HFTokenizer, SentencePieceTokenizer, Tokenizer, load_tokenizer


def __getattr__(name: str):
    # The torch-using part loads on first use, so preprocessing tools and workers start without torch.
    if name in ("DataModule", "build_data"):
        from llmtrain.data import module

        return getattr(module, name)
    raise AttributeError(f"module 'llmtrain.data' has no attribute {name!r}")


__all__ = [
    "BlendedDataset",
    "DataError",
    "DataModule",
    "GPTDataset",
    "HFTokenizer",
    "IndexedDataset",
    "IndexedDatasetWriter",
    "SentencePieceTokenizer",
    "Tokenizer",
    "build_data",
    "dtype_for_vocab",
    "load_tokenizer",
    "split_ranges",
]
