"""Measurements: load memory now; the strategy benchmark later."""
