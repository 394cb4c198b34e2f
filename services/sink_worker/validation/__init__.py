"""Continuous validation of the worker's spans, and the row-for-row verify."""
