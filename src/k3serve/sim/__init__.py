"""Simulators driven by the same policy code as the live engine and by recorded traces."""
