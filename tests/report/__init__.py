"""Tests of radbo/report.py."""
