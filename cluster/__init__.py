"""Wiring: configuration, Ray bootstrap, the command line and the load-test harness."""
