"""Tests of radbo/flops.py."""
