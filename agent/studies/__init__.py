"""Measurements beside a run: the noise study, the audit study, verify and its grid, the profile."""
