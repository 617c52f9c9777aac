"""Tests of radbo/cli.py."""
