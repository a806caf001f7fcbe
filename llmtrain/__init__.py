"""llmtrain: Megatron-style pretraining of large language models."""

__version__ = "0.1.0"


def from_pretrained(path: str):
    """Load a model from an llmtrain or Hugging Face directory; `model(input_ids)` returns logits."""
    from llmtrain.models.hf import from_pretrained as _from_pretrained

    return _from_pretrained(path)
