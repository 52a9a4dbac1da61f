"""What DCP metadata and plans say was saved, as comparable Python values."""


def describe_metadata(metadata) -> dict:
    """What DCP metadata says was saved: per key "bytes", or (size, dtype, strides, sorted chunks);
    strides are torch 2.15's (None before, and where torch records none)."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    return {key: "bytes" if isinstance(value, BytesStorageMetadata) else
            (tuple(value.size), str(value.properties.dtype), strides(value.properties),
             sorted((tuple(c.offsets), tuple(c.sizes)) for c in value.chunks))
            for key, value in metadata.state_dict_metadata.items()}


def strides(properties) -> tuple | None:
    """TensorProperties.strides (torch 2.15 added it to `.metadata`), or None."""
    value = getattr(properties, "strides", None)
    return None if value is None else tuple(value)


def written_items(plans) -> list[tuple]:
    """(key, chunk offset) of every item the plans write."""
    return [(item.index.fqn, tuple(item.index.offset or ())) for plan in plans for item in plan.items]


def listed_items(metadata) -> list[tuple]:
    """(key, chunk offset) of every entry the metadata lists."""
    return [(key, tuple(chunk.offsets)) for key, md in metadata.state_dict_metadata.items()
            for chunk in getattr(md, "chunks", [])] + \
           [(key, ()) for key, md in metadata.state_dict_metadata.items() if not hasattr(md, "chunks")]


def metadata_of(size, chunks):
    """Metadata of one float32 tensor "t" of `size` with the chunks (offsets, sizes) given."""
    import torch
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, TensorProperties, TensorStorageMetadata

    return Metadata({"t": TensorStorageMetadata(
        properties=TensorProperties(dtype=torch.float32), size=torch.Size(size),
        chunks=[ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s)) for o, s in chunks])})
