"""Stand-in for descript-audiotools (see ../README.md): the names MOVA's DAC VAE module imports."""


class AudioSignal:
    def __init__(self, *args, **kwargs):
        raise RuntimeError("audiotools stand-in: ckptdoctor's MOVA harness does not run MOVA's audio codec")
