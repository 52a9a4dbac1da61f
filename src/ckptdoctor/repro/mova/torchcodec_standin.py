"""Stand-in for torchcodec's decoders (see standins/README.md): MOVA's dataset module imports
`AudioDecoder` and `VideoDecoder` at module level; the harness's dataset is in memory and never
decodes. The real torchcodec needs FFmpeg's shared libraries, which this machine lacks.

Not on sys.path: transformers probes torchcodec by its package metadata, and must not find a
stand-in. `rank.import_movas_dataset_module` lends these names for that one import."""


class _NoDecoder:
    def __init__(self, *args, **kwargs):
        raise RuntimeError("torchcodec stand-in: ckptdoctor's MOVA harness uses an in-memory dataset")


class AudioDecoder(_NoDecoder):
    pass


class VideoDecoder(_NoDecoder):
    pass
