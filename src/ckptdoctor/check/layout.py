"""Where FSDP2 puts a tensor's shards: the mesh a save runs on, at any world size."""

from __future__ import annotations

import dataclasses

from ..errors import BadLayout


@dataclasses.dataclass(frozen=True)
class Layout:
    """"fsdp": shard over all N ranks; "hsdp:S": shard over S, replicate N/S times."""

    kind: str
    shard: int | None = None

    @classmethod
    def parse(cls, text: str) -> "Layout":
        if text == "fsdp":
            return cls("fsdp")
        if text.startswith("hsdp:") and text[5:].isdigit() and int(text[5:]) >= 1:
            return cls("hsdp", int(text[5:]))
        raise BadLayout(f"unknown layout {text!r}; expected 'fsdp' or 'hsdp:S' (S = shard group size, e.g. hsdp:8)")

    def __str__(self) -> str:
        return "fsdp" if self.kind == "fsdp" else f"hsdp:{self.shard}"

    def check(self, ranks: int) -> None:
        if ranks < 1:
            raise BadLayout(f"the number of ranks must be at least 1, got {ranks}")
        if self.kind == "hsdp" and ranks % self.shard:
            raise BadLayout(f"{ranks} ranks are not divisible by the shard group of {self.shard} ({self})")

    def mesh_shape(self, ranks: int) -> tuple[int, ...]:
        return (ranks,) if self.kind == "fsdp" else (ranks // self.shard, self.shard)

    def coordinate(self, rank: int, ranks: int) -> list[int]:
        return [rank] if self.kind == "fsdp" else [rank // self.shard, rank % self.shard]

    def placements(self):
        from torch.distributed.tensor import Replicate, Shard

        return (Shard(0),) if self.kind == "fsdp" else (Replicate(), Shard(0))
