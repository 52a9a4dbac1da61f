"""Helpers shared by the test packages (on the path through pytest's `pythonpath = tests`)."""
