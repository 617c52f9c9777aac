"""Tests of radbo/checkpoint.py."""
