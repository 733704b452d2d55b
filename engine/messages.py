"""The fixed integer header every pipeline message carries (docs/design.md 3.4).

`(kind, position, epoch, token)` travels as its own small int64 tensor, never inside a bf16
payload (integers above 256 are not exact there). For a prefill chunk, `position` is the
chunk's first position and `token` its token count; for a stats reply, `token` is the
number of float64 values that follow.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import torch

HEADER_LEN = 4


class Kind(IntEnum):
    TOKEN = 1  # one token at `position`; stage 0 reads the id from the header
    PREFILL = 2  # chunk of `token` tokens starting at `position`
    END = 3  # end of request: stages reply with their stats and idle
    SHUTDOWN = 4  # stop the worker loop
    STATS = 5  # a stage's per-request timing, float64 payload
    CONFIG = 6  # per-request sampling parameters for a head stage, int64 payload (see sampling_payload)


@dataclass(frozen=True)
class Header:
    kind: Kind
    position: int = 0
    epoch: int = 0
    token: int = 0

    def to_tensor(self, out: torch.Tensor | None = None) -> torch.Tensor:
        out = torch.empty(HEADER_LEN, dtype=torch.int64) if out is None else out
        out[0], out[1], out[2], out[3] = int(self.kind), self.position, self.epoch, self.token
        return out

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> "Header":
        kind, position, epoch, token = (int(x) for x in t.tolist())
        try:
            return cls(Kind(kind), position, epoch, token)
        except ValueError:
            raise RuntimeError(f"corrupt message header {t.tolist()}") from None


def sampling_payload(temperature: float, top_k: int, top_p: float, seed: int) -> torch.Tensor:
    """Sampling parameters as an exact int64 [4] payload (floats travel as their bit patterns)."""
    bits = torch.tensor([temperature, top_p], dtype=torch.float64).view(torch.int64)
    return torch.tensor([int(bits[0]), top_k, int(bits[1]), seed], dtype=torch.int64)


def parse_sampling_payload(t: torch.Tensor) -> tuple[float, int, float, int]:
    floats = torch.stack([t[0], t[2]]).view(torch.float64).tolist()
    return floats[0], int(t[1]), floats[1], int(t[3])
