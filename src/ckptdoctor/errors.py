"""Errors the CLI reports as one clear line (no traceback)."""


class CkptDoctorError(Exception):
    """A problem with the user's input or environment, explained in one sentence."""


class UnsupportedVersion(CkptDoctorError):
    pass


class BadLayout(CkptDoctorError):
    pass
