"""The packed-documents check shared by the architectures' tests: with model.document_separator, a packed
sequence gives each document the logits it gets alone (float64), and without it does not."""

from __future__ import annotations

import torch

from llmtrain import models
from llmtrain.config import ModelConfig

EOD = 3


def assert_packed_documents_equal_separate_runs(config: ModelConfig) -> None:
    torch.manual_seed(0)
    model = models.build(config).double()
    lengths = [5, 9, 10]  # each ends with EOD but the last
    g = torch.Generator().manual_seed(1)
    docs = [torch.randint(EOD + 1, config.vocab_size, (2, n), generator=g) for n in lengths]
    for d in docs[:-1]:
        d[:, -1] = EOD
    alone = torch.cat([model(d) for d in docs], dim=1)
    model.document_separator = EOD
    packed = model(torch.cat(docs, dim=1))
    assert torch.allclose(packed, alone, rtol=0, atol=1e-10)
    model.document_separator = None
    assert not torch.allclose(model(torch.cat(docs, dim=1)), alone, rtol=0, atol=1e-3)
