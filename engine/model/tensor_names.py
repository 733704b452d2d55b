"""Megatron-core tensor names of the engine's checkpoints and stage models: the embedding, the
output layer and the layer prefix with its GLOBAL index."""
from __future__ import annotations

import re

EMBEDDING_KEY = "embedding.word_embeddings.weight"
OUTPUT_KEY = "output_layer.weight"
LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.")


def layer_of(name: str) -> int | None:
    """Global layer index of a decoder tensor name, None for embedding / final norm / head."""
    m = LAYER_RE.match(name)
    return int(m.group(1)) if m else None

