"""What DCP metadata and plans say was saved, as comparable Python values."""


def describe_metadata(metadata) -> dict:
    """What DCP metadata says was saved: per key "bytes", or (size, dtype, sorted chunks)."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    return {key: "bytes" if isinstance(value, BytesStorageMetadata) else
            (tuple(value.size), str(value.properties.dtype), sorted((tuple(c.offsets), tuple(c.sizes)) for c in value.chunks))
            for key, value in metadata.state_dict_metadata.items()}


def written_items(plans) -> list[tuple]:
    """(key, chunk offset) of every item the plans write."""
    return [(item.index.fqn, tuple(item.index.offset or ())) for plan in plans for item in plan.items]


def listed_items(metadata) -> list[tuple]:
    """(key, chunk offset) of every entry the metadata lists."""
    return [(key, tuple(chunk.offsets)) for key, md in metadata.state_dict_metadata.items()
            for chunk in getattr(md, "chunks", [])] + \
           [(key, ()) for key, md in metadata.state_dict_metadata.items() if not hasattr(md, "chunks")]
